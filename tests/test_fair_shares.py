"""No service can starve the others, nor the daemon, through its probes or its traffic.

Real daemon, real replicas (tests/apps/faulty.py), traffic on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import resource
import socket
import sys
from pathlib import Path

import pytest
from conftest import APPS, CorralHome, http, spec_text, wait_for

pytestmark = pytest.mark.timeout(120)


def faulty_spec(name: str, mode: str, replicas: int = 1) -> str:
    return (
        f"name: {name}\nworkdir: {APPS}\n"
        f"run: {json.dumps(f'exec {sys.executable} faulty.py --mode {mode}')}\n"
        "service:\n  readiness_probe:\n    path: /health\n    initial_delay_seconds: 60\n"
        "    period_seconds: 0.5\n    timeout_seconds: 2\n"
        f"  replicas: {replicas}\n"
    )


def test_a_huge_health_answer_is_not_read(corral_home: CorralHome) -> None:
    """/health answers 200 announcing 1 GiB and never sends most of it: the status decides,
    the body is not read (reading it whole cost the daemon its size in memory, and a body
    that never ends kept the replica from ever being READY)."""
    corral_home.start_daemon()
    answer = corral_home.api(
        "POST", "/v1/services", body={"spec": faulty_spec("huge", "huge-health")}, timeout=30
    )
    assert answer.status == 201, answer.body
    svc = corral_home.wait_replicas("huge", 1, timeout=30)
    assert http(svc["endpoint"] + "/").status == 200
    pid = corral_home.daemon_pid()
    rss_kib = _rss_kib(pid)
    assert rss_kib < 400 * 1024, f"daemon RSS {rss_kib} KiB after probing a 1 GiB /health"


def test_open_file_limit_is_raised_to_the_hard_limit(corral_home: CorralHome) -> None:
    """A daemon started under a low soft limit of open files (1,024 is common) raises it to
    the hard limit, and so do its balancer workers: client connections are what fills it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 512:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    env = dict(corral_home.env)
    argv = [
        sys.executable,
        "-c",
        "import resource, sys; from corral.cli import main; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
        "resource.RLIMIT_NOFILE)[1])); sys.argv = ['corral', 'daemon', 'run']; main()",
    ]
    pid = corral_home.start_daemon(argv=argv, env=env)
    assert _soft_nofile(pid) == hard
    workers = wait_for(corral_home.worker_pids, 20, "the balancer workers")
    for worker in workers:
        wait_for(lambda w=worker: _soft_nofile(w) == hard, 20, f"worker {worker}'s limit")
    info = corral_home.api("GET", "/v1/daemon").json()
    assert info["open_files"]["limit"] == hard, info


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            return resource.RLIM_INFINITY if value == "unlimited" else int(value)
    raise AssertionError(f"no open-file limit for pid {pid}")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no RSS for pid {pid}")


# Starts the real daemon with corral.spec.parse_spec wrapped: a call made on a thread that runs
# an event loop is written to the file named in $PARSE_LOG (one line each).
_WATCHED_DAEMON = """
import asyncio, os, sys, traceback
import corral.spec
real = corral.spec.parse_spec
def watched(*args, **kwargs):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return real(*args, **kwargs)
    with open(os.environ["PARSE_LOG"], "a") as log:
        log.write(traceback.format_stack(limit=4)[0].strip().replace("\\n", " ") + "\\n")
    return real(*args, **kwargs)
corral.spec.parse_spec = watched
import corral.controller, corral.daemon
corral.controller.parse_spec = watched
corral.daemon.parse_spec = watched
import corral.admission
corral.admission.parse_spec = watched
# An update's file pruning (on a thread) made longer than a reconcile step's interval: a step
# runs while the new version is current, so a spec not yet remembered would be parsed on the loop.
import time
import corral.deploy_files
prune = corral.deploy_files.prune
def slow_prune(home, store, name):
    time.sleep(2.5)
    prune(home, store, name)
corral.deploy_files.prune = slow_prune
from corral.cli import main
sys.argv = ["corral", "daemon", "run"]
main()
"""


def test_no_spec_is_parsed_on_the_event_loop(corral_home: CorralHome, tmp_path: Path) -> None:
    """Create, update, rollback and a daemon restart: every spec is parsed off the loop (the
    largest accepted spec takes up to a second to parse, and the loop carries the API, every
    controller and prober)."""
    parse_log = tmp_path / "parsed-on-loop.txt"
    env = {**corral_home.env, "PARSE_LOG": str(parse_log)}
    argv = [sys.executable, "-c", _WATCHED_DAEMON]
    corral_home.start_daemon(argv=argv, env=env)
    spec = spec_text("parsed", 1)
    answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
    assert answer.status == 201, answer.body
    corral_home.wait_replicas("parsed", 1)
    for body in ({"spec": spec_text("parsed", 2)}, {"from_version": 1}):
        answer = corral_home.api("POST", "/v1/services/parsed/versions", body=body, timeout=30)
        assert answer.status == 201, answer.body
    corral_home.wait_replicas("parsed", 1, timeout=60)
    corral_home.stop_daemon()
    corral_home.start_daemon(argv=argv, env=env)
    corral_home.wait_replicas("parsed", 1)
    assert corral_home.service("parsed") is not None
    on_loop = parse_log.read_text() if parse_log.exists() else ""
    assert on_loop == "", f"specs parsed on the event loop:\n{on_loop}"


def _setup_spec(name: str, replicas: int, setup: str, timeout: float | None = None) -> str:
    text = spec_text(name, replicas, setup=setup)
    if timeout is not None:
        text += f"  setup_timeout_seconds: {timeout}\n"
    return text


def test_a_hung_setup_fails_after_its_time_limit(corral_home: CorralHome) -> None:
    corral_home.start_daemon()
    spec = _setup_spec("stuck", 1, "exec sleep 3600", timeout=2)
    answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
    assert answer.status == 201, answer.body

    def failed() -> dict[str, object] | None:
        svc = corral_home.service("stuck")
        rows = [r for r in (svc or {}).get("replicas", []) if r["status"] == "FAILED_PROVISION"]
        return rows[0] if rows else None

    row = wait_for(failed, 30, "the launch to fail on its setup time limit")
    assert str(row["failure"]).startswith("setup did not finish within 2s"), row  # no repr
    corral_home.api("DELETE", "/v1/services/stuck?purge=1")
    wait_for(lambda: corral_home.service("stuck") is None, 60, "the service to go")


def test_hung_setups_of_one_service_leave_launch_slots_to_the_others(
    corral_home: CorralHome,
) -> None:
    """16 replicas whose setup hangs (the daemon's whole launch lane) must not keep another
    service from launching: a service holds at most half the lane."""
    corral_home.start_daemon()
    hung = _setup_spec("hung", 16, "exec sleep 3600")
    answer = corral_home.api("POST", "/v1/services", body={"spec": hung}, timeout=30)
    assert answer.status == 201, answer.body
    wait_for(
        lambda: (
            sum(r["status"] == "PROVISIONING" for r in corral_home.service("hung")["replicas"]) >= 8
        ),
        30,
        "the hung setups to hold their slots",
    )
    _another_service_comes_up(corral_home)
    svc = corral_home.service("hung")
    assert svc is not None
    assert sum(r["status"] == "PROVISIONING" for r in svc["replicas"]) <= 8, svc["replicas"]


def _another_service_comes_up(home: CorralHome) -> None:
    answer = home.api("POST", "/v1/services", body={"spec": spec_text("other", 1)}, timeout=30)
    assert answer.status == 201, answer.body
    home.wait_replicas("other", 1, timeout=60)


def test_hung_setups_of_two_services_leave_a_launch_to_a_third(
    corral_home: CorralHome,
) -> None:
    """Two services whose setups hang hold the whole launch lane (8 slots each, until their
    setup time limit: 30 minutes by default); a third service must still launch."""
    corral_home.start_daemon()
    for name in ("hung1", "hung2"):
        spec = _setup_spec(name, 8, "exec sleep 3600")
        answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
        assert answer.status == 201, answer.body

    def provisioning(name: str) -> int:
        svc = corral_home.service(name) or {"replicas": []}
        return sum(r["status"] == "PROVISIONING" for r in svc["replicas"])

    wait_for(
        lambda: provisioning("hung1") + provisioning("hung2") == 16,
        30,
        "the hung setups to hold every launch slot",
    )
    _another_service_comes_up(corral_home)
    assert provisioning("hung1") + provisioning("hung2") == 16


def test_idle_connections_to_one_service_cannot_starve_the_others(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Each service may hold at most `load_balancer.max_connections` client connections per
    balancer worker (default: a quarter of the worker's open-file limit); one more is answered
    503 at once. Idle connections piled on one service leave the others and the API alone."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # so the cap below is exact
    corral_home.start_daemon()
    capped = spec_text("capped", 1) + "  load_balancer:\n    max_connections: 5\n"
    for text in (capped, spec_text("calm", 1)):
        answer = corral_home.api("POST", "/v1/services", body={"spec": text}, timeout=30)
        assert answer.status == 201, answer.body
    capped_url = corral_home.wait_replicas("capped", 1)["endpoint"]
    calm_url = corral_home.wait_replicas("calm", 1)["endpoint"]
    port = int(capped_url.rsplit(":", 1)[1])
    idle: list[socket.socket] = []
    try:
        refused = 0
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.settimeout(0.5)
            try:
                head = sock.recv(200)
            except TimeoutError:
                idle.append(sock)  # accepted and waiting for a request
                continue
            assert head.startswith(b"HTTP/1.1 503"), head
            refused += 1
            sock.close()
        assert len(idle) == 5 and refused == 15, (len(idle), refused)
        assert http(calm_url + "/").status == 200
        assert corral_home.api("GET", "/v1/services").status == 200
        over = http(capped_url + "/")
        assert over.status == 503 and b"too many connections" in over.body, over
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: http(capped_url + "/").status == 200, 10, "the capped service to serve")


def test_a_replica_waiting_for_a_launch_slot_says_so(corral_home: CorralHome) -> None:
    """PENDING for as long as a setup may hang (30 minutes by default) must say why: the
    daemon's launch slots (16) all held, or the service's own share of them."""
    corral_home.start_daemon(env={**corral_home.env, "CORRAL_LAUNCHES_PER_SERVICE": "17"})
    spec = _setup_spec("wide", 18, "exec sleep 3600")
    answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
    assert answer.status == 201, answer.body

    def waits() -> list[str] | None:
        svc = corral_home.service("wide") or {"replicas": []}
        rows = svc["replicas"]
        if sum(r["status"] == "PROVISIONING" for r in rows) < 16:
            return None
        reasons = [r.get("waiting") or "" for r in rows if r["status"] == "PENDING"]
        return reasons if len(reasons) == 2 and all(reasons) else None

    reasons = sorted(wait_for(waits, 30, "16 launches to run and 2 to wait, saying why"))
    assert reasons == [
        "launch slots busy: all 16 of the daemon's are held (wide 16)",
        "launch slots busy: this service launches 17 replicas at a time "
        "(CORRAL_LAUNCHES_PER_SERVICE)",
    ], reasons
    assert "replica 17 waits: launch slots busy" in corral_home.run("status", "wide").stdout


def test_a_launch_waiting_behind_its_own_past_the_limit_says_so(
    corral_home: CorralHome,
) -> None:
    """Two services' hung setups hold all 16 slots; a third service's first launch runs past
    them (JobPool._serve_starved) and its second waits. The reason said "all 16 of the daemon's
    are held (hung1 8, hung2 8, other 1)": 17 holders of 16 slots, with no word of why."""
    corral_home.start_daemon()
    for name, replicas in (("hung1", 8), ("hung2", 8), ("other", 2)):
        spec = _setup_spec(name, replicas, "exec sleep 3600")
        answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
        assert answer.status == 201, answer.body

    def waits() -> list[str] | None:
        svc = corral_home.service("other") or {"replicas": []}
        reasons = [r.get("waiting") or "" for r in svc["replicas"] if r["status"] == "PENDING"]
        held = "(hung1 8, hung2 8, other 1)"
        return reasons if len(reasons) == 1 and reasons[0].endswith(held) else None

    (reason,) = wait_for(waits, 30, "other's second launch to wait behind its first")
    assert reason == (
        "launch slots busy: all 16 of the daemon's are held, and 1 launch(es) past them, "
        "one per service that had none (hung1 8, hung2 8, other 1)"
    ), reason
