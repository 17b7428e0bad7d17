"""Autoscaling on what LLM engines hold (queue_depth), pure over a simulated clock, through the
spec, and through a real daemon in front of simulated engines."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from conftest import CorralHome, spec_text, write_spec

from corral.autoscale_queue import EngineAutoscaler, queue_depth
from corral.spec import SpecError, parse_spec

BASE = "run: x\nservice:\n  readiness_probe: /health\n"


def policy(text: str) -> Any:
    return parse_spec(BASE + text).service.replica_policy


def test_skyserves_model_first_service_shape_is_read() -> None:
    p = policy(
        "  replicas: 1\n  max_replicas: 3\n"
        "  autoscaling:\n    metrics:\n      - type: queue_depth\n        target: 5\n"
    )
    assert (p.min_replicas, p.max_replicas, p.target_queue_per_replica) == (1, 3, 5)
    assert p.autoscaling and p.target_qps_per_replica is None
    qps = policy("  max_replicas: 2\n  autoscaling:\n    metrics: [{type: qps, target: 3}]\n")
    assert (qps.min_replicas, qps.max_replicas, qps.target_qps_per_replica) == (1, 2, 3)
    for bad, says in (
        ("  max_replicas: 3\n", "needs autoscaling.metrics"),
        ("  autoscaling:\n    metrics: [{type: tokens, target: 5}]\n", "type"),
        ("  autoscaling:\n    metrics: [{type: queue_depth, target: 0}]\n", "target"),
        (
            "  max_replicas: 2\n  autoscaling:\n    metrics: [{type: qps, target: 1}]\n"
            "  replica_policy: {min_replicas: 1}\n",
            "one form",
        ),
    ):
        with pytest.raises(SpecError) as caught:
            parse_spec(BASE + bad)
        assert says in str(caught.value), (bad, str(caught.value))


def test_the_target_follows_the_depth_with_skyserves_holds() -> None:
    p = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 4\n"
        "    target_queue_per_replica: 5\n    upscale_delay_seconds: 60\n"
        "    downscale_delay_seconds: 120\n    num_overprovision: 1\n"
    )
    scaler = EngineAutoscaler(p)
    scaler.observe(3)
    assert scaler.decide(0.0, []).target == 2  # 1 replica, +1 overprovision
    scaler.observe(17)  # wants 4
    assert scaler.decide(10.0, []).target == 2
    assert scaler.decide(49.0, []).target == 2  # SkyServe: int(60/20)=3 looks, 40 s held
    decision = scaler.decide(50.0, [])
    assert (decision.target, decision.raw_target) == (5, 4)
    scaler.observe(100)
    assert scaler.decide(60.0, []).target == 5  # clipped at max_replicas (4) + 1
    scaler.observe(0)
    assert scaler.decide(70.0, []).target == 5
    assert scaler.decide(169.0, []).target == 5  # 120 s delay: 100 s held
    assert scaler.decide(170.0, []).target == 2
    scaler.observe(12)  # a dip that ends before the hold restarts it
    scaler.decide(180.0, [])
    scaler.observe(0)
    scaler.decide(190.0, [])
    scaler.observe(12)
    assert scaler.decide(225.0, []).target == 2  # the dip at 190 reset the up-hold


def test_a_noisy_queue_over_its_target_is_followed_as_skyserve_counts() -> None:
    """SkyServe looks every 20 s: a sample that dips under the target one time in four (every
    20 s, always at the same phase) restarts the count of that phase only, and the other three
    move after int(300 / 20) looks in a row. Counting every 5 s sample as a look, one dip
    restarted it all and the fleet never grew, at 1.4 times its target on average."""
    p = policy(
        "  replica_policy:\n    min_replicas: 2\n    max_replicas: 4\n"
        "    target_queue_per_replica: 5\n"
    )
    scaler = EngineAutoscaler(p)
    moved = None
    for i in range(240):  # 20 minutes, a decision every 5 s
        scaler.observe(8 if i % 4 == 3 else 14)  # wants 2 one sample in four, else 3
        if scaler.decide(i * 5.0, []).target == 3 and moved is None:
            moved = i * 5.0
    assert moved is not None and 280.0 <= moved <= 300.0, moved


def test_from_zero_a_waiting_request_is_demand() -> None:
    p = policy(
        "  replica_policy:\n    min_replicas: 0\n    max_replicas: 2\n"
        "    target_queue_per_replica: 4\n"
    )
    scaler = EngineAutoscaler(p)
    assert scaler.decide(100.0, []).target == 0
    assert scaler.decide(101.0, [100.5]).target == 1  # at once


def test_a_light_steady_load_keeps_its_last_replica() -> None:
    """min_replicas 0 on the queue: a request every 30 s that is done within a second is
    seen by almost no sample, but it is load, as the request-rate autoscaler counts it: the
    last replica stays while requests come, and goes after the downscale hold once they stop."""
    p = policy(
        "  replica_policy:\n    min_replicas: 0\n    max_replicas: 2\n"
        "    target_queue_per_replica: 4\n    downscale_delay_seconds: 120\n"
    )
    scaler = EngineAutoscaler(p)
    arrivals = [7.0 + 30 * i for i in range(60)]  # 30 minutes, from 7 s
    for step in range(2, 360):  # from the first request on
        now = step * 5.0
        scaler.observe(0)  # every request finished before the sample
        got = scaler.decide(now, [t for t in arrivals if now - 60 < t <= now])
        assert got.target == 1, (now, got.reason)
    for step in range(360, 420):  # requests stopped at 1777 s
        got = scaler.decide(step * 5.0, [t for t in arrivals if step * 5.0 - 60 < t <= step * 5.0])
    assert got.target == 0, got.reason


def test_depth_is_what_waits_in_the_engines_else_in_flight_plus_held() -> None:
    """SkyServe v2's queue_depth is the engines' waiting requests: those an engine runs are
    its batch at work, and counting them would scale out a fleet that keeps up."""
    stats = {
        "held": 2,
        "replicas": {
            "1": {"ready": True, "in_flight": 9},
            "2": {"ready": True, "in_flight": 3},
            "3": {"ready": False, "in_flight": 1},
            "4": {"ready": True, "in_flight": 8},
        },
        "engines": {"1": {"waiting": 4.0, "running": 8.0}, "4": {"running": 8.0}},
    }
    assert queue_depth(stats) == 2 + 4 + 3
    assert queue_depth(None) == 0
    busy = {"replicas": {"1": {"ready": True}}, "engines": {"1": {"running": 200.0, "waiting": 0}}}
    assert queue_depth(busy) == 0


def test_a_service_scales_out_when_its_engines_fill(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Two replicas at most, 2 waiting requests per replica wanted: 6 long generations at once
    on an engine that runs 2 leave 4 in its queue, and a second replica is launched and becomes
    READY."""
    corral_home.env["CORRAL_DECISION_INTERVAL"] = "0.5"
    sim = f"{sys.executable} -m corral.llmsim --speed 0.5 --max-batch 2"
    run = f"exec {sim} --host 127.0.0.1 --port $PORT"
    text = spec_text("grow", 1, run=run).replace(
        "  replicas: 1\n",
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 2\n"
        "    target_queue_per_replica: 2\n    upscale_delay_seconds: 0\n",
    )
    corral_home.run("up", str(write_spec(tmp_path / "grow.yaml", text)), "-y", timeout=120)
    svc = corral_home.wait_replicas("grow", 1, timeout=60)
    endpoint = urllib.parse.urlsplit(str(svc["endpoint"]))
    body = json.dumps({"model": "m", "prompt": "write", "max_tokens": 400}).encode()
    clients = [http.client.HTTPConnection(endpoint.netloc, timeout=120) for _ in range(6)]

    def generate(client: http.client.HTTPConnection) -> None:
        try:
            client.request("POST", "/v1/completions", body, {"Content-Type": "x/json"})
            client.getresponse().read()
        except (OSError, http.client.HTTPException):
            pass  # cut below once the service has grown: the rest would take ~30 s

    threads = [threading.Thread(target=generate, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    grown = corral_home.wait_replicas("grow", 2, timeout=90, exact=False)
    events = corral_home.api("GET", "/v1/services/grow/events").json()["events"]
    assert any("request(s) waiting in engines" in str(e) for e in events), events
    assert grown["target"] == 2
    for client in clients:  # the clients leave: the balancer cancels their generations
        if client.sock is not None:
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_RDWR)
    for thread in threads:
        thread.join(120)
