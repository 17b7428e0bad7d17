"""Tests for corral.plan: replica rows and a simulated clock in, a reconcile step's actions out.

The rules of docs/architecture.md (Updates, Failure policy, the teardown retry of the launch
flow) are checked two ways: tables of one step over hand-made rows, and whole stories replayed
by :class:`Sim`, a stand-in executor that applies each action to in-memory rows at once (a
launch starts the app, a teardown finishes) while the test moves the clock and says when a
replica becomes READY or crashes.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass, field, replace

import psutil
import pytest

from corral import plan
from corral.infra.base import Liveness
from corral.job import SetupFailed
from corral.plan import (
    Add,
    Adopt,
    Busy,
    ClearFailure,
    Facts,
    Fail,
    Forget,
    Gone,
    Hold,
    Launch,
    MakeRoom,
    Note,
    Relaunch,
    RestartTeardown,
    Resume,
    Retire,
    ScaleDown,
    Switch,
    Unknown,
    backoff,
)
from corral.ports import fixed_port_taken
from corral.replicas import (
    LaunchState,
    ReplicaStatus,
    TeardownState,
    UpdateMode,
    failure_status,
    replica_status,
)


@dataclass(frozen=True)
class R:
    """A replica row with the facts the plan reads (defaults: launched, STARTING)."""

    id: int
    version: int = 1
    launch_state: LaunchState = LaunchState.SUCCEEDED
    teardown_state: TeardownState | None = None
    first_ready_at: float | None = None
    ready: int = 0
    app_failed: int = 0
    preempted: int = 0
    probe_failed: int = 0
    initial_delay_failed: int = 0
    scale_down: int = 0
    seq: int = 0
    failure: str | None = None
    updated_at: float = 0.0
    teardown_attempts: int = 0
    handle_json: str | None = None
    exit_code: int | None = None


def ready(rid: int, version: int = 1, at: float = 0.0) -> R:
    return R(rid, version, ready=1, first_ready_at=at)


def crashed(rid: int, at: float, version: int = 1, *, torn_down: bool = True) -> R:
    return R(
        rid,
        version,
        app_failed=1,
        failure="exit 1",
        updated_at=at,
        teardown_state=TeardownState.SUCCEEDED if torn_down else None,
    )


def facts(rows: list[R], **kw: object) -> Facts:
    values: dict[str, object] = {
        "rows": rows,
        "version": 1,
        "mode": UpdateMode.ROLLING,
        "min_replicas": 1,
        "version_ready": True,
        "target": len(rows),
    }
    values.update(kw)
    return Facts(**values)  # type: ignore[arg-type]


def without_notes(actions: list[plan.Action]) -> list[plan.Action]:
    return [a for a in actions if not isinstance(a, Note)]


# -- backoff: the one mechanism -------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "seconds"),
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)],
)
def test_backoff_doubles_up_to_the_cap(failures: int, seconds: float) -> None:
    assert backoff(failures) == seconds


def test_backoff_base_and_cap_are_the_callers() -> None:
    # The controller's retry of a locked state file at start: 0.5, 1, 2, 4, 5, 5 s.
    assert [backoff(n, base=0.5, cap=5.0) for n in range(1, 7)] == [0.5, 1, 2, 4, 5, 5]


# -- upkeep: one row at a time ----------------------------------------------------------------

FAILED_TEARDOWN = R(
    7, app_failed=1, teardown_state=TeardownState.FAILED, teardown_attempts=3, updated_at=100.0
)


@pytest.mark.parametrize(
    ("row", "busy", "now", "expected"),
    [
        # A launch job runs it: nothing to do. No job: its outcome was lost, resume it.
        (R(1, launch_state=LaunchState.RUNNING), Busy(launching=frozenset({1})), 0, []),
        (R(1, launch_state=LaunchState.RUNNING), Busy(), 0, [Resume(1)]),
        # A teardown in a job or a drain, or lost.
        (R(1, teardown_state=TeardownState.PENDING), Busy(tearing_down=frozenset({1})), 0, []),
        (R(1, teardown_state=TeardownState.RUNNING), Busy(), 0, [Resume(1)]),
        # Failed and still up: retired with its status as the reason.
        (R(1, app_failed=1), Busy(), 0, [Retire(1, "replica FAILED")]),
        (R(1, preempted=1), Busy(), 0, [Retire(1, "replica PREEMPTED")]),
        (
            R(1, probe_failed=1, first_ready_at=1.0),
            Busy(),
            0,
            [Retire(1, "replica FAILED_PROBING")],
        ),
        (R(1, launch_state=LaunchState.FAILED), Busy(), 0, [Retire(1, "replica FAILED_PROVISION")]),
        (
            R(1, initial_delay_failed=1),
            Busy(),
            0,
            [Retire(1, "replica FAILED_INITIAL_DELAY")],
        ),
        # A failed teardown is retried after backoff(attempts): 4 s after the third.
        (FAILED_TEARDOWN, Busy(), 103.9, []),
        (FAILED_TEARDOWN, Busy(), 104.0, [Retire(7, "retrying teardown (attempt 4)")]),
        # Chosen to go (scale down, down --replica-id) and not retired yet.
        (R(1, scale_down=1), Busy(), 0, [Retire(1, "scaled down")]),
        # PENDING: launched unless a job already has it.
        (R(1, launch_state=LaunchState.PENDING), Busy(), 0, [Launch(1)]),
        (R(1, launch_state=LaunchState.PENDING), Busy(launching=frozenset({1})), 0, []),
        # READY, STARTING, and a failure torn down: nothing.
        (ready(1), Busy(), 0, []),
        (R(1), Busy(), 0, []),
        (crashed(1, at=0.0), Busy(), 0, []),
    ],
)
def test_upkeep(row: R, busy: Busy, now: float, expected: list[plan.Action]) -> None:
    assert plan.upkeep([row], busy, now) == expected


# -- toward the target: one step ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "target", "expected"),
    [
        ([], 2, [Hold(None), Add(2, 2), Note("launching 2 toward target 2")]),
        ([ready(1)], 3, [Hold(None), Add(2, 3), Note("launching 2 toward target 3")]),
        ([ready(1), R(2)], 2, [Hold(None), Note("at target 2")]),
        # Scale down: the least useful first (PENDING before STARTING before READY) ...
        (
            [ready(1), R(2), R(3, launch_state=LaunchState.PENDING)],
            1,
            [
                Hold(None),
                ScaleDown(3, "scale down to 1"),
                ScaleDown(2, "scale down to 1"),
                Note("scaling down to 1"),
            ],
        ),
        # ... and among equals the newest (it has served least).
        (
            [ready(1), ready(2), ready(3)],
            1,
            [
                Hold(None),
                ScaleDown(3, "scale down to 1"),
                ScaleDown(2, "scale down to 1"),
                Note("scaling down to 1"),
            ],
        ),
        # Going or failed replicas do not count toward the target.
        (
            [ready(1), R(2, scale_down=1), R(3, teardown_state=TeardownState.PENDING)],
            2,
            [Hold(None), Add(1, 2), Note("launching 1 toward target 2")],
        ),
        ([], 0, [Hold(None), Note("at target 0")]),
    ],
)
def test_scale(rows: list[R], target: int, expected: list[plan.Action]) -> None:
    assert plan.toward_target(facts(rows, target=target), now=0.0) == expected


@pytest.mark.parametrize(
    ("rows", "now", "note"),
    [
        # One failure since the newest READY: wait 1 s from it.
        ([ready(1, at=5.0), crashed(2, at=10.0)], 10.5, "waiting 0s before relaunching (backoff)"),
        ([ready(1, at=5.0), crashed(2, at=10.0)], 11.0, "launching 1 toward target 2"),
        # Three in a row: 4 s after the last.
        (
            [ready(1, at=1.0), crashed(2, 10.0), crashed(3, 12.0), crashed(4, 13.0)],
            16.0,
            "waiting 1s before relaunching (backoff)",
        ),
        (
            [ready(1, at=1.0), crashed(2, 10.0), crashed(3, 12.0), crashed(4, 13.0)],
            17.0,
            "launching 1 toward target 2",
        ),
        # Failures before the newest READY are not consecutive: they do not count.
        (
            [crashed(2, 10.0), crashed(3, 12.0), ready(4, at=20.0)],
            20.0,
            "launching 1 toward target 2",
        ),
        # A READY replica that runs on ends the run however young: replicas lost together
        # (a node, the OOM killer) come back as fast as the first replacement is READY.
        (
            [crashed(2, 10.0), crashed(3, 10.0), ready(4, at=11.0), crashed(5, 12.0)],
            13.0,
            "launching 1 toward target 2",
        ),
        # Capped at 30 s however many failed.
        (
            [ready(1, at=0.0), *(crashed(i, 100.0 + i) for i in range(2, 12))],
            140.9,
            "waiting 0s before relaunching (backoff)",
        ),
        (
            [ready(1, at=0.0), *(crashed(i, 100.0 + i) for i in range(2, 12))],
            141.0,
            "launching 1 toward target 2",
        ),
    ],
)
def test_backoff_before_relaunching(rows: list[R], now: float, note: str) -> None:
    actions = plan.toward_target(facts(rows, target=2), now)
    assert Note(note) in actions
    assert any(isinstance(a, Add) for a in actions) == note.startswith("launching")


def test_crash_loop_gives_up_after_three_unrecoverable_failures() -> None:
    rows = [
        crashed(1, 1.0),
        replace(crashed(2, 2.0), app_failed=0, initial_delay_failed=1, failure="slow"),
        R(3, launch_state=LaunchState.FAILED, failure="setup: exit 2", seq=3, updated_at=3.0),
    ]
    reason = (
        "version 1 never became ready and 3 replicas failed; "
        "last: replica 3 FAILED_PROVISION: setup: exit 2"
    )
    actions = plan.toward_target(facts(rows, target=1, version_ready=False), now=1000.0)
    assert without_notes(actions) == [Hold(None), Fail(reason)]
    assert Note(f"not relaunching: {reason}") in actions
    # Recorded already: not written again, still not relaunched.
    again = plan.toward_target(
        facts(rows, target=1, version_ready=False, failure=reason), now=1000.0
    )
    assert without_notes(again) == [Hold(None)]


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (replace(crashed(1, 1.0), exit_code=127, failure="exit 127"), "exit 127"),
        (replace(crashed(1, 1.0), exit_code=126, failure="exit 126"), "exit 126"),
        (
            replace(
                crashed(1, 1.0),
                app_failed=0,
                launch_state=LaunchState.FAILED,
                failure="its fixed port 8080 is in use by pid 7 (nginx): ...",
            ),
            "its fixed port 8080 is in use by pid 7 (nginx)",
        ),
    ],
    ids=["command-not-found", "not-executable", "fixed-port-taken"],
)
def test_a_failure_no_relaunch_can_mend_gives_up_at_once(row: R, why: str) -> None:
    """`pyhton3: command not found` (127), a command that is not executable (126): the first
    such failure before READY fails the version with its line."""
    actions = plan.toward_target(facts([row], target=2, version_ready=False), now=1000.0)
    fail = [a for a in actions if isinstance(a, Fail)]
    assert fail and why in fail[0].reason and "1 replica failed" in fail[0].reason, actions
    assert not any(isinstance(a, Add) for a in actions)
    # An ordinary crash (exit 1), or a port another process took (a relaunch gets a port of
    # its own), is relaunched: it may have been a passing fault.
    for passing in (crashed(1, 1.0), replace(crashed(1, 1.0), failure="is in use by pid 7")):
        ordinary = plan.toward_target(facts([passing], target=2, version_ready=False), 1000.0)
        assert not any(isinstance(a, Fail) for a in ordinary)


def test_a_setup_that_cannot_run_its_command_is_given_up_at_once() -> None:
    """A setup exiting 127 (a typo'd command) is met again by every relaunch, as a run's is;
    any other setup failure may pass. The plan reads the words corral.job.SetupFailed says,
    which are for the user: one line, the signal named when one ended it."""
    assert str(SetupFailed(3)) == "setup exited with code 3"
    assert repr(SetupFailed(127)) == "setup exited with code 127 (a command it runs was not found)"
    assert str(SetupFailed(-9)) == "setup was ended by signal 9 (SIGKILL)"
    for code, gives_up in ((127, True), (126, True), (3, False), (-9, False)):
        said = f"{SetupFailed(code)!r}; see `corral logs`"
        row = R(1, 1, launch_state=LaunchState.FAILED, failure=said, updated_at=1.0)
        assert replica_status(row) is ReplicaStatus.FAILED_PROVISION
        assert plan.hopeless(row) is gives_up, code


def test_the_fixed_port_line_is_the_one_the_plan_gives_up_on() -> None:
    """What the local backend says of a fixed port another process holds (this test's own
    listener: pid and command line) carries the words the plan reads as hopeless."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said = fixed_port_taken(port, "some-other-home")
        assert said is not None and plan.HOPELESS_WORDS[0] in said, said
        assert f"its fixed port {port} is in use by pid {os.getpid()} (" in said, said
        command = " ".join(psutil.Process().cmdline())  # as ps shows it (xdist renames it)
        assert f"pid {os.getpid()} ({command})" in said, said
    assert fixed_port_taken(port, "some-other-home") is None  # nobody listens any more


@pytest.mark.parametrize(
    ("rows", "version_ready"),
    [
        # A version that was READY once is never given up (its failures are relaunched).
        ([crashed(1, 1.0), crashed(2, 2.0), crashed(3, 3.0)], True),
        # Preempted and probe failures are not the app's: they do not count.
        (
            [
                crashed(1, 1.0),
                crashed(2, 2.0),
                replace(crashed(3, 3.0), app_failed=0, preempted=1),
            ],
            False,
        ),
        # Failures of another version do not count against this one.
        ([crashed(1, 1.0), crashed(2, 2.0), crashed(3, 3.0, version=2)], False),
    ],
)
def test_no_give_up(rows: list[R], version_ready: bool) -> None:
    actions = plan.toward_target(facts(rows, target=1, version_ready=version_ready), 1000.0)
    assert not any(isinstance(a, Fail) for a in actions)
    assert Add(1, 1) in actions


def test_a_recorded_give_up_that_no_longer_holds_is_cleared() -> None:
    actions = plan.toward_target(facts([ready(1)], target=1, failure="gave up"), 0.0)
    assert actions[-1] == ClearFailure()


def test_old_failures_beyond_ten_are_forgotten_oldest_first() -> None:
    rows = [ready(1), *(crashed(i, float(i)) for i in range(2, 14))]
    actions = plan.toward_target(facts(rows, target=1), now=1000.0)
    assert [a for a in actions if isinstance(a, Forget)] == [Forget(2), Forget(3)]


# -- updates: one step ---------------------------------------------------------------------


def test_rolling_keeps_old_ready_until_new_ones_are_ready() -> None:
    rows = [ready(1), ready(2), R(3, version=2), ready(4, version=2), R(5, version=1)]
    actions = plan.toward_target(facts(rows, version=2, target=2), 0.0)
    why = "rolling update to version 2"
    # Old not READY go at once; one new READY lets one old READY go (the newest).
    assert without_notes(actions) == [
        Retire(5, why),
        Retire(2, why),
        MakeRoom(2, 2, 1),
        Hold(None),
    ]


def test_blue_green_holds_then_switches_at_min_replicas() -> None:
    old = [ready(1), ready(2)]
    held = plan.toward_target(
        facts([*old, ready(3, 2)], version=2, target=2, min_replicas=2, mode=UpdateMode.BLUE_GREEN),
        0.0,
    )
    # One READY of the two it needs: traffic stays on version 1, the second is launched.
    assert without_notes(held) == [Hold(2), Add(1, 2)]
    switched = plan.toward_target(
        facts(
            [*old, ready(3, 2), ready(4, 2)],
            version=2,
            target=2,
            min_replicas=2,
            mode=UpdateMode.BLUE_GREEN,
        ),
        0.0,
    )
    why = "blue-green switch to version 2"
    assert without_notes(switched) == [Retire(1, why), Retire(2, why), Switch(2), Hold(None)]


@pytest.mark.parametrize(
    ("min_replicas", "target", "needed"),
    [(0, 2, 1), (1, 2, 1), (3, 2, 2), (2, 0, 1)],
)
def test_blue_green_switch_needs_min_replicas_at_least_one_at_most_the_target(
    min_replicas: int, target: int, needed: int
) -> None:
    old = [ready(1)]
    new = [ready(10 + i, 2) for i in range(needed)]
    before = plan.replace_old_versions(
        facts(
            [*old, *new[:-1]],
            version=2,
            target=target,
            min_replicas=min_replicas,
            mode=UpdateMode.BLUE_GREEN,
        )
    )
    after = plan.replace_old_versions(
        facts(
            [*old, *new],
            version=2,
            target=target,
            min_replicas=min_replicas,
            mode=UpdateMode.BLUE_GREEN,
        )
    )
    assert Switch(2) not in before and Switch(2) in after


def test_blue_green_holds_nothing_when_no_old_replica_serves() -> None:
    rows = [R(1), ready(2, 2)]
    actions = plan.replace_old_versions(
        facts(rows, version=2, target=2, min_replicas=2, mode=UpdateMode.BLUE_GREEN)
    )
    assert actions == [Hold(None)]


# -- the service going down -----------------------------------------------------------------


def test_going_down() -> None:
    rows = [
        ready(1),
        R(2, teardown_state=TeardownState.SUCCEEDED),
        FAILED_TEARDOWN,
        replace(FAILED_TEARDOWN, id=8, updated_at=0.0),
    ]
    assert plan.going_down(rows, purge=False, now=103.0) == [
        Retire(1, "service down"),
        Forget(2),
        Retire(8, "service down (retry)"),
    ]
    assert plan.going_down(rows, purge=True, now=103.0) == [
        Retire(1, "service down"),
        Forget(2),
        Forget(7, "teardown failed; purged"),
        Forget(8, "teardown failed; purged"),
    ]


# -- restart recovery: rows a previous daemon left -------------------------------------------

H = '{"backend": "local", "endpoint": "http://127.0.0.1:1", "data": {}}'
RUNNING = R(1, launch_state=LaunchState.RUNNING, handle_json=H)
UP = R(1, handle_json=H, ready=1, first_ready_at=1.0)


@pytest.mark.parametrize(
    ("row", "liveness", "expected"),
    [
        # Interrupted teardowns run again; a cancelled launch never retired is retired.
        (
            R(1, teardown_state=TeardownState.RUNNING, handle_json=H),
            None,
            [RestartTeardown(1, "teardown interrupted by daemon restart")],
        ),
        (
            R(1, launch_state=LaunchState.CANCELLED, handle_json=H),
            None,
            [Retire(1, "launch cancelled before the daemon restart")],
        ),
        # A launch with nothing recorded as started: launched again (not the app's failure).
        (
            R(1, launch_state=LaunchState.RUNNING),
            None,
            [Relaunch(1, "launch interrupted", forget_handle=False)],
        ),
        # A launch that had started something: the backend's answer decides.
        (
            RUNNING,
            Liveness.ALIVE,
            [Adopt(1, "launch interrupted; process running", launched=True)],
        ),
        (RUNNING, Liveness.UNKNOWN, [Unknown(1, not_ready=False)]),
        (
            RUNNING,
            Liveness.EXITED,
            [Relaunch(1, "launch interrupted; process gone", forget_handle=True)],
        ),
        (
            RUNNING,
            Liveness.LOST,
            [Relaunch(1, "launch interrupted; process gone", forget_handle=True)],
        ),
        # A launched replica: adopted, kept while nobody can answer, or judged gone exactly
        # as a running daemon's probe judges it (Gone: FAILED if it exited, PREEMPTED if lost).
        (UP, Liveness.ALIVE, [Adopt(1, "running after restart", launched=False)]),
        (UP, Liveness.UNKNOWN, [Unknown(1, not_ready=True)]),
        (UP, Liveness.EXITED, [Gone(1, Liveness.EXITED)]),
        (UP, Liveness.LOST, [Gone(1, Liveness.LOST)]),
        # Failed, torn down, or never started: nothing to recover.
        (replace(UP, app_failed=1), None, []),
        (R(1, launch_state=LaunchState.PENDING), None, []),
        (crashed(1, 1.0), None, []),
    ],
)
def test_recover(row: R, liveness: Liveness | None, expected: list[plan.Action]) -> None:
    assert plan.asks_backend(row) == (liveness is not None)
    assert plan.recover(row, liveness) == expected


def test_a_lost_launch_outcome_is_judged_the_same_by_a_running_daemon() -> None:
    """The running loop resumes an unrecorded launch with the same rule as a restart; only an
    unknown answer stays silent (it asks again on its next step)."""
    why = "launch outcome not recorded"
    assert plan.launch_outcome(1, Liveness.ALIVE, why, tell_unknown=False) == [
        Adopt(1, f"{why}; process running", launched=True)
    ]
    assert plan.launch_outcome(1, Liveness.LOST, why, tell_unknown=False) == [
        Relaunch(1, f"{why}; process gone", forget_handle=True)
    ]
    assert plan.launch_outcome(1, Liveness.UNKNOWN, why, tell_unknown=False) == []


# -- stories over a simulated clock ---------------------------------------------------------


@dataclass
class Sim:
    """A service driven by :func:`plan.plan` step after step; launches and teardowns finish
    at once, READY and crashes happen when the test says."""

    target: int
    mode: UpdateMode = UpdateMode.ROLLING
    min_replicas: int = 1
    version: int = 1
    now: float = 1000.0  # (a READY time of 0.0 would read as "never")
    rows: dict[int, R] = field(default_factory=dict)
    failure: str | None = None
    held: int | None = None
    note: str = ""
    ready_versions: set[int] = field(default_factory=set)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    switches: list[int] = field(default_factory=list)

    def step(self) -> list[plan.Action]:
        rows = list(self.rows.values())
        actions = plan.upkeep(rows, Busy(), self.now)
        self.apply(actions)
        f = Facts(
            rows=list(self.rows.values()),
            version=self.version,
            mode=self.mode,
            min_replicas=self.min_replicas,
            version_ready=self.version in self.ready_versions,
            target=self.target,
            failure=self.failure,
        )
        later = plan.toward_target(f, self.now)
        self.apply(later)
        return actions + later

    def apply(self, actions: list[plan.Action]) -> None:
        for a in actions:
            match a:
                case Retire(rid) | ScaleDown(rid):
                    self.retire(rid)
                case Add(count):
                    for _ in range(count):
                        rid = next(self.ids)
                        self.rows[rid] = R(rid, self.version, seq=rid, updated_at=self.now)
                case Launch(rid):
                    self.rows[rid] = replace(self.rows[rid], launch_state=LaunchState.SUCCEEDED)
                case Fail(reason):
                    self.failure = reason
                case ClearFailure():
                    self.failure = None
                case Hold(version):
                    self.held = version
                case Switch(version):
                    self.switches.append(version)
                case Forget(rid):
                    del self.rows[rid]
                case Note(text):
                    self.note = text

    def retire(self, rid: int) -> None:
        r = self.rows[rid]
        if failure_status(r) is None:
            del self.rows[rid]
        else:
            self.rows[rid] = replace(r, teardown_state=TeardownState.SUCCEEDED, updated_at=self.now)

    def become_ready(self, rid: int) -> None:
        r = self.rows[rid]
        self.rows[rid] = replace(r, ready=1, first_ready_at=self.now, updated_at=self.now)
        self.ready_versions.add(r.version)

    def crash(self, rid: int) -> None:
        r = self.rows[rid]
        self.rows[rid] = replace(r, ready=0, app_failed=1, failure="exit 1", updated_at=self.now)

    def statuses(self, version: int | None = None) -> list[ReplicaStatus]:
        return [
            replica_status(r) for r in self.rows.values() if version is None or r.version == version
        ]

    def serving(self) -> int:
        """READY replicas that get traffic (blue-green holds the new version's)."""
        return sum(
            1
            for r in self.rows.values()
            if replica_status(r) is ReplicaStatus.READY and r.version != self.held
        )

    def update(self, mode: UpdateMode) -> None:
        self.version += 1
        self.mode = mode


def started(target: int, **kw: object) -> Sim:
    sim = Sim(target=target, **kw)  # type: ignore[arg-type]
    sim.step()
    for rid in list(sim.rows):
        sim.become_ready(rid)
    sim.step()
    assert sim.statuses() == [ReplicaStatus.READY] * target
    return sim


def test_rolling_update_never_serves_fewer_than_the_target() -> None:
    sim = started(3)
    sim.update(UpdateMode.ROLLING)
    sim.step()
    new = [r.id for r in sim.rows.values() if r.version == 2]
    assert len(new) == 3
    for rid in new:
        sim.now += 1
        sim.become_ready(rid)
        sim.step()
        assert sim.serving() >= 3
    assert sim.statuses(1) == [] and sim.statuses(2) == [ReplicaStatus.READY] * 3
    assert sim.note == "at target 3"


def test_blue_green_update_switches_all_at_once() -> None:
    sim = started(2)
    sim.update(UpdateMode.BLUE_GREEN)
    sim.min_replicas = 2
    sim.step()
    first, second = (r.id for r in sim.rows.values() if r.version == 2)
    sim.become_ready(first)
    sim.step()
    # The new READY replica is held: only version 1 serves.
    assert sim.held == 2 and sim.serving() == 2 and len(sim.statuses(1)) == 2
    sim.become_ready(second)
    sim.step()
    assert sim.switches == [2] and sim.held is None
    assert sim.statuses(1) == [] and sim.serving() == 2


def test_an_update_that_never_becomes_ready_gives_up_and_the_old_version_keeps_serving() -> None:
    sim = started(1)
    sim.update(UpdateMode.ROLLING)
    start = sim.now
    launches_at: list[float] = []
    for _ in range(20):
        before = set(sim.rows)
        sim.step()
        if set(sim.rows) - before:
            launches_at.append(sim.now - start)
        for r in list(sim.rows.values()):
            if r.version == 2 and replica_status(r) is ReplicaStatus.STARTING:
                sim.crash(r.id)
        sim.now += 0.5
    # Each crash is torn down on the next step (0.5 s later), and backoff counts from there:
    # 1 s after the first, 2 s after the second; the third failure ends it.
    assert launches_at == [0.0, 1.5, 4.0]
    assert sim.failure is not None and sim.failure.startswith("version 2 never became ready")
    assert sim.note.startswith("not relaunching")
    assert sim.statuses(1) == [ReplicaStatus.READY]


def test_a_replica_that_fails_after_ready_is_replaced_with_backoff() -> None:
    sim = started(1)
    (rid,) = sim.rows
    sim.now = 2000.0
    sim.crash(rid)
    sim.step()  # torn down now; relaunched 1 s after that
    assert sim.note == "waiting 1s before relaunching (backoff)"
    sim.now = 2001.0
    sim.step()
    assert sim.note == "launching 1 toward target 1"
    assert sim.statuses() == [ReplicaStatus.FAILED, ReplicaStatus.STARTING]


def test_scale_up_then_down_keeps_the_ready_ones() -> None:
    sim = started(1)
    sim.target = 3
    sim.step()
    assert sim.statuses() == [ReplicaStatus.READY, ReplicaStatus.STARTING, ReplicaStatus.STARTING]
    sim.target = 1
    sim.step()
    assert sim.statuses() == [ReplicaStatus.READY]
    assert sim.note == "scaling down to 1"


def test_a_blue_green_version_that_never_becomes_ready_is_never_promoted() -> None:
    sim = started(2)
    sim.update(UpdateMode.BLUE_GREEN)
    for _ in range(20):
        sim.step()
        for r in list(sim.rows.values()):
            if r.version == 2 and replica_status(r) is ReplicaStatus.STARTING:
                sim.crash(r.id)
        sim.now += 5.0
    assert sim.failure is not None and sim.failure.startswith("version 2 never became ready")
    assert sim.switches == [] and sim.serving() == 2
    assert sim.statuses(1) == [ReplicaStatus.READY] * 2


def test_replicas_that_die_soon_after_ready_back_off_longer_each_time() -> None:
    """A READY of a few seconds does not end a run of failures: an app that passes its first
    probe and dies 3 s later is relaunched 1, 2, 4 ... 30 s apart, not every 1 s forever."""
    sim = started(1)
    sim.now = 2000.0  # replica 1 has served for 1000 s: its crash starts a new run
    waits: list[float] = []
    for _ in range(7):
        (rid,) = (r.id for r in sim.rows.values() if failure_status(r) is None)
        if replica_status(sim.rows[rid]) is not ReplicaStatus.READY:
            sim.become_ready(rid)
            sim.now += 3.0
        sim.crash(rid)
        sim.step()  # torn down now; backoff counts from here
        died = sim.now
        while not any(replica_status(r) is ReplicaStatus.STARTING for r in sim.rows.values()):
            sim.now += 0.5
            sim.step()
        waits.append(sim.now - died)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_replica_ready_for_a_minute_ends_the_run_of_failures() -> None:
    sim = started(1)
    sim.now = 2000.0
    for stays in (3.0, 3.0, 3.0, 70.0):  # the last past STABLE_READY_SECONDS
        (rid,) = (r.id for r in sim.rows.values() if failure_status(r) is None)
        if replica_status(sim.rows[rid]) is not ReplicaStatus.READY:
            sim.become_ready(rid)
        sim.now += stays
        sim.crash(rid)
        sim.step()
        note = sim.note
        sim.now += 60.0
        sim.step()
    # three short READYs were one run (the third waited 4 s); a minute READY ends it
    assert note == "waiting 1s before relaunching (backoff)"
