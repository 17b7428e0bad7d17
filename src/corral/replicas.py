"""Replica and service statuses, derived from stored facts.

A status is never stored: it is computed from the facts a replica row records (launch state,
teardown state, first ready time, ready now, app failed, preempted, ...). That way a daemon that
restarts mid-change cannot find a status that disagrees with what actually happened, and a
status that SkyServe users know (PENDING ... READY, FAILED_*) always means the same thing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeVar


class LaunchState(enum.StrEnum):
    """Where a replica's launch is (the ``launch_state`` column; the values are what the state
    file holds, so an enum member and its text are interchangeable in rows and JSON)."""

    PENDING = "pending"  # waiting for a launch slot, or to be launched again
    RUNNING = "running"  # the launch job has started
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # retired while launching


class TeardownState(enum.StrEnum):
    """Where a replica's teardown is (the ``teardown_state`` column; NULL: not retired)."""

    PENDING = "pending"  # draining
    RUNNING = "running"  # the teardown job has started
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # may still run: retried with backoff, shown as FAILED_CLEANUP


# Teardowns started and not finished: the replica is SHUTTING_DOWN.
TEARING_DOWN = frozenset({TeardownState.PENDING, TeardownState.RUNNING})


class UpdateMode(enum.StrEnum):
    """How a new version replaces the one before it (the ``mode`` column of a version)."""

    ROLLING = "rolling"
    BLUE_GREEN = "blue_green"


class ReplicaStatus(enum.StrEnum):
    PENDING = "PENDING"  # waiting for a launch slot
    PROVISIONING = "PROVISIONING"  # launch job running
    STARTING = "STARTING"  # launched, never ready yet
    READY = "READY"
    NOT_READY = "NOT_READY"  # was ready, probe failing now
    SHUTTING_DOWN = "SHUTTING_DOWN"
    FAILED = "FAILED"  # the app exited
    FAILED_PROVISION = "FAILED_PROVISION"
    FAILED_INITIAL_DELAY = "FAILED_INITIAL_DELAY"
    FAILED_PROBING = "FAILED_PROBING"
    FAILED_CLEANUP = "FAILED_CLEANUP"  # teardown failed: a possible leak, kept visible
    PREEMPTED = "PREEMPTED"
    UNKNOWN = "UNKNOWN"


# The order in which replicas are chosen for scale-down: the least useful first.
SCALE_DOWN_ORDER: Sequence[ReplicaStatus] = (
    ReplicaStatus.PENDING,
    ReplicaStatus.PROVISIONING,
    ReplicaStatus.STARTING,
    ReplicaStatus.NOT_READY,
    ReplicaStatus.READY,
)


class ReplicaFacts(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def launch_state(self) -> LaunchState: ...
    @property
    def teardown_state(self) -> TeardownState | None: ...
    @property
    def first_ready_at(self) -> float | None: ...
    @property
    def updated_at(self) -> float: ...
    @property
    def ready(self) -> int: ...
    @property
    def app_failed(self) -> int: ...
    @property
    def preempted(self) -> int: ...
    @property
    def probe_failed(self) -> int: ...
    @property
    def initial_delay_failed(self) -> int: ...
    @property
    def scale_down(self) -> int: ...


def failure_status(r: ReplicaFacts) -> ReplicaStatus | None:
    """The failure a replica suffered, if any (kept visible after its teardown)."""
    if r.preempted:
        return ReplicaStatus.PREEMPTED
    if r.launch_state == LaunchState.FAILED:
        return ReplicaStatus.FAILED_PROVISION
    if r.app_failed:
        return ReplicaStatus.FAILED
    if r.initial_delay_failed:
        return ReplicaStatus.FAILED_INITIAL_DELAY
    if r.probe_failed:
        return ReplicaStatus.FAILED_PROBING
    return None


def replica_status(r: ReplicaFacts) -> ReplicaStatus:
    if r.teardown_state == TeardownState.FAILED:
        return ReplicaStatus.FAILED_CLEANUP
    if r.teardown_state in TEARING_DOWN:
        return ReplicaStatus.SHUTTING_DOWN
    failure = failure_status(r)
    if failure is not None:
        return failure
    if r.teardown_state == TeardownState.SUCCEEDED or r.launch_state == LaunchState.CANCELLED:
        return ReplicaStatus.SHUTTING_DOWN
    if r.launch_state == LaunchState.PENDING:
        return ReplicaStatus.PENDING
    if r.launch_state == LaunchState.RUNNING:
        return ReplicaStatus.PROVISIONING
    if r.launch_state == LaunchState.SUCCEEDED:
        if r.ready:
            return ReplicaStatus.READY
        return ReplicaStatus.NOT_READY if r.first_ready_at is not None else ReplicaStatus.STARTING
    return ReplicaStatus.UNKNOWN


# How long a replica that failed had to stay READY for its READY to end a run of failures.
STABLE_READY_SECONDS = 60.0


def ready_held(r: ReplicaFacts) -> bool:
    """Whether ``r``'s READY ends its version's run of failures for the relaunch backoff
    (corral.plan): it still runs, or it failed at least :data:`STABLE_READY_SECONDS` after.

    A READY of a few seconds that ended in a failure proves nothing: counted, an app that dies
    soon after its first probe was relaunched every few seconds forever, never backing off
    (Kubernetes' CrashLoopBackOff resets only after 10 minutes). A replica that runs on still
    counts however young, so replicas lost together (a node, the OOM killer) come back as fast
    as the first replacement is READY."""
    if failure_status(r) is None:
        return True
    ready_at = r.first_ready_at
    return ready_at is not None and r.updated_at - ready_at >= STABLE_READY_SECONDS


def is_live(r: ReplicaFacts) -> bool:
    """Counts toward the target: not failed, not going away."""
    return not r.scale_down and r.teardown_state is None and replica_status(r) in SCALE_DOWN_ORDER


F = TypeVar("F", bound=ReplicaFacts)


def scale_down_victims(
    replicas: Iterable[F],
    count: int,
    *,
    current_version: int,
    worth: Mapping[int, float] | None = None,
) -> list[F]:
    """Pick ``count`` live replicas to remove: old versions first, then the least useful
    status (PENDING before READY), then the one serving least by ``worth`` (a mixed fleet's
    target QPS per replica, SkyServe's instance-aware order; unknown: 0), then the newest (it
    has served least)."""
    live = [r for r in replicas if is_live(r)]
    order = {status: i for i, status in enumerate(SCALE_DOWN_ORDER)}
    worth = worth or {}
    live.sort(
        key=lambda r: (
            r.version >= current_version,
            order[replica_status(r)],
            worth.get(r.id, 0.0),
            -r.id,
        )
    )
    return live[: max(0, count)]


class ServiceStatus(enum.StrEnum):
    CONTROLLER_INIT = "CONTROLLER_INIT"
    REPLICA_INIT = "REPLICA_INIT"
    READY = "READY"
    NO_REPLICA = "NO_REPLICA"
    FAILED = "FAILED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    FAILED_CLEANUP = "FAILED_CLEANUP"
    CONTROLLER_FAILED = "CONTROLLER_FAILED"


def service_status(
    statuses: Iterable[ReplicaStatus],
    *,
    shutting_down: bool,
    gave_up: bool,
    controller_running: bool,
    controller_failed: bool = False,
) -> ServiceStatus:
    found = list(statuses)
    if controller_failed:
        return ServiceStatus.CONTROLLER_FAILED
    if ReplicaStatus.FAILED_CLEANUP in found:
        return ServiceStatus.FAILED_CLEANUP
    if shutting_down:
        return ServiceStatus.SHUTTING_DOWN
    if ReplicaStatus.READY in found:
        return ServiceStatus.READY
    if gave_up:
        return ServiceStatus.FAILED
    if not controller_running:
        return ServiceStatus.CONTROLLER_INIT
    if any(s in SCALE_DOWN_ORDER for s in found):
        return ServiceStatus.REPLICA_INIT
    return ServiceStatus.NO_REPLICA
