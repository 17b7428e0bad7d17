"""What one reconcile step of a service should do, decided from its facts alone.

The controller used to decide and act in the same breath (choose the rolling move, retire on the
spot), so its policies could only be tested through a real daemon. Here every decision is a pure
function of the replica rows, a few facts of the service and the time: it returns actions, and
the controller's executor carries them out (jobs, drain, teardown, store writes). A table of
rows and a simulated clock is enough to test every update and failure policy.

A step has two halves because the first one writes what the second one reads: :func:`upkeep`
(per-row chores: resume, retire the failed, retry teardowns, launch the pending) runs first, the
executor applies it, and :func:`toward_target` then plans over the rows as they are now (a
retired row's ``updated_at`` is when its teardown started, which is where backoff counts from).
:func:`plan` chains both over one set of rows, for callers without a store in between.

One backoff mechanism (:func:`corral.relaunch.backoff`) serves every retry: relaunching after
failures, retrying a failed teardown, and the controller's own retries of a locked state file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from corral.infra.base import Liveness
from corral.relaunch import BACKOFF_CAP as BACKOFF_CAP
from corral.relaunch import backoff as backoff
from corral.relaunch import relaunch_reason as relaunch_reason
from corral.relaunch import relaunch_wait as relaunch_wait
from corral.replicas import (
    TEARING_DOWN,
    LaunchState,
    ReplicaFacts,
    ReplicaStatus,
    TeardownState,
    UpdateMode,
    failure_status,
    is_live,
    replica_status,
    scale_down_victims,
)

# A version that never had a READY replica gives up after this many replica failures.
MAX_FAILURES_BEFORE_READY = 3
# Failed replica rows kept visible per service (older ones are pruned).
KEEP_FAILED = 10

# The failures the crash-loop rule counts: the app's own. A preempted replica or one whose
# probes failed after it was READY says nothing about whether the version can ever start.
UNRECOVERABLE = frozenset(
    {ReplicaStatus.FAILED, ReplicaStatus.FAILED_INITIAL_DELAY, ReplicaStatus.FAILED_PROVISION}
)
# Exits no relaunch can mend: the shell could not find (127) or run (126) the command, of `run`
# or of `setup`; one is enough to give up. So is a FIXED port held by another process ($PORT
# gets a new one). A launch failure is known by its words (corral.job.SetupFailed, PortTaken).
HOPELESS_EXIT_CODES = frozenset({126, 127})
HOPELESS_WORDS = ("its fixed port", "setup exited with code 126 ", "setup exited with code 127 ")


def hopeless(r: Row) -> bool:
    """A failure before READY that the next launch would meet again (see HOPELESS_WORDS)."""
    if failure_status(r) is ReplicaStatus.FAILED_PROVISION:
        return any(words in (r.failure or "") for words in HOPELESS_WORDS)
    return failure_status(r) is ReplicaStatus.FAILED and r.exit_code in HOPELESS_EXIT_CODES


class Row(ReplicaFacts, Protocol):
    """The facts of a replica row the plan reads (a :class:`corral.state.ReplicaRow`)."""

    @property
    def seq(self) -> int: ...
    @property
    def failure(self) -> str | None: ...
    @property
    def updated_at(self) -> float: ...
    @property
    def teardown_attempts(self) -> int: ...
    @property
    def handle_json(self) -> str | None: ...
    @property
    def exit_code(self) -> int | None: ...


@dataclass(frozen=True)
class Busy:
    """Rows the executor is working on right now (a job or a drain): their outcome is not lost."""

    launching: frozenset[int] = frozenset()
    tearing_down: frozenset[int] = frozenset()  # draining or in a teardown job


@dataclass(frozen=True)
class Facts:
    """A running service as one step sees it."""

    rows: Sequence[Row]
    version: int  # the current version
    mode: UpdateMode  # how the current version replaces the ones before it
    min_replicas: int  # of the current version's policy (the blue-green switch waits for it)
    version_ready: bool  # the current version has had a READY replica
    target: int  # the autoscaler's target
    failure: str | None = None  # why the service gave up, as stored
    busy: Busy = Busy()
    # Replica id -> its target QPS in a mixed fleet (instance_aware_least_load): a scale-down
    # takes the ones serving least first, as SkyServe's; empty otherwise.
    worth: Mapping[int, float] = field(default_factory=dict)
    fallback: int | None = None  # gave up, and this older version serves: kept (corral.fallback)


# -- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resume:
    """Finish a launch or teardown no job will record (a write refused, a daemon restart)."""

    replica_id: int


@dataclass(frozen=True)
class Retire:
    """Take a replica out of service: cancel its launch, or drain and tear it down."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class ScaleDown:
    """Mark a live replica as unwanted (so it no longer counts), then retire it."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class Launch:
    """Launch a PENDING row (it may still wait for a launch slot or for capacity)."""

    replica_id: int


@dataclass(frozen=True)
class Add:
    """New replicas of ``version`` (None: the current one), launched at once."""

    count: int
    target: int
    version: int | None = None


@dataclass(frozen=True)
class Fail:
    """The current version gives up (crash loop): record why, relaunch nothing."""

    reason: str


@dataclass(frozen=True)
class ClearFailure:
    """The recorded give-up no longer holds (an update, or a READY replica)."""


@dataclass(frozen=True)
class Hold:
    """Blue-green: READY replicas of ``version`` get no traffic yet (None: nothing held)."""

    version: int | None


@dataclass(frozen=True)
class Switch:
    """Blue-green: traffic goes to ``version`` now (its old replicas are retired)."""

    version: int


@dataclass(frozen=True)
class MakeRoom:
    """A rolling update that may find no spare capacity: ask the machine whether one old
    replica must go first (the executor knows the machine; docs/gpus.md)."""

    version: int
    target: int
    ready_new: int


@dataclass(frozen=True)
class Forget:
    """Delete a finished row (an old failure past :data:`KEEP_FAILED`, or a torn-down
    replica of a service going down); ``reason`` is logged as an event when given."""

    replica_id: int
    reason: str | None = None


@dataclass(frozen=True)
class RestartTeardown:
    """A teardown a previous daemon started: forget how far it got, then retire again."""

    replica_id: int
    reason: str


@dataclass(frozen=True)
class Relaunch:
    """Back to PENDING (launched again by a later step): nothing of its launch runs."""

    replica_id: int
    reason: str
    forget_handle: bool


@dataclass(frozen=True)
class Adopt:
    """A replica found running is kept: ``launched`` records its launch as done (only the job's
    return was lost); otherwise it was launched already and goes back into the ready set if it
    was READY."""

    replica_id: int
    reason: str
    launched: bool


@dataclass(frozen=True)
class Unknown:
    """Nobody could say whether it runs: kept, asked again later, never failed on that."""

    replica_id: int
    not_ready: bool


@dataclass(frozen=True)
class Gone:
    """Its backend says it is gone: judged as any gone replica (FAILED, or PREEMPTED)."""

    replica_id: int
    liveness: Liveness


@dataclass(frozen=True)
class Note:
    """What the step decided, in words (the service's ``last_decision``); while it waits
    for the relaunch backoff, ``until`` when the next attempt comes and ``why``."""

    text: str
    # Not compared: two steps that decided the same in the same words are equal.
    until: float | None = field(default=None, compare=False)
    why: str | None = field(default=None, compare=False)


Action = (
    Resume
    | Retire
    | ScaleDown
    | Launch
    | Add
    | Fail
    | ClearFailure
    | Hold
    | Switch
    | MakeRoom
    | Forget
    | Note
    | RestartTeardown
    | Relaunch
    | Adopt
    | Unknown
    | Gone
)


# -- rules -----------------------------------------------------------------------------------


def outcome_lost(r: Row, busy: Busy) -> bool:
    """A row mid-launch or mid-teardown that no job or drain works on: every step records its
    outcome with a write, and when that write fails (or the daemon restarts) nothing would ever
    finish the row. It is resumed instead."""
    if r.launch_state == LaunchState.RUNNING and r.id not in busy.launching:
        return True
    return r.teardown_state in TEARING_DOWN and r.id not in busy.tearing_down


def teardown_retry_due(r: Row, now: float) -> bool:
    """A failed teardown is retried for as long as it fails: a replica whose teardown failed
    may still run, and giving up after a few attempts left it running for good once a backend
    outage outlasted them."""
    return now - r.updated_at >= backoff(r.teardown_attempts)


def gave_up(version: int, version_ready: bool, current: Sequence[Row]) -> str | None:
    """SkyServe's rule, with a count: a version that never became ready and keeps failing is
    not relaunched forever (no crash loop)."""
    if version_ready:
        return None
    failed = [r for r in current if failure_status(r) in UNRECOVERABLE]
    if len(failed) < MAX_FAILURES_BEFORE_READY and not any(hopeless(r) for r in failed):
        return None
    last = max(failed, key=lambda r: r.id)
    return (
        f"version {version} never became ready and {len(failed)} "
        f"replica{'s' if len(failed) != 1 else ''} failed; "
        f"last: replica {last.seq or last.id} {failure_status(last)}: "
        f"{last.failure or 'no detail'}"
    )


def upkeep(rows: Sequence[Row], busy: Busy, now: float) -> list[Action]:
    """Per-row chores of a running service, before it is steered toward its target."""
    actions: list[Action] = []
    for r in rows:
        failure = failure_status(r)
        if outcome_lost(r, busy):
            actions.append(Resume(r.id))
        elif failure is not None and r.teardown_state is None:
            actions.append(Retire(r.id, f"replica {failure}"))
        elif r.teardown_state == TeardownState.FAILED:
            if teardown_retry_due(r, now):
                attempt = r.teardown_attempts + 1
                actions.append(Retire(r.id, f"retrying teardown (attempt {attempt})"))
        elif r.scale_down and r.teardown_state is None:
            actions.append(Retire(r.id, "scaled down"))
        elif r.launch_state == LaunchState.PENDING and r.id not in busy.launching:
            actions.append(Launch(r.id))
    return actions


def replace_old_versions(facts: Facts) -> list[Action]:
    """Retire replicas of older versions as the current one becomes READY.

    Rolling: traffic goes to READY replicas of every version, and old replicas are kept only
    while the new version has fewer READY than the target asks, so the READY count never drops
    below it. Blue-green: the new version's READY replicas get no traffic until it has
    ``min_replicas`` READY (at least 1); then traffic switches at once and every old replica
    drains and goes. A version that never becomes READY is never promoted: the old serve."""
    version, rows, target = facts.version, facts.rows, facts.target
    old = [r for r in rows if r.version != version and is_live(r)]
    if not old:
        return [Hold(None)]
    ready_new = sum(
        1 for r in rows if r.version == version and replica_status(r) is ReplicaStatus.READY
    )
    actions: list[Action] = []
    if facts.mode is UpdateMode.BLUE_GREEN:
        needed = min(max(1, facts.min_replicas), max(1, target))
        if ready_new >= needed:
            actions += [Retire(r.id, f"blue-green switch to version {version}") for r in old]
            actions += [Switch(version), Hold(None)]
        elif any(replica_status(r) is ReplicaStatus.READY for r in old):
            actions.append(Hold(version))
        else:
            actions.append(Hold(None))
        return actions
    why = f"rolling update to version {version}"
    old_ready = [r for r in old if replica_status(r) is ReplicaStatus.READY]
    keep = max(0, target - ready_new)
    keep_all = [r for r in old if r.version == facts.fallback]  # serves: its own successors
    actions += [Retire(r.id, why) for r in old if r not in old_ready + keep_all]
    victims = scale_down_victims(old_ready, len(old_ready) - keep, current_version=version)
    actions += [Retire(r.id, why) for r in victims]
    # No room is made for a version given up (its last relaunch may still wait for a device).
    room = [] if facts.fallback else [MakeRoom(version, target, ready_new)]
    return [*actions, *room, Hold(None)]


def toward_target(facts: Facts, now: float) -> list[Action]:
    """Replace old versions, then launch or scale down toward the target, unless the current
    version gave up (crash loop) or failed too recently (backoff)."""
    actions = replace_old_versions(facts)
    current = [r for r in facts.rows if r.version == facts.version]
    live = [r for r in current if is_live(r)]
    target = facts.target
    given_up = gave_up(facts.version, facts.version_ready, current)
    if given_up is not None:
        if facts.failure != given_up:
            actions.append(Fail(given_up))
        actions.append(Note(f"not relaunching: {given_up}"))
    elif len(live) < target:
        wait = relaunch_wait(current, now)
        if wait > 0:
            text = f"waiting {wait:.0f}s before relaunching (backoff)"
            actions.append(Note(text, until=now + wait, why=relaunch_reason(current)))
        else:
            actions.append(Add(target - len(live), target))
            actions.append(Note(f"launching {target - len(live)} toward target {target}"))
    elif len(live) > target:
        victims = scale_down_victims(
            live, len(live) - target, current_version=facts.version, worth=facts.worth
        )
        actions += [ScaleDown(r.id, f"scale down to {target}") for r in victims]
        actions.append(Note(f"scaling down to {target}"))
    else:
        actions.append(Note(f"at target {target}"))
    if facts.failure is not None and given_up is None:
        actions.append(ClearFailure())
    return actions + prune(facts.rows)


def prune(rows: Sequence[Row]) -> list[Action]:
    """Forget failed rows beyond the newest :data:`KEEP_FAILED` (kept for their logs)."""
    done = [
        r
        for r in rows
        if r.teardown_state == TeardownState.SUCCEEDED and failure_status(r) is not None
    ]
    return [Forget(r.id) for r in done[: max(0, len(done) - KEEP_FAILED)]]


def plan(facts: Facts, now: float) -> list[Action]:
    """One whole step over one set of rows: :func:`upkeep`, then :func:`toward_target`."""
    return [*upkeep(facts.rows, facts.busy, now), *toward_target(facts, now)]


def going_down(rows: Sequence[Row], *, purge: bool, now: float) -> list[Action]:
    """A service being shut down: every replica is retired (a failed teardown retried with
    backoff, or forgotten with ``purge``); torn-down rows are forgotten."""
    actions: list[Action] = []
    for r in rows:
        if r.teardown_state == TeardownState.SUCCEEDED:
            actions.append(Forget(r.id))
        elif r.teardown_state == TeardownState.FAILED and purge:
            actions.append(Forget(r.id, "teardown failed; purged"))
        elif r.teardown_state == TeardownState.FAILED:
            if teardown_retry_due(r, now):
                actions.append(Retire(r.id, "service down (retry)"))
        else:
            actions.append(Retire(r.id, "service down"))
    return actions


# -- restart recovery ------------------------------------------------------------------------


def asks_backend(r: Row) -> bool:
    """Whether :func:`recover` needs the backend's answer about this row (asked before the
    rules run, off them: it can take seconds)."""
    if r.teardown_state in TEARING_DOWN or r.handle_json is None:
        return False
    if r.launch_state == LaunchState.CANCELLED and r.teardown_state is None:
        return False
    if r.launch_state == LaunchState.RUNNING:
        return True
    return r.launch_state == LaunchState.SUCCEEDED and failure_status(r) is None


def recover(r: Row, liveness: Liveness | None) -> list[Action]:
    """A row a previous daemon left, brought back under control (at start). ``liveness``: the
    backend's answer about its handle when :func:`asks_backend` says it is needed.

    A live process is adopted; a launch interrupted before anything was recorded is launched
    again; an interrupted teardown is run again; a recorded replica found gone is judged as a
    running daemon's probe judges it (:class:`Gone`); an answer nobody could give changes
    nothing (:class:`Unknown`)."""
    if r.teardown_state in TEARING_DOWN:
        return [RestartTeardown(r.id, "teardown interrupted by daemon restart")]
    if r.launch_state == LaunchState.CANCELLED and r.teardown_state is None:
        # Killed between a launch's cancel and its retire: no later step looks at a cancelled
        # row, so it would stay SHUTTING_DOWN forever, uncounted. Retire it now.
        return [Retire(r.id, "launch cancelled before the daemon restart")]
    if not asks_backend(r):
        if r.launch_state == LaunchState.RUNNING and r.handle_json is None:
            # Nothing recorded as started: the sweep killed any half-done setup.
            return [Relaunch(r.id, "launch interrupted", forget_handle=False)]
        return []
    assert liveness is not None, "asks_backend: the backend's answer is needed"
    if r.launch_state == LaunchState.RUNNING:
        return launch_outcome(r.id, liveness, "launch interrupted", tell_unknown=True)
    if liveness is Liveness.ALIVE:
        return [Adopt(r.id, "running after restart", launched=False)]
    if liveness is Liveness.UNKNOWN:
        # Not failed on a question nobody could answer (a cluster down while the daemon
        # restarted): kept, out of the ready set until a probe passes.
        return [Unknown(r.id, not_ready=True)]
    return [Gone(r.id, liveness)]


def launch_outcome(
    replica_id: int, liveness: Liveness, why: str, *, tell_unknown: bool
) -> list[Action]:
    """A launch whose outcome was never recorded (the daemon restarted, or the write was
    refused), from the backend's answer: running is adopted, gone is launched again (it is not
    the app's failure: a cancelled launch kills what it started), unknown waits (a relaunch
    could run it twice)."""
    if liveness is Liveness.ALIVE:
        return [Adopt(replica_id, f"{why}; process running", launched=True)]
    if liveness is Liveness.UNKNOWN:
        return [Unknown(replica_id, not_ready=False)] if tell_unknown else []
    return [Relaunch(replica_id, f"{why}; process gone", forget_handle=True)]
