"""Tests of corral.infra.local: real processes, real HTTP on 127.0.0.1, real JobPool jobs.

Launches run inside a JobPool job, as in the daemon, so the capture route (the launch log) and
cancellation are the real ones. Every replica carries a home marker unique to its test; at
teardown every process that still carries it, and every process a test started itself, is
killed by pid. Every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from corral import jobs
from corral.infra.base import Infra, LaunchRequest, Liveness, ReplicaHandle
from corral.infra.local import LocalInfra, replica_key
from corral.jobs import Cancelled, CommandFailed, JobPool

pytestmark = pytest.mark.timeout(60)

DEADLINE = 10.0
PY = shlex.quote(sys.executable)
HTTP_SERVER = f'exec {PY} -m http.server "$PORT" --bind 127.0.0.1'
# Never go through a proxy from the environment to reach 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- helpers --------------------------------------------------------------------------------------


def wait_for(pred: Callable[[], bool], timeout: float = DEADLINE, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not pred():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def http_ok(endpoint: str) -> bool:
    try:
        with _OPENER.open(endpoint + "/", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def marked(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries this home marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("CORRAL_HOME_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def gone(pid: int) -> bool:
    """The pid no longer runs (absent, or a zombie waiting for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def py_cmd(code: str) -> str:
    return f"{PY} -c {shlex.quote(code)}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def read_pid(path: Path) -> int:
    wait_for(lambda: path.exists() and path.read_text().strip().isdigit(), what=str(path))
    return int(path.read_text().strip())


@dataclass
class Env:
    """Everything one test needs: a unique home marker, a pool, an infra, a place for files."""

    tmp: Path
    marker: str
    pool: JobPool
    infra: LocalInfra
    started: list[ReplicaHandle] = field(default_factory=list)
    own_pids: list[int] = field(default_factory=list)

    def request(
        self,
        run: str,
        *,
        setup: str | None = None,
        replica_id: int = 1,
        envs: dict[str, str] | None = None,
        workdir: Path | None = None,
        port: int | None = None,
        on_started: Callable[[ReplicaHandle], None] | None = None,
    ) -> LaunchRequest:
        rdir = self.tmp / f"replica-{replica_id}"

        def record(handle: ReplicaHandle) -> None:
            # What the controller does: the handle is stored before launch goes on. The process
            # exists (maybe as an unreaped zombie, for a run that exits at once).
            assert psutil.pid_exists(int(handle.data["pid"]))
            self.started.append(handle)
            if on_started is not None:
                on_started(handle)

        return LaunchRequest(
            service="svc",
            replica_id=replica_id,
            version=3,
            run=run,
            setup=setup,
            envs=envs or {},
            workdir=workdir,
            replica_dir=rdir,
            log_path=rdir / "logs" / "replica.log",
            port=port,
            resources={},
            home_marker=self.marker,
            on_started=record,
        )

    def submit(self, request: LaunchRequest) -> jobs.Job:
        return self.pool.submit(
            self.infra.launch, request, log=self.launch_log(request), kind="launch"
        )

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        handle = self.submit(request).result(DEADLINE)
        assert isinstance(handle, ReplicaHandle)
        return handle

    @staticmethod
    def launch_log(request: LaunchRequest) -> Path:
        return request.replica_dir / "launch.log"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    pool = JobPool(max_workers=4)
    e = Env(
        tmp_path, f"test-{uuid.uuid4().hex}", pool, LocalInfra(abort_grace=2.0, sweep_grace=2.0)
    )
    try:
        yield e
    finally:
        pool.shutdown(timeout=10)
        for handle in e.started:
            with contextlib.suppress(Exception):
                e.infra.terminate(handle, 0.5)
        for proc in marked(e.marker):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for pid in e.own_pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def spawn_orphan(argv: list[str], env: dict[str, str], cwd: Path) -> int:
    """Start ``argv`` in a session of its own through a short-lived parent, so it is NOT our
    child (as after a daemon restart: init reaps it, we never can). Returns its pid."""
    code = (
        "import json, subprocess, sys\n"
        "a = json.loads(sys.argv[1])\n"
        "p = subprocess.Popen(a['argv'], env=a['env'], cwd=a['cwd'], start_new_session=True,\n"
        "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,\n"
        "                     stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
    )
    arg = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)})
    out = subprocess.run(
        [sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=DEADLINE
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


# -- launch ---------------------------------------------------------------------------------------


def test_local_infra_satisfies_the_protocol() -> None:
    infra: Infra = LocalInfra()
    assert infra.name == "local"


def test_launch_serves_http_with_a_clean_environment(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_TOKEN", "secret")
    monkeypatch.setenv("CORRAL_HOME", "/somewhere")
    monkeypatch.setenv("UNRELATED_VAR", "not inherited")
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    workdir = env.tmp / "wd"
    workdir.mkdir()
    dump = py_cmd("import json, os; json.dump(dict(os.environ), open('env.json', 'w'))")
    request = env.request(
        f"{dump} && {HTTP_SERVER}",
        envs={"APP_MODE": "fast", "CORRAL_FROM_SPEC": "yes"},
        workdir=workdir,
        replica_id=7,
    )
    handle = env.launch(request)

    assert env.started == [handle]
    port = int(handle.data["port"])
    assert handle.backend == "local"
    assert handle.endpoint == f"http://127.0.0.1:{port}"
    assert handle.data["pgid"] == handle.data["pid"]
    wait_for(lambda: http_ok(handle.endpoint), what="the replica's HTTP server")
    assert env.infra.check(handle) is Liveness.ALIVE
    assert env.infra.exit_code(handle) is None

    child_env = json.loads((workdir / "env.json").read_text())
    assert child_env["PORT"] == str(port)
    assert child_env["APP_MODE"] == "fast"
    # Only the documented short list comes from the daemon's environment.
    assert "UNRELATED_VAR" not in child_env
    assert child_env["LC_TIME"] == "C.UTF-8"
    assert child_env["PATH"] == os.environ["PATH"]
    assert {k for k in child_env if k.startswith("CORRAL_")} == {
        "CORRAL_FROM_SPEC",
        "CORRAL_REPLICA_ID",
        "CORRAL_SERVICE",
        "CORRAL_VERSION",
        "CORRAL_HOME_MARKER",
        "CORRAL_REPLICA_KEY",
    }
    assert child_env["CORRAL_REPLICA_ID"] == "7"
    assert child_env["CORRAL_SERVICE"] == "svc"
    assert child_env["CORRAL_VERSION"] == "3"
    assert child_env["CORRAL_HOME_MARKER"] == env.marker
    assert child_env["CORRAL_REPLICA_KEY"] == replica_key(env.marker, "svc", 7)
    assert handle.data["key"] == child_env["CORRAL_REPLICA_KEY"]

    env.infra.terminate(handle, grace=5.0)
    assert env.infra.check(handle) is Liveness.EXITED
    assert env.infra.exit_code(handle) == -signal.SIGTERM
    # http.server logs each request on stderr: the replica's own log.
    assert '"GET / HTTP/1.1" 200' in request.log_path.read_text()


def test_setup_output_goes_to_the_launch_log_and_run_output_to_the_replica_log(
    env: Env,
) -> None:
    request = env.request(
        # The words are assembled by the shell so that the commands echoed in the launch log
        # do not contain them.
        'W=RUN; echo "$W-OUT"; echo "$W-ERR" >&2; pwd; exit 3',
        setup='W=SETUP; echo "$W-OUT"; echo "$W-ERR" >&2',
        envs={"API_KEY": "hunter2"},
    )
    handle = env.launch(request)
    pid = int(handle.data["pid"])
    wait_for(lambda: gone(pid), what="the run command to exit")
    # Exited and not yet reaped: the very next check sees it, and reaps it.
    assert env.infra.check(handle) is Liveness.EXITED
    assert env.infra.exit_code(handle) == 3
    assert not psutil.pid_exists(pid) or psutil.Process(pid).ppid() != os.getpid()

    launch_log = Env.launch_log(request).read_text()
    assert "SETUP-OUT" in launch_log and "SETUP-ERR" in launch_log
    assert f"pid {pid}" in launch_log and f"port {handle.data['port']}" in launch_log
    assert "API_KEY" in launch_log and "hunter2" not in launch_log
    assert "RUN-OUT" not in launch_log

    replica_log = request.log_path.read_text()
    assert "RUN-OUT" in replica_log and "RUN-ERR" in replica_log
    assert str(request.replica_dir) in replica_log  # the default working directory
    assert "SETUP-OUT" not in replica_log


def test_the_requested_port_is_used(env: Env) -> None:
    port = free_port()
    request = env.request('echo "$PORT" > port.txt; exec sleep 300', port=port)
    handle = env.launch(request)
    assert handle.endpoint == f"http://127.0.0.1:{port}"
    assert read_pid(request.replica_dir / "port.txt") == port


def test_failing_setup_raises_command_failed_and_leaves_nothing(env: Env) -> None:
    # The stray escapes setup's process group (setsid): run_command alone would not stop it.
    stray = py_cmd(
        "import os, time; os.setsid(); open('stray.pid', 'w').write(str(os.getpid()));"
        " time.sleep(300)"
    )
    request = env.request(
        "exec sleep 300",
        setup=f"{stray} & echo setting up; while [ ! -s stray.pid ]; do sleep 0.01; done; exit 7",
    )
    job = env.submit(request)
    with pytest.raises(CommandFailed) as info:
        job.result(DEADLINE)
    assert info.value.returncode == 7
    # What status shows and the launch log ends with: the user's command failed, in one line,
    # no corral traceback (it was CommandFailed('command exited with code 7: <the script>')).
    assert repr(info.value) == "setup exited with code 7"
    assert env.started == []
    assert gone(int((request.replica_dir / "stray.pid").read_text()))
    assert marked(env.marker) == []
    log = Env.launch_log(request).read_text()
    assert "setting up" in log and "Traceback" not in log, log
    assert log.rstrip().endswith("[corral] setup exited with code 7"), log


def test_a_missing_workdir_fails_before_anything_starts(env: Env) -> None:
    job = env.submit(env.request("exec sleep 300", workdir=env.tmp / "nope"))
    with pytest.raises(FileNotFoundError, match="nope"):
        job.result(DEADLINE)
    assert env.started == []
    assert marked(env.marker) == []


def test_cancel_during_a_slow_setup_is_quick_and_leaves_nothing(env: Env) -> None:
    request = env.request("exec sleep 300", setup="sleep 30")
    job = env.submit(request)
    wait_for(lambda: bool(marked(env.marker)), what="setup to start")
    started = time.monotonic()
    job.cancel()
    with pytest.raises(Cancelled):
        job.result(DEADLINE)
    assert time.monotonic() - started < 3.0
    assert env.started == []
    assert marked(env.marker) == []


def test_cancel_right_after_the_process_started_stops_it(env: Env) -> None:
    def cancel_me(handle: ReplicaHandle) -> None:
        job = jobs.current_job()
        assert job is not None
        job.cancel()

    job = env.submit(env.request("exec sleep 300", on_started=cancel_me))
    with pytest.raises(Cancelled):
        job.result(DEADLINE)
    [handle] = env.started
    assert env.infra.check(handle) is Liveness.EXITED
    assert env.infra.exit_code(handle) == -signal.SIGTERM
    assert marked(env.marker) == []


def test_a_failing_on_started_stops_the_process_and_propagates(env: Env) -> None:
    def fail(handle: ReplicaHandle) -> None:
        raise RuntimeError("state write failed")

    job = env.submit(env.request("exec sleep 300", on_started=fail))
    with pytest.raises(RuntimeError, match="state write failed"):
        job.result(DEADLINE)
    [handle] = env.started
    assert env.infra.check(handle) is Liveness.EXITED
    assert marked(env.marker) == []


# -- terminate / check / exit code ----------------------------------------------------------------


def test_terminate_stops_the_whole_group_and_is_idempotent(env: Env) -> None:
    request = env.request(f"sleep 300 & echo $! > grandchild.pid; {HTTP_SERVER}")
    handle = env.launch(request)
    grandchild = read_pid(request.replica_dir / "grandchild.pid")
    wait_for(lambda: http_ok(handle.endpoint), what="the replica's HTTP server")
    assert not gone(grandchild)

    env.infra.terminate(handle, grace=5.0)
    assert gone(int(handle.data["pid"]))
    assert gone(grandchild)
    assert env.infra.check(handle) is Liveness.EXITED
    assert env.infra.exit_code(handle) == -signal.SIGTERM
    env.infra.terminate(handle, grace=5.0)  # already gone: quietly succeeds
    assert not http_ok(handle.endpoint)


def test_a_child_ignoring_term_is_killed_after_the_grace(env: Env) -> None:
    code = (
        "import pathlib, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path('ready').touch()\n"
        "time.sleep(300)\n"
    )
    request = env.request(f"exec {py_cmd(code)}")
    handle = env.launch(request)
    wait_for((request.replica_dir / "ready").exists, what="the TERM handler")
    started = time.monotonic()
    env.infra.terminate(handle, grace=0.3)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 5.0
    assert env.infra.exit_code(handle) == -signal.SIGKILL
    assert env.infra.check(handle) is Liveness.EXITED


def test_check_sees_a_kill_9(env: Env) -> None:
    handle = env.launch(env.request("exec sleep 300"))
    assert env.infra.check(handle) is Liveness.ALIVE
    os.kill(int(handle.data["pid"]), signal.SIGKILL)
    wait_for(lambda: env.infra.check(handle) is Liveness.EXITED, what="EXITED")
    assert env.infra.exit_code(handle) == -signal.SIGKILL


def test_terminate_stops_survivors_of_a_leader_that_exited(env: Env) -> None:
    request = env.request("sleep 300 & echo $! > bg.pid; exit 0")
    handle = env.launch(request)
    survivor = read_pid(request.replica_dir / "bg.pid")
    wait_for(lambda: env.infra.check(handle) is Liveness.EXITED, what="the leader to exit")
    assert env.infra.exit_code(handle) == 0
    assert not gone(survivor)
    env.infra.terminate(handle, grace=5.0)
    assert gone(survivor)


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "scan"])
def test_terminate_stops_what_setup_left_running(
    env: Env, monkeypatch: pytest.MonkeyPatch, cgroup: bool
) -> None:
    """A setup that starts something and exits 0 (a sidecar, a daemonizing tool) left it
    running for good: it is older than ``run``'s leader, so the key scan passed over it, and
    it was outside the replica's cgroup. A replica's teardown, and so ``down``, left it
    behind, and the restarted daemon's sweep spared it (no row named its key any more)."""
    if not cgroup:
        monkeypatch.setattr("corral.infra.cgroups.replica_cgroup", lambda *args: None)
    # The setup goes on after starting them (as an install would): older than the leader.
    setup = "sleep 300 & echo $! > kept.pid; setsid sleep 300 & echo $! > away.pid; sleep 0.3"
    request = env.request(HTTP_SERVER, setup=setup)
    handle = env.launch(request)
    if cgroup and not handle.data.get("cgroup"):
        pytest.skip("no writable cgroup v2 here")
    left = [read_pid(request.replica_dir / name) for name in ("kept.pid", "away.pid")]
    assert not any(gone(pid) for pid in left)  # setup's sidecars run alongside the replica
    env.infra.terminate(handle, grace=2.0)
    wait_for(lambda: all(gone(pid) for pid in left), timeout=3.0, what="setup's leftovers")
    assert marked(env.marker) == []


def test_a_recycled_pid_is_never_signalled(env: Env) -> None:
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    env.own_pids.append(sleeper.pid)
    try:
        proc = psutil.Process(sleeper.pid)
        real = proc.create_time()
        infra = LocalInfra()
        stale = ReplicaHandle(
            "local",
            "http://127.0.0.1:1",
            {"pid": sleeper.pid, "pgid": sleeper.pid, "create_time": real - 1000.0},
        )
        assert infra.check(stale) is Liveness.EXITED
        assert infra.exit_code(stale) is None
        infra.terminate(stale, grace=0.1)
        assert sleeper.poll() is None and proc.status() != psutil.STATUS_ZOMBIE

        boot_id = Path("/proc/sys/kernel/random/boot_id")
        if boot_id.exists():
            ticks = int(
                Path(f"/proc/{sleeper.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19]
            )
            ids: dict[str, Any] = {"pid": sleeper.pid, "boot_id": boot_id.read_text().strip()}
            # Same wall-clock start but other start ticks: another process on a recycled pid.
            other = ReplicaHandle(
                "local", "", {**ids, "create_time": real, "start_ticks": ticks + 1}
            )
            assert infra.check(other) is Liveness.EXITED
            infra.terminate(other, grace=0.1)
            assert sleeper.poll() is None
            # The ticks decide: a create_time shifted by a wall-clock step is still recognised.
            stepped = ReplicaHandle(
                "local", "", {**ids, "create_time": real + 3.0, "start_ticks": ticks}
            )
            assert infra.check(stepped) is Liveness.ALIVE
    finally:
        sleeper.kill()
        sleeper.wait(DEADLINE)


def test_malformed_handles_are_rejected() -> None:
    infra = LocalInfra()
    with pytest.raises(ValueError, match="not a local"):
        infra.check(ReplicaHandle("ray", "", {"pid": 123, "create_time": 1.0}))
    with pytest.raises(ValueError, match="malformed"):
        infra.check(ReplicaHandle("local", "", {"pid": "x", "create_time": 1.0}))
    with pytest.raises(ValueError, match="malformed"):
        infra.terminate(ReplicaHandle("local", "", {"pid": 0, "create_time": 1.0}), 1.0)


# -- re-adoption and sweep ------------------------------------------------------------------------


def test_a_fresh_instance_adopts_a_replica_it_did_not_start(env: Env) -> None:
    """The replica is launched by another OS process that then exits: as after a daemon
    restart, it is not our child, and only the handle's data connects us to it."""
    request = env.request(HTTP_SERVER, replica_id=4)
    launcher = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from corral.infra.base import LaunchRequest\n"
        "from corral.infra.local import LocalInfra\n"
        "a = json.loads(sys.argv[1])\n"
        "req = LaunchRequest(service='svc', replica_id=4, version=1, run=a['run'], setup=None,\n"
        "    envs={}, workdir=None, replica_dir=Path(a['dir']), log_path=Path(a['log']),\n"
        "    port=None, resources={}, home_marker=a['marker'], on_started=lambda h: None)\n"
        "h = LocalInfra().launch(req)\n"
        "print('HANDLE ' + json.dumps({'endpoint': h.endpoint, 'data': dict(h.data)}))\n"
    )
    arg = json.dumps(
        {
            "run": request.run,
            "dir": str(request.replica_dir),
            "log": str(request.log_path),
            "marker": env.marker,
        }
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher, arg], capture_output=True, text=True, timeout=DEADLINE
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("HANDLE "))
    raw = json.loads(line.removeprefix("HANDLE "))
    handle = ReplicaHandle("local", raw["endpoint"], raw["data"])
    env.started.append(handle)
    pid = int(handle.data["pid"])
    assert psutil.Process(pid).ppid() != os.getpid()

    infra = LocalInfra()
    wait_for(lambda: http_ok(handle.endpoint), what="the adopted replica's HTTP server")
    assert infra.check(handle) is Liveness.ALIVE
    assert infra.exit_code(handle) is None
    infra.terminate(handle, grace=5.0)
    assert gone(pid)
    assert infra.check(handle) is Liveness.EXITED
    assert infra.exit_code(handle) is None
    infra.terminate(handle, grace=5.0)


def test_sweep_stops_only_what_no_known_handle_accounts_for(env: Env) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    # A replica whose launch died before on_started: marked, but unknown. A grandchild too.
    leaked_env = {
        **base,
        "CORRAL_HOME_MARKER": env.marker,
        "CORRAL_REPLICA_KEY": replica_key(env.marker, "svc", 9),
    }
    leaked = spawn_orphan(["sh", "-c", "sleep 300 & exec sleep 301"], leaked_env, env.tmp)
    env.own_pids.append(leaked)
    # Another corral home's replica: none of this sweep's business.
    other_marker = f"other-{uuid.uuid4().hex}"
    other = spawn_orphan(["sleep", "302"], {**base, "CORRAL_HOME_MARKER": other_marker}, env.tmp)
    env.own_pids.append(other)
    # A known replica, with a child in its group and one that left it for a session of its own.
    request = env.request(
        "sleep 303 & "
        + py_cmd(
            "import os, time; os.setsid(); open('setsid.pid', 'w').write(str(os.getpid()));"
            " time.sleep(300)"
        )
        + " & exec sleep 304",
        replica_id=1,
    )
    known = env.launch(request)
    escaped = read_pid(request.replica_dir / "setsid.pid")
    wait_for(lambda: len(marked(env.marker)) >= 5, what="all processes to start")
    leaked_group = [p.pid for p in marked(env.marker) if os.getpgid(p.pid) == leaked]
    assert len(leaked_group) == 2

    report = env.infra.sweep(env.marker, [known])

    assert len(report) == 2, report
    assert all(line.startswith("stopped ") and "svc/9" in line for line in report)
    for pid in leaked_group:
        assert gone(pid)
    assert env.infra.check(known) is Liveness.ALIVE
    assert not gone(escaped)
    assert not gone(other)
    survivors = {p.pid for p in marked(env.marker)}
    assert leaked not in survivors and escaped in survivors
    assert env.infra.sweep(env.marker, [known]) == []


def test_sweep_spares_a_launch_in_flight(env: Env) -> None:
    job = env.submit(env.request("exec sleep 300", setup="sleep 30"))
    wait_for(lambda: bool(marked(env.marker)), what="setup to start")
    assert env.infra.sweep(env.marker, []) == []
    assert marked(env.marker)
    job.cancel()
    with pytest.raises(Cancelled):
        job.result(DEADLINE)


def test_teardown_in_a_cgroup_scans_no_process_table(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cgroup per replica, teardown reads the cgroup, not the whole process table: 200
    teardowns at once each reading every process's environment stalled the daemon for
    seconds. Counted: calls of psutil.process_iter during the teardowns."""
    handles = [
        env.launch(env.request(py_cmd("import time; time.sleep(600)"), replica_id=i))
        for i in (1, 2, 3)
    ]
    if not all(h.data.get("cgroup") for h in handles):
        pytest.skip("no writable cgroup v2 here: teardown falls back on a scan")
    pids = [int(h.data["pid"]) for h in handles]
    scans = 0
    real = psutil.process_iter

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal scans
        scans += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(psutil, "process_iter", counting)
    for handle in handles:
        env.infra.terminate(handle, 2.0)
    assert scans == 0, f"{scans} scans of the process table for 3 teardowns"
    assert all(gone(pid) for pid in pids)
