"""One service's controller: reconcile replicas toward the target, probe them, feed the balancer.

Everything here runs on the daemon's event loop except launches and teardowns, which run as
JobPool jobs. The controller never waits on a job: a job's completion callback posts back to the
loop and wakes the reconcile step. No lock is held across I/O; the only shared structure with job
threads is the SQLite store (which has its own short-held lock).

Order of every change: write the fact to the store, then act. A daemon killed between the two
finds the fact on restart and finishes the action (see :meth:`ServiceController._adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from corral import capture, deploy, logfiles
from corral.autoscale import Autoscaler, Decision, make_autoscaler
from corral.capacity import Capacity, Grant
from corral.dataplane.plane import DataPlane, ServiceRoute
from corral.dataplane.protocol import Route
from corral.infra.base import (
    EndpointOwner,
    Infra,
    LaunchRequest,
    Liveness,
    ReplicaHandle,
    scratch_root,
)
from corral.jobs import Job, JobPool, JobState
from corral.ports import free_port, port_holders
from corral.probe import ProbeResult, probe
from corral.replicas import (
    ReplicaStatus,
    ServiceStatus,
    failure_status,
    is_live,
    replica_status,
    scale_down_victims,
    service_status,
)
from corral.spec import ServiceSpec, parse_spec
from corral.state import ReplicaRow, StateError, Store
from corral.versionfiles import remove_service_files

log = logging.getLogger("corral.controller")

# A version that never had a READY replica gives up after this many replica failures.
MAX_FAILURES_BEFORE_READY = 3
# Failed replica rows kept visible per service (older ones are pruned).
KEEP_FAILED = 10
BACKOFF_CAP = 30.0
# Launch jobs of one service at once: half the daemon's launch lane (16), so one service whose
# setups hang cannot hold every slot while the others' launches wait.
LAUNCHES_PER_SERVICE = 8
# Probes of one service in flight at once (the daemon's probe session itself has no cap).
PROBES_PER_SERVICE = 16
# How often replica logs are checked against ControllerDeps.log_max_bytes.
LOG_CAP_PERIOD = 2.0


@dataclass
class ControllerDeps:
    """What every controller of one daemon shares."""

    store: Store
    pool: JobPool
    infras: Mapping[str, Infra]
    home: Path
    home_marker: str
    http: aiohttp.ClientSession
    dataplane: DataPlane  # the balancer workers: every service's traffic, out of this process
    drain_timeout: float = 30.0
    teardown_grace: float = 5.0
    # A teardown job running longer than this is abandoned and reported (FAILED_CLEANUP): a
    # backend call that never returns must not hold a teardown slot, or the service, forever.
    teardown_timeout: float = 120.0
    decision_interval: float = 5.0  # autoscaler decisions (SkyServe: 20 s)
    qps_window: float = 60.0  # the autoscaler's load signal: requests over this window
    # Replica logs over this are rotated (corral.logfiles: copy to .1, truncate); 0: no cap.
    log_max_bytes: int = logfiles.DEFAULT_MAX_BYTES
    # A service's fair share of the launch lane (see LAUNCHES_PER_SERVICE).
    launches_per_service: int = LAUNCHES_PER_SERVICE
    # The machine's GPUs, CPUs and memory, and who holds them (local replicas; None: unplaced).
    capacity: Capacity | None = None


@dataclass
class _ProbeState:
    last_probe: float = 0.0
    failing_since: float | None = None
    last_error: str | None = None


@dataclass
class _Runtime:
    """In-memory bookkeeping; everything durable is in the store."""

    launches: dict[int, Job] = field(default_factory=dict)
    teardowns: dict[int, Job] = field(default_factory=dict)
    draining: set[int] = field(default_factory=set)
    ready: dict[int, str] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)  # replica id -> version, of `ready`
    probes: dict[int, _ProbeState] = field(default_factory=dict)
    # Teardowns given up on (timed out) whose backend call has not returned yet.
    hung: dict[int, Job] = field(default_factory=dict)
    # Rows whose unrecorded launch outcome is being asked of the backend (off the loop).
    resuming: set[int] = field(default_factory=set)
    # Rows to retire whose backend this daemon lacks (told once in the events, then left).
    no_backend: set[int] = field(default_factory=set)


def handle_to_json(handle: ReplicaHandle) -> dict[str, Any]:
    return {"backend": handle.backend, "endpoint": handle.endpoint, "data": dict(handle.data)}


def handle_from_row(row: ReplicaRow) -> ReplicaHandle | None:
    data = row.handle_data
    if data is None:
        return None
    return ReplicaHandle(backend=data["backend"], endpoint=data["endpoint"], data=data["data"])


class ReplicaRefused(Exception):
    """A request about one replica that cannot be done; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ServiceController:
    """Keeps one service's replicas at their target and its balancer's ready set current."""

    def __init__(
        self, name: str, deps: ControllerDeps, on_removed: Callable[[str], None] | None = None
    ) -> None:
        self.name = name
        self.deps = deps
        self.store = deps.store
        self._on_removed = on_removed
        self._rt = _Runtime()
        self._specs: dict[int, ServiceSpec] = {}
        self._wake = asyncio.Event()
        # A fair share of the daemon's probing: a service with many slow probes waits on its
        # own slots and never holds the connections other services' probes need.
        self._probe_slots = asyncio.Semaphore(PROBES_PER_SERVICE)
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self.balancer: ServiceRoute | None = None
        self._route_version = 0  # the version whose `service:` settings the route carries
        self.failed: str | None = None  # the controller itself crashed
        self.last_decision: str = ""
        self._autoscaler: Autoscaler | None = None
        self._policy_version = 0
        self._decision: Decision | None = None
        self._next_decision = 0.0
        # Blue-green: READY replicas of this version get no traffic until the switch.
        self._held_version: int | None = None
        self.dir = deps.home / "services" / name
        self.logs = self.dir / "logs"
        if deps.capacity is not None:
            deps.capacity.watch(name, self.wake)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the balancer, re-adopt what the store knows, then run the loops."""
        self.logs.mkdir(parents=True, exist_ok=True)
        ready = asyncio.Event()
        self._spawn(self._run(ready), f"corral-controller-{self.name}")
        await ready.wait()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, started: asyncio.Event) -> None:
        # The controller's own output (logging, warnings, prints) lands in its own log: this task
        # and every task it creates carry the route in their context.
        with capture.to(self.logs / "controller.log"):
            try:
                await asyncio.to_thread(self._load_specs)
                await self._start_balancer()
                await self._adopt_when_writable(started)
            except Exception as exc:
                self.failed = f"controller failed to start: {exc!r}"
                log.exception("service %s: controller failed to start", self.name)
                started.set()
                # Nothing is launched or probed, but `corral down` must still remove the
                # service (and tear down what an earlier daemon left), or it is stuck forever.
                await self._wait_for_down()
                await self._reconcile_loop()
                return
            started.set()
            log.info("service %s: controller started", self.name)
            probe_task = asyncio.create_task(self._probe_loop(), name=f"corral-probe-{self.name}")
            cap_task = asyncio.create_task(self._log_cap_loop(), name=f"corral-logs-{self.name}")
            try:
                await self._reconcile_loop()
            finally:
                for task in (probe_task, cap_task):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _adopt_when_writable(self, started: asyncio.Event) -> None:
        """:meth:`_adopt`, retried while the state file refuses writes (another process holds
        its lock as the daemon starts): giving up would leave the service CONTROLLER_FAILED,
        unmanaged until the next restart. Meanwhile the daemon comes up (``started``) and
        answers; the service's balancer serves once its replicas are adopted."""
        delay = 0.5
        while True:
            try:
                self._adopt()
                return
            except StateError as exc:
                if self._stopping:
                    raise
                log.warning("service %s: adopting replicas postponed: %s", self.name, exc)
            started.set()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def stop(self) -> None:
        """Stop controlling (daemon shutdown). Replicas keep running, and the balancer workers
        keep serving them; a restart re-adopts both."""
        self._stopping = True
        self._wake.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _wait_for_down(self) -> None:
        """Return once the service is asked to shut down (or is gone, or the daemon stops)."""
        while not self._stopping:
            svc = self.store.service(self.name)
            if svc is None or svc.intent == "shutting_down":
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=2.0)
            self._wake.clear()

    def wake(self) -> None:
        """Ask for a reconcile step soon (thread-safe)."""
        self._loop.call_soon_threadsafe(self._wake.set)

    # -- spec and paths -----------------------------------------------------------------------

    def remember(self, version: int, spec: ServiceSpec) -> None:
        """A version's spec, parsed already (by the API, off the loop)."""
        self._specs[version] = spec

    def _load_specs(self) -> None:
        """Parse the specs a restarted controller needs (its current version, and every
        version a replica still runs), on a thread: the largest spec the parser accepts takes
        up to a second, and the loop also carries the API, every controller and prober."""
        row = self.store.service(self.name)
        if row is None:
            return
        versions = {row.current_version} | {r.version for r in self.store.replicas(self.name)}
        for version in sorted(versions):
            with contextlib.suppress(KeyError):
                self.spec(version)

    def spec(self, version: int) -> ServiceSpec:
        """A version's spec: parsed once (off the loop: at create/update by the API, at start
        by :meth:`_load_specs`), then cached."""
        spec = self._specs.get(version)
        if spec is None:
            row = self.store.version(self.name, version)
            if row is None:
                raise KeyError(f"service {self.name} has no version {version}")
            spec = parse_spec(row.spec_yaml, source=row.source or "<stored spec>", name=self.name)
            self._specs[version] = spec
        return spec

    def launch_log(self, replica_id: int) -> Path:
        return self.logs / f"replica_{replica_id}_launch.log"

    def replica_log(self, replica_id: int) -> Path:
        return self.logs / f"replica_{replica_id}.log"

    # -- balancer -----------------------------------------------------------------------------

    async def _start_balancer(self) -> None:
        """Put the service in the data plane's table (its port was chosen at create and is
        kept for the service's life: the workers may already serve it from before a restart)."""
        row = self.store.service(self.name)
        if row is None:
            raise KeyError(self.name)
        port = row.lb_port
        if port is None:
            port = free_port()
            self.store.update_service(self.name, lb_port=port)
        self._route_version = row.current_version
        route = self._route(row.current_version, port)
        route.server_context()  # a missing or bad TLS file fails the service here
        self.balancer = self.deps.dataplane.route(self.name, route)

    def _follow_version(self, version: int) -> None:
        """An update may change the balancer's settings (policy, timeouts, TLS): the workers
        get the new ones with the next table (a new listener on the same port)."""
        if self.balancer is None or version == self._route_version:
            return
        self._route_version = version
        route = self._route(version, self.balancer.port)
        try:
            route.server_context()
        except (OSError, ssl.SSLError) as exc:
            text = f"balancer settings of version {version} not applied (TLS): {exc}"
            log.error("service %s: %s", self.name, text)
            self.store.event(self.name, "balancer.tls_failed", text)
            return
        self.balancer.configure(route)

    def _route(self, version: int, port: int) -> Route:
        row = self.store.version(self.name, version)
        return route_of(self.spec(version), port, row.base_dir if row is not None else None)

    def _publish_ready(self) -> None:
        if self.balancer is not None:
            held = self._held_version
            self.balancer.set_ready(
                {
                    rid: endpoint
                    for rid, endpoint in self._rt.ready.items()
                    if held is None or self._rt.versions.get(rid) != held
                },
                self._rt.versions,
            )

    def _set_ready(self, replica_id: int, endpoint: str | None, version: int = 0) -> None:
        changed = False
        if endpoint is None:
            changed = self._rt.ready.pop(replica_id, None) is not None
            self._rt.versions.pop(replica_id, None)
        elif self._rt.ready.get(replica_id) != endpoint:
            self._rt.ready[replica_id] = endpoint
            self._rt.versions[replica_id] = version
            changed = True
        if changed:
            self._publish_ready()

    # -- restart recovery ---------------------------------------------------------------------

    def _adopt(self) -> None:
        """Bring rows left by a previous daemon back under control (at start; run again while
        the state file refuses writes, so every step must be safe to repeat)."""
        for r in self.store.replicas(self.name):
            handle = handle_from_row(r)
            if r.teardown_state in ("pending", "running"):
                self.store.update_replica(r.id, teardown_state=None)
                self._retire(self.store.replica(r.id), "teardown interrupted by daemon restart")
                continue
            if r.launch_state == "cancelled" and r.teardown_state is None:
                # Killed between _launch_done's two writes (cancel recorded, retire not): no
                # later step looks at a cancelled row, so it would stay SHUTTING_DOWN forever,
                # uncounted, its process (if the cancel missed it) untracked. Retire it now.
                self._retire(r, "launch cancelled before the daemon restart")
                continue
            if r.launch_state == "running":
                if handle is None:
                    # Nothing recorded as started: the sweep killed any half-done setup.
                    self.store.update_replica(r.id, launch_state="pending")
                    self.store.event(
                        self.name, "replica.relaunch", "launch interrupted", replica_id=r.id
                    )
                    continue
                liveness = self._liveness(r, handle)
                if liveness is Liveness.ALIVE:
                    # Started and recorded: only the job's return was lost.
                    self.store.update_replica(r.id, launch_state="succeeded")
                    self._event(r.id, "replica.adopt", "launch interrupted; process running")
                elif liveness is Liveness.UNKNOWN:
                    # Relaunching could run it twice: the reconcile loop asks again later.
                    self._event(r.id, "replica.unknown", self._unknown_reason(r))
                else:
                    # Interrupted before it could finish (a cancelled launch kills what it
                    # started): launch again, it is not a failure of the app.
                    self.store.update_replica(
                        r.id, launch_state="pending", handle=None, endpoint=None
                    )
                    self._event(r.id, "replica.relaunch", "launch interrupted; process gone")
                continue
            if r.launch_state == "succeeded" and handle is not None and failure_status(r) is None:
                liveness = self._liveness(r, handle)
                if liveness is Liveness.ALIVE:
                    if r.ready:
                        self._rt.ready[r.id] = handle.endpoint
                        self._rt.versions[r.id] = r.version
                    self.store.event(
                        self.name, "replica.adopt", "running after restart", replica_id=r.id
                    )
                elif liveness is Liveness.UNKNOWN:
                    # Not failed on a question nobody could answer (a cluster down while the
                    # daemon restarted): kept, out of the ready set until a probe passes.
                    self.store.update_replica(r.id, ready=0)
                    self._event(r.id, "replica.unknown", self._unknown_reason(r))
                else:
                    self._mark_gone(r, self._infra_for(r), handle, liveness)
        self._publish_ready()

    def _mark_gone(
        self,
        r: ReplicaRow,
        infra: Infra,
        handle: ReplicaHandle,
        liveness: Liveness,
        detail: str = "",
    ) -> None:
        """Record a replica found gone, judged the same whether a running daemon's probe or a
        restarted daemon's adoption found it: an app that exited is FAILED (with its exit code
        when the backend knows it) and counts toward the crash-loop rule; a replica whose host
        went away is PREEMPTED and replaced, whoever noticed. ``detail`` says more of an exit."""
        if liveness is Liveness.LOST:
            self._mark_failed(r, preempted=1, failure="replica's host went away")
            return
        code = infra.exit_code(handle)
        said = f"code {code}" if code is not None else "exit code unknown: no daemon was watching"
        self._mark_failed(
            r,
            app_failed=1,
            exit_code=code,
            failure=(
                f"process exited ({said}){detail}; see `corral logs {self.name} {r.seq or r.id}`"
            ),
        )

    def _outcome_lost(self, r: ReplicaRow) -> bool:
        """A row mid-launch or mid-teardown that no job or drain of this controller works on.

        Every step records its outcome with a write on the loop; when that write fails (the
        state file locked by another process for longer than the loop may wait), the job is
        already forgotten and nothing would ever finish the row. The reconcile loop resumes it
        instead, as :meth:`_adopt` does after a restart.
        """
        rid = r.id
        if r.launch_state == "running" and rid not in self._rt.launches:
            return True
        return (
            r.teardown_state in ("pending", "running")
            and rid not in self._rt.teardowns
            and rid not in self._rt.draining
        )

    def _resume(self, r: ReplicaRow) -> None:
        """Finish a step whose outcome was not recorded (see :meth:`_outcome_lost`)."""
        if r.teardown_state in ("pending", "running"):
            # _retire starts over from the drain (it writes teardown_state itself).
            self._retire(r, "teardown resumed (its progress was not recorded)")
            return
        if handle_from_row(r) is None:
            self.store.update_replica(r.id, launch_state="pending", handle=None, endpoint=None)
            self._event(r.id, "replica.relaunch", "launch outcome not recorded; nothing started")
        elif r.id not in self._rt.resuming:
            # The backend is asked on a thread: a cluster that does not answer can take
            # seconds per question, and this loop carries every balancer.
            self._rt.resuming.add(r.id)
            self._spawn(self._resume_launch(r.id), name=f"corral-resume-{self.name}-{r.id}")

    async def _resume_launch(self, replica_id: int) -> None:
        """Adopt or relaunch a started replica whose launch outcome was not recorded."""
        try:
            r = self.store.replica(replica_id)
            handle = handle_from_row(r) if r is not None else None
            if r is None or handle is None or not self._outcome_lost(r):
                return
            liveness = await asyncio.to_thread(self._liveness, r, handle)
            now = self.store.replica(replica_id)
            if now is None or not self._outcome_lost(now) or now.handle_json != r.handle_json:
                return  # something else finished it meanwhile
            if liveness is Liveness.UNKNOWN:
                return  # asked again on a later reconcile; a relaunch now could run it twice
            if liveness is Liveness.ALIVE:
                self.store.update_replica(replica_id, launch_state="succeeded")
                self._event(
                    replica_id, "replica.adopt", "launch outcome not recorded; process running"
                )
            else:
                self.store.update_replica(
                    replica_id, launch_state="pending", handle=None, endpoint=None
                )
                self._event(
                    replica_id, "replica.relaunch", "launch outcome not recorded; process gone"
                )
            self._wake.set()
        except StateError as exc:
            log.warning("service %s: replica %d not resumed yet: %s", self.name, replica_id, exc)
        finally:
            self._rt.resuming.discard(replica_id)

    def _event(self, replica_id: int, action: str, reason: str | None) -> None:
        self.store.event(self.name, action, reason, replica_id=replica_id)

    def _liveness(self, r: ReplicaRow, handle: ReplicaHandle) -> Liveness:
        """The backend's answer, or UNKNOWN when nobody can answer.

        A backend this daemon was started without (``RAY_ADDRESS`` unset, or the cluster down
        at start) or one whose check raises is not evidence that the replica died: failing or
        relaunching it on that would double-run or kill capacity the user still pays for.
        """
        infra = self.deps.infras.get(r.infra)
        if infra is None:
            return Liveness.UNKNOWN
        try:
            return infra.check(handle)
        except Exception as exc:
            log.warning("service %s: replica %d: backend check failed: %s", self.name, r.id, exc)
            return Liveness.UNKNOWN

    def _unknown_reason(self, r: ReplicaRow) -> str:
        if r.infra not in self.deps.infras:
            return f"backend {r.infra!r} is not available in this daemon; left as it is"
        return f"backend {r.infra!r} does not answer; checked again later"

    def _infra_for(self, r: ReplicaRow) -> Infra:
        infra = self.deps.infras.get(r.infra)
        if infra is None:
            raise KeyError(f"no backend {r.infra!r} in this daemon")
        return infra

    # -- reconcile ----------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while not self._stopping:
            try:
                done = self._reconcile()
            except StateError as exc:
                # The state file is locked by another process (or unwritable): nothing of this
                # step was acted on past its last write; the next step picks it up again.
                log.warning("service %s: reconcile step postponed: %s", self.name, exc)
                done = False
            except Exception:
                log.exception("service %s: reconcile step failed", self.name)
                done = False
            if done and await self._remove():
                return
            interval = 2.0
            if self._autoscaler is not None:
                interval = min(interval, self._autoscaler.decision_interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            self._wake.clear()

    async def _remove(self) -> bool:
        """The last step of `down`: close the endpoint (the workers confirm, bounded), then
        delete the service, so that once the API answers 404 its port is closed too and the
        name is free again. False if the state file refused the delete (retried next step)."""
        if self.balancer is not None and not await self.balancer.close():
            log.warning("service %s: a balancer worker did not confirm the close", self.name)
        # The working directories of replicas without a workdir (outside the home). Before the
        # row goes: from then until the daemon forgets this controller, nothing may await.
        scratch = scratch_root(self.deps.home_marker) / self.name
        await asyncio.to_thread(shutil.rmtree, scratch, ignore_errors=True)
        # Every version's copy of the workdir and its values (secrets) go with the service.
        await asyncio.to_thread(remove_service_files, self.deps.home, self.name)
        try:
            if self.store.service(self.name) is not None:
                self.store.event(self.name, "service.removed", "all replicas torn down")
                self.store.delete_service(self.name)
                log.info("service %s: removed", self.name)
        except StateError as exc:
            log.warning("service %s: removal postponed: %s", self.name, exc)
            return False
        if self.deps.capacity is not None:
            self.deps.capacity.unwatch(self.name)
            self.deps.capacity.freed()
        if self._on_removed is not None:
            self._on_removed(self.name)
        return True

    def _decide(self, version: int, spec: ServiceSpec) -> Decision:
        """The autoscaler's target, re-decided every decision interval from the balancer's
        request timestamps (``time.monotonic()``, the clock the autoscaler expects)."""
        policy = spec.service.replica_policy
        if self._autoscaler is None:
            self._autoscaler = make_autoscaler(
                policy,
                decision_interval=self.deps.decision_interval,
                qps_window=self.deps.qps_window,
            )
            self._policy_version = version
        elif self._policy_version != version:
            self._autoscaler.reset_policy(policy)
            self._policy_version = version
            self._next_decision = 0.0
        now = time.monotonic()
        if self._decision is None or now >= self._next_decision:
            # The window plus the time since the last decision: a crossing seen now is dated.
            lookback = self._autoscaler.lookback(now)
            times = self.balancer.request_timestamps(lookback) if self.balancer else []
            previous = self._decision
            self._decision = self._autoscaler.decide(now, times)
            self._next_decision = now + self._autoscaler.decision_interval
            if previous is None or previous.target != self._decision.target:
                self.store.event(self.name, "autoscale", self._decision.reason)
                log.info(
                    "service %s: target %d: %s",
                    self.name,
                    self._decision.target,
                    self._decision.reason,
                )
        return self._decision

    def _reconcile(self) -> bool:
        """One step toward the wanted state. Returns True when the service is fully removed."""
        svc = self.store.service(self.name)
        if svc is None:
            return True
        replicas = self.store.replicas(self.name)
        if svc.intent == "shutting_down":
            return self._reconcile_down(replicas, purge=bool(svc.purge))
        spec = self.spec(svc.current_version)
        self._follow_version(svc.current_version)
        now = time.time()

        for r in replicas:
            if self._outcome_lost(r):
                self._resume(r)
                continue
            failure = failure_status(r)
            if failure is not None and r.teardown_state is None:
                self._retire(r, f"replica {failure}")
            elif r.teardown_state == "failed":
                if _teardown_retry_due(r, now):
                    self._retire(r, f"retrying teardown (attempt {r.teardown_attempts + 1})")
            elif r.scale_down and r.teardown_state is None:
                self._retire(r, "scaled down")
            elif r.launch_state == "pending" and r.id not in self._rt.launches:
                self._launch(r, self.spec(r.version))

        rows = self.store.replicas(self.name)
        current = [r for r in rows if r.version == svc.current_version]
        live = [r for r in current if is_live(r)]
        target = self._decide(svc.current_version, spec).target
        self._replace_old_versions(svc.current_version, rows, target)
        gave_up = self._gave_up(svc.current_version, current)
        if gave_up is not None:
            if svc.failure != gave_up:
                self.store.update_service(self.name, failure=gave_up)
                self.store.event(self.name, "service.failed", gave_up)
                log.error("service %s: %s", self.name, gave_up)
            self.last_decision = f"not relaunching: {gave_up}"
        elif len(live) < target:
            wait = self._relaunch_wait(current, now)
            if wait > 0:
                self.last_decision = f"waiting {wait:.0f}s before relaunching (backoff)"
            else:
                for _ in range(target - len(live)):
                    row = self.store.add_replica(
                        self.name, svc.current_version, spec.infra, f"target {target}"
                    )
                    self._launch(row, spec)
                self.last_decision = f"launching {target - len(live)} toward target {target}"
        elif len(live) > target:
            for r in scale_down_victims(
                live, len(live) - target, current_version=svc.current_version
            ):
                self.store.update_replica(r.id, scale_down=1)
                self._retire(self.store.replica(r.id), f"scale down to {target}")
            self.last_decision = f"scaling down to {target}"
        else:
            self.last_decision = f"at target {target}"
        if svc.failure is not None and gave_up is None:
            self.store.update_service(self.name, failure=None)
        self._prune_failed()
        return False

    def _replace_old_versions(self, version: int, rows: list[ReplicaRow], target: int) -> None:
        """Retire replicas of older versions as the current one becomes READY.

        Rolling: traffic goes to READY replicas of every version, and old replicas are kept
        only while the new version has fewer READY than the target asks, so the READY count
        never drops below it. Blue-green: the new version's READY replicas get no traffic
        until it has ``min_replicas`` READY (at least 1); then traffic switches at once and
        every old replica drains and goes. A version that never becomes READY is never
        promoted: the old replicas keep serving.
        """
        old = [r for r in rows if r.version != version and is_live(r)]
        held = None
        if old:
            ready_new = sum(
                1 for r in rows if r.version == version and replica_status(r) is ReplicaStatus.READY
            )
            vrow = self.store.version(self.name, version)
            if vrow is not None and vrow.mode == "blue_green":
                policy = self.spec(version).service.replica_policy
                needed = min(max(1, policy.min_replicas), max(1, target))
                if ready_new >= needed:
                    for r in old:
                        self._retire(r, f"blue-green switch to version {version}")
                    self.store.event(self.name, "update.switch", f"traffic to version {version}")
                elif any(replica_status(r) is ReplicaStatus.READY for r in old):
                    held = version
            else:
                old_ready = [r for r in old if replica_status(r) is ReplicaStatus.READY]
                keep = max(0, target - ready_new)
                for r in [r for r in old if r not in old_ready]:
                    self._retire(r, f"rolling update to version {version}")
                for r in scale_down_victims(
                    old_ready, len(old_ready) - keep, current_version=version
                ):
                    self._retire(r, f"rolling update to version {version}")
                self._make_room(version, rows, target, ready_new)
        if held != self._held_version:
            self._held_version = held
            self._publish_ready()

    def updated(self) -> None:
        """A new version was stored: reconcile now (blue-green holds its traffic at once)."""
        svc = self.store.service(self.name)
        if svc is not None:
            vrow = self.store.version(self.name, svc.current_version)
            if vrow is not None and vrow.mode == "blue_green":
                self._held_version = svc.current_version
                self._publish_ready()
        self.wake()

    def _reconcile_down(self, replicas: list[ReplicaRow], *, purge: bool) -> bool:
        remaining = 0
        for r in replicas:
            if r.teardown_state == "succeeded":
                self.store.delete_replica(r.id)
                continue
            if r.teardown_state == "failed" and purge:
                self.store.event(
                    self.name, "replica.purge", "teardown failed; purged", replica_id=r.id
                )
                self.store.delete_replica(r.id)
                continue
            remaining += 1
            if r.teardown_state == "failed":
                if _teardown_retry_due(r, time.time()):
                    self._retire(r, "service down (retry)")
            else:
                self._retire(r, "service down")
        # Nothing left: the service may go (the loop closes its endpoint, then deletes it).
        return remaining == 0 and not self._rt.launches and not self._rt.teardowns

    def _gave_up(self, version: int, current: list[ReplicaRow]) -> str | None:
        """SkyServe's rule, with a count: a version that never became ready and keeps failing
        is not relaunched forever (no crash loop)."""
        vrow = self.store.version(self.name, version)
        if vrow is None or vrow.first_ready_at is not None:
            return None
        unrecoverable = {
            ReplicaStatus.FAILED,
            ReplicaStatus.FAILED_INITIAL_DELAY,
            ReplicaStatus.FAILED_PROVISION,
        }
        failed = [r for r in current if failure_status(r) in unrecoverable]
        if len(failed) < MAX_FAILURES_BEFORE_READY:
            return None
        last = max(failed, key=lambda r: r.id)
        return (
            f"version {version} never became ready and {len(failed)} replicas failed; "
            f"last: replica {last.seq or last.id} {failure_status(last)}: "
            f"{last.failure or 'no detail'}"
        )

    def _relaunch_wait(self, current: list[ReplicaRow], now: float) -> float:
        """Exponential backoff after consecutive failures, so a crashing app is not hammered."""
        failures = [r for r in current if failure_status(r) is not None]
        readies = [r.first_ready_at for r in current if r.first_ready_at]
        if readies:
            newest_ready = max(readies)
            failures = [r for r in failures if r.updated_at > newest_ready]
        if not failures:
            return 0.0
        last = max(r.updated_at for r in failures)
        return max(0.0, last + _backoff(len(failures)) - now)

    def _prune_failed(self) -> None:
        done = [
            r
            for r in self.store.replicas(self.name)
            if r.teardown_state == "succeeded" and failure_status(r) is not None
        ]
        for r in done[:-KEEP_FAILED] if len(done) > KEEP_FAILED else []:
            self.store.delete_replica(r.id)

    # -- launch -------------------------------------------------------------------------------

    def _launch(self, r: ReplicaRow, spec: ServiceSpec) -> None:
        if r.id in self._rt.launches:
            return
        if len(self._rt.launches) >= self.deps.launches_per_service:
            return  # a fair share of the launch lane: it stays PENDING, a later step launches it
        grant = self._grant(r, spec)
        if grant is None:
            return  # it does not fit now: PENDING with the reason; a freed claim wakes us
        infra = self._infra_for(r)
        self.store.event(self.name, "replica.launch", f"on {r.infra}", replica_id=r.id)
        vrow = self.store.version(self.name, r.version)
        base = vrow.base_dir if vrow and vrow.base_dir else str(self.dir)
        # The version's own copy of its workdir, and its env and secret values.
        workdir, envs = deploy.launch_inputs(self.deps.home, self.name, r.version, spec, base)
        replica_dir = scratch_root(self.deps.home_marker) / self.name / str(r.id)
        port = None
        if "PORT" not in (spec.run or ""):
            port = spec.replica_port()
        request = LaunchRequest(
            service=self.name,
            replica_id=r.id,
            version=r.version,
            run=spec.run or "",
            setup=spec.setup,
            envs={**envs, **grant.env},  # corral's device variables win
            workdir=workdir,
            replica_dir=replica_dir,
            log_path=self.replica_log(r.id),
            port=port,
            resources=spec.resources.model_dump(exclude_none=True),
            home_marker=self.deps.home_marker,
            on_started=functools.partial(self._record_handle, r.id),
            setup_timeout=spec.service.setup_timeout_seconds,
            display_id=r.seq or None,
            cpu_ids=grant.claim.cpu_ids,
        )
        job = self.deps.pool.submit(
            self._run_launch,
            infra,
            request,
            log=self.launch_log(r.id),
            name=f"{self.name}-launch-{r.id}",
            kind="launch",
        )
        self._rt.launches[r.id] = job
        job.add_done_callback(functools.partial(self._from_thread, self._launch_done, r.id))

    def _grant(self, r: ReplicaRow, spec: ServiceSpec) -> Grant | None:
        """What the replica may hold (written before its launch), or None while it waits: the
        first time with a ``replica.waiting`` event, the reason kept for status."""
        capacity = self.deps.capacity
        if capacity is None or r.infra != "local":
            return Grant()
        granted = capacity.grant(r.id, spec.resources.model_dump(exclude_none=True))
        if isinstance(granted, Grant):
            return granted
        if capacity.note_wait(self.name, r.id, granted):
            self._event(r.id, "replica.waiting", granted)
            log.info("service %s: replica %d waits: %s", self.name, r.id, granted)
        return None

    def _make_room(self, version: int, rows: list[ReplicaRow], target: int, ready_new: int) -> None:
        """A rolling update on a full machine: replace one old replica at a time instead of
        surging (:meth:`corral.capacity.Capacity.make_room`; docs/gpus.md)."""
        capacity = self.deps.capacity
        if capacity is None:
            return
        picked = capacity.make_room(
            rows, version, target, ready_new, self.spec(version).resources.model_dump()
        )
        if picked is not None:
            old, new = picked
            self._retire(
                old,
                f"rolling update to version {version}: no spare capacity, replacing one "
                f"at a time (its devices go to replica {new.id})",
            )

    def _run_launch(self, infra: Infra, request: LaunchRequest) -> ReplicaHandle:
        """The launch job (on a JobPool thread). The row turns PROVISIONING only here, when a
        launch slot is free: while the job waits in a saturated launch lane the replica stays
        PENDING ("waiting for a launch slot"), which is what status should say and what
        scale-down removes first. A restart finds it pending either way and launches it."""
        self.store.update_replica(request.replica_id, launch_state="running")
        return infra.launch(request)

    def _from_thread(self, fn: Callable[[int, Job], None], replica_id: int, job: Job) -> None:
        """A job's done-callback runs on the job's thread: hand the result to the loop."""
        self._loop.call_soon_threadsafe(self._job_done, fn, replica_id, job)

    def _job_done(self, fn: Callable[[int, Job], None], replica_id: int, job: Job) -> None:
        """Record a job's outcome; if the state file refuses the write (locked by another
        process), say so and let the reconcile loop resume the row (see _outcome_lost)."""
        try:
            fn(replica_id, job)
        except StateError as exc:
            log.warning(
                "service %s: replica %d: outcome of job %s not recorded yet: %s",
                self.name,
                replica_id,
                job.name,
                exc,
            )
            self._wake.set()

    def _record_handle(self, replica_id: int, handle: ReplicaHandle) -> None:
        """Called from the launch thread the moment something exists: stored before use."""
        self.store.update_replica(
            replica_id,
            handle=handle_to_json(handle),
            endpoint=handle.endpoint,
            launched_at=time.time(),
        )

    def _launch_done(self, replica_id: int, job: Job) -> None:
        self._rt.launches.pop(replica_id, None)
        r = self.store.replica(replica_id)
        if r is None:
            return
        if job.state is JobState.SUCCEEDED:
            self.store.update_replica(replica_id, launch_state="succeeded")
            self.store.event(self.name, "replica.launched", r.endpoint, replica_id=replica_id)
            if job.log_error:
                # Running, but its launch output was lost (a full disk): say so where users look.
                self.store.event(
                    self.name, "replica.log_error", job.log_error, replica_id=replica_id
                )
        elif job.state is JobState.CANCELLED:
            self.store.update_replica(replica_id, launch_state="cancelled")
            self.store.event(self.name, "replica.launch_cancelled", None, replica_id=replica_id)
        elif isinstance(job.exception(), StateError):
            # The state file refused one of the launch's own writes (locked for longer than a
            # job waits): not the app's failure, so not counted against the version. Whatever
            # started and was not recorded was stopped by the backend; the reconcile loop
            # resumes the row as after a restart (_outcome_lost): adopt or launch again.
            self.store.event(
                self.name,
                "replica.relaunch",
                f"launch not recorded: {job.exception()}",
                replica_id=replica_id,
            )
            self._wake.set()
            return
        else:
            row = self.store.replica(replica_id)
            seq = row.seq if row is not None and row.seq else replica_id
            detail = f"{job.exception()!r}; see `corral logs {self.name} {seq} --launch`"
            self.store.update_replica(replica_id, launch_state="failed", failure=detail)
            self.store.event(self.name, "replica.launch_failed", detail, replica_id=replica_id)
        r = self.store.replica(replica_id)
        if r is not None and r.launch_state == "cancelled":
            self._retire(r, "launch cancelled")
        self._wake.set()

    # -- teardown -----------------------------------------------------------------------------

    def _retire(self, r: ReplicaRow | None, reason: str) -> None:
        """Take a replica out of service: cancel its launch, or drain and tear it down."""
        if r is None or r.id in self._rt.teardowns or r.id in self._rt.draining:
            return
        if self._teardown_stuck(r.id):
            return  # its last terminate call has not returned: never stack another on it
        self._set_ready(r.id, None)
        job = self._rt.launches.get(r.id)
        if job is not None:
            if job.cancel():
                self.store.event(self.name, "replica.cancel_launch", reason, replica_id=r.id)
            return  # _launch_done retires it once the launch has stopped
        if r.teardown_state == "succeeded":
            return
        handle = handle_from_row(r)
        if handle is None:
            # Nothing was started: nothing to tear down.
            if failure_status(r) is not None:
                self.store.update_replica(r.id, teardown_state="succeeded")
            else:
                # Event first, as in _teardown_done: a kill between leaves the row to redo.
                self.store.event(self.name, "replica.removed", reason, replica_id=r.id)
                self.store.delete_replica(r.id)
            self._freed()
            self._wake.set()
            return
        if r.infra not in self.deps.infras:
            # Nothing here can stop it (the daemon runs without that backend): say so once and
            # leave the row as it is, rather than retry a teardown that cannot start.
            if r.id not in self._rt.no_backend:
                self._rt.no_backend.add(r.id)
                self._event(r.id, "replica.unknown", self._unknown_reason(r))
            return
        self.store.update_replica(r.id, teardown_state="pending", ready=0)
        self.store.event(self.name, "replica.teardown", reason, replica_id=r.id)
        self._rt.draining.add(r.id)
        self._spawn(self._drain_then_teardown(r, handle), f"corral-drain-{r.id}")

    async def _drain_then_teardown(self, r: ReplicaRow, handle: ReplicaHandle) -> None:
        try:
            if self.balancer is not None and failure_status(r) is None:
                drained = await self.balancer.wait_drained(r.id, self._drain_timeout(r))
                if not drained:
                    log.warning(
                        "service %s: replica %d still had requests after %gs of draining",
                        self.name,
                        r.id,
                        self._drain_timeout(r),
                    )
        finally:
            self._rt.draining.discard(r.id)
        infra = self._infra_for(r)
        try:
            self.store.update_replica(r.id, teardown_state="running")
        except StateError as exc:
            # Nothing started yet: the reconcile loop resumes this teardown (_outcome_lost).
            log.warning("service %s: replica %d: teardown postponed: %s", self.name, r.id, exc)
            return
        job = self.deps.pool.submit(
            infra.terminate,
            handle,
            self.deps.teardown_grace,
            log=self.launch_log(r.id),
            name=f"{self.name}-teardown-{r.id}",
            kind="teardown",
            log_required=False,  # an unwritable log must not keep a replica running
        )
        self._rt.teardowns[r.id] = job
        job.add_done_callback(functools.partial(self._from_thread, self._teardown_done, r.id))
        self._loop.call_later(self.deps.teardown_timeout, self._teardown_overdue, r.id, job)

    def _freed(self) -> None:
        """A replica's claim (if any) is let go: replicas waiting for it, of any service, may
        fit now."""
        if self.deps.capacity is not None:
            self.deps.capacity.freed()

    def _teardown_overdue(self, replica_id: int, job: Job) -> None:
        """Bound a teardown job: one running longer than ``teardown_timeout`` is abandoned.

        A thread cannot be killed, and a backend call that ignores cancellation (a stuck RPC)
        would otherwise keep the replica SHUTTING_DOWN, the service undeletable and a teardown
        slot taken, forever. Abandoning fails the job now (so it is recorded as FAILED_CLEANUP
        with the reason, like any failed teardown, and retried with backoff) and hands its slot
        to the next queued teardown; the replica's next attempt waits until the stuck call has
        returned, so stuck threads never pile up on one replica. Time spent queued for a slot
        does not count: that is a busy lane, not a hung call.
        """
        if job.done() or self._stopping:
            return
        limit = self.deps.teardown_timeout
        ran = job.run_seconds
        if ran is None or ran < limit:
            wait = max(0.1, limit - (ran or 0.0))
            self._loop.call_later(wait, self._teardown_overdue, replica_id, job)
            return
        error = TimeoutError(
            f"teardown did not finish within {limit:g}s; its backend call is left running and "
            "the teardown is retried once it returns"
        )
        self._rt.hung[replica_id] = job
        if self.deps.pool.abandon(job, error):  # runs _teardown_done (FAILED_CLEANUP) next
            self.store.event(self.name, "replica.teardown_hung", str(error), replica_id=replica_id)
            log.error("service %s: replica %d: %s", self.name, replica_id, error)

    def _teardown_stuck(self, replica_id: int) -> bool:
        """True while an abandoned teardown of this replica is still inside its backend call."""
        job = self._rt.hung.get(replica_id)
        if job is None:
            return False
        if job.returned():
            del self._rt.hung[replica_id]
            return False
        return True

    def _drain_timeout(self, r: ReplicaRow) -> float:
        try:
            return self.spec(r.version).service.load_balancer.drain_timeout_seconds
        except Exception:
            return self.deps.drain_timeout

    def _teardown_done(self, replica_id: int, job: Job) -> None:
        self._rt.teardowns.pop(replica_id, None)
        self._rt.probes.pop(replica_id, None)
        r = self.store.replica(replica_id)
        if r is None:
            return
        if job.state is JobState.SUCCEEDED:
            if failure_status(r) is not None:
                # Back to the replica's own failure (why it failed), without the teardown's.
                self.store.update_replica(
                    replica_id, teardown_state="succeeded", failure=_replica_failure(r.failure)
                )
                self.store.event(self.name, "replica.terminated", None, replica_id=replica_id)
            else:
                # The event first: a daemon killed between the two writes then leaves a row
                # whose teardown a restart repeats (idempotent), never a replica gone from the
                # state without a word in the event log.
                self.store.event(self.name, "replica.terminated", None, replica_id=replica_id)
                self.store.delete_replica(replica_id)
            self._freed()
        else:
            detail = f"teardown failed: {job.exception()!r}; see {self.launch_log(replica_id)}"
            # The replica's own failure stays in the text: it is why it was torn down.
            original = _replica_failure(r.failure)
            self.store.update_replica(
                replica_id,
                teardown_state="failed",
                teardown_attempts=r.teardown_attempts + 1,
                failure=detail if original is None else f"{detail}{_BEFORE}{original}",
            )
            self.store.event(self.name, "replica.teardown_failed", detail, replica_id=replica_id)
            log.error("service %s: replica %d %s", self.name, replica_id, detail)
        self._wake.set()

    # -- log size cap -------------------------------------------------------------------------

    async def _log_cap_loop(self) -> None:
        """Every ~2 s, rotate the logs of this service's replicas that passed the cap
        (``deps.log_max_bytes``): an app flooding its output must not fill the disk. The copy
        runs on a thread; a replica's log is written by the replica itself, so only
        copy-and-truncate works (see corral.logfiles for what that may lose)."""
        cap = self.deps.log_max_bytes
        if cap <= 0:
            return
        while not self._stopping:
            await asyncio.sleep(LOG_CAP_PERIOD)
            try:
                paths = [
                    self.logs / "controller.log",  # opened for append too (corral.capture)
                    *(
                        path
                        for r in self.store.replicas(self.name)
                        if r.teardown_state != "succeeded"
                        for path in (self.replica_log(r.id), self.launch_log(r.id))
                    ),
                ]
                done = await asyncio.to_thread(logfiles.rotate_all, paths, cap)
            except StateError as exc:
                log.warning("service %s: log size check postponed: %s", self.name, exc)
                continue
            except Exception:
                log.exception("service %s: log size check failed", self.name)
                continue
            for item in done:
                if isinstance(item, str):
                    log.warning("service %s: log over the cap not rotated: %s", self.name, item)
                elif item.error is not None:
                    what = f"{item.path.name} over {cap} bytes emptied, old content dropped"
                    log.warning("service %s: %s: %s", self.name, what, item.error)
                else:
                    what = f"{item.path.name} over {cap} bytes: {item.kept} bytes moved"
                    log.info("service %s: %s to %s", self.name, what, item.backup.name)

    # -- probing ------------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while not self._stopping:
            try:
                await self._probe_round()
            except StateError as exc:  # locked or full: the next round probes and writes again
                log.warning("service %s: probe results not recorded: %s", self.name, exc)
            except Exception:
                log.exception("service %s: probe round failed", self.name)
            await asyncio.sleep(self._tick())

    def _tick(self) -> float:
        svc = self.store.service(self.name)
        if svc is None:
            return 1.0
        period = self.spec(svc.current_version).service.readiness_probe.period_seconds
        return max(0.05, min(1.0, period))

    async def _probe_round(self) -> None:
        rows = [
            r
            for r in self.store.replicas(self.name)
            if r.launch_state == "succeeded"
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
        infra = self.deps.infras.get(r.infra)
        if infra is None:
            return  # no backend to ask (see _liveness): the row keeps what adopt recorded
        liveness = await asyncio.to_thread(infra.check, handle)
        if liveness is Liveness.EXITED or liveness is Liveness.LOST:
            taken = ""
            port = handle.data.get("port")
            if (
                liveness is Liveness.EXITED
                and r.first_ready_at is None
                and isinstance(infra, EndpointOwner)
                and port
            ):
                # The usual reason an app exits before it ever answered: its port was taken.
                holders = await asyncio.to_thread(port_holders, int(port))
                if holders:
                    taken = f": its port {port} is in use by {', '.join(holders)}"
            self._mark_gone(r, infra, handle, liveness, taken)
            return
        spec = self.spec(r.version)
        rp = spec.service.readiness_probe
        state = self._rt.probes.setdefault(r.id, _ProbeState())
        now = time.time()
        period = rp.period_seconds if r.first_ready_at else min(rp.period_seconds, 0.5)
        if now - state.last_probe < period:
            return
        state.last_probe = now
        async with self._probe_slots:
            result = await probe(
                self.deps.http,
                handle.endpoint,
                path=rp.path,
                post_data=rp.post_data,
                headers=rp.headers,
                timeout=rp.timeout_seconds,
            )
        current = self.store.replica(r.id)
        if current is None or current.teardown_state is not None or failure_status(current):
            return
        if result.ok and current.first_ready_at is None and isinstance(infra, EndpointOwner):
            # Before the first READY: the answer may have come from another process that took
            # the replica's port before the app bound it (see EndpointOwner). Not ready then.
            conflict = await asyncio.to_thread(infra.endpoint_conflict, handle)
            current = self.store.replica(r.id)
            if current is None or current.teardown_state is not None or failure_status(current):
                return
            if conflict is not None:
                if conflict != state.last_error:
                    self.store.event(
                        self.name, "replica.endpoint_conflict", conflict, replica_id=r.id
                    )
                    log.warning("service %s: replica %d: %s", self.name, r.id, conflict)
                result = ProbeResult(False, result.status, conflict, result.seconds)
        if result.ok:
            state.failing_since = None
            state.last_error = None
            if not current.ready:
                first = current.first_ready_at or now
                self.store.update_replica(r.id, ready=1, first_ready_at=first)
                self.store.mark_version_ready(self.name, r.version)
                self.store.event(self.name, "replica.ready", None, replica_id=r.id)
                self._set_ready(r.id, handle.endpoint, r.version)
                self._wake.set()
            return
        state.last_error = result.error
        if state.failing_since is None:
            state.failing_since = now
        if current.ready:
            self.store.update_replica(r.id, ready=0)
            self.store.event(self.name, "replica.not_ready", result.error, replica_id=r.id)
            self._set_ready(r.id, None)
        if current.first_ready_at is not None:
            if now - state.failing_since >= rp.failure_timeout_seconds:
                self._mark_failed(
                    current,
                    probe_failed=1,
                    failure=f"probes failing for {now - state.failing_since:.0f}s: {result.error}",
                )
        elif now - (current.launched_at or now) >= rp.initial_delay_seconds:
            self._mark_failed(
                current,
                initial_delay_failed=1,
                failure=f"not ready within {rp.initial_delay_seconds:g}s: {result.error}",
            )

    def _mark_failed(self, r: ReplicaRow, *, failure: str, **facts: Any) -> None:
        self.store.update_replica(r.id, ready=0, failure=failure, **facts)
        self.store.event(self.name, "replica.failed", failure, replica_id=r.id)
        log.warning("service %s: replica %d failed: %s", self.name, r.id, failure)
        self._set_ready(r.id, None)
        self._wake.set()

    # -- requests -----------------------------------------------------------------------------

    def terminate_replica(self, seq: int, *, purge: bool) -> str:
        """``corral down NAME --replica-id N``, as SkyServe's terminate_replica: a live replica
        is drained and torn down, and since the target is unchanged the next reconcile step
        launches its replacement. A failed replica is refused (it is kept visible on purpose)
        unless ``purge``, which forgets its row. Raises :class:`ReplicaRefused`."""
        r = self.store.replica_by_seq(self.name, seq)
        if r is None:
            raise ReplicaRefused(404, f"service {self.name!r} has no replica {seq}")
        status = replica_status(r)
        if status is ReplicaStatus.SHUTTING_DOWN or r.scale_down or r.id in self._rt.draining:
            raise ReplicaRefused(409, f"replica {seq} of {self.name!r} is already shutting down")
        if failure_status(r) is not None or status is ReplicaStatus.FAILED_CLEANUP:
            if r.teardown_state not in ("succeeded", "failed"):
                raise ReplicaRefused(409, f"replica {seq} ({status}) is being torn down already")
            if not purge:
                why = (
                    "its teardown failed, so it may still run: `corral status -v` says why"
                    if status is ReplicaStatus.FAILED_CLEANUP
                    else "it is stopped already and kept visible for its logs"
                )
                raise ReplicaRefused(
                    409,
                    f"replica {seq} of {self.name!r} is {status}: {why}; "
                    f"`corral down {self.name} --replica-id {seq} --purge` forgets it",
                )
            self.store.event(self.name, "replica.purge", f"{status}; purged", replica_id=r.id)
            self.store.delete_replica(r.id)
            return f"replica {seq} of {self.name} ({status}) forgotten"
        self.store.update_replica(r.id, scale_down=1)
        self._retire(self.store.replica(r.id), "terminated on request (down --replica-id)")
        self.wake()
        return f"replica {seq} of {self.name} is shutting down; a replacement starts"

    # -- views --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The service as the API shows it (plain data, computed now)."""
        svc = self.store.service(self.name)
        if svc is None:
            raise KeyError(self.name)
        rows = self.store.replicas(self.name)
        statuses = [replica_status(r) for r in rows]
        decision = self._decision
        capacity = self.deps.capacity
        devices = capacity.devices() if capacity is not None else {}
        waiting = capacity.waiting if capacity is not None else {}
        try:
            policy = self.spec(svc.current_version).service.replica_policy.model_dump()
        except Exception as exc:  # a stored spec this corral cannot read any more
            policy = {"error": repr(exc)}
        versions = [
            {
                "version": v.version,
                "mode": v.mode,
                "created_at": v.created_at,
                "first_ready_at": v.first_ready_at,
            }
            for v in self.store.versions(self.name)
        ]
        status = service_status(
            statuses,
            shutting_down=svc.intent == "shutting_down",
            gave_up=svc.failure is not None,
            controller_running=self.balancer is not None,
            controller_failed=self.failed is not None,
        )
        scheme = (
            "https"
            if self.balancer is not None and self.balancer.url.startswith("https")
            else "http"
        )
        now = time.time()
        held = self._held_version
        serving = sorted(
            {v for rid, v in self._rt.versions.items() if rid in self._rt.ready and v != held}
        )
        # A failed update leaves the old version serving: the service is not FAILED then,
        # and why the update failed is a field of its own.
        update_failed = svc.failure is not None and status is not ServiceStatus.FAILED
        return {
            "name": self.name,
            "status": str(status),
            "endpoint": f"{scheme}://127.0.0.1:{svc.lb_port}" if svc.lb_port else None,
            "version": svc.current_version,
            "target": decision.target if decision else None,
            "autoscaler": {
                "qps": round(decision.qps, 3),
                "raw_target": decision.raw_target,
                "reason": decision.reason,
            }
            if decision
            else None,
            "policy": policy,
            "versions": versions,
            "traffic_held_for_version": self._held_version,
            "traffic_versions": serving,
            "balancer_errors": self.balancer.bind_errors() if self.balancer is not None else [],
            "failure": self.failed or (None if update_failed else svc.failure),
            "last_update_failure": svc.failure if update_failed else None,
            "last_decision": self.last_decision,
            "created_at": svc.created_at,
            "replicas": [
                self._replica_view(
                    r,
                    status_,
                    now,
                    devices=devices.get(r.id),
                    waiting=waiting.get(r.id) if status_ is ReplicaStatus.PENDING else None,
                )
                for r, status_ in zip(rows, statuses, strict=True)
            ],
        }

    def _replica_view(
        self,
        r: ReplicaRow,
        status: ReplicaStatus,
        now: float,
        *,
        devices: Any = None,
        waiting: str | None = None,
    ) -> dict[str, Any]:
        """One replica as the API shows it: ``id`` is its number within the service (what
        users type); ``uid`` the internal id (events, the state file); ``devices`` what it
        holds on this machine, ``waiting`` why a PENDING one does not fit yet."""
        view: dict[str, Any] = {
            "id": r.seq or r.id,
            "uid": r.id,
            "version": r.version,
            "status": str(status),
            "endpoint": r.endpoint,
            "infra": r.infra,
            "age_seconds": round(now - r.created_at, 1),
            "failure": r.failure,
            "exit_code": r.exit_code,
            "pid": (r.handle_data or {}).get("data", {}).get("pid"),
            "devices": devices,
            "waiting": waiting,
        }
        if status is ReplicaStatus.STARTING and r.launched_at is not None:
            # How long it has been trying, against how long it may (then FAILED_INITIAL_DELAY).
            view["starting_seconds"] = round(now - r.launched_at, 1)
            with contextlib.suppress(Exception):
                view["initial_delay_seconds"] = _initial_delay(self.spec(r.version))
        return view


def _initial_delay(spec: ServiceSpec) -> float:
    return float(spec.service.readiness_probe.initial_delay_seconds)


def route_of(spec: ServiceSpec, port: int, base_dir: str | None = None) -> Route:
    """The data plane's route of a service (everything but the ready set) from its spec.

    Relative TLS file paths are taken from the directory the CLI ran in (``base_dir``), as
    ``workdir`` is (SkyPilot's rule): the workers run elsewhere, and the path must mean the
    same file to them."""
    lb = spec.service.load_balancer
    tls = spec.service.tls

    def path(value: str) -> str:
        file = Path(value).expanduser()
        if not file.is_absolute() and base_dir:
            file = Path(base_dir) / file
        return str(file)

    return Route(
        port=port,
        tls_cert=path(tls.certfile) if tls is not None else None,
        tls_key=path(tls.keyfile) if tls is not None else None,
        config={
            "policy": spec.service.load_balancing_policy,
            # At zero replicas a request waits for the first one instead of a 503.
            "no_replica_wait": 60.0 if spec.service.replica_policy.min_replicas == 0 else 0.0,
            "connect_timeout": lb.connect_timeout_seconds,
            "first_byte_timeout": lb.first_byte_timeout_seconds or lb.stream_timeout_seconds,
            "idle_timeout": lb.stream_timeout_seconds,
            "max_body_bytes": lb.max_body_bytes,
            "max_header_bytes": lb.max_header_bytes,
            "header_timeout": lb.header_timeout_seconds,
            "max_connections": lb.max_connections,
        },
    )


_TEARDOWN_FAILED = "teardown failed: "
_BEFORE = "; replica: "


def _replica_failure(text: str | None) -> str | None:
    """A replica's own failure text, from a row whose text may have a teardown error in front
    (``teardown failed: ...; replica: <own failure>``)."""
    if text is None or not text.startswith(_TEARDOWN_FAILED):
        return text
    _, sep, original = text.partition(_BEFORE)
    return original if sep else None


def _teardown_retry_due(r: ReplicaRow, now: float) -> bool:
    """A failed teardown is retried for as long as it fails (backoff capped at BACKOFF_CAP): a
    replica whose teardown failed may still run, and giving up after a few attempts left it
    running for good once a backend outage outlasted them."""
    return now - r.updated_at >= _backoff(r.teardown_attempts)


def _backoff(failures: int) -> float:
    return min(BACKOFF_CAP, float(2 ** max(0, failures - 1)))
