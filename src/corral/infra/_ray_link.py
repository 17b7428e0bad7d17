"""The daemon's Ray backend while its cluster connection is made in the background.

Why: connecting a driver to a Ray cluster (importing Ray, then ``ray.init``) takes seconds,
~15 s on a busy machine, and a cluster that is down takes until its timeout. A daemon must
answer its API within a second or two whatever its backends do, so the daemon registers a
:class:`RayLink` under ``ray`` at once and the link connects on a thread of its own, trying
again (backing off) for as long as the cluster does not answer. Nothing of Ray is imported
by this module: the import itself is part of what is kept off the daemon's way.

While the link is not usable (:meth:`RayLink.not_ready` says why, in words a user reads in
``corral status``):

* a launch waits: the executor keeps the replica PENDING with that reason instead of starting
  its job (and :meth:`RayLink.launch`, should a job start anyway, waits cancellably);
* ``check`` answers UNKNOWN, which is never evidence of death (docs/architecture.md): the row
  is kept and asked again;
* ``terminate`` raises, so a teardown is FAILED_CLEANUP and retried, never skipped;
* a restarted daemon's controllers wait for the first attempt to end (:meth:`settling`, at most
  ``connect_timeout`` s) before they adopt rows on Ray, so a cluster that answers in time is
  re-adopted as before, not reported unknown.

Once connected, ``on_connected`` runs before anything else may use the cluster (the daemon's
leak sweep of the cluster: no launch can race it), then every call goes to the real
:class:`corral.infra.ray.RayInfra`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from corral import jobs
from corral.infra.base import EndsHome, Infra, LaunchRequest, Liveness, ReplicaHandle

if TYPE_CHECKING:
    from corral.infra.ray import RayInfra

__all__ = ["RayLink", "ray_installed"]

log = logging.getLogger("corral.infra.ray")

# Seconds between connection attempts: the first retry soon (a cluster starting up), then less
# often, never rarer than the cap (a cluster brought back is used within that long).
_RETRY_FIRST = 2.0
_RETRY_CAP = 30.0


def ray_installed() -> bool:
    """Whether Ray can be imported, without importing it (that takes seconds)."""
    return importlib.util.find_spec("ray") is not None


class RayLink:
    """The ``ray`` backend of a daemon: connects in the background, then delegates.

    ``connect_timeout``: how long the first attempt may take before it is reported as failing
    (the attempt goes on; a later success is used). ``make`` builds the connected backend
    (tests pass their own); by default :class:`corral.infra.ray.RayInfra`.
    """

    name = "ray"

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float = 10.0,
        make: Callable[[str], Infra] | None = None,
    ) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self._make = make or _connected_ray
        self._lock = threading.Lock()
        self._infra: Infra | None = None
        self._problem: str | None = None  # why the last attempt failed
        self._since = time.monotonic()
        self._first_done = threading.Event()  # the first attempt ended, or ran out of time
        self._closed = threading.Event()

    # -- the connection -----------------------------------------------------------------------

    def start(
        self,
        on_connected: Callable[[Infra], None] | None = None,
        on_ready: Callable[[], object] | None = None,
    ) -> None:
        """Connect on a thread of its own. ``on_connected(infra)`` runs on that thread once
        connected, before the link serves any call (its errors are logged, not fatal);
        ``on_ready()`` after, to wake whoever waits."""
        self._since = time.monotonic()
        timer = threading.Timer(self.connect_timeout, self._overdue)
        timer.daemon = True
        timer.start()
        threading.Thread(
            target=self._connect_loop,
            args=(on_connected, on_ready, timer),
            name="corral-ray-link",
            daemon=True,
        ).start()

    def close(self) -> None:
        """Stop trying (the daemon stops). A connection already made stays."""
        self._closed.set()

    def _connect_loop(
        self,
        on_connected: Callable[[Infra], None] | None,
        on_ready: Callable[[], object] | None,
        timer: threading.Timer,
    ) -> None:
        delay = _RETRY_FIRST
        while not self._closed.is_set():
            try:
                infra = self._make(self.address)
            except Exception as exc:
                said = str(exc).removeprefix(f"Ray cluster at {self.address} ")
                self._failed(f"Ray cluster at {self.address} is not usable: {said}", delay)
                if self._closed.wait(delay):
                    return
                delay = min(_RETRY_CAP, delay * 2)
                continue
            if on_connected is not None:
                try:
                    on_connected(infra)
                except Exception:
                    log.exception("after connecting to the Ray cluster at %s", self.address)
            with self._lock:
                self._infra = infra
                self._problem = None
            timer.cancel()
            self._first_done.set()
            log.info(
                "connected to the Ray cluster at %s in %.1fs",
                self.address,
                time.monotonic() - self._since,
            )
            if on_ready is not None:
                with contextlib.suppress(RuntimeError):  # the daemon's loop closed: it stopped
                    on_ready()
            return

    def _failed(self, problem: str, delay: float) -> None:
        with self._lock:
            said = self._problem
            self._problem = problem
        if problem != said:  # once per distinct reason: a cluster down for hours is one line
            log.error("%s; trying again (every %gs at most)", problem, _RETRY_CAP)
        self._first_done.set()

    def _overdue(self) -> None:
        """The first attempt outlived ``connect_timeout``: say so, let adoption go on."""
        with self._lock:
            if self._infra is not None or self._problem is not None:
                return
            self._problem = (
                f"Ray cluster at {self.address} is not usable: no answer within "
                f"{self.connect_timeout:g}s"
            )
        log.error("%s; still trying", self._problem)
        self._first_done.set()

    def connected(self) -> Infra | None:
        with self._lock:
            return self._infra

    def not_ready(self) -> str | None:
        """None once the cluster can be used; otherwise why not, for a waiting replica."""
        with self._lock:
            if self._infra is not None:
                return None
            if self._problem is not None:
                return f"{self._problem} (still trying)"
        waited = time.monotonic() - self._since
        return f"connecting to the Ray cluster at {self.address} ({waited:.0f}s so far)"

    def settling(self) -> bool:
        """True while the first connection attempt is under way (at most ``connect_timeout``)."""
        return not self._first_done.is_set()

    # -- the backend --------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        """The real launch, once connected; until then wait (cancellably), saying why once."""
        said = False
        while (infra := self.connected()) is None:
            if not said:
                print(f"[corral] waiting: {self.not_ready()}", flush=True)
                said = True
            jobs.sleep(0.5)
        return infra.launch(request)

    def terminate(self, handle: ReplicaHandle, grace: float) -> None:
        infra = self.connected()
        if infra is None:
            raise RuntimeError(f"cannot stop the replica yet: {self.not_ready()}")
        infra.terminate(handle, grace)

    def check(self, handle: ReplicaHandle) -> Liveness:
        infra = self.connected()
        return Liveness.UNKNOWN if infra is None else infra.check(handle)

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        infra = self.connected()
        return None if infra is None else infra.exit_code(handle)

    def sweep(
        self,
        home_marker: str,
        known: Collection[ReplicaHandle],
        recorded: Collection[str] | None = None,
    ) -> list[str]:
        """Nothing before the connection: the sweep then runs in ``on_connected``."""
        infra = self.connected()
        return [] if infra is None else infra.sweep(home_marker, known, recorded)

    def end_home(self, home_marker: str, grace: float) -> list[str]:
        """The home is gone: its actors removed once connected (nothing else can find them)."""
        infra = self.connected()
        if not isinstance(infra, EndsHome):
            return [f"could not remove this home's Ray actors: {self.not_ready()}"]
        return infra.end_home(home_marker, grace)


def _connected_ray(address: str) -> RayInfra:
    """A :class:`RayInfra` connected to ``address``: Ray imported here, on the link's thread.
    No time limit of its own: :meth:`RayLink._overdue` reports a slow one, and it is used
    whenever it succeeds."""
    from corral.infra.ray import RayInfra

    return RayInfra(address, connect_timeout=24 * 3600.0)
