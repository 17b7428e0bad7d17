"""The prober: liveness every tick and the readiness probe every period, for one service.

It turns what it sees into facts (READY, NOT_READY, FAILED_*, PREEMPTED) in the store and the
balancer's ready set at once, and wakes the controller; it never retires or launches anything
itself (the plan does, on the next step).
"""

from __future__ import annotations

import asyncio
import logging
import time

from corral.infra.base import EndpointOwner, Infra, Liveness, ReplicaHandle
from corral.ports import port_holders
from corral.probe import ProbeResult, probe
from corral.replicas import LaunchState, failure_status
from corral.servicecore import ProbeState, ServiceCore, handle_from_row
from corral.state import FailureKind, ReplicaRow, StateError

log = logging.getLogger("corral.controller")

# Probes of one service in flight at once (the daemon's probe session itself has no cap).
PROBES_PER_SERVICE = 16


class Prober:
    """Probes one service's launched replicas until the service's controller stops."""

    def __init__(self, svc: ServiceCore) -> None:
        self.svc = svc
        # A fair share of the daemon's probing: a service with many slow probes waits on its
        # own slots and never holds the connections other services' probes need.
        self._probe_slots = asyncio.Semaphore(PROBES_PER_SERVICE)

    async def run(self) -> None:
        while not self.svc.stopping:
            try:
                await self._probe_round()
            except StateError as exc:  # locked or full: the next round probes and writes again
                log.warning("service %s: probe results not recorded: %s", self.svc.name, exc)
            except Exception:
                log.exception("service %s: probe round failed", self.svc.name)
            await asyncio.sleep(self.tick())

    def tick(self) -> float:
        svc = self.svc.store.service(self.svc.name)
        if svc is None:
            return 1.0
        period = self.svc.spec(svc.current_version).service.readiness_probe.period_seconds
        return max(0.05, min(1.0, period))

    async def _probe_round(self) -> None:
        rows = [
            r
            for r in self.svc.store.replicas(self.svc.name)
            if r.launch_state is LaunchState.SUCCEEDED
            and r.teardown_state is None
            and failure_status(r) is None
            and r.handle_json is not None
        ]
        if rows:
            await asyncio.gather(*(self._probe_one(r) for r in rows))

    async def _probe_one(self, r: ReplicaRow) -> None:
        handle = handle_from_row(r)
        if handle is None:
            return
        infra = self.svc.deps.infras.get(r.infra)
        if infra is None:
            return  # no backend to ask (see liveness): the row keeps what adopt recorded
        liveness = await asyncio.to_thread(infra.check, handle)
        if liveness is Liveness.EXITED or liveness is Liveness.LOST:
            taken = await self._port_taken(r, infra, handle, liveness)
            self.svc.mark_gone(r, infra, handle, liveness, taken)
            return
        rp = self.svc.spec(r.version).service.readiness_probe
        state = self.svc.rt.probes.setdefault(r.id, ProbeState())
        now = time.time()
        period = rp.period_seconds if r.first_ready_at else min(rp.period_seconds, 0.5)
        if now - state.last_probe < period:
            return
        state.last_probe = now
        async with self._probe_slots:
            result = await probe(
                self.svc.deps.http,
                handle.endpoint,
                path=rp.path,
                post_data=rp.post_data,
                headers=rp.headers,
                timeout=rp.timeout_seconds,
            )
        current = _still_up(self.svc.store.replica(r.id))
        if current is None:
            return
        if result.ok and current.first_ready_at is None and isinstance(infra, EndpointOwner):
            # Before the first READY: the answer may have come from another process that took
            # the replica's port before the app bound it (see EndpointOwner). Not ready then.
            conflict = await asyncio.to_thread(infra.endpoint_conflict, handle)
            current = _still_up(self.svc.store.replica(r.id))
            if current is None:
                return
            if conflict is not None:
                if conflict != state.last_error:
                    self.svc.event(r.id, "replica.endpoint_conflict", conflict)
                    log.warning("service %s: replica %d: %s", self.svc.name, r.seq, conflict)
                result = ProbeResult(False, result.status, conflict, result.seconds)
        self._record(r.version, current, handle.endpoint, result, state, now)

    async def _port_taken(
        self, r: ReplicaRow, infra: Infra, handle: ReplicaHandle, liveness: Liveness
    ) -> str:
        """Why an app exited before it ever answered, when it is the usual reason: its port was
        taken (empty otherwise)."""
        port = handle.data.get("port")
        if not (
            liveness is Liveness.EXITED
            and r.first_ready_at is None
            and isinstance(infra, EndpointOwner)
            and port
        ):
            return ""
        holders = await asyncio.to_thread(port_holders, int(port))
        return f": its port {port} is in use by {', '.join(holders)}" if holders else ""

    def _record(
        self,
        version: int,
        current: ReplicaRow,
        endpoint: str,
        result: ProbeResult,
        state: ProbeState,
        now: float,
    ) -> None:
        """A probe's answer as facts: READY, NOT_READY, or failed once it has failed too long
        (FAILED_PROBING after ready, FAILED_INITIAL_DELAY before). ``version``: the one the
        replica had when it was probed (an in-place update may have relabelled it since)."""
        rid = current.id
        if result.ok:
            state.failing_since = None
            state.last_error = None
            if not current.ready:
                self.svc.store.mark_ready(rid, current.first_ready_at or now)
                self.svc.store.mark_version_ready(self.svc.name, version)
                self.svc.event(rid, "replica.ready", None)
                log.info("service %s: replica %d READY at %s", self.svc.name, current.seq, endpoint)
                self.svc.set_ready(rid, endpoint, version)
                self.svc.wake_event.set()
            return
        state.last_error = result.error
        if state.failing_since is None:
            state.failing_since = now
        if current.ready:
            self.svc.store.mark_not_ready(rid)
            self.svc.event(rid, "replica.not_ready", result.error)
            self.svc.set_ready(rid, None)
        rp = self.svc.spec(version).service.readiness_probe
        if current.first_ready_at is not None:
            if now - state.failing_since >= rp.failure_timeout_seconds:
                self.svc.mark_failed(
                    current,
                    FailureKind.PROBE,
                    f"probes failing for {now - state.failing_since:.0f}s: {result.error}",
                )
        elif now - (current.launched_at or now) >= rp.initial_delay_seconds:
            self.svc.mark_failed(
                current,
                FailureKind.INITIAL_DELAY,
                f"not ready within {rp.initial_delay_seconds:g}s: {result.error}",
            )


def _still_up(r: ReplicaRow | None) -> ReplicaRow | None:
    """The row, unless it went away, failed or is being torn down meanwhile."""
    if r is None or r.teardown_state is not None or failure_status(r):
        return None
    return r
