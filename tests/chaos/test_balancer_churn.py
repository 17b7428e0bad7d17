"""Chaos: the balancer under steady load while replicas die and are replaced.

The promise tested here is the architecture's last invariant: *a request the balancer accepted
is answered*, and for an idempotent GET "answered" must mean answered well. A replica killed
with SIGKILL mid-request, a pooled keep-alive connection to a dead replica, a connect refused by
a port nobody listens on any more: each is a failure before any response header, which the
balancer retries on another replica (never the same one) while the controller drops the dead
replica from the ready set and launches a replacement. A rolling update and a scale-down are the
graceful version of the same churn: replicas leave the ready set, drain, then stop.

How it is driven (all real: the CLI, the daemon, examples/app.py replicas, HTTP on 127.0.0.1):

* an open-loop load generator (:class:`PacedLoad`) sends GETs at a fixed rate (~200 req/s) for
  a fixed time, each with its own deadline, from an asyncio loop on a thread. Open loop: a slow
  answer does not slow the schedule down, so a stall shows up as latency, not as fewer requests;
* a seeded schedule (``chaos_support.rng``) SIGKILLs the process group of a random READY replica
  every few seconds; corral must notice and replace it. A kill happens only while at least two
  replicas are READY, so that a retry always has somewhere to go (with no replica at all a 503
  is the right answer, and not what is tested here).

Every failed request (non-2xx, connection error, deadline) is a lost request and fails the test,
with the first few errors in the message. Latency is reported (p50/p99/max), never asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aiohttp import web
from chaos_support import LONG, record, rng, rounds, seconds
from conftest import (
    ENV_HOME_MARKER,
    CorralHome,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)
from load import LoadResult, PacedLoad

from corral.balancer import LoadBalancer

pytestmark = pytest.mark.timeout(900 if LONG else 240)

RATE = 200.0  # requests per second, open loop
KILL_EVERY = (3.0, 5.0)  # s between two kills, drawn per kill


# -- the service ----------------------------------------------------------------------------------


def churn_spec(directory: Path, name: str, replicas: int, version: str = "1") -> Path:
    """examples/app.py with fast probes; APP_VERSION changes the launch (a rolling relaunch)."""
    text = spec_text(name, replicas, envs={"APP_VERSION": version})
    return write_spec(directory / f"{name}-v{version}-{replicas}.yaml", text)


def start_service(home: CorralHome, tmp_path: Path, name: str, replicas: int) -> str:
    """`corral up` the service; return the balancer's URL once every replica is READY."""
    home.run("up", str(churn_spec(tmp_path, name, replicas)), "--detach")
    svc = home.wait_replicas(name, replicas, timeout=90.0)
    url = str(svc["endpoint"]).rstrip("/")
    assert url.startswith("http://127.0.0.1:"), url
    return url


def ready_replicas(home: CorralHome, name: str) -> list[dict[str, Any]]:
    svc = home.service(name)
    assert svc is not None, f"service {name} vanished"
    return sorted((r for r in svc["replicas"] if r["status"] == "READY"), key=lambda r: r["id"])


def kill_replica_group(home: CorralHome, pid: int) -> bool:
    """SIGKILL the process group a replica leads, after checking the pid is this home's replica.

    The marker check means a pid recycled since the status was read is never signalled. Returns
    False when the replica was already gone (nothing was signalled).
    """
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return False
    if env.get(ENV_HOME_MARKER) != home.marker:
        return False
    try:
        os.killpg(pid, signal.SIGKILL)  # the local backend starts each replica as a group leader
    except ProcessLookupError:
        return False
    wait_for(lambda: not pid_alive(pid), 10.0, f"killed replica pid {pid} to die")
    return True


def balancer_counters(home: CorralHome, name: str) -> dict[str, float]:
    """The service's retry and error counters from the daemon's /metrics.

    Retries > 0 is the evidence that the kills really hit requests in flight (or pooled
    connections) and the balancer's retry path, not luck, is what kept the client whole.
    """
    answer = home.api("GET", "/metrics")
    assert answer.status == 200, answer
    out: dict[str, float] = {"retries": 0.0}
    for line in answer.body.decode().splitlines():
        if f'service="{name}"' not in line or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.startswith("corral_lb_retries_total"):
            out["retries"] += float(value)
        elif metric.startswith("corral_lb_errors_total"):
            reason = metric.split('reason="', 1)[1].split('"', 1)[0]
            out[f"lb_error:{reason}"] = out.get(f"lb_error:{reason}", 0.0) + float(value)
    return out


def report(label: str, result: LoadResult, **extra: Any) -> str:
    line = {"run": label, **result.summary(), **extra}
    text = json.dumps(line, sort_keys=True)
    print(f"\n[balancer churn] {text}")
    return text


def assert_nothing_lost(result: LoadResult, label: str, seed_note: str) -> None:
    assert result.sent > 0, f"{label}: no request was sent"
    assert result.failed == 0, (
        f"{label}: {result.failed} of {result.sent} requests failed ({dict(result.errors)}); "
        f"{seed_note}; first failures:\n" + "\n".join(result.examples)
    )


# -- tests ----------------------------------------------------------------------------------------


def test_replica_kills_under_load_lose_no_request(corral_home: CorralHome, tmp_path: Path) -> None:
    """Random SIGKILLs of READY replicas while ~200 req/s of GETs flow: zero failed requests."""
    name = "churn"
    replicas = 3
    duration = seconds(15.0, 60.0)
    seed = f"CORRAL_CHAOS_SEED={os.environ.get('CORRAL_CHAOS_SEED', '1')}"
    random = rng("balancer_churn.kills")
    url = start_service(corral_home, tmp_path, name, replicas)

    load = PacedLoad(url, RATE, duration)
    load.start()
    started = time.monotonic()
    end = started + duration
    kills: list[dict[str, Any]] = []
    skipped = 0
    next_kill = started + random.uniform(*KILL_EVERY) / 2
    while True:
        if next_kill >= end - 1.0:  # leave the last second for the last retries to settle
            break
        time.sleep(max(0.0, next_kill - time.monotonic()))
        ready = ready_replicas(corral_home, name)
        if len(ready) < 2:
            skipped += 1  # a retry needs another replica; try again shortly
            next_kill = time.monotonic() + 0.5
            continue
        victim = random.choice(ready)
        if kill_replica_group(corral_home, int(victim["pid"])):
            kills.append(
                {
                    "at_s": round(time.monotonic() - started, 2),
                    "replica": victim["id"],
                    "ready": len(ready),
                }
            )
        next_kill = time.monotonic() + random.uniform(*KILL_EVERY)
    result = load.join()

    # corral replaced every killed replica: back to full strength, none of the victims serving.
    svc = corral_home.wait_replicas(name, replicas, timeout=60.0)
    killed_ids = {k["replica"] for k in kills}
    ready_ids = {r["id"] for r in svc["replicas"] if r["status"] == "READY"}
    assert not killed_ids & ready_ids, f"a killed replica is READY again: {killed_ids & ready_ids}"

    counters = balancer_counters(corral_home, name)
    line = report(
        "kills",
        result,
        kills=len(kills),
        kill_times=[k["at_s"] for k in kills],
        skipped_kills=skipped,
        seed=seed,
        balancer=counters,
    )
    record(
        "balancer: replica SIGKILL under load",
        rounds=len(kills),
        lost=result.failed,
        requests=result.sent,
        p99_ms=result.summary()["p99_ms"],
        rate=RATE,
        seconds=duration,
        retries=counters["retries"],
    )
    assert len(kills) >= max(2, int(duration / KILL_EVERY[1]) - 1), f"too few kills ran: {kills}"
    assert_nothing_lost(result, line, seed)
    assert len(result.pids) > replicas, "replacements never served a request"


def test_rolling_update_and_scale_down_under_load_lose_no_request(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Graceful churn while ~200 req/s flow: per round, a rolling update that relaunches every
    replica, then a scale-down 4 -> 3 (or back up 3 -> 4). Replicas leave the ready set, drain
    and stop: zero failed requests.
    """
    name = "roll"
    n_rounds = rounds(1, 3)
    duration = seconds(15.0, 45.0)  # at least; the load goes on until the churn is over
    seed = f"CORRAL_CHAOS_SEED={os.environ.get('CORRAL_CHAOS_SEED', '1')}"
    size = 4
    url = start_service(corral_home, tmp_path, name, size)

    load = PacedLoad(url, RATE, duration + 130.0 * n_rounds)  # stopped below, after the churn
    load.start()
    started = time.monotonic()
    steps: list[str] = []
    time.sleep(2.0)  # some steady traffic first
    for round_no in range(n_rounds):
        version = str(round_no + 2)
        before = {r["id"] for r in ready_replicas(corral_home, name)}
        spec = churn_spec(tmp_path, name, size, version=version)
        corral_home.run("update", name, str(spec), "--detach")

        def rolled(before: set[int] = before, size: int = size) -> bool:
            ready = ready_replicas(corral_home, name)
            return len(ready) == size and not before & {r["id"] for r in ready}

        wait_for(rolled, 60.0, f"round {round_no}: the rolling update to replace every replica")
        steps.append(f"rolled v{version} at {time.monotonic() - started:.1f}s")
        size = 3 if size == 4 else 4
        spec = churn_spec(tmp_path, name, size, version=version)
        corral_home.run("update", name, str(spec), "--detach")
        corral_home.wait_replicas(name, size, timeout=60.0)
        steps.append(f"scaled to {size} at {time.monotonic() - started:.1f}s")
    # traffic on the final set for a while, and at least `duration` in all
    time.sleep(max(2.0, duration - (time.monotonic() - started)))
    load.stop()
    result = load.join()

    line = report(
        "rolling+scale-down",
        result,
        balancer=balancer_counters(corral_home, name),
        steps=steps,
        seed=seed,
    )
    record(
        "balancer: rolling update + scale-down under load",
        rounds=n_rounds,
        lost=result.failed,
        requests=result.sent,
        p99_ms=result.summary()["p99_ms"],
        rate=RATE,
        seconds=duration,
    )
    assert_nothing_lost(result, line, seed)


def test_all_but_one_replica_killed_at_once_loses_no_request(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A correlated failure: 3 of 4 READY replicas SIGKILLed in the same instant under load.

    The dead replicas have no request in flight, so least_load prefers them until each has
    refused a connection (and been ejected) or the controller has dropped it; one request may
    meet several of them in a row. It must still end on the survivor.
    """
    name = "burst"
    replicas = 4
    n_rounds = rounds(2, 6)
    seed = f"CORRAL_CHAOS_SEED={os.environ.get('CORRAL_CHAOS_SEED', '1')}"
    url = start_service(corral_home, tmp_path, name, replicas)

    load = PacedLoad(url, RATE, 600.0)  # stopped below, after the last round
    load.start()
    started = time.monotonic()
    kill_times: list[float] = []
    try:
        for round_no in range(n_rounds):
            random = rng("balancer_churn.burst", round_no)
            time.sleep(1.0 + random.random())  # steady traffic on the full set first
            ready = ready_replicas(corral_home, name)
            assert len(ready) == replicas, f"round {round_no}: {len(ready)} READY"
            survivor = random.choice(ready)
            victims = [r for r in ready if r["id"] != survivor["id"]]
            kill_times.append(round(time.monotonic() - started, 2))
            for victim in victims:
                os.killpg(int(victim["pid"]), signal.SIGKILL)
            for victim in victims:
                pid = int(victim["pid"])
                wait_for(lambda pid=pid: not pid_alive(pid), 10.0, f"pid {pid} to die")
            dead = {r["id"] for r in victims}
            # the controller saw the deaths (a status read right after the kill is stale) ...
            wait_for(
                lambda dead=dead: not dead & {r["id"] for r in ready_replicas(corral_home, name)},
                30.0,
                f"killed replicas {sorted(dead)} to leave READY",
            )
            # ... and replaced them
            corral_home.wait_replicas(name, replicas, timeout=60.0)
        time.sleep(1.0)
    finally:
        load.stop()
    result = load.join()

    counters = balancer_counters(corral_home, name)
    line = report(
        "burst kills", result, rounds=n_rounds, kill_times=kill_times, seed=seed, balancer=counters
    )
    record(
        "balancer: 3 of 4 replicas SIGKILLed at once under load",
        rounds=n_rounds,
        lost=result.failed,
        requests=result.sent,
        p99_ms=result.summary()["p99_ms"],
        rate=RATE,
        retries=counters["retries"],
    )
    assert_nothing_lost(result, line, seed)


def test_request_skips_every_refusing_replica_to_the_live_one() -> None:
    """The race behind the burst test, made deterministic, in-process (a real LoadBalancer, a
    real aiohttp replica, real refused ports on 127.0.0.1).

    Three replicas in the ready set refuse connections (dead, not yet noticed) and the one live
    replica is busy (one request in flight), so least_load tries all three dead ones first. With
    the balancer's 3 attempts spent on refusals, the request got a 502 while a live replica was
    ready. A refusal proves the request reached nobody, so it must not use up an attempt.
    """

    async def scenario() -> tuple[int, str]:
        release = asyncio.Event()
        holding = asyncio.Event()

        async def handle(request: web.Request) -> web.Response:
            if request.path == "/hold":
                holding.set()
                await release.wait()
            return web.Response(text="live")

        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        live = f"http://127.0.0.1:{runner.addresses[0][1]}"
        dead = []
        for _ in range(3):
            with socket.socket() as sock:  # bound then released: nothing listens there
                sock.bind(("127.0.0.1", 0))
                dead.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        lb = LoadBalancer(name="refusals", policy="least_load", max_attempts=3)
        port = await lb.start()
        try:
            lb.set_ready({4: live})
            async with aiohttp.ClientSession() as session:
                busy = asyncio.ensure_future(session.get(f"http://127.0.0.1:{port}/hold"))
                await asyncio.wait_for(holding.wait(), 10.0)
                # the three dead replicas join the set (died after the controller last looked)
                lb.set_ready({1: dead[0], 2: dead[1], 3: dead[2], 4: live})
                async with session.get(f"http://127.0.0.1:{port}/x") as response:
                    answer = (response.status, await response.text())
                release.set()
                async with await asyncio.wait_for(busy, 10.0) as held:
                    assert held.status == 200
            return answer
        finally:
            release.set()
            await lb.stop()
            await runner.cleanup()

    async def bounded() -> tuple[int, str]:
        return await asyncio.wait_for(scenario(), 30.0)

    status, text = asyncio.run(bounded())
    assert (status, text) == (200, "live"), f"HTTP {status}: {text}"
