"""End-to-end tests of corral: the real CLI, a real daemon and real replica processes.

Each test has its own corral home (``corral_home`` in conftest.py): its own daemon, state and
ports, so the tests run in parallel. Traffic goes to 127.0.0.1 only. Every wait has a deadline,
and teardown fails a test that leaves a replica process behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import (
    APPS,
    EXAMPLES,
    CorralHome,
    LineReader,
    endpoint_of,
    get_json,
    http,
    make_cert,
    needs_openssl,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.timeout(150)

LIVE = {"PENDING", "PROVISIONING", "STARTING", "NOT_READY", "READY"}


# -- helpers ------------------------------------------------------------------------------------


def app_spec(
    directory: Path,
    name: str,
    replicas: int,
    *,
    period: float = 0.2,
    setup: str | None = None,
    run: str | None = None,
    workdir: Path = EXAMPLES,
    initial_delay: float = 30,
) -> Path:
    """A spec running examples/app.py (or ``run`` in ``workdir``) with fast probes."""
    text = spec_text(
        name,
        replicas,
        run=run,
        setup=setup,
        workdir=workdir,
        period=period,
        initial_delay=initial_delay,
    )
    return write_spec(directory / f"{name}.yaml", text)


def ready(service: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in service["replicas"] if r["status"] == "READY"]


def port_closed(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- 1. up --------------------------------------------------------------------------------------


def test_up_three_replicas_serves_through_endpoint(corral_home: CorralHome) -> None:
    # The shipped example, as is, from the repository root: its relative workdir is taken
    # from the directory corral runs in, as in SkyPilot.
    spec = EXAMPLES / "demo.yaml"
    result = corral_home.run("up", str(spec), "-n", "trio", cwd=EXAMPLES.parent)
    endpoint = endpoint_of(result.stdout)

    service = corral_home.wait_replicas("trio", 3)
    assert service["endpoint"] == endpoint

    seen = Counter(get_json(f"{endpoint}/hello/{i}")["replica"] for i in range(30))
    ids = {str(r["id"]) for r in service["replicas"]}
    assert set(seen) == ids, f"requests reached {dict(seen)}, replicas are {ids}"

    status = corral_home.status("trio")
    assert status["status"] == "READY"
    assert status["endpoint"] == endpoint
    replicas = status["replicas"]
    assert [r["status"] for r in replicas] == ["READY"] * 3
    assert len({r["endpoint"] for r in replicas}) == 3
    assert all(r["endpoint"] and r["endpoint"].startswith("http://127.0.0.1:") for r in replicas)
    pids = {r["pid"] for r in replicas}
    assert len(pids) == 3 and all(isinstance(p, int) and pid_alive(p) for p in pids)
    # The pid an answer reports is the pid status shows (the run is `exec python app.py`).
    answers = {a["replica"]: a["pid"] for a in (get_json(f"{endpoint}/") for _ in range(9))}
    assert answers == {str(r["id"]): r["pid"] for r in replicas}

    table = corral_home.run("status").stdout
    assert "trio" in table and endpoint in table and "3/3" in table, table
    again = corral_home.run("up", str(spec), "-n", "trio", check=False, cwd=EXAMPLES.parent)
    assert again.returncode != 0 and "already exists" in again.stderr, again
    unchanged = corral_home.service("trio")
    assert unchanged is not None and len(unchanged["replicas"]) == 3


# -- 2. a replica killed ------------------------------------------------------------------------


def test_killed_replica_is_failed_and_replaced(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = app_spec(tmp_path, "phoenix", 3)
    endpoint = endpoint_of(corral_home.run("up", str(spec)).stdout)
    before = corral_home.wait_replicas("phoenix", 3)
    victim = before["replicas"][0]
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        svc = corral_home.service("phoenix")
        assert svc is not None
        dead = [r for r in svc["replicas"] if r["id"] == victim["id"]]
        if not dead or dead[0]["status"] != "FAILED":
            return None
        live = [r for r in svc["replicas"] if r["status"] in LIVE]
        if len(live) != 3 or any(r["status"] != "READY" for r in live):
            return None
        return svc

    after = wait_for(replaced, 30, "the killed replica FAILED and 3 READY again")
    dead = next(r for r in after["replicas"] if r["id"] == victim["id"])
    assert dead["exit_code"] == -signal.SIGKILL, dead
    assert "process exited (signal 9 (SIGKILL))" in dead["failure"], dead  # not "code -9"
    new_ids = {r["id"] for r in ready(after)} - {r["id"] for r in before["replicas"]}
    assert len(new_ids) == 1, after["replicas"]
    assert not pid_alive(victim["pid"])

    ready_ids = {str(r["id"]) for r in ready(after)}
    served: Counter[str] = Counter()
    for i in range(20):
        answer = http(f"{endpoint}/after/{i}")
        assert answer.status == 200, f"request {i} failed after the replacement: {answer}"
        served[answer.json()["replica"]] += 1
    assert set(served) <= ready_ids, served
    assert str(victim["id"]) not in served
    # The failure stays visible in the CLI's status too.
    assert any(
        r["id"] == victim["id"] and r["status"] == "FAILED"
        for r in corral_home.status("phoenix")["replicas"]
    )


# -- 3. logs ------------------------------------------------------------------------------------


def test_logs(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = app_spec(tmp_path, "chatty", 3)
    endpoint = endpoint_of(corral_home.run("up", str(spec)).stdout)
    service = corral_home.wait_replicas("chatty", 3)
    for i in range(9):
        get_json(f"{endpoint}/visit/{i}")
    ids = [r["id"] for r in service["replicas"]]

    for rid in ids:
        text = corral_home.run("logs", "chatty", str(rid), "--no-follow").stdout
        assert f"replica {rid} listening on 127.0.0.1:" in text, text
        assert re.search(rf'replica {rid}: "GET /visit/\d HTTP/1.1" 200', text), text
        mentioned = set(re.findall(r"replica (\d+)\b", text))
        assert mentioned == {str(rid)}, f"replica {rid}'s log mentions replicas {mentioned}"

        launch = corral_home.run("logs", "chatty", str(rid), "--launch", "--no-follow").stdout
        assert f"run: exec {sys.executable} app.py" in launch, launch
        assert "started pid" in launch, launch

    controller = corral_home.run("logs", "chatty", "--controller", "--no-follow").stdout
    assert "controller started" in controller, controller

    # A replica that does not exist: a clear error, with and without --follow (the default),
    # and never a silent exit 0 or a stream that waits forever.
    for extra in (["--no-follow"], [], ["--launch", "--no-follow"], ["--launch"]):
        bad = corral_home.run("logs", "chatty", "999", *extra, check=False, timeout=20)
        assert bad.returncode != 0, (extra, bad)
        assert "999" in bad.stderr and "error" in bad.stderr.lower(), (extra, bad.stderr)
    missing = corral_home.run("logs", "nosuch", "1", "--no-follow", check=False, timeout=20)
    assert missing.returncode != 0 and "nosuch" in missing.stderr, missing

    # --follow streams what the replica prints after the command started.
    rid = ids[0]
    follower = corral_home.popen("logs", "chatty", str(rid))
    reader = LineReader(follower)
    reader.wait_line(rf"replica {rid} listening", timeout=20)
    marker = f"/follow-{uuid.uuid4().hex}"
    get_json(service["replicas"][0]["endpoint"] + marker)
    reader.wait_line(re.escape(marker), timeout=20)
    assert follower.poll() is None, "logs --follow exited on its own"
    follower.terminate()
    follower.wait(10)


# -- 4. down ------------------------------------------------------------------------------------


def test_down_leaves_nothing(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = app_spec(tmp_path, "gone", 2)
    endpoint = endpoint_of(corral_home.run("up", str(spec)).stdout)
    service = corral_home.wait_replicas("gone", 2)
    pids = [r["pid"] for r in service["replicas"]]
    lb_port = int(endpoint.rsplit(":", 1)[1])
    get_json(endpoint)

    result = corral_home.run("down", "gone")
    assert "service gone: down" in result.stdout, result.stdout

    assert not [p for p in pids if pid_alive(p)], "replica processes survived `corral down`"
    assert port_closed(lb_port), f"the balancer port {lb_port} still accepts connections"
    assert corral_home.status() == []
    assert "no services" in corral_home.run("status").stdout
    assert corral_home.db_rows("SELECT id FROM replicas WHERE service = 'gone'") == []
    assert corral_home.db_rows("SELECT name FROM services WHERE name = 'gone'") == []
    assert corral_home.marked_processes() == []
    answer = corral_home.api("GET", "/v1/services/gone")
    assert answer.status == 404 and "error" in answer.json()
    for args in (["down", "gone"], ["status", "gone"]):
        result = corral_home.run(*args, check=False)
        assert result.returncode != 0 and "no service named 'gone'" in result.stderr, result


def test_down_during_launch(corral_home: CorralHome, tmp_path: Path) -> None:
    """`down` while setups run cancels the launches: their processes stop at once, and a
    follower of a launch log ends by itself once the replica is gone."""
    spec = app_spec(tmp_path, "hasty", 2, setup="echo preparing; sleep 60")
    corral_home.run("up", "--detach", str(spec))

    def provisioning() -> dict[str, Any] | None:
        svc = corral_home.service("hasty")
        if svc is None or [r["status"] for r in svc["replicas"]] != ["PROVISIONING"] * 2:
            return None
        return svc if len(corral_home.marked_processes()) >= 2 else None

    service = wait_for(provisioning, 20, "2 replicas in setup")
    in_setup = {p.pid for p in corral_home.marked_processes()}
    follower = corral_home.popen("logs", "hasty", str(service["replicas"][0]["id"]), "--launch")
    reader = LineReader(follower)
    reader.wait_line("setup: echo preparing", timeout=20)

    corral_home.run("down", "hasty", "--timeout", "30")
    (asked,), (removed,) = corral_home.db_rows(
        "SELECT ts FROM events WHERE service = 'hasty' AND action IN"
        " ('service.down', 'service.removed') ORDER BY id"
    )
    assert removed - asked < 10, "cancelling the launches took too long"
    assert not [p for p in in_setup if pid_alive(p)], "setup processes survived `down`"
    assert corral_home.marked_processes() == []
    assert corral_home.db_rows("SELECT id FROM replicas") == []
    follower.wait(15)
    reader.wait_line("cancelled", timeout=5)


@needs_openssl
def test_down_of_a_service_whose_controller_failed(corral_home: CorralHome, tmp_path: Path) -> None:
    """A controller that cannot start (here: the version's copy of its certificate damaged in
    the home while the daemon was stopped; `up` refuses files that do not load) fails the
    service, and `corral down` still removes it instead of waiting forever."""
    spec = app_spec(tmp_path, "nocert", 1)
    cert, key = make_cert(tmp_path, "nocert", "IP:127.0.0.1")
    spec.write_text(spec.read_text() + f"  tls:\n    keyfile: {key}\n    certfile: {cert}\n")
    corral_home.run("up", str(spec))
    corral_home.stop_daemon()
    copy = corral_home.path / "services" / "nocert" / "versions" / "1" / "tls" / "cert.pem"
    copy.write_text("not a certificate\n")
    corral_home.start_daemon()
    corral_home.wait_for(
        lambda: corral_home.status("nocert")["status"] == "CONTROLLER_FAILED",
        30,
        "the service to fail",
    )
    # Its endpoint, were it fixed, is HTTPS: status said http:// for want of a route.
    assert str(corral_home.status("nocert")["endpoint"]).startswith("https://")

    corral_home.run("down", "nocert", "--timeout", "20")
    assert corral_home.status() == []
    assert corral_home.db_rows("SELECT name FROM services") == []
    assert corral_home.marked_processes() == []


# -- 5. spec errors -----------------------------------------------------------------------------


def test_spec_errors(corral_home: CorralHome, tmp_path: Path) -> None:
    typo = write_spec(
        tmp_path / "typo.yaml",
        textwrap.dedent(
            """\
            name: typo
            run: exec python3 app.py
            service:
              readiness_probe: /health
              replcas: 2
            """
        ),
    )
    result = corral_home.run("up", str(typo), check=False)
    assert result.returncode != 0
    message = result.stderr
    assert "replcas" in message, message
    assert f"{typo}:5:" in message, message
    assert "did you mean 'replicas'" in message, message

    demo = str(EXAMPLES / "demo.yaml")
    assert corral_home.run("validate", demo, cwd=EXAMPLES.parent).returncode == 0

    fixed = write_spec(
        tmp_path / "fixed.yaml",
        textwrap.dedent(
            """\
            name: fixed
            run: python3 -m http.server 8080 --bind 127.0.0.1
            resources:
              ports: 8080
            service:
              readiness_probe: /
              replicas: 2
            """
        ),
    )
    result = corral_home.run("up", str(fixed), check=False)
    assert result.returncode != 0
    assert "8080" in result.stderr and "$PORT" in result.stderr, result.stderr
    assert corral_home.run("validate", str(fixed), check=False).returncode != 0

    # The daemon refuses it too (a client that skips the CLI's check), and creates nothing.
    corral_home.start_daemon()
    answer = corral_home.api("POST", "/v1/services", body={"spec": fixed.read_text()})
    assert answer.status == 400, answer
    assert "$PORT" in answer.json()["error"]
    answer = corral_home.api("POST", "/v1/services", body={"spec": typo.read_text()})
    assert answer.status == 400, answer
    assert any(i["loc"] == "service.replcas" and i["line"] == 5 for i in answer.json()["issues"])
    assert corral_home.status() == []
    assert corral_home.db_rows("SELECT name FROM services") == []


# -- 6. crash loop ------------------------------------------------------------------------------


def test_crash_loop_gives_up(corral_home: CorralHome, tmp_path: Path) -> None:
    # One app that exits at once (FAILED), one whose setup fails (FAILED_PROVISION); each
    # prints its reason (not part of its command line, so only the right log has it).
    crashy = app_spec(tmp_path, "crashy", 2, run=f"exec {sys.executable} crash.py", workdir=APPS)
    broken = app_spec(tmp_path, "broken", 2, setup="echo setup broke-$((6 * 7)); exit 7")
    corral_home.start_daemon()
    ups = {
        name: corral_home.popen("up", str(spec))
        for name, spec in [("crashy", crashy), ("broken", broken)]
    }
    reasons = {"crashy": "simulated config error", "broken": "setup broke-42"}
    final = {"crashy": "FAILED", "broken": "FAILED_PROVISION"}
    for name, proc in ups.items():
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode != 0, out
        assert f"service {name} is FAILED" in out, out
        hint = re.search(rf"`corral logs {name} (\d+)( --launch)?`", out.replace("\n", " "))
        assert hint, f"the error does not point to the logs: {out}"

        # Given up promptly (measured by the daemon's clock: the CLI's own start-up is slow on
        # a loaded machine), after a backoff, not at the first failure.
        events = corral_home.api("GET", f"/v1/services/{name}/events").json()["events"]
        created = next(e["ts"] for e in events if e["action"] == "service.create")
        gave_up = next(e["ts"] for e in events if e["action"] == "service.failed")
        assert 1 < gave_up - created < 15, events

        service = corral_home.service(name)
        assert service is not None and service["status"] == "FAILED"
        assert service["failure"], service
        launched = service["replicas"]
        assert 3 <= len(launched) <= 4, launched
        assert all(r["status"] == final[name] for r in launched), launched
        if name == "crashy":
            assert all(r["exit_code"] == 3 for r in launched), launched

        # The command the hint gives, run as is (following: it must end, the replica is gone),
        # shows why it failed.
        hinted = corral_home.run(*hint.group(0).strip("`").split()[1:], timeout=30)
        assert reasons[name] in hinted.stdout, (hint.group(0), hinted.stdout)

    # No relaunch afterwards: the controller says so, and over a few reconcile rounds (2 s
    # each) the replica sets stay as they were.
    ids = {s["name"]: [r["id"] for r in s["replicas"]] for s in corral_home.status()}
    time.sleep(3)  # an observation window, not a wait for something to happen
    for name in ups:
        again = corral_home.service(name)
        assert again is not None and again["status"] == "FAILED"
        assert again["last_decision"].startswith("not relaunching"), again["last_decision"]
        assert [r["id"] for r in again["replicas"]] == ids[name]


# -- 7. daemon SIGKILL during launches ------------------------------------------------------------


def test_daemon_sigkill_during_launch(corral_home: CorralHome, tmp_path: Path) -> None:
    # The first setup of each replica hangs for 60 s (long after the test: only the restarted
    # daemon's leak sweep can stop it in time); the relaunch after the restart skips it.
    flags = tmp_path / "setup-flags"
    flags.mkdir()
    setup = (
        f"f={flags}/$CORRAL_REPLICA_ID; if [ -e $f ]; then echo again; else touch $f; sleep 60; fi"
    )
    spec = app_spec(tmp_path, "slow", 3, setup=setup)
    corral_home.run("up", "--detach", str(spec))

    def provisioning() -> bool:
        svc = corral_home.service("slow")
        if svc is None or [r["status"] for r in svc["replicas"]] != ["PROVISIONING"] * 3:
            return False
        return len(list(flags.iterdir())) == 3  # every setup is running

    wait_for(provisioning, 20, "3 replicas PROVISIONING", interval=0.05)
    in_setup = {p.pid for p in corral_home.marked_processes()}
    assert in_setup, "no setup process carries the home marker"
    daemon = corral_home.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    wait_for(lambda: not pid_alive(daemon), 10, "the daemon to die")
    assert all(pid_alive(p) for p in in_setup), "setups died with the daemon: nothing to test"

    corral_home.start_daemon()
    service = corral_home.wait_replicas("slow", 3, timeout=40)
    ids = [r["id"] for r in service["replicas"]]
    assert len(ids) == len(set(ids)) == 3, service["replicas"]  # interrupted is not failed
    pids = {r["pid"] for r in service["replicas"]}
    assert not [p for p in in_setup if pid_alive(p)], "setups of the killed daemon still run"
    assert "leak sweep: killed" in corral_home.tail("daemon.log", 100)

    # Exactly the 3 replicas run: no orphan from the killed launches, no duplicate.
    assert {p.pid for p in corral_home.marked_processes()} == pids
    endpoint = service["endpoint"]
    seen = {get_json(f"{endpoint}/x")["replica"] for _ in range(9)}
    assert seen == {str(i) for i in ids}


# -- 8. daemon restart --------------------------------------------------------------------------


def test_daemon_restart_readopts(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = app_spec(tmp_path, "sticky", 2)
    endpoint = endpoint_of(corral_home.run("up", str(spec)).stdout)
    before = corral_home.wait_replicas("sticky", 2)
    pids = {r["id"]: r["pid"] for r in before["replicas"]}
    daemon = corral_home.daemon_pid()

    result = corral_home.run("daemon", "stop")
    assert "daemon stopped" in result.stdout
    wait_for(lambda: not pid_alive(daemon), 20, "the daemon to exit")
    assert all(pid_alive(p) for p in pids.values()), "replicas died with the daemon"
    assert corral_home.run("daemon", "status", check=False).returncode != 0

    corral_home.start_daemon()
    after = corral_home.wait_replicas("sticky", 2)
    assert {r["id"]: r["pid"] for r in after["replicas"]} == pids
    if after["endpoint"] != endpoint:  # fine only if another process took the port meanwhile
        assert not port_free(int(endpoint.rsplit(":", 1)[1])), "the balancer port changed"
        endpoint = after["endpoint"]
    seen = Counter(get_json(f"{endpoint}/again")["replica"] for _ in range(10))
    assert set(seen) == {str(i) for i in pids}, seen
    events = corral_home.api("GET", "/v1/services/sticky/events").json()["events"]
    assert sum(1 for e in events if e["action"] == "replica.adopt") == 2, events

    # An adopted replica is not the new daemon's child: its death is still seen and it is
    # replaced, and `down` (without --purge) stops the adopted one cleanly.
    victim, survivor = sorted(pids)
    os.kill(pids[victim], signal.SIGKILL)

    def replaced() -> bool:
        svc = corral_home.service("sticky")
        assert svc is not None
        states = {r["id"]: r["status"] for r in svc["replicas"]}
        return states.get(victim) == "FAILED" and len(ready(svc)) == 2

    wait_for(replaced, 30, "the killed adopted replica to be FAILED and replaced")

    # Restarted, balancer workers too, while something else took the balancer's port: the
    # endpoint does not move silently. It stays, the failure is loud (event + status), and the
    # workers take the port as soon as it is free again.
    corral_home.run("daemon", "stop", "--all")
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not use

        def squat() -> bool:
            # The workers are gone when `stop --all` returns, but a closing connection of
            # theirs (or another test's ephemeral port) may hold the port a moment longer.
            try:
                squatter.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

        wait_for(squat, 10, f"port {port} to be free after `daemon stop --all`")
        squatter.listen()
        corral_home.start_daemon()
        stuck = wait_for(
            lambda: (s := corral_home.service("sticky")) and s["balancer_errors"] and s,
            20,
            "the port conflict to show in the service's status",
        )
        assert stuck["endpoint"] == endpoint, stuck
        assert "address already in use" in stuck["balancer_errors"][0].lower(), stuck
        events = corral_home.api("GET", "/v1/services/sticky/events").json()["events"]
        assert any(e["action"] == "balancer.bind_failed" for e in events), events
    wait_for(lambda: not corral_home.service("sticky")["balancer_errors"], 20, "the port back")
    back = corral_home.wait_replicas("sticky", 2)
    assert get_json(endpoint + "/back")["replica"] in {str(r["id"]) for r in ready(back)}

    down = corral_home.run("down", "sticky", "--timeout", "30")
    assert "service sticky: down" in down.stdout, down.stdout
    assert not pid_alive(pids[survivor])
    assert corral_home.marked_processes() == []


# -- 9. many services ---------------------------------------------------------------------------


def test_twenty_services(corral_home: CorralHome, tmp_path: Path) -> None:
    names = [f"svc-{i:02d}" for i in range(20)]
    # A long initial delay: 20 CLIs starting at once keep a 2-core machine busy for a while.
    specs = [app_spec(tmp_path, n, 2, period=0.5, initial_delay=60) for n in names]
    # Five at a time (the first five race to start the daemon on the fresh home): 20 CLIs at
    # once would starve the tests running in parallel on a 2-core machine for many seconds.
    for first in range(0, 20, 5):
        batch = [
            (n, corral_home.popen("up", "--detach", str(s)))
            for n, s in zip(names[first : first + 5], specs[first : first + 5], strict=True)
        ]
        for name, proc in batch:
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"`corral up --detach` of {name}: {out.decode()}"

    def all_ready() -> list[dict[str, Any]] | None:
        services = corral_home.api("GET", "/v1/services").json()["services"]
        counts = [len(ready(s)) for s in services]
        if len(services) == 20 and counts == [2] * 20:
            return list(services)
        return None

    services = wait_for(all_ready, 60, "20 services with 2 READY replicas each", interval=0.5)
    corral_home.status()  # remember every replica pid
    failed = [(s["name"], r) for s in services for r in s["replicas"] if r["status"] != "READY"]
    assert not failed, f"replicas failed: {failed}\n" + "\n".join(
        corral_home.tail(f"services/{name}/logs/replica_{r['id']}.log", 10) for name, r in failed
    )
    pids = {r["pid"] for s in services for r in s["replicas"]}
    assert len(pids) == 40
    # Each balancer worker rotates over the replicas on its own; with 2 workers, 5 requests
    # give one of them at least 3, so every replica answers.
    for s in services:
        answers = {get_json(s["endpoint"] + "/")["replica"] for _ in range(5)}
        assert answers == {str(r["id"]) for r in s["replicas"]}, (s["name"], answers)
    assert len({s["endpoint"] for s in services}) == 20

    corral_home.run("down", "--all", timeout=90)
    assert not [p for p in pids if pid_alive(p)]
    assert corral_home.marked_processes() == []
    assert corral_home.status() == []


def test_up_waits_for_a_daemon_that_is_still_starting(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Two `corral up` on a fresh home both start a daemon; the loser's daemon exits at once
    (the home's lock is taken) while the winner may not answer yet. The loser must wait for the
    winner, not fail. Made deterministic by holding the lock while the `up` starts its daemon."""
    spec = app_spec(tmp_path, "late", 1)
    corral_home.path.mkdir(parents=True)
    with open(corral_home.path / "daemon.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        up = corral_home.popen("up", "--detach", str(spec))

        def lost_the_race() -> bool:
            # Its daemon said so and exited, and the CLI has reaped it (seen its exit code).
            if "another corral daemon" not in corral_home.tail("daemon.log"):
                return False
            if up.poll() is not None:
                return True
            return not psutil.Process(up.pid).children()

        wait_for(lost_the_race, 30, "the daemon started by `corral up` to give up the lock")
        assert up.poll() is None, f"`corral up` failed instead of waiting: {up.stdout.read()!r}"
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    corral_home.start_daemon()
    out = up.communicate(timeout=30)[0].decode()
    assert up.returncode == 0, out
    assert "service late accepted" in out
    corral_home.wait_replicas("late", 1)


# -- 10. API ------------------------------------------------------------------------------------


def test_api_errors_are_json(corral_home: CorralHome) -> None:
    corral_home.start_daemon()

    assert corral_home.api("GET", "/v1/health", token=None).status == 200
    for token in (None, "wrong", corral_home.token + "x", ""):
        answer = corral_home.api("GET", "/v1/services", token=token)
        assert answer.status == 401, (token, answer)
        assert "error" in answer.json()
    answer = corral_home.api("POST", "/v1/daemon/stop", token=None)
    assert answer.status == 401 and corral_home.healthy()

    bodies = [
        b"{not json",
        b"[1, 2]",
        b"",
        b"\xff\xfe{}",
        b'{"spec": 5}',
        b'{"spec": "name: x", "name": 3}',
        json.dumps({"spec": "name: ../../etc\nrun: sleep 1\n"}).encode(),
        json.dumps({"spec": "run: sleep 1\n", "name": "../../etc"}).encode(),
    ]
    for raw in bodies:
        answer = corral_home.api("POST", "/v1/services", raw=raw)
        assert answer.status == 400, (raw, answer)
        assert isinstance(answer.json()["error"], str)
    huge = json.dumps({"spec": "#" * (2 << 20)}).encode()
    answer = corral_home.api("POST", "/v1/services", raw=huge)
    assert answer.status == 413 and "error" in answer.json(), answer
    assert corral_home.api("GET", "/v1/services").json() == {"services": []}

    for method, path in [
        ("GET", "/v1/services/..%2F..%2Fetc"),
        ("GET", "/v1/services/..%2F..%2Fetc%2Fpasswd"),
        ("DELETE", "/v1/services/..%2F..%2Fetc"),
        ("GET", "/v1/services/..%2F..%2Fetc/logs?kind=controller"),
        ("GET", "/v1/services/..%2F..%2Fetc/events"),
        ("GET", "/v1/services/%2e%2e"),
        ("GET", "/v1/services/NOPE"),
        ("GET", "/v1/services/nope/logs?kind=weird&replica=1"),
        ("GET", "/v1/services/nope/logs?replica=abc"),
        ("GET", "/v1/nothing/here"),
        ("PUT", "/v1/services"),
    ]:
        answer = corral_home.api(method, path)
        assert 400 <= answer.status < 500, (method, path, answer)
        assert "error" in answer.json(), (method, path, answer)

    spec = corral_home.api("GET", "/v1/openapi.json")
    assert spec.status == 200
    document = spec.json()
    assert document["openapi"].startswith("3.")
    assert "/v1/services" in document["paths"] and "/v1/services/{name}" in document["paths"]
    assert corral_home.healthy()
