"""Chaos: the backend fails under a real daemon (issue 7, "backend faults").

Each test runs the REAL daemon (``corral.bootstrap.serve``) in a subprocess over the real local
backend wrapped in ``FaultyInfra`` (tests/chaos/faulty_daemon.py), which raises, hangs or holds
when the test rewrites the cue file ``HOME/faults.json``. The test drives the daemon through the
CLI and the API, as a user would, and checks what the user would see (status, events, logs) and
what the machine holds (replica processes, by pid).

* launch raising: the replica is FAILED_PROVISION with the error in status, events and its launch
  log; it is replaced with backoff (or, for a version that never became READY, the service gives
  up after 3 with the error); a process started before the raise is torn down; a second service
  keeps serving throughout.
* teardown raising: FAILED_CLEANUP is shown (replica and service), the teardown is retried with
  backoff (past the point where it used to give up), and once the fault clears the replica is
  cleaned and no process is left.
* teardown hanging: the controller bounds it (``CORRAL_TEARDOWN_TIMEOUT``), reports it as
  FAILED_CLEANUP, does not stack a second call on the stuck one, and meanwhile other services
  launch, serve and go down; when the call returns the teardown is retried and completes.
* JobPool saturated: more held launches than the launch lane's limit: the API answers, the
  queued replicas show PENDING, they start in submission order as slots free, none is lost or
  launched twice.

Reproduce: ``.venv/bin/pytest -p no:xdist tests/chaos/test_backend_faults.py`` (short) or with
``CORRAL_CHAOS=long`` (long); ``CORRAL_CHAOS_SEED`` replays a seed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from chaos_support import BASE_SEED, LONG, record, rng, rounds
from conftest import (
    CorralHome,
    http,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)

from corral.jobs import JobPool, JobState

pytestmark = pytest.mark.timeout(600 if LONG else 240)

FAULTY_DAEMON = Path(__file__).with_name("faulty_daemon.py")
LIVE = {"PENDING", "PROVISIONING", "STARTING", "NOT_READY", "READY"}
# The bound on a teardown the tests give the daemon: short, so a hang is reported quickly.
TEARDOWN_TIMEOUT = 3.0


# -- the faulty daemon ----------------------------------------------------------------------------


def start_faulty_daemon(
    home: CorralHome, faults: dict[str, dict[str, Any]] | None = None, **env: str
) -> int:
    """Start faulty_daemon.py as the home's daemon (detached, like ``corral daemon run``) with
    the cue ``faults`` (none by default) and wait until it answers. Started through
    :meth:`CorralHome.start_daemon`, so the fixture's teardown (``down --all --purge``, stop by
    pid, leak check) treats it like any daemon."""
    home.path.mkdir(parents=True, exist_ok=True)
    set_faults(home, faults or {})
    argv = [sys.executable, str(FAULTY_DAEMON), str(home.path)]
    return home.start_daemon(argv=argv, env={**home.env, **env})


def set_faults(home: CorralHome, cue: dict[str, dict[str, Any]]) -> None:
    """Rewrite the cue atomically: the daemon reads it on every backend call."""
    tmp = home.path / "faults.json.tmp"
    tmp.write_text(json.dumps(cue))
    tmp.replace(home.path / "faults.json")


def journal(home: CorralHome, service: str | None = None) -> list[dict[str, Any]]:
    """What the backend was asked to do, in order (see faulty_daemon.py)."""
    try:
        lines = (home.path / "faults.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    entries = [json.loads(line) for line in lines if line.strip()]
    return [e for e in entries if service is None or e["service"] == service]


def ops(home: CorralHome, service: str, op: str, replica: int | None = None) -> list[int]:
    return [
        e["replica"]
        for e in journal(home, service)
        if e["op"] == op and (replica is None or e["replica"] == replica)
    ]


# -- specs, services, events ----------------------------------------------------------------------


def app_spec(directory: Path, name: str, replicas: int, *, marker: str = "0") -> Path:
    """examples/app.py with fast probes; ``marker`` goes into the envs (changing it makes an
    update that relaunches replicas, not just relabels them)."""
    text = spec_text(name, replicas, envs={"ROUND": marker})
    return write_spec(directory / f"{name}.yaml", text)


def events(home: CorralHome, name: str, after: int = 0) -> list[dict[str, Any]]:
    """Every event of a service after id ``after`` (paged: the API answers 200 at a time)."""
    found: list[dict[str, Any]] = []
    while True:
        answer = home.api("GET", f"/v1/services/{name}/events?after={after}")
        assert answer.status == 200, (answer.status, answer.body)
        page = answer.json()["events"]
        if not page:
            return found
        found.extend(page)
        after = page[-1]["id"]


def last_event_id(home: CorralHome, name: str) -> int:
    evs = events(home, name)
    return evs[-1]["id"] if evs else 0


def by_status(svc: dict[str, Any], *statuses: str) -> list[dict[str, Any]]:
    return [r for r in svc["replicas"] if r["status"] in statuses]


def serves(endpoint: str) -> bool:
    """One request through a service's balancer answers 200."""
    return http(endpoint + "/", timeout=10.0).status == 200


def gone(home: CorralHome, name: str) -> bool:
    return home.service(name) is None


def daemon_jobs(home: CorralHome) -> dict[str, dict[str, int]]:
    answer = home.api("GET", "/v1/daemon")
    assert answer.status == 200, answer.body
    jobs: dict[str, dict[str, int]] = answer.json()["jobs"]
    return jobs


@contextlib.contextmanager
def faults_cleared_on_exit(home: CorralHome) -> Any:
    """Whatever happens, the cue is empty before the fixture takes the home down."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            set_faults(home, {})


# -- 1. launch raising ----------------------------------------------------------------------------


def test_launch_raising(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    start_faulty_daemon(home)
    n_rounds = rounds(1, 8)
    lost = 0
    healthy_requests = 0
    with faults_cleared_on_exit(home):
        home.run("up", str(app_spec(tmp_path, "healthy", 1)))
        home.run("up", str(app_spec(tmp_path, "flaky", 1)))
        healthy = home.service("healthy")
        assert healthy is not None
        healthy_endpoint = healthy["endpoint"]

        # A version that never became READY: the service gives up after 3 failed launches and
        # says why, instead of relaunching forever.
        set_faults(home, {"broken": {"launch_raise": "before"}})
        result = home.run("up", str(app_spec(tmp_path, "broken", 1)), check=False)
        assert result.returncode != 0, result.stdout
        assert "FAILED" in result.stdout + result.stderr, result.stdout + result.stderr
        broken = home.service("broken")
        assert broken is not None
        assert broken["status"] == "FAILED", broken
        assert "InjectedFault" in (broken["failure"] or ""), broken
        assert [r["status"] for r in broken["replicas"]] == ["FAILED_PROVISION"] * 3, broken
        for r in broken["replicas"]:
            assert "InjectedFault" in r["failure"], r
        first = broken["replicas"][0]["id"]  # what `corral logs` takes
        launch_log = home.run("logs", "broken", str(first), "--launch", "--no-follow").stdout
        assert "InjectedFault" in launch_log and "Traceback" in launch_log, launch_log
        # It never ran, so it has no log of its own: asking for it points at the launch log.
        none = home.run("logs", "broken", str(first), "--no-follow", check=False)
        hint = f"its launch log: `corral logs broken {first} --launch`"
        assert none.returncode != 0 and hint in none.stderr, none.stderr
        failed_events = [
            e for e in events(home, "broken") if e["action"] == "replica.launch_failed"
        ]
        assert len(failed_events) == 3, failed_events
        assert all("InjectedFault" in (e["reason"] or "") for e in failed_events), failed_events
        assert healthy_endpoint and serves(healthy_endpoint)
        healthy_requests += 1

        for round_no in range(n_rounds):
            r = rng("launch_raising", round_no)
            # Round 0 raises after the start (the harder case: a process to tear down, whose
            # teardown fails too); "broken" above covered raising before it.
            mode = "after" if round_no == 0 else r.choice(["before", "after"])
            failures = r.randint(1, 2)
            flaky = home.wait_replicas("flaky", 1, timeout=60)
            (victim,) = by_status(flaky, "READY")
            mark = last_event_id(home, "flaky")
            cue = {"launch_raise": mode}
            if mode == "after":
                # The started process must be torn down, and that fails too until the fault
                # clears: FAILED_CLEANUP first, then back to the replica's own failure.
                cue["terminate_raise"] = "after"
            set_faults(home, {"flaky": cue})
            os.kill(int(victim["pid"]), signal.SIGKILL)  # a replica our daemon started

            def launch_failures(mark: int = mark) -> list[dict[str, Any]]:
                return [
                    e for e in events(home, "flaky", mark) if e["action"] == "replica.launch_failed"
                ]

            def enough(failures: int = failures) -> bool:
                nonlocal healthy_requests
                # The other service and the API keep serving while this one fails.
                assert serves(healthy_endpoint), "the healthy service stopped serving"
                healthy_requests += 1
                return len(launch_failures()) >= failures

            wait_for(enough, 60, f"round {round_no} (seed {BASE_SEED}): {failures} launch failures")
            set_faults(home, {})
            seen = launch_failures()
            assert all("InjectedFault" in (e["reason"] or "") for e in seen), seen
            # The failure is visible in status: the newest failed replica (never pruned) ends
            # FAILED_PROVISION with the error (after its teardown, when the launch had started).
            newest = seen[-1]["replica_id"]

            def shown(newest: int = newest) -> dict[str, Any] | None:
                svc = home.service("flaky")
                assert svc is not None
                found = [x for x in svc["replicas"] if x["id"] == newest]
                return found[0] if found and found[0]["status"] == "FAILED_PROVISION" else None

            failed = wait_for(shown, 30, f"replica {newest} shown FAILED_PROVISION")
            assert (failed["failure"] or "").startswith("InjectedFault('injected launch"), failed
            if mode == "after":
                # Teardowns of failed replicas failed too (the killed one's first, before any
                # relaunch): below, each must end showing its own failure again.
                cleanup = [
                    e
                    for e in events(home, "flaky", mark)
                    if e["action"] == "replica.teardown_failed"
                ]
                assert cleanup and all("InjectedFault" in str(e["reason"]) for e in cleanup)
            # Replaced per policy once the backend works again: one READY replica, nothing else
            # live, and the process a raising launch had started ("after") torn down.
            flaky = home.wait_replicas("flaky", 1, timeout=90)
            if mode == "after":
                started = [
                    e["pid"]
                    for e in journal(home, "flaky")
                    if e["op"] == "launch_raise" and e.get("pid")
                ]
                assert started, journal(home, "flaky")
                home.replica_pids.update(started)
                wait_for(
                    lambda started=started: not any(pid_alive(p) for p in started),
                    30,
                    "the processes of launches that raised after starting to be torn down",
                )
            if len(by_status(flaky, "READY")) != 1:
                lost += 1

            # Once every teardown went through, each failed replica shows its own failure again
            # (not the teardown error that was in front of it meanwhile).
            def settled() -> dict[str, Any] | None:
                svc = home.service("flaky")
                assert svc is not None
                return None if by_status(svc, "FAILED_CLEANUP", "SHUTTING_DOWN") else svc

            flaky = wait_for(settled, 60, "flaky's failed replicas cleaned up")
            for x in by_status(flaky, "FAILED_PROVISION"):
                assert x["failure"].startswith("InjectedFault('injected launch"), x
            for x in by_status(flaky, "FAILED"):
                assert x["failure"].startswith("process exited"), x
        assert home.healthy()
        # The broken service was never relaunched past its 3 attempts.
        assert len(ops(home, "broken", "launch_enter")) == 3, journal(home, "broken")
        home.run("down", "broken", "flaky")
        assert serves(healthy_endpoint)
    record(
        "backend: launch raising",
        rounds=n_rounds,
        lost=lost,
        healthy_requests=healthy_requests,
        gave_up_after=3,
    )
    assert lost == 0


# -- 2. teardown raising --------------------------------------------------------------------------


def test_teardown_raising(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    start_faulty_daemon(home)
    n_rounds = rounds(1, 3)
    # Failed attempts per replica before the fault clears. For `down`, in long mode, past 5:
    # where the controller used to stop retrying and left the replica's process behind for good
    # (1 + 2 + 4 + 8 + 16 + 30 s of backoff: too slow for the short run).
    attempts_needed = 3
    down_attempts_needed = 7 if LONG else 3
    lost = 0
    with faults_cleared_on_exit(home):
        home.run("up", str(app_spec(tmp_path, "healthy", 1)))
        home.run("up", str(app_spec(tmp_path, "td", 2)))
        td = home.service("td")
        assert td is not None
        endpoint = td["endpoint"]

        for round_no in range(n_rounds):
            mode = rng("teardown_raising", round_no).choice(["before", "after"])
            old = home.wait_replicas("td", 2, timeout=60)
            old_ids = {r["id"] for r in old["replicas"] if r["status"] == "READY"}
            old_pids = {int(r["pid"]) for r in old["replicas"] if r["status"] == "READY"}
            set_faults(home, {"td": {"terminate_raise": mode}})
            # A real relaunching update: the new version comes up, the old replicas are retired
            # and their teardown raises.
            spec = app_spec(tmp_path, "td", 2, marker=str(round_no + 1)).read_text()
            answer = home.api("POST", "/v1/services/td/versions", body={"spec": spec})
            assert answer.status == 201, answer.body

            def shown_failed(old_ids: set[int] = old_ids) -> dict[str, Any] | None:
                svc = home.service("td")
                assert svc is not None
                cleanup = {r["id"] for r in by_status(svc, "FAILED_CLEANUP")}
                new_ready = [r for r in by_status(svc, "READY") if r["id"] not in old_ids]
                if cleanup == old_ids and len(new_ready) == 2:
                    return svc
                return None

            svc = wait_for(shown_failed, 90, f"round {round_no}: old replicas FAILED_CLEANUP")
            # Shown, not hidden: the service says FAILED_CLEANUP, each replica says why.
            assert svc["status"] == "FAILED_CLEANUP", svc
            for r in by_status(svc, "FAILED_CLEANUP"):
                assert "InjectedFault" in (r["failure"] or ""), r
            if mode == "before":  # nothing was terminated: the old processes still run
                assert all(pid_alive(p) for p in old_pids)
            # ... while the new version serves.
            assert serves(endpoint)
            status_text = home.run("status", "td").stdout
            assert "FAILED_CLEANUP" in status_text, status_text

            def retried(old_ids: set[int] = old_ids) -> bool:
                failed = [
                    e["replica_id"]
                    for e in events(home, "td")
                    if e["action"] == "replica.teardown_failed"
                ]
                return all(failed.count(i) >= attempts_needed for i in old_ids)

            wait_for(retried, 120, f"{attempts_needed} failed teardown attempts per replica")
            set_faults(home, {})

            def cleaned(old_ids: set[int] = old_ids) -> bool:
                svc = home.service("td")
                assert svc is not None
                return not ({r["id"] for r in svc["replicas"]} & old_ids)

            wait_for(cleaned, 60, f"round {round_no}: old replicas cleaned after the fault")
            wait_for(lambda p=old_pids: not any(pid_alive(x) for x in p), 30, "old pids gone")
            svc = home.wait_replicas("td", 2, timeout=30)
            if svc["status"] != "READY":
                lost += 1

        # `corral down` while teardowns raise: the CLI says so (not a silent success), the
        # replicas stay visible and are retried, and the down finishes once the fault clears.
        final = home.wait_replicas("td", 2, timeout=60)
        pids = {int(r["pid"]) for r in by_status(final, "READY")}
        set_faults(home, {"td": {"terminate_raise": "before"}})
        result = home.run("down", "td", "--timeout", "60", check=False)
        assert result.returncode != 0, result.stdout
        assert "teardown failed" in result.stdout + result.stderr, result.stdout + result.stderr
        svc = home.service("td")
        assert svc is not None and svc["status"] == "FAILED_CLEANUP", svc
        assert all(pid_alive(p) for p in pids), "a failed teardown must not pretend"

        def down_retried() -> bool:
            failed = [
                e["replica_id"]
                for e in events(home, "td")
                if e["action"] == "replica.teardown_failed"
            ]
            return all(
                failed.count(r["id"]) >= down_attempts_needed for r in by_status(final, "READY")
            )

        wait_for(down_retried, 120, "failed teardowns of `down` retried")
        set_faults(home, {})
        wait_for(lambda: gone(home, "td"), 60, "td removed once teardown works again")
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "td's processes gone")
        healthy = home.service("healthy")
        assert healthy is not None and serves(healthy["endpoint"])
    record(
        "backend: teardown raising",
        rounds=n_rounds + 1,
        lost=lost,
        failed_attempts_before_clearing=attempts_needed,
        failed_attempts_before_clearing_down=down_attempts_needed,
    )
    assert lost == 0


# -- 3. teardown hanging --------------------------------------------------------------------------


def test_down_says_which_teardown_failed_and_purge_what_it_forgot(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral down` of a service whose replica cannot be torn down fails naming that replica,
    its error and its pid (it said "teardown failed for some replicas: None"), and still
    waits for the other services it was given. `down --purge` then forgets it and says so:
    the process may still run, and here it does (the teardown raised before stopping it)."""
    home = corral_home
    start_faulty_daemon(home)
    with faults_cleared_on_exit(home):
        home.run("up", str(app_spec(tmp_path, "stuck", 1)))
        home.run("up", str(app_spec(tmp_path, "other", 1)))
        (replica,) = home.wait_replicas("stuck", 1, timeout=60)["replicas"]
        pid = int(replica["pid"])
        set_faults(home, {"stuck": {"terminate_raise": "before"}})
        failed = home.run("down", "stuck", "other", "-y", check=False, timeout=90)
        said = " ".join(failed.stderr.split())
        assert failed.returncode != 0, said
        assert f"service stuck: teardown failed for replica {replica['id']} (" in said, said
        assert "InjectedFault" in said and f"pid {pid}" in said and "None" not in said, said
        assert "service other: down" in failed.stdout  # waited for, though listed after it
        assert home.service("other") is None
        purged = home.run("down", "stuck", "--purge", "-y", timeout=90)
        said = " ".join(purged.stdout.split())
        assert f"service stuck: down; forgot replica {replica['id']} (" in said, said
        assert f"pid {pid}" in said and "they may still run" in said, said
        assert pid_alive(pid)  # as said: the teardown never stopped it
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, "the forgotten replica to end")


def test_teardown_hanging(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    start_faulty_daemon(home, CORRAL_TEARDOWN_TIMEOUT=str(TEARDOWN_TIMEOUT))
    n_rounds = rounds(1, 3)
    lost = 0
    with faults_cleared_on_exit(home):
        for round_no in range(n_rounds):
            width = 1 if round_no == 0 else rng("teardown_hanging", round_no).randint(2, 4)
            stuck, other, fresh = f"stuck{round_no}", f"other{round_no}", f"fresh{round_no}"
            home.run("up", str(app_spec(tmp_path, stuck, width)))
            home.run("up", str(app_spec(tmp_path, other, 1)))
            stuck_svc = home.wait_replicas(stuck, width, timeout=60)
            ids = {r["uid"] for r in stuck_svc["replicas"]}
            pids = {int(r["pid"]) for r in stuck_svc["replicas"]}

            set_faults(home, {stuck: {"terminate_hang": True}})
            home.run("down", stuck, "--no-wait")

            def reported(stuck: str = stuck, ids: set[int] = ids) -> dict[str, Any] | None:
                svc = home.service(stuck)
                assert svc is not None
                hung = by_status(svc, "FAILED_CLEANUP")
                if {r["uid"] for r in hung} == ids and all(
                    "did not finish" in (r["failure"] or "") for r in hung
                ):
                    return svc
                return None

            svc = wait_for(reported, 60, f"hung teardowns of {stuck} reported")
            assert svc["status"] == "FAILED_CLEANUP", svc
            assert sorted(ops(home, stuck, "terminate_hang")) == sorted(ids)
            hung_events = [e for e in events(home, stuck) if e["action"] == "replica.teardown_hung"]
            shown = {r["id"] for r in stuck_svc["replicas"]}  # events name replicas so
            assert {e["replica_id"] for e in hung_events} == shown, hung_events
            assert daemon_jobs(home)["teardown"]["abandoned"] == width

            # The controller and the teardown lane go on: another service launches and serves,
            # and another `corral down` completes while those calls are still stuck.
            home.run("up", str(app_spec(tmp_path, fresh, 1)))
            fresh_svc = home.service(fresh)
            assert fresh_svc is not None and serves(fresh_svc["endpoint"])
            home.run("down", other, fresh)
            assert home.healthy()
            # Still stuck: no second terminate was stacked on a call that has not returned.
            assert sorted(ops(home, stuck, "terminate_enter")) == sorted(ids), journal(home, stuck)
            assert all(pid_alive(p) for p in pids)

            # The call returns: the teardown is retried and the service goes.
            set_faults(home, {})
            wait_for(lambda s=stuck: gone(home, s), 60, f"{stuck} removed after the hang ends")
            wait_for(lambda p=pids: not any(pid_alive(x) for x in p), 30, f"{stuck} pids gone")
            wait_for(
                lambda: daemon_jobs(home)["teardown"]["abandoned"] == 0,
                30,
                "the stuck threads to be gone from the pool's count",
            )
            if any(pid_alive(p) for p in pids):
                lost += 1
    record("backend: teardown hanging", rounds=n_rounds, lost=lost, bound_s=TEARDOWN_TIMEOUT)
    assert lost == 0


# -- 4. JobPool saturated -------------------------------------------------------------------------


def test_jobpool_saturated(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    # One service saturates the whole lane here (its fair share is raised to the lane's size),
    # to test the pool's queueing itself; tests/test_fair_shares.py tests the share.
    start_faulty_daemon(home, CORRAL_LAUNCHES_PER_SERVICE="64")
    n_rounds = rounds(1, 3)
    lost = duplicated = api_calls = 0
    with faults_cleared_on_exit(home):
        home.run("up", str(app_spec(tmp_path, "side", 1)))
        side = home.service("side")
        assert side is not None
        limit = daemon_jobs(home)["launch"]["limit"]
        for round_no in range(n_rounds):
            r = rng("jobpool_saturated", round_no)
            extra = r.randint(3, 6)
            width = limit + extra
            name = f"wide{round_no}"
            set_faults(home, {name: {"launch_hold": True, "release": []}})
            home.run("up", str(app_spec(tmp_path, name, width)), "--detach")

            def saturated(name: str = name, width: int = width) -> dict[str, Any] | None:
                entered = ops(home, name, "launch_enter")
                if len(entered) < limit:
                    return None
                svc = home.service(name)
                assert svc is not None
                return svc if len(svc["replicas"]) == width else None

            svc = wait_for(saturated, 60, f"{limit} launches of {name} running")
            ids = sorted(x["uid"] for x in svc["replicas"])
            entered = ops(home, name, "launch_enter")
            # FIFO: the first `limit` replicas hold the slots, the rest wait for one.
            assert sorted(entered) == ids[:limit], (entered, ids)
            queued = ids[limit:]
            assert daemon_jobs(home)["launch"]["queued"] == extra
            # Status tells a launch that waits for a slot from one that runs.
            statuses = {x["uid"]: x["status"] for x in svc["replicas"]}
            assert [statuses[i] for i in queued] == ["PENDING"] * extra, statuses
            assert [statuses[i] for i in ids[:limit]] == ["PROVISIONING"] * limit, statuses

            # The API, the CLI and the other service answer while every slot is taken.
            for _ in range(20):
                assert home.api("GET", "/v1/services", timeout=10).status == 200
                assert serves(side["endpoint"])
                api_calls += 1
            assert "PENDING" in home.run("status", name).stdout

            # Free the slots one at a time, in a random order: each freed slot goes to the
            # oldest queued launch.
            release: list[int] = []
            order = ids[:limit]
            r.shuffle(order)
            for k, rid in enumerate(order[:extra]):
                release.append(rid)
                set_faults(home, {name: {"launch_hold": True, "release": release}})
                wait_for(
                    lambda k=k, name=name: len(ops(home, name, "launch_enter")) >= limit + k + 1,
                    60,
                    f"a queued launch to take the slot of replica {rid}",
                )
            started_late = ops(home, name, "launch_enter")[limit:]
            assert started_late == queued, (started_late, queued)
            set_faults(home, {})

            svc = home.wait_replicas(name, width, timeout=120)
            launched = ops(home, name, "launch_enter")
            duplicated += len(launched) - len(set(launched))
            ready_ids = sorted(x["uid"] for x in by_status(svc, "READY"))
            lost += len(set(ids) - set(ready_ids))
            assert ready_ids == ids and sorted(launched) == ids, (ready_ids, launched)
            assert len({x["pid"] for x in svc["replicas"]}) == width
            launch_events = [e for e in events(home, name) if e["action"] == "replica.launched"]
            shown = sorted(x["id"] for x in svc["replicas"])  # events name replicas so
            assert sorted(e["replica_id"] for e in launch_events) == shown
            home.run("down", name)
            assert serves(side["endpoint"])
    record(
        "backend: JobPool saturated",
        rounds=n_rounds,
        lost=lost,
        duplicated=duplicated,
        api_calls_while_saturated=api_calls,
    )
    assert lost == 0 and duplicated == 0


# -- 5. the pool itself: an abandoned job gives its slot back -------------------------------------


def test_abandoned_job_frees_its_lane_slot() -> None:
    """The mechanism the controller's teardown bound relies on, without a daemon: a job stuck
    in a call that ignores cancellation is abandoned, fails at once with the given error, and
    the job queued behind it in a lane of ONE worker runs; the stuck thread leaves once its
    call returns and is never reused."""
    pool = JobPool(max_workers=1)
    release = threading.Event()
    threads: list[str] = []

    def stuck() -> str:
        threads.append(threading.current_thread().name)
        release.wait(60)  # ignores cancellation, like a hung RPC
        return "late"

    def quick() -> str:
        threads.append(threading.current_thread().name)
        return "ok"

    try:
        first = pool.submit(stuck, kind="t")
        wait_for(lambda: first.state is JobState.RUNNING, 10, "the stuck job to start")
        second = pool.submit(quick, kind="t")
        assert not second.wait(0.3), "the lane has one worker: the second job must wait"
        assert pool.abandon(first, TimeoutError("stuck")) is True
        assert first.done() and first.state is JobState.FAILED and first.abandoned
        assert isinstance(first.exception(), TimeoutError) and not first.returned()
        assert second.result(timeout=10) == "ok"
        assert pool.stats()["t"]["abandoned"] == 1
        assert pool.abandon(second, TimeoutError("late")) is False  # finished: nothing to do
        release.set()
        wait_for(first.returned, 10, "the stuck call to return")
        wait_for(lambda: pool.stats()["t"]["abandoned"] == 0, 10, "the stuck thread to leave")
        assert first.state is JobState.FAILED  # its late success changes nothing
        third = pool.submit(quick, kind="t")
        assert third.result(timeout=10) == "ok"
        assert threads[-1] != threads[0], "the abandoned thread must not take new work"
        assert pool.stats()["t"]["workers"] <= 1
    finally:
        release.set()
        assert pool.shutdown(timeout=10)


# -- 6. the backend cannot answer across a daemon restart -----------------------------------------


def test_backend_unknown_across_restart(corral_home: CorralHome, tmp_path: Path) -> None:
    """A daemon restarted while its backend cannot say whether the replicas live (a cluster that
    does not answer) must neither fail nor relaunch them: that would kill capacity or run it
    twice. The event log says why they were kept; probes, which still reach the apps, make them
    READY again on the same processes."""
    home = corral_home
    name = "unknown0"
    lost = 0
    with faults_cleared_on_exit(home):
        pid = start_faulty_daemon(home)
        home.run("up", str(app_spec(tmp_path, name, 2)))
        before = home.wait_replicas(name, 2, timeout=60)
        pids = {r["id"]: int(r["pid"]) for r in before["replicas"]}
        mark = last_event_id(home, name)

        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "the killed daemon to be gone")
        launches_before = len(ops(home, name, "launch_enter"))
        start_faulty_daemon(home, {name: {"check_unknown": True}})

        def kept() -> list[dict[str, Any]] | None:
            evs = [e for e in events(home, name, mark) if e["action"] == "replica.unknown"]
            return evs if {e["replica_id"] for e in evs} == set(pids) else None

        noted = wait_for(kept, 30, "a replica.unknown event for each replica")
        assert all("does not answer" in (e["reason"] or "") for e in noted), noted
        after = home.wait_replicas(name, 2, timeout=60)
        assert {r["id"]: int(r["pid"]) for r in after["replicas"]} == pids, after
        assert len(ops(home, name, "launch_enter")) == launches_before, journal(home, name)
        failed = [e for e in events(home, name, mark) if e["action"] == "replica.failed"]
        assert not failed, failed
        assert serves(after["endpoint"])
        lost = sum(1 for p in pids.values() if not pid_alive(p))
    record("backend: no answer across a restart", rounds=1, lost=lost, replicas=len(pids))
    assert lost == 0
