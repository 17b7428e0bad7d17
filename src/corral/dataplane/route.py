"""One service's view of the data plane, with the methods the controller calls.

:class:`ServiceRoute` is what the controller holds instead of an in-process balancer
(``set_ready``, ``wait_drained``, ``arrivals``): it does not know where traffic runs.
Kept apart from :mod:`corral.dataplane.plane` (which re-exports it), the daemon-side machinery
it asks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from corral.arrivals import Arrivals as Arrivals  # re-exported for the plane
from corral.dataplane.protocol import HISTORY_SECONDS, TIME_BUCKET, Route
from corral.ports import hold_port

if TYPE_CHECKING:
    from corral.dataplane.plane import DataPlane


class ServiceRoute:
    """One service in the data plane; see the module docstring."""

    def __init__(self, plane: DataPlane, name: str, route: Route) -> None:
        self._plane = plane
        self.name = name
        self.route = route
        self._left: dict[int, int] = {}  # replica id -> seq of the first table without it
        # The port stays the service's while this daemon runs, whatever its workers do.
        self._hold = hold_port(route.host, route.port)

    @property
    def port(self) -> int:
        return self.route.port

    @property
    def url(self) -> str:
        scheme = "https" if self.route.tls_cert else "http"
        return f"{scheme}://127.0.0.1:{self.route.port}"

    def configure(self, route: Route) -> None:
        """New listener settings (an update changed the policy, timeouts or TLS)."""
        self.route = replace(
            route,
            ready=self.route.ready,
            versions=self.route.versions,
            accelerators=self.route.accelerators,
            weights=self.route.weights,
            ids=self.route.ids,
        )
        self._plane.changed()

    def set_ready(
        self,
        replicas: Mapping[int, str],
        versions: Mapping[int, int] | None = None,
        accelerators: Mapping[int, str] | None = None,
        weights: Mapping[int, float] | None = None,
        ids: Mapping[int, int] | None = None,
    ) -> None:
        """The ready set, with each replica's version and, where known, its accelerator, its
        weight (instance_aware_least_load) and the id users see it by."""
        seq = self._plane.changed()
        before = set(self.route.ready or ())
        for rid in before - set(replicas):
            self._left[rid] = seq
        for rid in replicas:
            self._left.pop(rid, None)
        self.route = replace(
            self.route,
            ready=dict(replicas),
            versions=dict(versions or {}),
            accelerators=dict(accelerators or {}),
            weights=dict(weights or {}),
            ids=dict(ids or {}),
        )

    async def wait_drained(self, replica_id: int, timeout: float) -> bool:
        """Wait until every worker has applied a table without the replica and has no request
        in flight to it; False if ``timeout`` passes first.

        The timeout counts from when the daemon pushes tables at all (``DataPlane.open``): a
        restarted daemon's controller may retire a replica while the daemon still starts, and
        a drain that timed out then would end a replica the workers still route to."""
        seq = self._left.get(replica_id, 0)
        plane = self._plane
        await plane.wait_until(plane.is_open, None)
        if not await plane.wait_until(lambda: plane.drained(self.name, replica_id, seq), timeout):
            return False
        self._left.pop(replica_id, None)
        return True

    def arrivals(self, window: float = 60.0) -> Arrivals:
        """The service's requests of the last ``window`` seconds, as the autoscaler reads them."""
        return self._plane.arrivals(self.name, window)

    async def wait_reported(self, timeout: float) -> bool:
        """Wait (bounded) until every worker has reported on the service to this daemon: a
        restarted daemon's first report from each carries the requests it kept
        (HISTORY_SECONDS), and a first decision made before them reads no load at all."""
        return await self._plane.wait_until(lambda: self._plane.reported(self.name), timeout)

    def stats(self) -> dict[str, Any] | None:
        """This service's balancer counters and engine reports, or None before any report."""
        return self._plane.stats(self.name).get(self.name)

    def bind_errors(self) -> list[str]:
        return self._plane.bind_errors(self.name)

    async def wait_serving(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until every balancer worker is connected and has applied the table
        with this service: a new service's endpoint answers once `corral up` returns, even
        on a daemon whose workers are still starting. False if the wait timed out."""
        seq = self._plane.current_seq()
        return await self._plane.wait_until(lambda: self._plane.all_applied(seq), timeout)

    async def close(self, timeout: float = 2.0) -> bool:
        """The service is gone: take it out of the table and wait (bounded) until every
        connected worker has applied that table, i.e. closed the service's listener, so that
        `corral down` returning means the endpoint is closed. False if the wait timed out."""
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        seq = self._plane.remove(self.name)
        return await self._plane.wait_until(lambda: self._plane.applied(seq), timeout)


def recent_arrivals(times: dict[int, int] | None, window: float) -> Arrivals:
    """The requests of the last ``window`` seconds from a service's counts per time bucket (as
    the workers report them), each bucket a run at its middle, dropping buckets older than
    anyone asks for."""
    if not times:
        return Arrivals()
    now = time.monotonic()
    horizon = int((now - HISTORY_SECONDS) / TIME_BUCKET)
    for bucket in [b for b in times if b < horizon]:
        del times[bucket]
    first = int((now - window) / TIME_BUCKET)
    return Arrivals(
        ((bucket + 0.5) * TIME_BUCKET, times[bucket]) for bucket in sorted(times) if bucket >= first
    )
