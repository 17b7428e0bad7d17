"""The data plane outlives the control plane: balancer workers on real processes.

Each test brings a service up through the CLI (real daemon, real balancer workers, real
examples/app.py replicas, traffic on 127.0.0.1 only), then does to the daemon what a crash, an
operator or an upgrade does: SIGKILL, `corral daemon stop`, a restart. What must hold: traffic
never notices; a restarted daemon adopts the running workers (same pids, same port) instead of
starting a second set; a dead worker is replaced while the others keep the port; with no daemon
a dead replica is passed over; `corral daemon stop --all` stops traffic for real.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CorralHome,
    finished,
    get_json,
    http,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)
from load import PacedLoad

from corral.dataplane.worker import RESPAWN_AFTER, RESPAWN_STAGGER

pytestmark = pytest.mark.timeout(180)


def up(home: CorralHome, tmp_path: Path, name: str, replicas: int) -> str:
    spec = write_spec(tmp_path / f"{name}.yaml", spec_text(name, replicas))
    home.run("up", str(spec), timeout=90)
    svc = home.wait_replicas(name, replicas, timeout=60)
    assert svc["endpoint"], svc
    return str(svc["endpoint"])


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def answers(url: str) -> bool:
    return why_not(url) is None


def why_not(url: str) -> str | None:
    """None when ``url`` answers 200; else what went wrong, for the assertion's message."""
    try:
        answer = http(url + "/x", timeout=10.0)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if answer.status == 200 else f"{answer.status}: {answer.body[:200]!r}"


def refuses(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def replica_pids(svc: dict[str, Any]) -> list[int]:
    return [int(r["pid"]) for r in svc["replicas"] if r["status"] == "READY" and r["pid"]]


def new_daemon(home: CorralHome, old: int) -> int | None:
    """The pid of a daemon other than ``old`` that answers, or None yet."""
    info = home.daemon_info()
    pid = int(info["pid"]) if info else None
    return pid if pid and pid != old and home.healthy() else None


def kill_group(pid: int) -> None:
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, f"replica pid {pid} to die")


def test_traffic_never_notices_daemon_kills_and_stops(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    url = up(corral_home, tmp_path, "steady", 2)
    workers = corral_home.worker_pids()
    assert len(workers) >= 1
    load = PacedLoad(url, rate=100.0, duration=14.0, post_every=3)
    load.start()
    try:
        for _ in range(2):
            wait_for(lambda: load.result.sent > 150, 10, "load to flow")
            corral_home.stop_daemon(signal.SIGKILL)
            assert answers(url), "the endpoint went dark with the daemon"
            corral_home.start_daemon()
        stopped = corral_home.run("daemon", "stop")
        assert "keep serving" in stopped.stdout
        assert answers(url)
        corral_home.run("daemon", "start")
    finally:
        result = load.join()
    assert result.failed == 0, (result.summary(), result.errors, result.examples)
    assert result.sent >= 1000
    # Adopted, never doubled: the same worker processes, on the same port.
    assert corral_home.worker_pids() == workers
    svc = corral_home.status("steady")
    assert port_of(svc["endpoint"]) == port_of(url)
    info = corral_home.api("GET", "/v1/daemon").json()
    assert [w["pid"] for w in info["balancer_workers"]] == workers
    assert all(w["connected"] for w in info["balancer_workers"])


def test_stop_all_stops_traffic_and_start_brings_the_same_port_back(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    url = up(corral_home, tmp_path, "whole", 1)
    workers = corral_home.worker_pids()
    result = corral_home.run("daemon", "stop", "--all")
    assert "no longer answer" in result.stdout
    assert refuses(port_of(url))
    assert not any(pid_alive(pid) for pid in workers)
    corral_home.run("daemon", "start")
    wait_for(lambda: answers(url), 30, "the service to answer on its old port")
    assert set(corral_home.worker_pids()).isdisjoint(workers)


def test_dead_worker_is_replaced_while_the_others_keep_the_port(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    url = up(corral_home, tmp_path, "pair", 1)
    first, second = corral_home.worker_pids()
    os.kill(first, signal.SIGKILL)
    # Connections queued on the dead worker's socket die with it (a limit of SO_REUSEPORT);
    # once it is gone, the other worker holds the port alone: every new connection is served.
    # Finished, not merely a zombie: see conftest.finished.
    wait_for(lambda: finished(first), 10, "the worker to finish")
    for _ in range(20):
        assert (error := why_not(url)) is None, error
    replaced = wait_for(
        lambda: (pids := corral_home.worker_pids()) and len(pids) == 2 and first not in pids,
        30,
        "the dead worker to be replaced",
    )
    assert replaced
    assert second in corral_home.worker_pids()
    wait_for(
        lambda: all(
            w["connected"] for w in corral_home.api("GET", "/v1/daemon").json()["balancer_workers"]
        ),
        30,
        "the new worker to connect",
    )


def test_without_a_daemon_a_dead_replica_is_passed_over(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    url = up(corral_home, tmp_path, "alone", 2)
    svc = corral_home.status("alone")
    victim, survivor = replica_pids(svc)
    corral_home.run("daemon", "stop")
    kill_group(victim)
    # A POST written on a pooled connection to the victim in the instant before its worker
    # reads the close is a 502 by design (it may have reached the replica; nginx does the
    # same): GETs first, retried on another replica, let every worker see the close (CI met
    # that instant once on a loaded machine). Then the POSTs.
    for _ in range(10):
        assert (error := why_not(url)) is None, error
    load = PacedLoad(url, rate=50.0, duration=3.0, post_every=2)
    load.start()
    result = load.join()
    assert result.failed == 0, (result.summary(), result.examples)
    assert set(result.pids) == {survivor}
    # The next daemon finds the replica gone and replaces it.
    corral_home.run("daemon", "start")
    svc = corral_home.wait_replicas("alone", 2, timeout=60)
    assert victim not in replica_pids(svc)


def test_a_crashed_daemon_is_brought_back_and_replaces_a_dead_replica(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    url = up(corral_home, tmp_path, "phoenix", 2)
    old = corral_home.daemon_pid()
    victim = replica_pids(corral_home.status("phoenix"))[0]
    os.kill(old, signal.SIGKILL)
    kill_group(victim)

    new = wait_for(lambda: new_daemon(corral_home, old), 30, "a worker to start a new daemon")
    corral_home.daemon_pids.add(new)
    svc = corral_home.wait_replicas("phoenix", 2, timeout=60)
    assert victim not in replica_pids(svc)
    assert answers(url)
    # A daemon stopped on purpose stays stopped: watched for twice the time a worker waits
    # before it starts one.
    corral_home.run("daemon", "stop")
    assert (corral_home.path / "daemon.stopped").exists()
    deadline = time.monotonic() + 2 * (RESPAWN_AFTER + RESPAWN_STAGGER * 4)
    while time.monotonic() < deadline:
        assert corral_home.daemon_info() is None, "a daemon stopped on purpose came back"
        time.sleep(0.1)
    assert answers(url)


def requests_total(home: CorralHome, service: str) -> float:
    """corral_lb_requests_total of ``service`` in the daemon's /metrics, summed over codes."""
    text = http(
        home.api_url + "/metrics", headers={"Authorization": f"Bearer {home.token}"}
    ).body.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("corral_lb_requests_total{") and f'service="{service}"' in line
    )


def test_metrics_come_from_the_workers(corral_home: CorralHome, tmp_path: Path) -> None:
    url = up(corral_home, tmp_path, "counted", 1)
    for _ in range(7):
        assert answers(url)
    wait_for(lambda: requests_total(corral_home, "counted") >= 7, 10, "the requests in /metrics")
    svc = get_json(corral_home.api_url + "/v1/health")
    assert svc["ok"]


def test_service_counters_do_not_go_down_when_workers_are_replaced(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A counter that goes down part of the way reads to Prometheus as a reset (and rate()
    as a spike): what the replaced workers counted stays in the service's totals."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    url = up(corral_home, tmp_path, "kept", 1)
    for _ in range(20):
        assert answers(url)
    wait_for(lambda: requests_total(corral_home, "kept") >= 20, 10, "the requests in /metrics")
    old = corral_home.worker_pids()
    corral_home.run("daemon", "restart-workers")
    wait_for(lambda: not any(pid_alive(pid) for pid in old), 15, "the old workers to exit")
    assert requests_total(corral_home, "kept") >= 20
    first = corral_home.worker_pids()[0]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: finished(first), 10, "the worker to finish")
    for _ in range(3):
        assert answers(url)
    wait_for(lambda: requests_total(corral_home, "kept") >= 23, 10, "the new requests counted")
    # A balancer setting changed: each worker starts a new balancer and retires the old one.
    changed = spec_text("kept", 1).replace(
        "service:\n", "service:\n  load_balancing_policy: round_robin\n"
    )
    corral_home.run("update", "kept", str(write_spec(tmp_path / "kept2.yaml", changed)), "-y")
    wait_for(lambda: corral_home.service("kept")["version"] == 2, 30, "the update to land")
    for _ in range(2):
        assert answers(url)
    # Without the retired balancers' counts the total would stay near the new ones' (2).
    wait_for(lambda: requests_total(corral_home, "kept") >= 25, 10, "the update's requests")


def test_service_counters_do_not_go_down_when_the_daemon_restarts(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A restarted daemon (stop and start, a SIGKILL) sums its live workers' reports with what
    gone workers counted before it: those reports alone took corral_lb_requests_total down to
    what the live workers counted, which Prometheus reads as counted since 0 (a spike)."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    url = up(corral_home, tmp_path, "kept", 1)
    for _ in range(20):
        assert answers(url)
    wait_for(lambda: requests_total(corral_home, "kept") == 20, 10, "the requests in /metrics")
    old = corral_home.worker_pids()
    corral_home.run("daemon", "restart-workers")  # what they counted is carried by the daemon
    wait_for(lambda: not any(pid_alive(pid) for pid in old), 15, "the old workers to exit")
    for _ in range(3):
        assert answers(url)
    wait_for(lambda: requests_total(corral_home, "kept") == 23, 10, "the new requests counted")
    corral_home.run("daemon", "stop")
    corral_home.run("daemon", "start")
    corral_home.note_daemon()
    wait_for(lambda: requests_total(corral_home, "kept") == 23, 20, "23 after a stop and start")
    pid = corral_home.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    new = wait_for(lambda: new_daemon(corral_home, pid), 30, "a worker to start a new daemon")
    corral_home.daemon_pids.add(new)
    wait_for(lambda: requests_total(corral_home, "kept") == 23, 20, "23 after a SIGKILL")
    assert answers(url)
    wait_for(lambda: requests_total(corral_home, "kept") == 24, 10, "counting on from there")


def test_restart_workers_replaces_every_worker_under_load(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The upgrade path: each worker replaced by a new process, the new one first. Every
    request is counted: an old worker reports what it counted last, its drain included."""
    url = up(corral_home, tmp_path, "upgrade", 2)
    old = corral_home.worker_pids()
    load = PacedLoad(url, rate=100.0, duration=6.0, post_every=3)
    load.start()
    try:
        wait_for(lambda: load.result.sent > 100, 10, "load to flow")
        result = corral_home.run("daemon", "restart-workers")
    finally:
        outcome = load.join()
    new = corral_home.worker_pids()
    assert len(new) == len(old) and set(new).isdisjoint(old), (old, new, result.stdout)
    wait_for(lambda: not any(pid_alive(pid) for pid in old), 15, "the old workers to exit")
    assert outcome.failed == 0, (outcome.summary(), outcome.errors, outcome.examples)
    counted = lambda: requests_total(corral_home, "upgrade")  # noqa: E731
    wait_for(lambda: counted() >= outcome.sent, 10, f"{outcome.sent} requests counted")
    assert counted() == outcome.sent


def test_two_restart_workers_at_once_leave_one_worker_per_slot(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Two `corral daemon restart-workers` at once: each replaced the worker the other had just
    started, and one new worker ran on, listening on every port, in a slot recorded as another
    worker's: `daemon status` did not show it, and it wrote that worker's row of the shared
    load board. Now the second restart waits for the first."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    up(corral_home, tmp_path, "twice", 1)
    answers: list[Any] = []
    restart = lambda: answers.append(  # noqa: E731
        corral_home.api("POST", "/v1/daemon/restart-workers", timeout=60).status
    )
    threads = [threading.Thread(target=restart) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [200, 200]
    recorded = lambda: sorted(corral_home.worker_pids())  # noqa: E731
    running = lambda: sorted(corral_home.worker_processes())  # noqa: E731
    wait_for(lambda: running() == recorded() and len(recorded()) == 2, 20, "one worker a slot")


def test_one_daemon_is_brought_back_however_many_workers_see_the_crash(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Every worker sees a crashed daemon; only one starts another (a worker that started
    one a moment ago holds the others back), so a `daemon stop` right after the comeback
    leaves no second daemon to take the home's lock later."""
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "3"
    up(corral_home, tmp_path, "single", 1)
    old = corral_home.daemon_pid()
    os.kill(old, signal.SIGKILL)

    back = wait_for(lambda: new_daemon(corral_home, old), 30, "a worker to start a new daemon")
    corral_home.daemon_pids.add(back)
    corral_home.run("daemon", "stop")
    wait_for(lambda: finished(back), 30, "the daemon stopped on purpose to exit")
    deadline = time.monotonic() + 2 * (RESPAWN_AFTER + RESPAWN_STAGGER * 3) + 3
    while time.monotonic() < deadline:
        running = [p.pid for p in corral_home.home_processes() if "daemon" in " ".join(p.cmdline())]
        assert not running and corral_home.daemon_info() is None, f"a second daemon: {running}"
        time.sleep(0.1)


def long_stream(home: CorralHome, tmp_path: Path, name: str, step_ms: int) -> tuple[str, Any]:
    """A service of one engine simulator whose 32-token answers take ``step_ms`` a token, and a
    thread streaming one answer through it (its outcome in the dict it returns)."""
    engine = f"{sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT"
    run = f"exec {engine} --step-base-ms {step_ms}"
    text = spec_text(name, 1, run=run)
    home.run("up", str(write_spec(tmp_path / f"{name}.yaml", text)), timeout=90)
    svc = home.wait_replicas(name, 1)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 32, "stream": True})
    done: dict[str, Any] = {}

    def stream() -> None:
        request = urllib.request.Request(
            str(svc["endpoint"]) + "/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=90) as answer:
                done["body"] = answer.read()
        except OSError as exc:
            done["error"] = exc

    reader = threading.Thread(target=stream)
    reader.start()
    done["thread"] = reader
    return text, done


def finished_whole(done: dict[str, Any]) -> None:
    done["thread"].join(90)
    assert not done["thread"].is_alive()
    assert "error" not in done, done
    assert done["body"].rstrip().endswith(b"data: [DONE]"), done["body"][-200:]


def replica_ttft_count(home: CorralHome, service: str, replica: int) -> float | None:
    """corral_lb_replica_ttft_seconds_count of one replica in /metrics, None without one."""
    text = http(
        home.api_url + "/metrics", headers={"Authorization": f"Bearer {home.token}"}
    ).body.decode()
    name = f'corral_lb_replica_ttft_seconds_count{{replica="{replica}",service="{service}"}}'
    found = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(found[0].rsplit(" ", 1)[1]) if found else None


def test_a_leaving_replicas_ttft_does_not_go_down_while_a_worker_still_drains_it(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Both workers timed streams of a replica; it leaves while one of them still relays a
    stream from it. The other forgets it at once, and its part of the replica's histogram
    must not leave the series with it (a counter going down part of the way, no process
    restarted: rate() reads a reset), only when the last worker forgets the replica."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    _, done = long_stream(corral_home, tmp_path, "leaving", 250)  # 8 s
    url = str(corral_home.service("leaving")["endpoint"]) + "/v1/completions"
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True})

    def short() -> None:  # a connection each: the kernel spreads them over both workers
        ask = urllib.request.Request(
            url, data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(ask, timeout=30) as answer:
            answer.read()

    shorts = [threading.Thread(target=short) for _ in range(16)]
    for thread in shorts:
        thread.start()
    for thread in shorts:
        thread.join(30)
    counted = wait_for(
        lambda: n if (n := replica_ttft_count(corral_home, "leaving", 1) or 0) >= 17 else None,
        10,
        "17 streams timed",
    )
    assert done["thread"].is_alive(), "the long stream ended before the replica left"
    corral_home.run("down", "leaving", "--replica-id", "1", "-y")
    seen = []
    while done["thread"].is_alive():
        now = replica_ttft_count(corral_home, "leaving", 1)
        if now is None:
            break
        seen.append(now)
        time.sleep(0.1)
    assert seen and min(seen) >= counted, (counted, seen)
    finished_whole(done)


def test_a_stream_under_way_outlives_a_route_change(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """An update that changes a balancer setting retires each worker's balancer: a stream
    under way through it finishes (up to drain_timeout_seconds, as on a leaving replica),
    not cut at the 5 s a stopping balancer gives its other connections."""
    text, done = long_stream(corral_home, tmp_path, "long", 250)  # 8 s
    changed = text.replace("service:\n", "service:\n  load_balancing_policy: round_robin\n")
    corral_home.run("update", "long", str(write_spec(tmp_path / "long2.yaml", changed)), "-y")
    finished_whole(done)


def test_a_stream_under_way_outlives_restart_workers(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """An upgrade's restart-workers: the old worker finishes a stream longer than the 10 s it
    was given before (the services' drain_timeout_seconds, 30 s here)."""
    _, done = long_stream(corral_home, tmp_path, "longer", 400)  # 13 s
    old = corral_home.worker_pids()
    corral_home.run("daemon", "restart-workers", timeout=200)
    assert set(corral_home.worker_pids()).isdisjoint(old)
    finished_whole(done)
