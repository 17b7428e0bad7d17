"""Chaos: the daemon is SIGKILLed at random points, restarted, and must put everything right.

The promise tested is the architecture's restart invariant: *a daemon killed at any point
restarts into the same services and replicas* (it re-adopts live ones, finishes interrupted
launches and teardowns, sweeps what it started but never recorded), with no replica orphaned,
duplicated or pointed at by a row when it is gone, and an event log that says what happened.

One corral home, one seeded round after another (``chaos_support.rng``; the failure message
names the seed and the round). Each round:

1. picks an operation that fits the home's current services: ``up`` a new service (2-3
   replicas), a relaunching update (new ``APP_VERSION``, rolling or blue-green, 2-3 replicas),
   an in-place scale-down or scale-up (only ``service.replicas`` changes: the same replicas are
   relabelled, then one is retired or launched), a replica crash (its process group SIGKILLed
   just before the daemon: it must end FAILED, kept visible, and be replaced), or ``down``;
   operations not yet covered in the run go first, so even the short run sees each one;
2. picks where the kill lands: after a random delay, or at an observable point made to last
   long enough to be hit on a loaded machine:

   * ``setup``: a trap file makes every replica's ``setup`` sleep 60 s; the kill lands while
     setups sleep (a replica PROVISIONING with nothing recorded: only the restarted daemon's
     leak sweep can stop that sleep in time, and the relaunch must not duplicate it);
   * ``teardown``: a flag file makes replicas ignore SIGTERM, so a teardown sits in its
     TERM-to-KILL grace; the kill lands while a replica is SHUTTING_DOWN;
   * ``write``: the daemon dies (``os._exit``, as abruptly as SIGKILL) right after its Nth
     write to the state file, N random: exactly between two steps of whatever it was doing,
     even inside the API request that carries the operation (see :data:`ARMED_DAEMON`);

3. SIGKILLs the daemon by pid (every third round the restarted daemon too, at a random point
   of its own start: imports, leak sweep, re-adoption), takes a picture of the state file while
   nothing runs it, removes the trap and the flag, restarts the daemon and waits (with a
   deadline) until the state file shows the intended state;
4. checks every invariant of ``invariants.py`` (rows vs processes, orphans, duplicates, the
   intended state, the events written since the restart), that setups caught by the kill were
   swept, and that the endpoint answers from the intended version.

Everything is real: the daemon (``corral.bootstrap.serve``, from a small script that adds only the
"die after write N" cue), examples/app.py replicas (behind a small wrapper that can ignore
SIGTERM on cue), SQLite, HTTP on 127.0.0.1.

Two smaller tests keep the rounds honest: one breaks the home by hand in each way the checker
must see (so a blind checker fails), and one stages in the state file a kill window too narrow to
hit by timing (between the two writes of a cancelled launch).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

import pytest
from chaos_support import BASE_SEED, LONG, record, rng, rounds
from conftest import CorralHome, http, pid_alive, spec_text, wait_for
from invariants import HomeState, Intent, check_home, marked_processes, read_state, settled

pytestmark = pytest.mark.timeout(1200 if LONG else 300)

TEST = "daemon_kill"
MAX_SERVICES = 2  # live at once: each has up to 3 replicas, on a shared 2-core machine
SETTLE_TIMEOUT = 120.0  # restart -> intended state; generous: the machine is shared
OBSERVE_TIMEOUT = 45.0  # until the kill point is reached (a launch in setup, a teardown)

# The wrapper: examples/app.py, except that a SIGTERM is ignored while the flag file exists.
# That stretches a teardown to its TERM-to-KILL grace (5 s), long enough for a kill to land in.
WRAPPER = '''\
"""examples/app.py, slow to stop on cue (a chaos test's replica)."""
import os
import runpy
import signal
import subprocess
import sys

flag = sys.argv[1]


def on_term(signum, frame):
    if not os.path.exists(flag):
        os._exit(128 + signum)


signal.signal(signal.SIGTERM, on_term)
sys.argv = ["app.py"]
runpy.run_path("app.py", run_name="__main__")
'''

# The daemon every round runs: the real one (corral.bootstrap.serve over the real local backend),
# with one addition that stays inert until armed: once HOME/die-after-writes holds N, the Nth
# write to the state file after that is the daemon's last (os._exit right after it: no cleanup,
# no flush, as SIGKILL). Every write is a state transition, so this lands kills exactly between
# two steps of a launch, a teardown or an update, where a timed kill rarely falls.
ARMED_DAEMON = '''\
"""corral's daemon, dying right after the Nth state write once armed (a chaos test's daemon)."""
import asyncio
import functools
import os
import sys
import threading
from pathlib import Path

from corral import state
from corral.bootstrap import serve

HOME = Path(sys.argv[1])
ARM = HOME / "die-after-writes"
WRITES = ("create_service", "update_service", "mark_down", "delete_service", "add_version",
          "mark_version_ready", "add_replica", "update_replica", "delete_replica", "event",
          "forget_replica")
lock = threading.Lock()
left = [None]


def armed(name, method):
    @functools.wraps(method)
    def write(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        with lock:
            if left[0] is None:
                try:
                    left[0] = int(ARM.read_text())
                except (OSError, ValueError):
                    return result
            left[0] -= 1
            if left[0] <= 0:
                shown = [repr(a)[:60] for a in args]
                shown += [f"{k}={v!r}"[:60] for k, v in kwargs.items()]
                (HOME / "died-at").write_text(f"{name}({', '.join(shown)})")
                os._exit(137)
        return result
    return write


for name in WRITES:
    setattr(state.Store, name, armed(name, getattr(state.Store, name)))
asyncio.run(serve(HOME))
'''

OPS = ("up", "update-rolling", "update-blue_green", "scale-down", "scale-up", "crash", "down")
# Where a kill may land, per operation ("delay": after a random delay in the given range).
KILL_POINTS = {
    "up": ("setup", "write", "delay"),
    "update-rolling": ("setup", "teardown", "write", "delay"),
    "update-blue_green": ("setup", "teardown", "write", "delay"),
    "scale-down": ("teardown", "write", "delay"),
    "scale-up": ("setup", "write", "delay"),
    "crash": ("write", "delay"),  # a replica SIGKILLed just before the daemon: noticed or not yet
    "down": ("teardown", "write", "delay"),
}
MAX_WRITES = 30  # "write": the daemon dies after write 1..MAX_WRITES (an update makes ~20-40)
DELAYS = {"up": 2.5, "update-rolling": 3.0, "update-blue_green": 3.0, "crash": 1.5}


@dataclass
class Service:
    replicas: int
    version: int = 1
    app_version: int = 1  # APP_VERSION of the running replicas (the answer's "version")
    failed: set[int] = field(default_factory=set)  # replicas this test crashed (kept visible)


@dataclass
class Chaos:
    """The home under test, what it should be running, and what the rounds did."""

    home: CorralHome
    tmp: Path
    trap: Path  # exists: every setup sleeps 60 s
    stubborn: Path  # exists: replicas ignore SIGTERM
    wrapper: Path
    daemon_script: Path
    services: dict[str, Service] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    ops: Counter[str] = field(default_factory=Counter)
    points: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    died_in: Counter[str] = field(default_factory=Counter)  # "write" kills: after which write

    @property
    def arm(self) -> Path:
        return self.home.path / "die-after-writes"

    def intended(self) -> dict[str, Intent | None]:
        wanted: dict[str, Intent | None] = {name: None for name in self.removed}
        for name, svc in self.services.items():
            wanted[name] = Intent(svc.replicas, svc.version, frozenset(svc.failed))
        return wanted

    def spec(self, name: str, svc: Service) -> str:
        setup = f"if [ -e {self.trap} ]; then sleep 60; fi"
        run = f"exec {sys.executable} {self.wrapper} {self.stubborn}"
        return spec_text(
            name, svc.replicas, run=run, setup=setup, envs={"APP_VERSION": svc.app_version}
        )

    # -- operations (each returns once the API accepted it: the intent is durable) ------------

    # Each returns once the request is answered, so the intent is durable. With a "write" kill
    # the daemon may die inside the request, after the write that records the intent (it is
    # then durable, unanswered) or before it: the state file says which.

    def _request(self, method: str, path: str, body: object, status: int) -> bool:
        """Send one API request; False when the daemon died before answering it."""
        try:
            answer = self.home.api(method, path, body=body)
        except OSError:  # reset, refused: the daemon is gone
            if self.home.daemon_info() is not None and pid_alive(self.home.daemon_pid()):
                raise
            self.counts["requests cut"] += 1
            return False
        assert answer.status == status, (answer.status, answer.body)
        return True

    def up(self, name: str, replicas: int) -> None:
        svc = Service(replicas)
        body = {"spec": self.spec(name, svc), "source": f"{name}.yaml", "base_dir": str(self.tmp)}
        if (
            self._request("POST", "/v1/services", body, 201)
            or name in read_state(self.home).services
        ):
            self.services[name] = svc
        else:
            self.removed.add(name)  # never created: it must not exist either

    def update(self, name: str, mode: str, *, replicas: int, relaunch: bool) -> None:
        old = self.services[name]
        new = Service(replicas, old.version + 1, old.app_version + (1 if relaunch else 0))
        new.failed = old.failed
        body = {
            "spec": self.spec(name, new),
            "mode": mode,
            "source": f"{name}.yaml",
            "base_dir": str(self.tmp),
        }
        path = f"/v1/services/{name}/versions"
        if (
            self._request("POST", path, body, 201)
            or read_state(self.home).services[name]["current_version"] == new.version
        ):
            self.services[name] = new

    def crash(self, name: str, r: Random) -> int:
        """SIGKILL the process group of a random READY replica of ``name``; its id."""
        rows = [
            row
            for row in read_state(self.home).replicas.values()
            if row["service"] == name and row["ready"] and row["teardown_state"] is None
        ]
        victim = r.choice(rows)
        handle = json.loads(victim["handle_json"])["data"]
        os.killpg(int(handle["pgid"]), signal.SIGKILL)
        self.services[name].failed.add(victim["id"])
        return int(victim["id"])

    def down(self, name: str) -> None:
        if (
            self._request("DELETE", f"/v1/services/{name}", None, 202)
            or read_state(self.home).services[name]["intent"] == "shutting_down"
        ):
            del self.services[name]
            self.removed.add(name)


# -- choosing ---------------------------------------------------------------------------------


def applicable(chaos: Chaos) -> list[str]:
    live = chaos.services
    ops = []
    if len(live) < MAX_SERVICES:
        ops.append("up")
    if live:
        ops += ["update-rolling", "update-blue_green", "down"]
    if any(s.replicas >= 2 for s in live.values()):
        ops.append("scale-down")
    if any(s.replicas <= 2 for s in live.values()):
        ops.append("scale-up")
    # Failed replicas stay visible, the last 10 per service: stay well below that.
    if any(len(s.failed) < 4 for s in live.values()):
        ops.append("crash")
    return ops


def choose(r: Random, options: list[str] | tuple[str, ...], seen: Counter[str]) -> str:
    """A seeded pick that prefers what the run has not done yet, so that the short run covers
    every operation and kill point. ``down`` and ``delay`` come last among those: ``down``
    empties the home (the next round has to start over with ``up``) and ``delay`` is what the
    long run's later rounds are mostly made of anyway."""
    fresh = [o for o in options if not seen[o]]
    if fresh:
        fresh = [o for o in fresh if o not in ("down", "delay")] or fresh
        return r.choice(fresh)
    return r.choice(list(options))


# -- kill points ------------------------------------------------------------------------------


def wait_setups(chaos: Chaos, name: str, version: int, count: int) -> list[int]:
    """Wait until ``count`` replicas of ``name`` v``version`` sleep in their setup; their pids."""

    def sleeping() -> list[int] | None:
        state = read_state(chaos.home)
        mine = {
            f"{chaos.home.marker}/{name}/{rid}"
            for rid, row in state.replicas.items()
            if row["service"] == name and row["version"] == version
        }
        pids = [
            p.pid for p in marked_processes(chaos.home) if "sleep" in p.cmdline and p.key in mine
        ]
        return pids if len(pids) >= count else None

    found: list[int] = wait_for(sleeping, OBSERVE_TIMEOUT, f"{count} setups of {name} asleep")
    return found


def wait_teardown(chaos: Chaos, name: str) -> int:
    """Wait until a replica of ``name`` is being torn down; its id."""

    def leaving() -> int | None:
        for rid, row in read_state(chaos.home).replicas.items():
            if row["service"] == name and row["teardown_state"] in ("pending", "running"):
                return rid
        return None

    rid: int = wait_for(leaving, OBSERVE_TIMEOUT, f"a replica of {name} SHUTTING_DOWN", 0.02)
    return rid


def kill_daemon(home: CorralHome) -> None:
    pid = home.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 15, f"daemon pid {pid} to die")
    home._reap()


def start_daemon(chaos: Chaos, *, wait: bool = True) -> int:
    """Start the armed daemon (:data:`ARMED_DAEMON`) detached, as ``corral up`` starts one;
    with ``wait``, until it answers. Its pid."""
    home = chaos.home
    argv = [sys.executable, str(chaos.daemon_script), str(home.path)]
    return home.start_daemon(60, argv=argv, wait=wait)


# -- the round ----------------------------------------------------------------------------------


def run_round(chaos: Chaos, round_no: int) -> None:
    r = rng(TEST, round_no)
    home = chaos.home
    op = choose(r, applicable(chaos), chaos.ops)
    point = choose(r, KILL_POINTS[op], chaos.points)
    chaos.ops[op] += 1
    chaos.points[point] += 1
    if point == "setup":
        chaos.trap.touch()
    if point == "teardown":
        chaos.stubborn.touch()
    writes = r.randint(1, MAX_WRITES)
    if point == "write":
        chaos.arm.write_text(str(writes))
    daemon = home.daemon_pid()

    name = ""
    if op == "up":
        name = f"s{round_no}"
        chaos.up(name, r.choice((2, 3)))
    elif op.startswith("update-"):
        name = r.choice(sorted(chaos.services))
        chaos.update(name, op.split("-", 1)[1], replicas=r.choice((2, 3)), relaunch=True)
    elif op == "scale-down":
        name = r.choice(sorted(n for n, s in chaos.services.items() if s.replicas >= 2))
        chaos.update(name, "rolling", replicas=chaos.services[name].replicas - 1, relaunch=False)
    elif op == "scale-up":
        name = r.choice(sorted(n for n, s in chaos.services.items() if s.replicas <= 2))
        chaos.update(name, "rolling", replicas=chaos.services[name].replicas + 1, relaunch=False)
    elif op == "crash":
        name = r.choice(sorted(n for n, s in chaos.services.items() if len(s.failed) < 4))
        chaos.crash(name, r)
    else:
        name = r.choice(sorted(chaos.services))
        chaos.down(name)
    intent = chaos.services.get(name)

    asleep: list[int] = []
    if point == "setup":
        assert intent is not None
        new = intent.replicas if op != "scale-up" else 1
        asleep = wait_setups(chaos, name, intent.version, r.randint(1, new))
    elif point == "teardown":
        wait_teardown(chaos, name)
        time.sleep(r.uniform(0.0, 1.0))  # somewhere inside the 5 s grace: a chosen kill time
    elif point == "write":
        wanted = chaos.intended()
        wait_for(
            lambda: not pid_alive(daemon) or settled(home, wanted),
            SETTLE_TIMEOUT,
            f"the daemon to die after {writes} writes",
        )
    else:
        time.sleep(r.uniform(0.0, DELAYS.get(op, 0.6)))  # a chosen kill time, not a wait
    died_at = ""
    if point == "write":
        if pid_alive(daemon):
            died_at = f"none: the operation settled before write {writes}"
            chaos.counts["writes past the operation"] += 1
        else:
            died_at = (home.path / "died-at").read_text()
            chaos.died_in[died_at.split("(", 1)[0]] += 1
        chaos.arm.unlink(missing_ok=True)
        (home.path / "died-at").unlink(missing_ok=True)
    if pid_alive(daemon):
        kill_daemon(home)
    home._reap()
    asleep = [p for p in asleep if pid_alive(p)]
    chaos.counts["setups caught"] += len(asleep)

    # Every third round the restarted daemon is killed too, at a random point of its own start
    # (imports, the leak sweep, re-adoption, the first reconcile steps), trap and flag still set.
    double = round_no % 3 == 1
    if double:
        chaos.counts["double kills"] += 1
        pid = start_daemon(chaos, wait=False)
        time.sleep(r.uniform(0.0, 2.0))  # a chosen kill time, not a wait
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 15, f"daemon pid {pid} to die")
        home._reap()

    before = read_state(home)
    chaos.trap.unlink(missing_ok=True)
    chaos.stubborn.unlink(missing_ok=True)
    start_daemon(chaos)

    where = f"seed {BASE_SEED} round {round_no}: {op} of {name}, kill at {point}"
    where += f" {writes}, after {died_at}" if point == "write" else ""
    where += ", and again while restarting" if double else ""
    intended = chaos.intended()
    try:
        wait_for(lambda: settled(home, intended), SETTLE_TIMEOUT, "the intended state", 0.2)
    except AssertionError:
        findings = check_home(home, intended, before_restart=before)
        raise AssertionError(f"{where}: never settled:\n{findings}") from None
    findings = check_home(home, intended, before_restart=before)
    chaos.counts["orphans"] += len(findings.orphans)
    chaos.counts["duplicates"] += len(findings.duplicates)
    chaos.counts["dangling rows"] += len(findings.dangling)
    assert not findings, f"{where}:\n{findings}"

    survivors = [p for p in asleep if pid_alive(p)]
    assert not survivors, f"{where}: setups of the killed daemon still run: {survivors}"
    if asleep:
        assert "leak sweep: killed" in home.tail("daemon.log", 400), where

    after = read_state(home)
    actions = Counter(e["action"] for e in after.events if e["id"] > before.last_event_id)
    chaos.counts["adopted"] += actions["replica.adopt"]
    chaos.counts["relaunched"] += actions["replica.relaunch"]
    chaos.counts["teardowns resumed"] += sum(
        1
        for e in after.events
        if e["id"] > before.last_event_id
        and "interrupted" in (e["reason"] or "")
        and e["action"] == "replica.teardown"
    )
    check_story(chaos, name, op, after, where)
    check_serving(chaos, where)


def check_story(chaos: Chaos, name: str, op: str, after: HomeState, where: str) -> None:
    """The event log of the service the round worked on records the operation itself."""
    actions = [e["action"] for e in after.events if e["service"] == name]
    wanted = {
        "up": "service.create",
        "down": "service.removed",
        "crash": "replica.failed",
    }.get(op, "service.update")
    assert wanted in actions, f"{where}: no {wanted} event for {name}: {actions}"


def check_serving(chaos: Chaos, where: str) -> None:
    """Every running service answers through its endpoint, from its current version only."""
    for name, svc in chaos.services.items():
        service = chaos.home.service(name)
        assert service is not None and service["endpoint"], (where, name, service)
        ready = {str(r["id"]) for r in service["replicas"] if r["status"] == "READY"}
        for i in range(4):
            answer = http(f"{service['endpoint']}/round/{i}", timeout=15)
            assert answer.status == 200, (where, name, answer.status, answer.body[:300])
            body = answer.json()
            assert body["version"] == str(svc.app_version), (where, name, body)
            assert body["replica"] in ready, (where, name, body, ready)


# -- the test -------------------------------------------------------------------------------------


def make_chaos(home: CorralHome, tmp_path: Path) -> Chaos:
    wrapper = tmp_path / "slow_to_stop.py"
    wrapper.write_text(WRAPPER)
    script = tmp_path / "armed_daemon.py"
    script.write_text(ARMED_DAEMON)
    return Chaos(
        home=home,
        tmp=tmp_path,
        trap=tmp_path / "setup-trap",
        stubborn=tmp_path / "ignore-sigterm",
        wrapper=wrapper,
        daemon_script=script,
    )


def test_daemon_sigkill_at_random_points(corral_home: CorralHome, tmp_path: Path) -> None:
    chaos = make_chaos(corral_home, tmp_path)
    total = rounds(7, 40)
    start_daemon(chaos)
    done = 0
    try:
        for round_no in range(total):
            run_round(chaos, round_no)
            done += 1
    finally:
        chaos.trap.unlink(missing_ok=True)
        chaos.stubborn.unlink(missing_ok=True)
        lost = chaos.counts["orphans"] + chaos.counts["duplicates"] + chaos.counts["dangling rows"]
        record(
            "daemon SIGKILL",
            rounds=done,
            lost=lost if done == total else max(lost, 1),
            operations=dict(chaos.ops),
            kill_points=dict(chaos.points),
            died_after_write=dict(chaos.died_in),
            **{k.replace(" ", "_"): v for k, v in chaos.counts.items()},
        )
    # Even the short run covers every operation and every observable kill point.
    assert set(chaos.ops) == set(OPS), chaos.ops
    assert all(chaos.points[p] for p in ("setup", "teardown", "write")), chaos.points


def test_invariants_see_what_is_wrong(corral_home: CorralHome, tmp_path: Path) -> None:
    """The checker the rounds rely on is not blind: each kind of breakage, made by hand, is
    reported under its invariant (a checker that always says "consistent" would pass too)."""
    chaos = make_chaos(corral_home, tmp_path)
    corral_home.start_daemon()
    chaos.up("lone", 1)
    intended = chaos.intended()
    wait_for(lambda: settled(corral_home, intended), SETTLE_TIMEOUT, "lone READY", 0.2)
    assert not check_home(corral_home, intended)
    (rid,) = read_state(corral_home).replicas

    # A second process group with the replica's key, and a process of a replica nobody knows.
    marker = corral_home.marker
    assert marker is not None
    strays = []
    for key in (f"{marker}/lone/{rid}", f"{marker}/lone/999999"):
        env = {**os.environ, "CORRAL_HOME_MARKER": marker, "CORRAL_REPLICA_KEY": key}
        strays.append(_start(["sleep", "60"], env, corral_home))
    wait_for(lambda: len(marked_processes(corral_home)) == 3, 10, "the strays to show")
    found = check_home(corral_home, intended)
    assert any(f"{marker}/lone/{rid}" in d for d in found.duplicates), found
    assert any("999999" in o and "no replica row" in o for o in found.orphans), found
    assert any(f"key {marker}/lone/{rid}" in o for o in found.orphans), found
    for proc in strays:
        proc.kill()
        proc.wait(10)
    assert not check_home(corral_home, intended)

    # Not what was asked for: another count, or a service nobody asked for.
    assert check_home(corral_home, {"lone": Intent(2, 1)}).mismatched
    assert not settled(corral_home, {"lone": Intent(1, 2)})
    assert check_home(corral_home, {}).mismatched

    # A row whose process is gone, and a restart that wrote no event.
    kill_daemon(corral_home)
    before = read_state(corral_home)
    (pid,) = {p.pid for p in marked_processes(corral_home)}
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, "the replica to die")
    found = check_home(corral_home, intended, before_restart=before)
    assert any(f"pid {pid} is gone" in d for d in found.dangling), found
    assert any("no event since" in e for e in found.missing_events), found
    # The restarted daemon sees the dead replica: FAILED (kept visible) and replaced.
    corral_home.start_daemon()

    def replaced() -> bool:
        state = read_state(corral_home)
        return (
            any(r["app_failed"] for r in state.replicas.values())
            and not check_home(corral_home, {"lone": Intent(1, 1)}).dangling
        )

    wait_for(replaced, SETTLE_TIMEOUT, "the dead replica FAILED and replaced", 0.2)
    found = check_home(corral_home, intended, before_restart=before)
    assert any("not a READY replica" in m for m in found.mismatched), found  # the FAILED row


def _start(args: list[str], env: dict[str, str], home: CorralHome) -> subprocess.Popen[bytes]:
    """A process of our own in a session of its own, killed at teardown if still running."""
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    home.popens.append(proc)
    return proc


def test_kill_between_the_two_writes_of_a_cancelled_launch(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A kill window too narrow to hit by timing, staged in the state file instead.

    When a launch is cancelled (scale-down, an update, ``down``) the controller records
    ``launch_state=cancelled`` and then, in a second write, retires the replica. A daemon killed
    between the two leaves a cancelled row that nothing was tearing down: the restart must
    retire it (not leave it SHUTTING_DOWN forever, uncounted) and put the service back at its
    size. Staged here: the replica's process stopped (as the cancel stops it) and its row
    cancelled, while the daemon is dead.
    """
    chaos = make_chaos(corral_home, tmp_path)
    corral_home.start_daemon()
    chaos.up("halted", 2)
    intended = chaos.intended()
    wait_for(lambda: settled(corral_home, intended), SETTLE_TIMEOUT, "halted READY", 0.2)
    kill_daemon(corral_home)
    victim = min(read_state(corral_home).replicas.values(), key=lambda row: row["id"])
    pgid = int(json.loads(victim["handle_json"])["data"]["pgid"])
    os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pgid), 10, "the cancelled replica's process to stop")
    db = sqlite3.connect(corral_home.path / "state.db", timeout=10)
    with db:
        db.execute(
            "UPDATE replicas SET launch_state = 'cancelled', ready = 0 WHERE id = ?",
            (victim["id"],),
        )
    db.close()
    before = read_state(corral_home)

    corral_home.start_daemon()
    try:
        wait_for(lambda: settled(corral_home, intended), SETTLE_TIMEOUT, "2 READY again", 0.2)
    except AssertionError:
        raise AssertionError(f"never settled:\n{check_home(corral_home, intended)}") from None
    findings = check_home(corral_home, intended, before_restart=before)
    assert not findings, str(findings)
    assert victim["id"] not in read_state(corral_home).replicas
