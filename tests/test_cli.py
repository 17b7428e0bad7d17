"""The CLI a SkyServe user reaches for, end to end: `corral` run as a subprocess against a real
daemon, real replicas of examples/app.py, real ports on 127.0.0.1.

Covers the flags SkyServe has (`status --endpoint/-v`, name globs, `logs --load-balancer/
--tail`, `down -a/-p/-y/--replica-id`, `--version`), replica ids per service, what a status
row says during a blue-green update, and the messages that replace tracebacks and internals
(no daemon, an unusable home, a taken port, Ctrl-C).
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, CorralHome, LineReader, get_json, pid_alive, spec_text, write_spec

from corral import __version__
from corral.state import Store


def _ids(home: CorralHome, name: str) -> list[int]:
    service = home.service(name)
    assert service is not None
    return [r["id"] for r in service["replicas"]]


def test_version_and_no_daemon(corral_home: CorralHome) -> None:
    assert __version__ in corral_home.run("--version").stdout
    # --json is always JSON; without a daemon no service is known.
    result = corral_home.run("status", "--json")
    assert json.loads(result.stdout) == {"services": []}
    # A home with services whose daemon is not running (a home with none: no services, see
    # test_cli_first_hour.py).
    corral_home.path.mkdir(parents=True, exist_ok=True)
    Store(corral_home.path / "state.db").create_service(
        "kept", "run: x", source=None, base_dir=None, lb_port=None
    )
    human = corral_home.run("status", check=False)
    assert human.returncode == 1
    assert "corral daemon start" in human.stderr and "Traceback" not in human.stderr
    # The README's line for `status` once promised "no services" for this case too.
    assert (
        "services but no daemon: an error saying to start one" in (REPO / "README.md").read_text()
    )
    # A daemon that died without cleaning up: its daemon.json names a port nobody serves.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (corral_home.path / "token").write_text("x" * 32)
    dead = subprocess.Popen(["true"])
    dead.wait()
    info = corral_home.path / "daemon.json"
    info.write_text(json.dumps({"pid": dead.pid, "port": port}))
    stale = corral_home.run("status", check=False)
    assert stale.returncode == 1
    assert f"not reachable at http://127.0.0.1:{port}" in stale.stderr, stale.stderr
    assert "corral daemon start" in stale.stderr
    for internal in ("Errno", "ClientConnectorError", "Traceback", "ssl:default"):
        assert internal not in stale.stderr, stale.stderr
    assert json.loads(corral_home.run("status", "--json").stdout) == {"services": []}
    info.unlink()  # no daemon to stop at teardown
    corral_home.daemon_pids.discard(dead.pid)
    for db in corral_home.path.glob("state.db*"):
        db.unlink()  # nor a service to take down


def test_unusable_home_is_one_line_and_exit_78(corral_home: CorralHome, tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    cases = {file: "is a file", dangling: "does not exist", file / "home": "not a directory"}
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # Root writes anywhere but to a read-only mount: the directory is bound read-only over
    # itself in a mount namespace of the command's own (CI runs as root).
    read_only = _read_only_prefix(locked) if os.geteuid() == 0 else []
    if os.geteuid() != 0 or read_only:
        cases[locked] = "is not writable"
        cases[locked / "new-home"] = "cannot be created: " + str(locked) + " is not writable"
    for home, words in cases.items():
        prefix = read_only if home in (locked, locked / "new-home") else []
        for args in (["status"], ["up", "nothing.yaml"], ["daemon", "start"]):
            result = subprocess.run(
                [*prefix, *corral_home.cli("--home", str(home), *args)],
                env={**corral_home.env, "CORRAL_HOME": str(home)},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 78, (home, args, result)
            assert words in result.stderr and "CORRAL_HOME" in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "Traceback" not in result.stderr
    assert not any(locked.iterdir())  # nothing was made there


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("CORRAL_DECISION_INTERVAL", "abc", "must be a number of seconds, not 'abc'"),
        ("CORRAL_WORKER_IDLE_EXIT", "1m", "must be a number of seconds, not '1m'"),
        ("CORRAL_API_HEADER_TIMEOUT", "-3", "must be between 0 and 3600 seconds"),
        ("CORRAL_BALANCER_WORKERS", "0", "must be between 1 and 64"),
        ("CORRAL_TEARDOWN_TIMEOUT", "2h", "must be a number of seconds"),
        ("CORRAL_QPS_WINDOW", "0", "must be between 0 and 3600 seconds"),
        ("CORRAL_LAUNCHES_PER_SERVICE", "many", "must be a whole number"),
        ("CORRAL_LOG_MAX_BYTES", "lots", ""),
        ("CORRAL_DAEMON_RESPAWN", "false", "must be 0 or 1, not 'false'"),
        ("CORRAL_CONFINE", "no", "must be auto or off, not 'no'"),
    ],
)
def test_a_bad_setting_stops_the_daemon_before_it_starts_anything(
    corral_home: CorralHome, name: str, value: str, words: str
) -> None:
    """A bad number in the daemon's environment (README) is named, and stops it before it starts a
    balancer worker: those outlive the daemon, so one that refused to run left two workers
    behind (a bad decision interval was read after they started). Two settings were not
    checked at all: a bad idle exit made every worker fail at its start, and a bad API
    header timeout silently became 10 s."""
    result = corral_home.run("daemon", "start", check=False, env={name: value})
    assert result.returncode == 1, result
    assert f"${name}" in result.stderr and words in result.stderr, result.stderr
    assert not list(corral_home.path.glob("dataplane/worker-*.log")), "a worker was started"
    assert corral_home.daemon_info() is None


def _read_only_prefix(directory: Path) -> list[str]:
    """A command prefix that runs what follows with ``directory`` mounted read-only, in a
    private mount namespace (nothing outside it sees the mount); [] where unshare is refused."""
    script = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    probe = subprocess.run(
        [*prefix, str(directory), "sh", "-c", f"! touch {directory}/probe 2>/dev/null"],
        capture_output=True,
        timeout=30,
    )
    return [*prefix, str(directory)] if probe.returncode == 0 else []


def test_flags_globs_ids_and_replica_down(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    assert "daemon started: pid" in home.run("daemon", "start").stdout
    assert "daemon already running: pid" in home.run("daemon", "start").stdout
    for name, count in (("svc-a", 2), ("svc-b", 1), ("other", 1)):
        home.run("up", "-y", str(write_spec(tmp_path / f"{name}.yaml", spec_text(name, count))))
    for name, count in (("svc-a", 2), ("svc-b", 1), ("other", 1)):
        home.wait_replicas(name, count)
    # Replica ids count within each service; the replica knows its own.
    assert _ids(home, "svc-a") == [1, 2] and _ids(home, "svc-b") == [1] == _ids(home, "other")
    a = home.status("svc-a")
    assert {get_json(a["endpoint"] + "/")["replica"] for _ in range(8)} == {"1", "2"}

    globbed = json.loads(home.run("status", "svc-*", "--json").stdout)["services"]
    assert sorted(s["name"] for s in globbed) == ["svc-a", "svc-b"]
    assert (
        home.run("status", "svc-b", "--endpoint").stdout == home.status("svc-b")["endpoint"] + "\n"
    )
    assert home.run("status", "svc-*", "--endpoint", check=False).returncode == 1
    nomatch = home.run("status", "zzz-*", check=False)
    assert nomatch.returncode == 1 and "no service matches" in nomatch.stderr
    assert "FAILURE" in home.run("status", "-v").stdout
    # A narrow terminal wraps rows; it never cuts an endpoint (what users copy from here).
    narrow = subprocess.run(
        home.cli("status"),
        env={**home.env, "COLUMNS": "40"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    everything = home.status()
    endpoints = [s["endpoint"] for s in everything] + [
        r["endpoint"] for s in everything for r in s["replicas"]
    ]
    assert all(e in narrow for e in endpoints), narrow

    # logs: --tail N prints the last N lines and exits (SkyServe's --tail is no-follow).
    tail = home.run("logs", "svc-a", "1", "--tail", "2", timeout=30).stdout
    assert len(tail.splitlines()) == 2 and all(
        line.startswith("replica 1") for line in tail.splitlines()
    )
    # --tail N --follow: the last N lines, then what comes (probes log a line every 0.2 s).
    follower = home.popen("logs", "svc-a", "2", "--tail", "1", "--follow")
    reader = LineReader(follower)
    reader.wait_line(r"^replica 2", 30)
    home.wait_for(lambda: len(reader.seen) >= 3 or reader.lines.qsize() >= 2, 30, "more lines")
    assert follower.poll() is None, "a followed log ended while its replica runs"
    follower.terminate()
    follower.wait(timeout=10)
    lb = home.run("logs", "svc-a", "--load-balancer", "--no-follow").stdout
    assert "balancer svc-a listening" in lb and "svc-b" not in lb, lb
    controller = home.run("logs", "other", "--controller", "--tail", "1").stdout
    assert len(controller.splitlines()) == 1

    # down --replica-id: that replica goes, the service replaces it, the other stays as is.
    keep = {r["id"]: r["pid"] for r in a["replicas"]}[2]
    gone = home.run("down", "svc-a", "--replica-id", "1", "-y").stdout
    assert "replica 1 of svc-a is shutting down" in gone
    after = home.wait_for(
        lambda: (
            (s := home.service("svc-a"))
            and [r["id"] for r in s["replicas"]] == [2, 3]
            and all(r["status"] == "READY" for r in s["replicas"])
            and s
        ),
        60,
        "replica 1 replaced by replica 3",
    )
    assert {r["id"]: r["pid"] for r in after["replicas"]}[2] == keep
    # Its launch log ends saying it was torn down, and why, not on its last launch line.
    launch = (home.path / "services/svc-a/logs/replica_1_launch.log").read_text()
    assert re.search(r"\[corral\] tearing the replica down \(.+\); grace", launch), launch
    assert launch.endswith("[corral] replica torn down\n"), launch
    missing = home.run("down", "svc-a", "--replica-id", "9", "-y", check=False)
    assert missing.returncode == 1 and "has no replica 9" in missing.stderr

    down = home.run("down", "svc-*", "-y").stdout
    assert "service svc-a: down" in down and "service svc-b: down" in down
    assert [s["name"] for s in home.status()] == ["other"]
    home.run("down", "-a", "-y")
    assert home.status() == []


def test_status_during_blue_green_shows_the_traffic_version(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "v1.yaml", spec_text("bg", 1))))
    slow = spec_text("bg", 1, run="sleep 4; APP_VERSION=2 exec python3 app.py")
    home.run(
        "update", "bg", str(write_spec(tmp_path / "v2.yaml", slow)), "--mode", "blue_green", "-d"
    )

    def held() -> dict[str, Any] | None:
        s = home.service("bg")
        starting = [r for r in s["replicas"] if r["version"] == 2] if s else []
        return s if starting and starting[0]["status"] == "STARTING" else None

    svc = home.wait_for(held, 30, "version 2 STARTING")
    assert svc["version"] == 2 and svc["traffic_versions"] == [1]
    starting = next(r for r in svc["replicas"] if r["version"] == 2)
    assert starting["initial_delay_seconds"] == 60 and starting["starting_seconds"] >= 0
    table = home.run("status", "bg").stdout
    row = next(line for line in table.splitlines() if line.lstrip().startswith("bg "))
    assert "1 (v2 starting)" in row and "1/1" in row, table
    assert "initial delay" in table  # the STARTING replica: how long, out of how long
    done = home.wait_for(
        lambda: (s := home.service("bg")) and s["traffic_versions"] == [2] and s,
        60,
        "traffic on version 2",
    )
    assert done["traffic_held_for_version"] is None
    assert get_json(done["endpoint"] + "/")["version"] == "2"


def test_taken_port_is_named_and_failed_replica_needs_purge(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        text = spec_text("porty", 1, extra=f"resources:\n  ports: {port}\n")
        home.run("up", "-d", str(write_spec(tmp_path / "p.yaml", text)))
        failed = home.wait_for(
            lambda: next(
                (r for r in home.service("porty")["replicas"] if r["status"].startswith("FAILED")),
                None,
            ),
            90,
            "a FAILED replica",
        )
    assert f"port {port} is in use by pid {os.getpid()}" in failed["failure"], failed
    assert "corral logs porty" in failed["failure"]
    rid = str(failed["id"])

    def refused() -> str:
        # Refused while it is being torn down, then because it is kept visible on purpose.
        result = home.run("down", "porty", "--replica-id", rid, "-y", check=False)
        assert result.returncode == 1, result
        return result.stderr if "--purge" in result.stderr else ""

    assert "is FAILED" in home.wait_for(refused, 30, "the failed replica torn down")
    purged = home.run("down", "porty", "--replica-id", rid, "--purge", "-y")
    assert "forgotten" in purged.stdout
    assert failed["id"] not in _ids(home, "porty")


def test_ctrl_c_during_up_says_what_keeps_running(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    slow = spec_text("slowpoke", 1, run="sleep 30; exec python3 app.py")
    proc = home.popen("up", str(write_spec(tmp_path / "slow.yaml", slow)))
    reader = LineReader(proc)
    # Progress lines carry the time since the wait began.
    reader.wait_line(r"\[\s*\d+s\] replica 1 \(v1\): (PROVISIONING|STARTING)", 30)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    reader.wait_line(r"interrupted", 10)
    said = "".join(reader.seen) + "".join(_drain(reader))
    assert "service slowpoke keeps running" in said and "corral down slowpoke" in said, said
    assert "Traceback" not in said and "Aborted" not in said
    assert home.service("slowpoke") is not None
    # The same for an update: the rollout goes on.
    slower = slow.replace("sleep 30", "sleep 31")  # another run: new replicas, not relabelled
    proc = home.popen("update", "slowpoke", str(write_spec(tmp_path / "slow2.yaml", slower)))
    reader = LineReader(proc)
    reader.wait_line(r"version 2 accepted", 30)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    reader.wait_line(r"interrupted", 10)
    said = "".join(reader.seen) + "".join(_drain(reader))
    assert "the rollout of version 2 goes on" in said and "corral down slowpoke" in said, said
    assert home.service("slowpoke")["version"] == 2


def test_down_asks_only_a_person_at_a_terminal(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "asked.yaml", spec_text("asked", 1))))

    def at_terminal(*args: str, answer: bytes = b"") -> subprocess.CompletedProcess[str]:
        main, terminal = pty.openpty()
        try:
            os.write(main, answer)
            return subprocess.run(
                home.cli(*args),
                env=home.env,
                stdin=terminal,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            os.close(main)
            os.close(terminal)

    no = at_terminal("down", "asked", answer=b"n\n")
    assert no.returncode == 1 and "Tear down asked?" in no.stdout, no
    assert home.service("asked") is not None
    yes = at_terminal("down", "asked", "-y")
    assert yes.returncode == 0 and "?" not in yes.stdout, yes
    assert home.service("asked") is None


def _drain(reader: LineReader) -> list[str]:
    lines = []
    while not reader.lines.empty():
        lines.append(reader.lines.get())
    return lines


def test_logs_without_a_daemon_are_read_from_disk(corral_home: CorralHome, tmp_path: Path) -> None:
    """`corral daemon stop` leaves the services running and writing their logs; `status` and
    `down` work without a daemon, and so does `corral logs`: it prints the files as they are
    (and says so on stderr) instead of asking for a daemon first."""
    corral_home.run("up", str(write_spec(tmp_path / "svc.yaml", spec_text("ondisk", 1))))
    corral_home.run("daemon", "stop")
    logs = corral_home.path / "services" / "ondisk" / "logs"
    (logs / "replica_1.log").open("a").write("first\nsecond\nthird\n")
    got = corral_home.run("logs", "ondisk", "1", "--tail", "2")
    assert got.stdout == "second\nthird\n" and "as it is on disk" in got.stderr, got
    # Just after the size cap moved the log to .1: the last lines are read from there too.
    (logs / "replica_1.log.1").write_bytes((logs / "replica_1.log").read_bytes())
    (logs / "replica_1.log").write_text("fourth\n")
    got = corral_home.run("logs", "ondisk", "1", "--tail", "3")
    assert got.stdout == "second\nthird\nfourth\n", got
    launch = corral_home.run("logs", "ondisk", "1", "--launch", "--no-follow")
    assert "[corral] run:" in launch.stdout, launch.stdout
    controller = corral_home.run("logs", "ondisk", "--controller", "--no-follow")
    assert "ondisk" in controller.stdout, controller.stdout
    missing = corral_home.run("logs", "ondisk", "7", check=False)
    assert missing.returncode == 1 and "no such log of 'ondisk'" in missing.stderr
    assert "corral daemon start" in missing.stderr
    assert corral_home.daemon_info() is None  # none was started to answer


@pytest.mark.parametrize(
    "verb", [("update", "nothing-here", "--to-version", "1"), ("logs", "nothing-here", "1")]
)
def test_verbs_without_daemon_say_how_to_start_one(
    corral_home: CorralHome, verb: tuple[str, ...]
) -> None:
    result = corral_home.run(*verb, check=False)
    assert result.returncode == 1
    assert "corral daemon start" in result.stderr and "Traceback" not in result.stderr


def test_daemon_status_json_without_a_daemon_is_json(corral_home: CorralHome) -> None:
    """``daemon status --json`` with no daemon once printed a sentence a script could not
    parse; it exits 1 as before, with a JSON document saying none runs."""
    result = corral_home.run("daemon", "status", "--json", check=False)
    assert result.returncode == 1, result
    assert json.loads(result.stdout) == {"running": False, "home": str(corral_home.path)}


def test_up_of_a_service_still_going_down_says_to_wait(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`up` of a name whose `down` is under way must not point to `update` (refused too, as
    the service is shutting down): it says the name is free once the service is gone."""
    home = corral_home
    # A replica that ignores SIGTERM: its teardown waits out the grace (5 s).
    run = f"trap '' TERM; exec {sys.executable} app.py"
    spec = write_spec(tmp_path / "slow.yaml", spec_text("slow", 1, run=run))
    home.run("up", str(spec))
    home.run("down", "slow", "--no-wait")
    svc = home.wait_for(lambda: home.service("slow"), 10, "the service to be listed")
    assert svc["status"] == "SHUTTING_DOWN", svc
    again = home.run("up", str(spec), check=False)
    assert again.returncode == 1, again
    assert "service 'slow' is shutting down" in again.stderr, again.stderr
    assert "corral update" not in again.stderr, again.stderr
    assert f"`corral up {spec}` again once `corral status slow` no longer lists it" in (
        again.stderr
    )
    home.wait_for(lambda: home.service("slow") is None, 60, "the service to go")


def test_up_waiting_for_a_service_another_shell_takes_down_says_so(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`up` waits for the first READY replica; a `down` from elsewhere meanwhile ended it with
    a bare "no service named 'mute'", as if the name had been mistyped."""
    home = corral_home
    spec = write_spec(tmp_path / "mute.yaml", spec_text("mute", 1, run="exec sleep 3600"))
    waiting = home.popen("up", str(spec), "-y")
    home.wait_for(lambda: home.service("mute"), 30, "the service to be created")
    home.run("down", "mute", "-y")
    said = waiting.communicate(timeout=60)[0].decode()
    assert waiting.returncode == 1, said
    assert "service 'mute' was taken down while this command waited for it" in said, said


def test_daemon_stop_fails_for_a_stuck_daemon_instead_of_calling_it_gone(
    corral_home: CorralHome,
) -> None:
    """A daemon that holds the home but neither answers nor exits (here SIGSTOPped) was
    reported as "no daemon running", exit 0: a script went on to delete the home or start a
    second daemon. It is a failure that names the pid; a daemon only slow to end (after an
    earlier stop, its API closed) is waited for."""
    corral_home.start_daemon()
    pid = corral_home.daemon_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        stuck = corral_home.run("daemon", "stop", "--timeout", "1", check=False)
        assert stuck.returncode == 1, stuck.stdout + stuck.stderr
        said = " ".join((stuck.stdout + stuck.stderr).split())
        assert f"the daemon (pid {pid}) holds this home but neither answers nor exits" in said
        assert pid_alive(pid)
    finally:
        os.kill(pid, signal.SIGCONT)
    corral_home.run("daemon", "stop")
    assert not pid_alive(pid)


def test_waiting_for_the_daemon_to_exit_gives_up_at_its_deadline() -> None:
    """`daemon stop` fails, not "stopped", when the daemon outlives the wait: the wait
    says whether it ended (a real process stands in for the daemon)."""
    import time

    import psutil

    from corral.cli_daemon import _wait_for_exit

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = psutil.Process(child.pid)
        assert _wait_for_exit(proc, time.monotonic() + 0.3) is False
        child.terminate()
        assert _wait_for_exit(proc, time.monotonic() + 10) is True
    finally:
        child.kill()
        child.wait(10)


def test_daemon_stop_returns_once_the_daemon_has_exited(corral_home: CorralHome) -> None:
    """The daemon's API closes first, then it ends its controllers and workers and removes
    its replicas' scratch directory. `daemon stop` returned when the API stopped answering,
    so a script that went on (deleting the home, checking what was left: a flaky
    test_ownership) raced the daemon's last steps."""
    for _ in range(3):  # the race was lost most times: three rounds make it certain
        corral_home.start_daemon()
        pid = corral_home.daemon_pid()
        corral_home.run("daemon", "stop")
        assert not pid_alive(pid)
