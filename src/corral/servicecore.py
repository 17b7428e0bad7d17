"""What the parts of one service's controller share: the daemon's dependencies, the service's
in-memory bookkeeping, and the few operations every part needs (spec cache, events, the ready
set, the backend's liveness answer, and how a replica found failed or gone is recorded).

The controller (the loop), the executor (jobs, drain, teardown), the prober and restart
recovery each hold one :class:`ServiceCore` instead of reaching into each other. How a gone
replica is judged lives here once (:meth:`ServiceCore.mark_gone`), so a running daemon's probe
and a restarted daemon's adoption cannot judge the same fact differently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from corral import logfiles
from corral.capacity import Capacity
from corral.dataplane.plane import DataPlane, ServiceRoute
from corral.infra.base import Connecting, Infra, Liveness, ReplicaHandle
from corral.jobs import Job, JobPool, exit_text
from corral.loglines import last_line
from corral.plan import HOPELESS_EXIT_CODES
from corral.replicas import replica_status
from corral.spec import ServiceSpec, parse_spec, qps_of_accelerator
from corral.state import FailureKind, ReplicaRow, StateError, Store
from corral.versionfiles import version_envs

log = logging.getLogger("corral.controller")

# Launch jobs of one service at once: half the daemon's launch lane (16), so one service whose
# setups hang cannot hold every slot while the others' launches wait.
LAUNCHES_PER_SERVICE = 8


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
class ProbeState:
    last_probe: float = 0.0
    failing_since: float | None = None
    last_error: str | None = None


@dataclass
class Runtime:
    """In-memory bookkeeping; everything durable is in the store."""

    launches: dict[int, Job] = field(default_factory=dict)
    teardowns: dict[int, Job] = field(default_factory=dict)
    draining: set[int] = field(default_factory=set)
    ready: dict[int, str] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)  # replica id -> version, of `ready`
    probes: dict[int, ProbeState] = field(default_factory=dict)
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


class ServiceCore:
    """One service's shared state (everything durable is in the store)."""

    def __init__(self, name: str, deps: ControllerDeps) -> None:
        self.name = name
        self.deps = deps
        self.store = deps.store
        self.rt = Runtime()
        self.specs: dict[int, ServiceSpec] = {}
        self.wake_event = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.balancer: ServiceRoute | None = None
        self._accelerators: dict[int, str] = {}  # the last read of accelerators()
        self._ids: dict[int, int] = {}  # seq_of() of the replicas published ready so far
        # Blue-green: READY replicas of this version get no traffic until the switch.
        self.held_version: int | None = None
        self.last_decision = ""  # what the last reconcile step decided, in words
        # While relaunches wait for their backoff: when the next attempt comes, and why.
        self.backoff: tuple[float, str] | None = None
        self.dir = deps.home / "services" / name
        self.logs = logfiles.service_logs(deps.home, name)

    def wake(self) -> None:
        """Ask for a reconcile step soon (thread-safe)."""
        self.loop.call_soon_threadsafe(self.wake_event.set)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def spec(self, version: int) -> ServiceSpec:
        """A version's spec: parsed once (off the loop: at create/update by the API, at start
        by :meth:`_load_specs`), then cached."""
        spec = self.specs.get(version)
        if spec is None:
            row = self.store.version(self.name, version)
            if row is None:
                raise KeyError(f"service {self.name} has no version {version}")
            envs = version_envs(self.deps.home, self.name, version)  # filled in, as at `up`
            source = row.source or "<stored spec>"
            spec = parse_spec(row.spec_yaml, source=source, name=self.name, envs=envs)
            self.specs[version] = spec
        return spec

    # A replica's files, messages, events and Ray actor name carry ``seq``, its id within
    # the service (what status, `corral logs` and the dashboard show); the row's ``id`` is an
    # internal key only (rows, process keys, claims, the balancer's counters).

    def launch_log(self, seq: int) -> Path:
        return logfiles.log_file(self.logs, "launch", seq)

    def replica_log(self, seq: int) -> Path:
        return logfiles.log_file(self.logs, "replica", seq)

    def seq_of(self, replica_id: int) -> int:
        """The id users see of the replica whose internal key is ``replica_id``."""
        row = self.store.replica(replica_id)
        return row.seq if row is not None and row.seq else replica_id

    def event(self, replica_id: int, action: str, reason: str | None) -> None:
        self.store.event(self.name, action, reason, replica_id=replica_id)

    def launching(self, r: ReplicaRow) -> None:
        """A replica's launch begins: in the event log and in the controller's log."""
        self.event(r.id, "replica.launch", f"on {r.infra}")
        log.info(
            "service %s: replica %d launching (version %d) on %s",
            self.name,
            r.seq,
            r.version,
            r.infra,
        )

    def liveness(self, r: ReplicaRow, handle: ReplicaHandle) -> Liveness:
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
            log.warning("service %s: replica %d: backend check failed: %s", self.name, r.seq, exc)
            return Liveness.UNKNOWN

    def unknown_reason(self, r: ReplicaRow) -> str:
        if r.infra not in self.deps.infras:
            return f"backend {r.infra!r} is not available in this daemon; left as it is"
        waits = self.backend_waits(r)
        if waits is not None:
            return f"backend {r.infra!r}: {waits}; checked again once it answers"
        return f"backend {r.infra!r} does not answer; checked again later"

    def backend_waits(self, r: ReplicaRow) -> str | None:
        """Why ``r``'s backend cannot launch it yet (a cluster still connecting: see
        :class:`~corral.infra.base.Connecting`), or None; a wait that ended is forgotten."""
        infra = self.deps.infras.get(r.infra)
        if not isinstance(infra, Connecting):
            return None
        waits = infra.not_ready()
        if waits is None and self.deps.capacity is not None:
            self.deps.capacity.waiting.pop(r.id, None)
        return waits

    def note_wait(self, r: ReplicaRow, reason: str) -> None:
        """A PENDING replica waits: the newest reason kept for status, one event per wait."""
        capacity = self.deps.capacity
        if capacity is not None and capacity.note_wait(self.name, r.id, reason):
            self.event(r.id, "replica.waiting", reason)
            log.info("service %s: replica %d waits: %s", self.name, r.seq, reason)

    def infra_for(self, r: ReplicaRow) -> Infra:
        infra = self.deps.infras.get(r.infra)
        if infra is None:
            raise KeyError(f"no backend {r.infra!r} in this daemon")
        return infra

    def publish_ready(self) -> None:
        if self.balancer is not None:
            held = self.held_version
            ready = {
                rid: endpoint
                for rid, endpoint in self.rt.ready.items()
                if held is None or self.rt.versions.get(rid) != held
            }
            accelerators: dict[int, str] = {}
            if self._weighed(ready):  # the state file is read only for a policy that needs it
                accelerators = {rid: a for rid, a in self.accelerators().items() if rid in ready}
            weights = self._weights(ready, accelerators)
            ids = {rid: self._shown_id(rid) for rid in ready}
            self._ids = {rid: self._ids[rid] for rid in ready if rid in self._ids}
            self.balancer.set_ready(ready, self.rt.versions, accelerators, weights, ids)

    def _shown_id(self, rid: int) -> int:
        """seq_of() for the balancers, read once per replica (it never changes); a busy state
        file leaves the internal key for now: the ready set must still go out."""
        if rid not in self._ids:
            try:
                self._ids[rid] = self.seq_of(rid)
            except StateError:
                return rid
        return self._ids[rid]

    def accelerators(self) -> dict[int, str]:
        """The GPU model each placed replica of this service took, as the spec names it
        (``A100`` of ``A100:1``; docs/gpus.md). Replicas placed by no one (Ray) are absent.
        A busy or failing state file gives the last map read: the ready set must still go
        out."""
        capacity = self.deps.capacity
        if capacity is None:
            return {}
        try:
            holders = capacity.holders()
        except StateError as exc:
            log.warning(
                "service %s: accelerators not read (%s): the last known kept", self.name, exc
            )
            return dict(self._accelerators)
        self._accelerators = {
            h.replica_id: h.claim.option.partition(":")[0]
            for h in holders
            if h.service == self.name and h.claim.option
        }
        return dict(self._accelerators)

    def _weighed(self, ready: Mapping[int, str]) -> bool:
        """Whether a ready replica's version routes by instance_aware_least_load."""
        for version in {self.rt.versions.get(rid, 0) for rid in ready}:
            try:
                spec = self.spec(version)
            except (KeyError, StateError):
                continue
            if spec.service.load_balancing_policy == "instance_aware_least_load":
                return True
        return False

    def fleet(self) -> list[tuple[str, str | None]]:
        """Each replica's status and accelerator: what the instance-aware autoscaler counts."""
        accelerators = self.accelerators()
        return [
            (replica_status(r).value, accelerators.get(r.id))
            for r in self.store.replicas(self.name)
        ]

    def worth(self, spec: ServiceSpec) -> dict[int, float]:
        """Each placed replica's target QPS under the spec's per-accelerator targets (the
        smallest where no key names its accelerator), for the scale-down order; empty for
        any other spec (nothing read)."""
        targets = spec.service.replica_policy.target_qps_per_accelerator
        if not targets:
            return {}
        least = min(targets.values())
        return {
            rid: qps_of_accelerator(targets, accelerator) or least
            for rid, accelerator in self.accelerators().items()
        }

    def _weights(
        self, ready: Mapping[int, str], accelerators: Mapping[int, str]
    ) -> dict[int, float]:
        """Each ready replica's target QPS under instance_aware_least_load, from its own
        version's spec; one whose accelerator no key names (or is unknown) counts as the
        smallest target (SkyServe's autoscaler's fallback)."""
        weights: dict[int, float] = {}
        for rid in ready:
            try:
                spec = self.spec(self.rt.versions.get(rid, 0))
            except (KeyError, StateError):
                continue
            targets = spec.service.replica_policy.target_qps_per_accelerator
            if targets and spec.service.load_balancing_policy == "instance_aware_least_load":
                qps = qps_of_accelerator(targets, accelerators.get(rid))
                weights[rid] = qps if qps is not None else min(targets.values())
        return weights

    def set_ready(self, replica_id: int, endpoint: str | None, version: int = 0) -> None:
        changed = False
        if endpoint is None:
            changed = self.rt.ready.pop(replica_id, None) is not None
            self.rt.versions.pop(replica_id, None)
        elif self.rt.ready.get(replica_id) != endpoint:
            self.rt.ready[replica_id] = endpoint
            self.rt.versions[replica_id] = version
            changed = True
        if changed:
            self.publish_ready()

    def mark_gone(
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
            self.mark_failed(r, FailureKind.PREEMPTED, "replica's host went away")
            return
        code = infra.exit_code(handle)
        # Only the process's parent learns its exit code: the daemon that launched it, not one
        # that adopted it after a restart.
        unknown = "exit code unknown: an earlier daemon started it"
        said = exit_text(code) if code is not None else unknown
        # The app's last line says why, most often (`pyhton3: not found` from the shell, an
        # exception's last line): SkyServe's users read "failed" and had to dig for it. Not
        # after a signal (what ended it is not in its output), nor where ``detail`` says why.
        if code is not None and (code in HOPELESS_EXIT_CODES or (code >= 0 and not detail)):
            line = last_line(self.replica_log(r.seq))
            if line and not line.startswith("[corral]"):  # the app said nothing of its own
                said += f": {line}"
        self.mark_failed(
            r,
            FailureKind.APP,
            f"process exited ({said}){detail}; see `corral logs {self.name} {r.seq}`",
            exit_code=code,
        )

    def mark_failed(
        self, r: ReplicaRow, kind: FailureKind, failure: str, *, exit_code: int | None = None
    ) -> None:
        self.store.mark_failed(r.id, kind, failure, exit_code=exit_code)
        self.store.event(self.name, "replica.failed", failure, replica_id=r.id)
        log.warning("service %s: replica %d failed: %s", self.name, r.seq, failure)
        self.set_ready(r.id, None)
        self.wake_event.set()
