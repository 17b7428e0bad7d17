"""One service's controller: reconcile replicas toward the target, probe them, feed the balancer.

Everything here runs on the daemon's event loop except launches and teardowns, which run as
JobPool jobs. The controller never waits on a job: a job's completion callback posts back to the
loop and wakes the reconcile step. No lock is held across I/O; the only shared structure with job
threads is the SQLite store (which has its own short-held lock).

Order of every change: write the fact to the store, then act. A daemon killed between the two
finds the fact on restart and finishes the action (see :func:`corral.recovery.adopt`).

The controller is the loop that composes the parts: each step asks :mod:`corral.plan` what to do
and the :class:`corral.executor.Executor` does it; the :class:`corral.prober.Prober` turns probe
answers into facts; :mod:`corral.recovery` adopts what a previous daemon left; and
:mod:`corral.views` shows the service. They share one :class:`corral.servicecore.ServiceCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral import capture, fallback, plan
from corral.arrivals import Arrivals
from corral.autoscale import Autoscaler, Decision
from corral.autoscale_queue import SampledAutoscaler, fits, make_scaler
from corral.dataplane.plane import ServiceRoute
from corral.dataplane.protocol import Route
from corral.errors import NoSuchReplica, ReplicaBusy, ReplicaGoing
from corral.executor import Executor
from corral.infra.base import Connecting, scratch_root
from corral.logcap import cap_logs, prepare_logs
from corral.ports import free_port
from corral.prober import Prober
from corral.recovery import adopt
from corral.replicas import (
    ReplicaStatus,
    TeardownState,
    UpdateMode,
    failure_status,
    is_live,
    replica_status,
)
from corral.service_route import route_of
from corral.servicecore import (
    LAUNCHES_PER_SERVICE,
    ControllerDeps,
    ServiceCore,
    handle_from_row,
    handle_to_json,
)
from corral.spec import ReplicaPolicy, ServiceSpec
from corral.state import ReplicaRow, ServiceRow, StateError, Store
from corral.versionfiles import remove_service_files, version_tls
from corral.views import service_view

# Re-exported: the daemon builds its controllers' dependencies from these names.
__all__ = [
    "LAUNCHES_PER_SERVICE",
    "ControllerDeps",
    "ServiceController",
    "handle_from_row",
    "handle_to_json",
    "route_of",
]

log = logging.getLogger("corral.controller")
# How long a controller's first decision waits for every balancer worker's first report: a
# restarted daemon's workers send the requests they kept, and without them the load reads 0.
FIRST_REPORTS_TIMEOUT = 3.0


class ServiceController:
    """Keeps one service's replicas at their target and its balancer's ready set current."""

    def __init__(
        self, name: str, deps: ControllerDeps, on_removed: Callable[[str], None] | None = None
    ) -> None:
        self.svc = ServiceCore(name, deps)
        self.executor = Executor(self.svc)
        self.prober = Prober(self.svc)
        self._on_removed = on_removed
        # The version whose `service:` settings the route carries, and whether it gave up.
        self._route_key = (0, False)
        self.failed: str | None = None  # the controller itself crashed
        self._autoscaler: Autoscaler | None = None
        self._policy_version = 0
        self._decision: Decision | None = None
        self._next_decision = 0.0
        if deps.capacity is not None:
            deps.capacity.watch(name, self.wake)

    # What the daemon and the API use of a controller.

    @property
    def name(self) -> str:
        return self.svc.name

    @property
    def store(self) -> Store:
        return self.svc.store

    @property
    def balancer(self) -> ServiceRoute | None:
        return self.svc.balancer

    @property
    def logs(self) -> Path:
        return self.svc.logs

    @property
    def last_decision(self) -> str:
        return self.svc.last_decision

    def spec(self, version: int) -> ServiceSpec:
        return self.svc.spec(version)

    def launch_log(self, seq: int) -> Path:
        return self.svc.launch_log(seq)

    def replica_log(self, seq: int) -> Path:
        return self.svc.replica_log(seq)

    def wake(self) -> None:
        """Ask for a reconcile step soon (thread-safe)."""
        self.svc.wake()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the balancer, re-adopt what the store knows, then run the loops."""
        await asyncio.to_thread(prepare_logs, self.svc)
        ready = asyncio.Event()
        self.svc.spawn(self._run(ready), f"corral-controller-{self.svc.name}")
        await ready.wait()

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
                log.exception("service %s: controller failed to start", self.svc.name)
                started.set()
                # Nothing is launched or probed, but `corral down` must still remove the
                # service (and tear down what an earlier daemon left), or it is stuck forever.
                await self._wait_for_down()
                await self._reconcile_loop()
                return
            started.set()
            log.info("service %s: controller started", self.svc.name)
            probe_task = asyncio.create_task(self.prober.run(), name=f"corral-probe-{self.name}")
            cap_task = asyncio.create_task(cap_logs(self.svc), name=f"corral-logs-{self.name}")
            try:
                # A restarted daemon's first decision reads what the workers kept (history);
                # a new service has no replica and nothing to wait for: it launches at once.
                if self.balancer is not None and self.svc.store.replicas(self.svc.name):
                    await self.balancer.wait_reported(FIRST_REPORTS_TIMEOUT)
                await self._reconcile_loop()
            finally:
                for task in (probe_task, cap_task):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _adopt_when_writable(self, started: asyncio.Event) -> None:
        """Adopt (:func:`corral.recovery.adopt`), retried while the state file refuses writes
        (another process holds its lock as the daemon starts): giving up would leave the
        service CONTROLLER_FAILED, unmanaged until the next restart. Meanwhile the daemon comes
        up (``started``) and answers; the service's balancer serves once its replicas are
        adopted."""
        for attempt in itertools.count(1):
            try:
                await self._backends_settled(started)
                adopt(self.svc, self.executor)
                return
            except StateError as exc:
                if self.svc.stopping:
                    raise
                log.warning("service %s: adopting replicas postponed: %s", self.svc.name, exc)
            started.set()
            await asyncio.sleep(plan.backoff(attempt, base=0.5, cap=5.0))

    async def _backends_settled(self, started: asyncio.Event) -> None:
        """Rows on a backend still making its first connection (a cluster, bounded by the
        backend's own timeout) are adopted after it: a restarted daemon then judges them on a
        real answer instead of calling them unknown. Meanwhile the daemon answers
        (``started``) and the balancer workers keep serving this service's last table."""
        waits: list[Connecting] = []
        for name in {r.infra for r in self.svc.store.replicas(self.svc.name)}:
            infra = self.svc.deps.infras.get(name)
            if isinstance(infra, Connecting):
                waits.append(infra)
        if not any(b.settling() for b in waits):
            return
        started.set()
        log.info("service %s: adopting its replicas once its backend answers", self.svc.name)
        while any(b.settling() for b in waits) and not self.svc.stopping:
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Stop controlling (daemon shutdown). Replicas keep running, and the balancer workers
        keep serving them; a restart re-adopts both."""
        self.svc.stopping = True
        self.svc.wake_event.set()
        tasks = list(self.svc.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _wait_for_down(self) -> None:
        """Return once the service is asked to shut down (or is gone, or the daemon stops)."""
        while not self.svc.stopping:
            svc = self.svc.store.service(self.svc.name)
            if svc is None or svc.intent == "shutting_down":
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.svc.wake_event.wait(), timeout=2.0)
            self.svc.wake_event.clear()

    # -- spec --------------------------------------------------------------------------------

    def remember(self, version: int, spec: ServiceSpec) -> None:
        """A version's spec, parsed already (by the API, off the loop)."""
        self.svc.specs[version] = spec

    def _load_specs(self) -> None:
        """Parse the specs a restarted controller needs (its current version, and every
        version a replica still runs), on a thread: the largest spec the parser accepts takes
        up to a second, and the loop also carries the API, every controller and prober."""
        row = self.svc.store.service(self.svc.name)
        if row is None:
            return
        versions = {row.current_version} | {
            r.version for r in self.svc.store.replicas(self.svc.name)
        }
        for version in sorted(versions):
            with contextlib.suppress(KeyError):
                self.spec(version)

    # -- balancer -----------------------------------------------------------------------------

    async def _start_balancer(self) -> None:
        """Put the service in the data plane's table (its port was chosen at create and is
        kept for the service's life: the workers may already serve it from before a restart)."""
        row = self.svc.store.service(self.svc.name)
        if row is None:
            raise KeyError(self.svc.name)
        port = row.lb_port
        if port is None:
            port = free_port()
            self.svc.store.update_service(self.svc.name, lb_port=port)
        self._route_key = (row.current_version, self._relaunches_nothing(row))
        route = self._route(*self._route_key, port)
        route.server_context()  # a missing or bad TLS file fails the service here
        self.svc.balancer = self.svc.deps.dataplane.route(self.svc.name, route)

    def _follow_version(self, version: int, gave_up: bool) -> None:
        """An update may change the balancer's settings (policy, timeouts, TLS), and a version
        that gave up has no replica to wait for: the workers get the new ones with the next
        table (a new listener on the same port)."""
        if self.balancer is None or (version, gave_up) == self._route_key:
            return
        self._route_key = (version, gave_up)
        route = self._route(version, gave_up, self.balancer.port)
        try:
            route.server_context()
        except (OSError, ssl.SSLError) as exc:
            text = f"balancer settings of version {version} not applied (TLS): {exc}"
            log.error("service %s: %s", self.svc.name, text)
            self.svc.store.event(self.svc.name, "balancer.tls_failed", text)
            return
        self.balancer.configure(route)

    def _relaunches_nothing(self, svc: ServiceRow) -> bool:
        """The current version gave up and no older one was READY to serve in its place
        (:mod:`corral.fallback`, which relaunches that one): no replica comes to wait for."""
        if svc.failure is None:
            return False
        versions = self.svc.store.versions(self.svc.name)
        return fallback.newest_ready_before(versions, svc.current_version) is None

    def _route(self, version: int, gave_up: bool, port: int) -> Route:
        row = self.svc.store.version(self.svc.name, version)
        copy = version_tls(self.svc.deps.home, self.svc.name, version)
        base_dir = row.base_dir if row is not None else None
        return route_of(self.spec(version), port, base_dir, copy, gave_up=gave_up)

    # -- reconcile ----------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while not self.svc.stopping:
            try:
                done = self._reconcile()
            except StateError as exc:
                # The state file is locked by another process (or unwritable): nothing of this
                # step was acted on past its last write; the next step picks it up again.
                log.warning("service %s: reconcile step postponed: %s", self.svc.name, exc)
                done = False
            except Exception:
                log.exception("service %s: reconcile step failed", self.svc.name)
                done = False
            if done and await self._remove():
                return
            interval = 2.0
            if self._autoscaler is not None:
                interval = min(interval, self._autoscaler.decision_interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.svc.wake_event.wait(), timeout=interval)
            self.svc.wake_event.clear()

    async def _remove(self) -> bool:
        """The last step of `down`: close the endpoint (the workers confirm, bounded), then
        delete the service, so that once the API answers 404 its port is closed too and the
        name is free again. False if the state file refused the delete (retried next step)."""
        if self.balancer is not None and not await self.balancer.close():
            log.warning("service %s: a balancer worker did not confirm the close", self.svc.name)
        # The working directories of replicas without a workdir (outside the home). Before the
        # row goes: from then until the daemon forgets this controller, nothing may await.
        scratch = scratch_root(self.svc.deps.home_marker) / self.svc.name
        await asyncio.to_thread(shutil.rmtree, scratch, ignore_errors=True)
        # Every version's copy of the workdir and its values (secrets) go with the service.
        await asyncio.to_thread(remove_service_files, self.svc.deps.home, self.svc.name)
        try:
            if self.svc.store.service(self.svc.name) is not None:
                self.svc.store.event(self.svc.name, "service.removed", "all replicas torn down")
                self.svc.store.delete_service(self.svc.name)
                log.info("service %s: removed", self.svc.name)
        except StateError as exc:
            log.warning("service %s: removal postponed: %s", self.svc.name, exc)
            return False
        if self.svc.deps.capacity is not None:
            self.svc.deps.capacity.unwatch(self.svc.name)
            self.svc.deps.capacity.freed()
        if self._on_removed is not None:
            self._on_removed(self.svc.name)
        return True

    def _decide(self, version: int, spec: ServiceSpec) -> Decision:
        """The autoscaler's target, re-decided every decision interval from the balancer's
        request timestamps (``time.monotonic()``, the clock the autoscaler expects)."""
        policy = spec.service.replica_policy
        if self._autoscaler is None or not fits(self._autoscaler, policy):
            self._autoscaler = make_scaler(
                policy,
                decision_interval=self.svc.deps.decision_interval,
                qps_window=self.svc.deps.qps_window,
                previous=self._autoscaler,
                running=None if self._autoscaler else self._running(version, policy),
            )
            self._policy_version = version
            self._next_decision = 0.0
        elif self._policy_version != version:
            self._autoscaler.reset_policy(policy)
            self._policy_version = version
            self._next_decision = 0.0
        now = time.monotonic()
        if self._decision is None or now >= self._next_decision:
            # The window plus the time since the last decision: a crossing seen now is dated.
            lookback = self._autoscaler.lookback(now)
            times = self.balancer.arrivals(lookback) if self.balancer else Arrivals()
            previous = self._decision
            if isinstance(self._autoscaler, SampledAutoscaler):
                stats = self.balancer.stats() if self.balancer else None
                self._autoscaler.sample(stats, self.svc.fleet)
            self._decision = self._autoscaler.decide(now, times)
            self._next_decision = now + self._autoscaler.decision_interval
            if previous is None or previous.target != self._decision.target:
                self.svc.store.event(self.svc.name, "autoscale", self._decision.reason)
                log.info(
                    "service %s: target %d: %s",
                    self.svc.name,
                    self._decision.target,
                    self._decision.reason,
                )
        return self._decision

    def _running(self, version: int, policy: ReplicaPolicy) -> int:
        """The target the replicas of ``version`` that count toward it make, without
        overprovision: what a restarted daemon's autoscaler goes on from (min_replicas would
        tear down a loaded fleet at once, and bring it back only after the upscale delay)."""
        rows = self.svc.store.replicas(self.svc.name)
        live = sum(1 for r in rows if r.version == version and is_live(r))
        return max(0, live - policy.num_overprovision)

    def _reconcile(self) -> bool:
        """One step toward the wanted state. Returns True when the service is fully removed."""
        svc = self.svc.store.service(self.svc.name)
        if svc is None:
            return True
        replicas = self.svc.store.replicas(self.svc.name)
        if svc.intent == "shutting_down":
            return self._reconcile_down(replicas, purge=bool(svc.purge))
        spec = self.spec(svc.current_version)
        self._follow_version(svc.current_version, self._relaunches_nothing(svc))
        now = time.time()
        self.executor.apply(plan.upkeep(replicas, self.executor.busy(), now), replicas)
        # The chores wrote to the rows (a retired failure's teardown started now, which is
        # where backoff counts from): the rest of the step plans over the rows as they are.
        rows = self.svc.store.replicas(self.svc.name)
        vrow = self.svc.store.version(self.svc.name, svc.current_version)
        ready = vrow is None or vrow.first_ready_at is not None
        versions = self.svc.store.versions(self.svc.name)
        facts = plan.Facts(
            rows=rows,
            version=svc.current_version,
            mode=vrow.mode if vrow is not None else UpdateMode.ROLLING,
            min_replicas=spec.service.replica_policy.min_replicas,
            version_ready=ready,
            target=self._decide(svc.current_version, spec).target,
            failure=svc.failure,
            worth=self.svc.worth(spec),
            fallback=fallback.fallback_version(versions, svc.current_version, ready, rows),
        )
        actions = plan.toward_target(facts, now)
        self.executor.apply([*actions, *fallback.keep_serving(facts, now)], rows)
        return False

    def updated(self) -> None:
        """A new version was stored: reconcile now (blue-green holds its traffic at once)."""
        svc = self.svc.store.service(self.svc.name)
        if svc is not None:
            vrow = self.svc.store.version(self.svc.name, svc.current_version)
            if vrow is not None and vrow.mode is UpdateMode.BLUE_GREEN:
                self.svc.held_version = svc.current_version
                self.svc.publish_ready()
        # An update of the service section only relabels the live replicas in the state file:
        # the versions their traffic is counted under follow (status, traffic_versions).
        versions = self.svc.rt.versions
        relabelled = False
        for r in self.svc.store.replicas(self.svc.name):
            if r.id in self.svc.rt.ready and versions.get(r.id) != r.version:
                versions[r.id] = r.version
                relabelled = True
        if relabelled:
            self.svc.publish_ready()
        self.wake()

    def _reconcile_down(self, replicas: list[ReplicaRow], *, purge: bool) -> bool:
        actions = plan.going_down(replicas, purge=purge, now=time.time())
        self.executor.apply(actions, replicas)
        forgotten = sum(1 for a in actions if isinstance(a, plan.Forget))
        # Nothing left: the service may go (the loop closes its endpoint, then deletes it).
        return len(replicas) == forgotten and not self.svc.rt.launches and not self.svc.rt.teardowns

    # -- requests -----------------------------------------------------------------------------

    def terminate_replica(self, seq: int, *, purge: bool) -> str:
        """``corral down NAME --replica-id N``, as SkyServe's terminate_replica: a live replica
        is drained and torn down, and since the target is unchanged the next reconcile step
        launches its replacement. A failed replica is refused (it is kept visible on purpose)
        unless ``purge``, which forgets its row. Raises NoSuchReplica or ReplicaBusy (domain
        errors: the API gives them their status)."""
        r = self.svc.store.replica_by_seq(self.svc.name, seq)
        if r is None:
            raise NoSuchReplica(f"service {self.svc.name!r} has no replica {seq}")
        status = replica_status(r)
        if status is ReplicaStatus.SHUTTING_DOWN or r.scale_down or r.id in self.svc.rt.draining:
            raise ReplicaGoing(f"replica {seq} of {self.svc.name!r} is already shutting down")
        if failure_status(r) is not None or status is ReplicaStatus.FAILED_CLEANUP:
            if r.teardown_state not in (TeardownState.SUCCEEDED, TeardownState.FAILED):
                raise ReplicaBusy(f"replica {seq} ({status}) is being torn down already")
            if not purge:
                why = (
                    "its teardown failed, so it may still run: `corral status -v` says why"
                    if status is ReplicaStatus.FAILED_CLEANUP
                    else "it is stopped already and kept visible for its logs"
                )
                raise ReplicaBusy(
                    f"replica {seq} of {self.svc.name!r} is {status}: {why}; "
                    f"`corral down {self.svc.name} --replica-id {seq} --purge` forgets it",
                )
            self.svc.store.forget_replica(self.svc.name, r.id, "replica.purge", f"{status}; purged")
            return f"replica {seq} of {self.svc.name} ({status}) forgotten"
        why = "terminated on request (down --replica-id)"
        self.executor.retire(self.svc.store.mark_scale_down(r.id), why)
        self.wake()
        return f"replica {seq} of {self.svc.name} is shutting down; a replacement starts"

    # -- views --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The service as the API shows it (plain data, computed now)."""
        return service_view(self.svc, self._decision, self.failed)
