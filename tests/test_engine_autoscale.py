"""Autoscaling on the engines' KV-cache use and tokens per second (and their queue): the spec,
the pure autoscaler over a simulated clock, the rate read from a real simulated engine, and a
daemon that scales out when its engines' KV caches fill."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import CorralHome, spec_text, write_spec

from corral.autoscale import past
from corral.autoscale_queue import EngineAutoscaler, engine_load, fits, make_scaler
from corral.balancer import LoadBalancer
from corral.dataplane import engines
from corral.llmsim import EngineConfig, SimServer
from corral.spec import SpecError, parse_spec

BASE = "run: x\nservice:\n  readiness_probe: /health\n"


def policy(text: str) -> Any:
    return parse_spec(BASE + text).service.replica_policy


def test_the_engine_targets_are_read_in_both_forms() -> None:
    p = policy(
        "  replicas: 1\n  max_replicas: 4\n  autoscaling:\n    metrics:\n"
        "      - {type: kv_cache_usage, target: 0.8}\n"
        "      - {type: tokens_per_second, target: 500}\n"
        "      - {type: queue_depth, target: 6}\n"
    )
    assert p.engine_targets == {
        "target_queue_per_replica": 6,
        "target_kv_cache_usage": 0.8,
        "target_tokens_per_second_per_replica": 500,
    }
    assert p.autoscaling and isinstance(
        make_scaler(p, decision_interval=5, qps_window=60), EngineAutoscaler
    )
    q = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 3\n"
        "    target_kv_cache_usage: 0.7\n"
    )
    assert q.autoscaling and q.target_kv_cache_usage == 0.7
    assert not fits(make_scaler(q, decision_interval=5, qps_window=60), policy("  replicas: 2\n"))
    for bad, field in (
        ("    target_kv_cache_usage: 1.5\n", "target_kv_cache_usage"),
        ("    target_kv_cache_usage: 0\n", "target_kv_cache_usage"),
        ("    target_tokens_per_second_per_replica: -5\n", "target_tokens_per_second_per_replica"),
    ):
        with pytest.raises(SpecError) as caught:
            policy("  replica_policy:\n    min_replicas: 1\n    max_replicas: 3\n" + bad)
        assert field in str(caught.value), (bad, str(caught.value))
    with pytest.raises(SpecError) as caught:
        policy(
            "  max_replicas: 2\n  autoscaling:\n    metrics:\n"
            "      - {type: kv_cache_usage, target: 0.8}\n"
            "      - {type: kv_cache_usage, target: 0.5}\n"
        )
    assert "kv_cache_usage more than once" in str(caught.value)


def test_the_most_any_signal_asks_for_is_followed_with_the_holds() -> None:
    p = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 6\n"
        "    target_kv_cache_usage: 0.8\n    target_tokens_per_second_per_replica: 100\n"
        "    target_queue_per_replica: 10\n    upscale_delay_seconds: 60\n"
        "    downscale_delay_seconds: 120\n"
    )
    scaler = EngineAutoscaler(p)
    scaler.observe(depth=3, kv_usage=1.9, tokens_per_second=150)  # KV: ceil(1.9 / 0.8) = 3
    d = scaler.decide(0.0, [])
    assert (d.raw_target, d.target) == (3, 1)
    assert "replicas' worth of KV cache in use (3 at 0.8 each)" in d.reason
    assert scaler.decide(39.0, []).target == 1  # the upscale hold is 40 s
    scaler.observe(depth=3, kv_usage=0.5, tokens_per_second=480)  # tokens: 5
    assert scaler.decide(40.0, []).target == 5
    scaler.observe(depth=3, kv_usage=0.4, tokens_per_second=90)  # all want 1
    assert scaler.decide(50.0, []).target == 5
    assert scaler.decide(149.0, []).target == 5  # the downscale hold is 100 s
    assert scaler.decide(150.0, []).raw_target == 1
    scaler.observe(depth=0, kv_usage=0.8, tokens_per_second=0)  # exactly one replica's worth
    assert scaler.decide(151.0, []).raw_target == 1


def test_queue_depth_alone_is_warned_of() -> None:
    """A queue that a steady load empties scales the replicas down, and the queue that forms
    then scales them up again (qwen-7b.yaml's shape flapped 1, 3, 1, 3 in a review): the spec
    is told, and a kv_cache_usage target beside it silences the warning."""
    base = (
        "  max_replicas: 4\n  autoscaling:\n    metrics:\n      - {type: queue_depth, target: 5}\n"
    )
    alone = parse_spec(BASE + base).warnings
    assert any("queue_depth is the only autoscaling target" in w for w in alone), alone
    paired = parse_spec(BASE + base + "      - {type: kv_cache_usage, target: 0.8}\n").warnings
    assert not any("is the only autoscaling target" in w for w in paired), paired


def test_a_reasons_large_figures_are_written_out() -> None:
    """A fleet's tokens per second run to thousands: the reason said "2.5e+03 tokens/s"."""
    p = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 6\n"
        "    target_tokens_per_second_per_replica: 2000\n"
    )
    scaler = EngineAutoscaler(p)
    scaler.observe(depth=0, tokens_per_second=2500)
    reason = scaler.decide(0.0, []).reason
    assert "2500 tokens/s generated (2 at 2000 each)" in reason and "e+" not in reason, reason


def test_the_signals_are_summed_over_ready_replicas() -> None:
    stats = {
        "held": 1,
        "replicas": {"1": {"ready": True}, "2": {"ready": True}, "3": {"ready": False}},
        "engines": {
            "1": {"waiting": 2.0, "running": 3.0, "kv_usage": 0.5, "tokens_per_second": 40.0},
            "2": {"running": 1.0, "kv_usage": 0.25},
            "3": {"running": 9.0, "kv_usage": 0.9, "tokens_per_second": 99.0},
        },
    }
    assert engine_load(stats) == (1 + 2, 0.75, 40.0)  # held, and replica 1's waiting
    assert engine_load(None) == (0.0, 0.0, 0.0)


def test_tokens_per_second_is_the_counters_growth() -> None:
    first = engines.with_rate({"generation_tokens": 100.0}, None, 10.0)
    assert "tokens_per_second" not in first and first["read_at"] == 10.0
    second = engines.with_rate({"generation_tokens": 350.0}, first, 12.0)
    assert second["tokens_per_second"] == 125.0
    restarted = engines.with_rate({"generation_tokens": 5.0}, second, 13.0)
    assert "tokens_per_second" not in restarted  # the counter went back
    sglang = engines.with_rate({"gen_throughput": 77.0}, None, 1.0)
    assert sglang["tokens_per_second"] == 77.0


def test_an_engines_fractions_are_averaged_and_odd_samples_skipped() -> None:
    """vLLM with two data-parallel ranks behind one API server publishes each rank's KV-cache
    use: the replica is at their mean (summed, 0.5 and 0.7 read as 1.2, a replica and a half
    of cache for one replica). A NaN or an infinity is no reading: summed, a NaN zeroed the
    whole fleet's queue depth, and an infinity made every decision raise."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 4\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} NaN\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2\n'
        "sglang:gen_throughput +Inf\n"
    )
    got = engines.parse(text)
    assert got == {"kv_usage": pytest.approx(0.6), "running": 7.0, "waiting": 2.0}, got
    p = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 4\n"
        "    target_tokens_per_second_per_replica: 100\n    target_queue_per_replica: 5\n"
    )
    scaler = EngineAutoscaler(p)
    signals = engines.with_rate(engines.parse("sglang:gen_throughput +Inf\n"), None, 1.0)
    scaler.sample(
        {"replicas": {"1": {"ready": True, "in_flight": 9}}, "engines": {"1": signals}}, lambda: []
    )
    assert scaler.decide(0.0, []).raw_target == 2  # the in-flight count, the throughput unknown


def test_the_simulator_reports_kv_use_and_tokens_that_the_worker_turns_into_a_rate() -> None:
    async def go() -> None:
        config = EngineConfig(cache_blocks=64, step_base_ms=20)
        async with SimServer(config) as sim, aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "hello", "max_tokens": 300}
            tasks = [
                asyncio.create_task(http.post(sim.url + "/v1/completions", json=body))
                for _ in range(2)
            ]
            lb = LoadBalancer(name="x")
            seen: dict[int, Any] = {}
            for _ in range(100):
                seen = await engines.refresh(lb, {1: sim.url}, "/metrics", seen)
                if seen.get(1, {}).get("tokens_per_second"):
                    break
                await asyncio.sleep(0.1)
            signals = seen[1]
            assert signals["kv_usage"] > 0.5, signals  # 2 x 19 blocks of 64 reserved
            assert signals["tokens_per_second"] > 0, signals
            for task in tasks:
                (await task).release()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_service_scales_out_when_its_engines_kv_caches_fill(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """One replica at first, a KV-cache target of 0.5: two long generations reserve 0.81 of
    its cache (64 blocks of 16 tokens), which asks for ceil(0.8 / 0.5) = 2 replicas."""
    corral_home.env["CORRAL_DECISION_INTERVAL"] = "0.5"
    run = (
        f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT --speed 0.5"
        " --cache-blocks 64"
    )
    text = spec_text("kv", 1, run=run).replace(
        "  replicas: 1\n",
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 2\n"
        "    target_kv_cache_usage: 0.5\n    upscale_delay_seconds: 0\n",
    )
    corral_home.run("up", str(write_spec(tmp_path / "kv.yaml", text)), "-y", timeout=120)
    svc = corral_home.wait_replicas("kv", 1, timeout=60)
    url = str(svc["endpoint"]) + "/v1/completions"
    body = json.dumps({"model": "m", "prompt": "write", "max_tokens": 400}).encode()

    def generate() -> None:
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "x/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            answer.read()

    threads = [threading.Thread(target=generate, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()

    def generating() -> Any:
        now = corral_home.service("kv")
        llm = (now or {}).get("llm") or {}
        return llm if (llm.get("tokens_per_second") or 0) > 0 else None

    shown = corral_home.wait_for(generating, 30, "tokens per second in the service view")
    assert shown["tokens_per_second"] > 10, shown
    metrics = corral_home.api("GET", "/metrics").body.decode()
    assert re.search(r'corral_engine_tokens_per_second\{replica="\d+",service="kv"\} \d', metrics)
    grown = corral_home.wait_replicas("kv", 2, timeout=90, exact=False)
    events = corral_home.api("GET", "/v1/services/kv/events").json()["events"]
    assert any("worth of KV cache in use" in str(e) for e in events), events
    assert grown["target"] == 2
    for thread in threads:
        thread.join(120)


def test_a_spec_update_to_another_kind_of_autoscaler_keeps_the_target() -> None:
    """A request-rate autoscaled fleet at 4 whose update adds a queue target (or drops it)
    gets a new autoscaler of another kind: it goes on from 4, not from min_replicas (which cut
    the fleet to 1 at once, then held 280 s before growing back)."""
    base = (
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 4\n"
        "    target_qps_per_replica: 1\n"
    )
    qps = policy(base + "    upscale_delay_seconds: 20\n")
    times = [40.0 + i * 0.25 for i in range(240)]  # 4 requests/s over the last minute
    first = make_scaler(qps, decision_interval=5.0, qps_window=60.0)
    assert first.decide(100.0, times).target == 4
    engine = policy(base + "    target_queue_per_replica: 5\n")
    second = make_scaler(engine, decision_interval=5.0, qps_window=60.0, previous=first)
    assert isinstance(second, EngineAutoscaler)
    second.observe(depth=20)
    assert second.decide(105.0, times).target == 4
    third = make_scaler(policy(base), decision_interval=5.0, qps_window=60.0, previous=second)
    assert third.decide(110.0, times).target == 4


def test_a_reason_says_when_the_hold_has_passed_but_no_look_moved_yet() -> None:
    """The hold is the earliest a move can come; the move comes at a look of SkyServe's 20 s
    clock. A reason that said "until the hold of 0s is over (12s so far)" read as a hold
    ignored."""
    text = (
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 4\n"
        "    target_queue_per_replica: 2\n    upscale_delay_seconds: 60\n"
    )
    scaler = EngineAutoscaler(policy(text))
    scaler.observe(depth=6)
    first = scaler.decide(0.0, [])
    assert first.target == 1, first.reason
    assert first.reason.endswith("for 0s of the 40s hold of the 60s upscale delay: holding 1")
    assert past(39.0, 60) == "" and past(5.0, 20) != ""
    assert "the hold has passed" in past(40.0, 60)
    # A move's look is said as how long ago it was, not as a time on the scaler's own clock
    # ("the one at 5000.0s", a figure nothing else shows).
    short = EngineAutoscaler(policy(text.replace("delay_seconds: 60", "delay_seconds: 10")))
    short.observe(depth=6)
    moved = short.decide(5000.0, [])
    assert moved.target == 3 and "s ago moved from 1)" in moved.reason, moved.reason
    assert "5000" not in moved.reason, moved.reason


def test_llama_cpp_servers_metrics_are_read() -> None:
    """corral starts `llama-server --metrics` for a model-first spec on CPUs: its queue, batch,
    KV-cache use and token counter, in llama.cpp's own names, are the engine's load (they were
    not read, so a queue_depth or kv_cache_usage target never scaled such a service)."""
    text = (
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        "llamacpp:tokens_predicted_total 3469\n"
        "llamacpp:prompt_tokens_total 6886\n"
        "llamacpp:kv_cache_usage_ratio 0.9\n"
        "llamacpp:requests_processing 4\n"
        "llamacpp:requests_deferred 7\n"
    )
    got = engines.parse(text)
    assert got == {
        "waiting": 7.0,
        "running": 4.0,
        "kv_usage": 0.9,
        "generation_tokens": 3469.0,
        "prompt_tokens": 6886.0,
    }, got
    p = policy(
        "  replica_policy:\n    min_replicas: 1\n    max_replicas: 4\n"
        "    target_queue_per_replica: 2\n"
    )
    scaler = EngineAutoscaler(p)
    signals = engines.with_rate(got, None, 1.0)
    scaler.sample(
        {"replicas": {"1": {"ready": True, "in_flight": 0}}, "engines": {"1": signals}}, lambda: []
    )
    assert scaler.decide(0.0, []).raw_target == 4  # ceil(7 deferred / 2)
