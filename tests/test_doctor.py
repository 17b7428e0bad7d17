"""`corral doctor`: it names every corral process's home, and ends only those of deleted homes.

Real processes, no mocks. The registry of homes is per test (``CORRAL_RUNTIME_DIR`` in the
fixture's environment, which both the daemon and every `corral` command get), so this test
sees only its own registered homes; processes of other tests on the machine show up with an
unknown home and are filtered out by home id (and are never ended: no flag here ends them).

An orphan is made by hand: a `sleep` carrying a home's marker, and a registration whose path
is then deleted. A real replica or worker would notice its home's deletion and exit by itself
(they watch it), which is what leaves doctor the rarer cases: processes that do not watch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import CorralHome, spec_text, wait_for, write_spec

from corral import ownership
from corral.infra.base import scratch_root

ENV_HOME_MARKER = "CORRAL_HOME_MARKER"


def _doctor(home: CorralHome, *args: str, check: bool = True) -> dict[str, Any]:
    result = home.run("doctor", "--json", *args, check=check)
    return dict(json.loads(result.stdout))


def _of(report: dict[str, Any], home_id: str) -> list[dict[str, Any]]:
    return [p for p in report["processes"] if p["home_id"] == home_id]


def _sleep(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``sleep 300`` in a session of its own, reaped by a thread the moment it exits: doctor
    (another process) waits for it to be gone, and a zombie child of ours would look alive."""
    proc = subprocess.Popen(
        ["sleep", "300"], env=env, stdin=subprocess.DEVNULL, start_new_session=True
    )
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


def _marked_sleep(home: CorralHome, marker: str) -> subprocess.Popen[bytes]:
    """A process of home ``marker`` that does not watch its home (unlike corral's own)."""
    return _sleep({**home.env, ENV_HOME_MARKER: marker})


def test_doctor_lists_a_live_home(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "svc.yaml", spec_text("svc", 1, initial_delay=30))
    corral_home.run("up", "-y", str(spec))
    service = corral_home.wait_replicas("svc", 1)
    replica_pid = service["replicas"][0]["pid"]
    marker = corral_home.marker
    assert marker is not None

    report = _doctor(corral_home)
    mine = _of(report, marker)
    assert all(p["exists"] is True and p["home"] == str(corral_home.path) for p in mine), mine
    kinds = {(p["kind"], p["pid"]) for p in mine}
    assert ("daemon", corral_home.daemon_pid()) in kinds, mine
    workers = corral_home.worker_pids()
    assert workers and {("worker", pid) for pid in workers} <= kinds, (workers, mine)
    replicas = [p for p in mine if p["kind"] == "replica"]
    assert replica_pid in {p["pid"] for p in replicas}, mine
    assert {p["replica"] for p in replicas} == {"svc/1"}, replicas
    [home] = [h for h in report["homes"] if h["home_id"] == marker]
    assert home["exists"] is True and home["daemon_pid"] == corral_home.daemon_pid()

    text = corral_home.run("doctor").stdout
    assert str(corral_home.path) in text and "0 orphan process(es)" in text, text


def _register_doomed_home(tmp_path: Path, home_id: str, pid: int, created: float) -> None:
    """A home registered with daemon ``pid`` (started at ``created``), then deleted."""
    doomed = tmp_path / home_id
    doomed.mkdir()
    (doomed / ownership.HOME_ID_FILE).write_text(home_id)
    ownership.register(doomed, home_id, pid, created)
    shutil.rmtree(doomed)


def test_doctor_ends_only_orphans(
    corral_home: CorralHome, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_RUNTIME_DIR", corral_home.env["CORRAL_RUNTIME_DIR"])
    daemon_pid = corral_home.start_daemon()
    workers = corral_home.worker_pids()
    live_id = corral_home.marker
    assert live_id is not None
    started: list[subprocess.Popen[bytes]] = []
    try:
        fake_daemon = _sleep(corral_home.env)
        started.append(fake_daemon)
        doomed_id = "d00med0123456789"
        _register_doomed_home(
            tmp_path, doomed_id, fake_daemon.pid, psutil.Process(fake_daemon.pid).create_time()
        )
        # A deleted home whose daemon pid is now another process (this one): not its daemon.
        _register_doomed_home(tmp_path, "em9ty0123456789a", os.getpid(), 1.0)
        orphan = _marked_sleep(corral_home, doomed_id)
        live = _marked_sleep(corral_home, live_id)
        unknown = _marked_sleep(corral_home, "0123456789abcdef")
        started += [orphan, live, unknown]

        def sees_doomed() -> dict[str, Any] | None:
            report = _doctor(corral_home)
            return report if len(_of(report, doomed_id)) == 2 else None

        report = wait_for(sees_doomed, 15, "doctor to see both processes of the deleted home")
        assert {(p["kind"], p["pid"], p["exists"]) for p in _of(report, doomed_id)} == {
            ("daemon", fake_daemon.pid, False),
            ("replica", orphan.pid, False),
        }
        assert {p["exists"] for p in _of(report, live_id)} == {True}
        assert {p["pid"] for p in _of(report, live_id)} >= {daemon_pid, live.pid, *workers}
        assert [(p["pid"], p["exists"]) for p in _of(report, "0123456789abcdef")] == [
            (unknown.pid, None)
        ]
        assert not _of(report, "em9ty0123456789a")
        text = corral_home.run("doctor").stdout
        assert "2 orphan process(es) of 1 deleted home(s)" in text, text
        assert "1 deleted home(s) registered with no process left" in text, text

        # The deleted home's replicas worked in a scratch directory outside the home.
        scratch = scratch_root(doomed_id)
        (scratch / "1").mkdir(parents=True, exist_ok=True)  # left by a run that failed
        (scratch / "1" / "written-by-the-replica").write_text("x")
        result = corral_home.run("doctor", "--end-orphans", "-y")
        assert f"removed its replicas' scratch directory {scratch}" in result.stdout
        assert not scratch.exists()
        assert f"ended daemon pid {fake_daemon.pid}" in result.stdout, result.stdout
        assert f"pid {orphan.pid}" in result.stdout, result.stdout
        wait_for(lambda: orphan.poll() is not None, 10, "the orphan replica to be ended")
        wait_for(lambda: fake_daemon.poll() is not None, 10, "the orphan daemon to be ended")
        assert not {doomed_id, "em9ty0123456789a"} & set(ownership.registrations())
        for proc in (live, unknown):
            assert proc.poll() is None, "a process of a home that exists (or unknown) was ended"
        assert all(psutil.pid_exists(pid) for pid in [daemon_pid, *workers])
        assert live_id in ownership.registrations()

        # `--include-unknown` ends the processes of every home this registry does not know:
        # here, those of the tests running beside this one (each registers in a runtime dir
        # of its own), so the test ends only its own unknown home, through the same function.
        from corral import cli_doctor

        procs, homes = cli_doctor.scan()
        cli_doctor.end_orphan_homes(
            [p for p in procs if p.home_id == "0123456789abcdef"],
            {k: h for k, h in homes.items() if k == "0123456789abcdef"},
            include_unknown=True,
        )
        wait_for(lambda: unknown.poll() is not None, 10, "the process of an unknown home")
        assert live.poll() is None
    finally:
        for proc in started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_doctor_sees_and_ends_ray_replicas_of_a_deleted_home(
    corral_home: CorralHome, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that a Ray actor on this machine runs carries the Ray backend's marker
    (``CORRAL_RAY_HOME_MARKER``), not the local one: doctor listed none of them, so the
    replicas of a home deleted after `corral daemon stop --all` kept their memory and ports
    unnamed (doctor said "0 orphan process(es)"). It lists them now, and ends them when
    their home is gone; one of a home it cannot tell (a daemon of another machine may use
    this node) is listed and left alone."""
    monkeypatch.setenv("CORRAL_RUNTIME_DIR", corral_home.env["CORRAL_RUNTIME_DIR"])
    doomed_id = "d00medray0123456"
    _register_doomed_home(tmp_path, doomed_id, os.getpid(), 1.0)

    def on_ray(home_id: str, shown: str, key: str) -> subprocess.Popen[bytes]:
        return _sleep(
            {
                **corral_home.env,
                "CORRAL_RAY_HOME_MARKER": home_id,
                "CORRAL_SERVICE": "svc",
                "CORRAL_REPLICA_ID": shown,
                "CORRAL_REPLICA_KEY": f"{home_id}/svc/{key}",
            }
        )

    orphan = on_ray(doomed_id, "3", "9")
    elsewhere = on_ray("e15ewhere0123456", "1", "1")
    try:

        def sees_both() -> dict[str, Any] | None:
            report = _doctor(corral_home)
            return report if _of(report, doomed_id) and _of(report, "e15ewhere0123456") else None

        report = wait_for(sees_both, 15, "doctor to see the Ray replicas")
        assert [
            (p["kind"], p["pid"], p["exists"], p["replica"]) for p in _of(report, doomed_id)
        ] == [("replica", orphan.pid, False, "svc/3 (ray)")]
        text = corral_home.run("doctor").stdout
        assert "1 orphan process(es) of 1 deleted home(s)" in text, text

        result = corral_home.run("doctor", "--end-orphans", "-y")
        assert f"Ray replica svc/3 pid {orphan.pid}" in result.stdout, result.stdout
        wait_for(lambda: orphan.poll() is not None, 10, "the orphan Ray replica to be ended")
        # `--include-unknown`, through the function and for this test's unknown home only
        # (as test_doctor_ends_only_orphans does: the CLI would reach other tests' homes).
        from corral import cli_doctor

        procs, homes = cli_doctor.scan()
        cli_doctor.end_orphan_homes(
            [p for p in procs if p.home_id == "e15ewhere0123456"],
            {k: h for k, h in homes.items() if k == "e15ewhere0123456"},
            include_unknown=True,
        )
        assert elsewhere.poll() is None, "a Ray replica of a home of unknown state was ended"
        assert doomed_id not in ownership.registrations()
    finally:
        for proc in (orphan, elsewhere):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
