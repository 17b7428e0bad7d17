"""Prometheus metrics and QPS of the load balancer, read back from the exposition text.

The balancer counts in plain ints (``stats()``); the control plane sums the stats of a service's
workers (``merge_stats``) and renders them (``render``). These tests go through both, as the
daemon does. Reuses the replicas and helpers of tests/test_balancer.py; everything on 127.0.0.1
and bounded by ``run``'s deadline.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import re
import time
from typing import Any

import aiohttp
import pytest
from test_balancer import HOST, Replica, cluster, run

from corral.balancer import CONTENT_TYPE_LATEST, LoadBalancer, merge_stats, render
from corral.balancer.metrics import ERROR_REASONS, LATENCY_BUCKETS, counters_only


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in exposition text (labels matched exactly), None if absent."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if found == labels:
            return float(m.group(3))
    return None


def exposition(*lbs: LoadBalancer) -> str:
    """What the daemon serves: each service's workers' stats summed, then rendered."""
    by_service: dict[str, list[dict[str, Any]]] = {}
    for lb in lbs:
        by_service.setdefault(lb.stats()["service"], []).append(lb.stats())
    return render({name: merge_stats(stats) for name, stats in by_service.items()}).decode()


def test_requests_codes_latency_and_retries_are_counted() -> None:
    async def main() -> None:
        async with (
            cluster(2, dead=1, policy="round_robin") as (lb, _, ready),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(7):
                async with s.get(lb.url + "/") as resp:
                    assert resp.status == 200
            for _ in range(3):
                async with s.get(lb.url + "/500") as resp:
                    assert resp.status == 500
            # replica 3 is dead: every request that picked it first was retried once
            failed = lb.stats()["replicas"]["3"]["failed"]
            assert failed > 0
            lb.set_ready({})
            async with s.get(lb.url + "/") as resp:
                assert resp.status == 503
            lb.set_ready(ready)
            text = exposition(lb)
            assert sample(text, "corral_lb_requests_total", service="svc", code="200") == 7
            assert sample(text, "corral_lb_requests_total", service="svc", code="500") == 3
            assert sample(text, "corral_lb_requests_total", service="svc", code="503") == 1
            assert sample(text, "corral_lb_request_seconds_count", service="svc") == 11
            total = sample(text, "corral_lb_request_seconds_sum", service="svc")
            assert total is not None and 0 < total < 11 * 5
            # the replica's own 500s are not the balancer's errors; the 503 is
            assert sample(text, "corral_lb_errors_total", service="svc", reason="no_replica") == 1
            assert sample(text, "corral_lb_retries_total", service="svc") == failed
            assert (
                sample(
                    text,
                    "corral_lb_errors_total",
                    service="svc",
                    reason="upstream_unreachable",
                )
                is None  # every retry succeeded: no request failed
            )
            for rid in ("1", "2", "3"):
                assert sample(text, "corral_lb_in_flight", service="svc", replica=rid) == 0
        # a service that is gone is simply not passed to render: no series left behind
        assert "service=" not in render({}).decode()

    run(main())


def test_in_flight_gauge_follows_requests_and_is_removed_after_drain() -> None:
    async def main() -> None:
        async with (
            cluster(2, policy="round_robin") as (lb, reps, ready),
            aiohttp.ClientSession() as s,
        ):
            held = asyncio.ensure_future(s.get(lb.url + "/hold"))
            await asyncio.wait_for(reps[0].arrived.wait(), 5)
            text = exposition(lb)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") == 0
            lb.set_ready({2: ready[2]})  # replica 1 leaves while busy: kept until drained
            text = exposition(lb)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1
            reps[0].gate.set()
            resp = await held
            assert resp.status == 200
            resp.release()
            assert await lb.wait_drained(1, 5)
            text = exposition(lb)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") is None
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") == 0
            lb.set_ready({})  # an idle replica that leaves goes at once
            text = exposition(lb)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") is None

    run(main())


def test_proxy_errors_client_disconnects_and_malformed_requests() -> None:
    async def main() -> None:
        async with cluster(1, max_body_bytes=100) as (lb, reps, _):
            async with aiohttp.ClientSession() as s:
                async with s.post(lb.url + "/", data=b"x" * 200) as resp:
                    assert resp.status == 413
                async with s.get(lb.url + "/cut") as resp:
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await resp.read()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with s.get(lb.url + "/hang") as resp:
                        await resp.read()
            await asyncio.wait_for(reps[0].cancelled.wait(), 5)
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            writer.write(b"\x16\x03\x01garbage\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.0 400")
            writer.close()
            text = exposition(lb)

            def errors(reason: str) -> float | None:
                return sample(text, "corral_lb_errors_total", service="svc", reason=reason)

            def requests(code: str) -> float | None:
                return sample(text, "corral_lb_requests_total", service="svc", code=code)

            assert (errors("body_too_large"), requests("413")) == (1, 1)
            # /cut: 200 went out, then the replica died: counted as 200 plus an error
            assert (errors("upstream_aborted"), requests("200")) == (1, 1)
            assert requests("499") == 1  # /hang: the client left before any response
            assert (errors("bad_request"), requests("400")) == (1, 1)
            assert set(ERROR_REASONS) >= {"body_too_large", "upstream_aborted", "bad_request"}

    run(main())


def test_several_services_and_workers_in_one_exposition() -> None:
    async def main() -> None:
        replica = await Replica(1).start()
        a = LoadBalancer(name="a")
        b1 = LoadBalancer(name="b", reuse_port=True)
        b2 = LoadBalancer(name="b", reuse_port=True)  # a second worker of service b
        try:
            for lb in (a, b1, b2):
                await lb.start()
                lb.set_ready({1: replica.url})
            async with aiohttp.ClientSession() as s:
                for lb, n in ((a, 2), (b1, 3), (b2, 4)):
                    for _ in range(n):
                        async with s.get(lb.url + "/") as resp:
                            assert resp.status == 200
            text = exposition(a, b1, b2)
            assert sample(text, "corral_lb_requests_total", service="a", code="200") == 2
            assert sample(text, "corral_lb_requests_total", service="b", code="200") == 7
            assert sample(text, "corral_lb_request_seconds_count", service="b") == 7
            assert sample(text, "corral_lb_in_flight", service="b", replica="1") == 0
            text = exposition(b1, b2)  # a stopped: the daemon no longer passes it
            assert sample(text, "corral_lb_requests_total", service="a", code="200") is None
            assert sample(text, "corral_lb_requests_total", service="b", code="200") == 7
        finally:
            for lb in (a, b1, b2):
                await lb.stop()
            await replica.stop()

    run(main())


def _fake_stats(service: str, **kw: Any) -> dict[str, Any]:
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    for i, n in kw.pop("buckets", {}).items():
        buckets[i] = n
    return {
        "service": service,
        "policy": "least_load",
        "url": "http://127.0.0.1:1",
        "ready": kw.pop("ready", [1]),
        "requests": kw.pop("requests", 0),
        "errors": kw.pop("errors", 0),
        "errors_by_reason": kw.pop("reasons", {}),
        "codes": kw.pop("codes", {}),
        "latency": {"buckets": buckets, "sum": kw.pop("sum", 0.0), "count": sum(buckets)},
        "retries": kw.pop("retries", 0),
        "bad_requests": 0,
        "aborted": 0,
        "client_disconnects": 0,
        "in_flight": kw.pop("in_flight", 0),
        "replicas": kw.pop("replicas", {}),
    }


def test_merge_stats_sums_workers_and_render_is_cumulative() -> None:
    one = _fake_stats(
        "svc",
        requests=3,
        codes={"200": 2, "502": 1},
        reasons={"upstream_unreachable": 1},
        buckets={0: 1, 3: 1, len(LATENCY_BUCKETS): 1},
        sum=200.5,
        retries=1,
        in_flight=1,
        replicas={"1": {"ready": True, "in_flight": 1, "served": 2, "failed": 1}},
    )
    two = _fake_stats(
        "svc",
        ready=[1, 2],
        requests=2,
        codes={"200": 2},
        buckets={3: 2},
        sum=0.01,
        replicas={
            "1": {"ready": True, "in_flight": 0, "served": 1, "failed": 0},
            "2": {"ready": True, "in_flight": 0, "served": 1, "failed": 0},
        },
    )
    merged = merge_stats([one, two])
    assert merged["requests"] == 5 and merged["retries"] == 1 and merged["in_flight"] == 1
    assert merged["codes"] == {"200": 4, "502": 1}
    assert merged["errors_by_reason"] == {"upstream_unreachable": 1}
    assert merged["ready"] == [1, 2]
    replica = dict(merged["replicas"]["1"])
    assert replica.pop("ttft")["count"] == 0  # no streamed answer in these stats
    assert replica == {"ready": True, "in_flight": 1, "streaming": 0, "served": 3, "failed": 1}
    assert merged["latency"]["count"] == 5 and merged["latency"]["sum"] == 200.51
    json.dumps(merged)  # what crosses the process boundary
    assert merge_stats([])["requests"] == 0

    text = render({"svc": merged}).decode()
    bucket = "corral_lb_request_seconds_bucket"
    assert sample(text, bucket, service="svc", le="0.0005") == 1
    assert sample(text, bucket, service="svc", le="0.001") == 1
    assert sample(text, bucket, service="svc", le="0.005") == 4  # cumulative
    assert sample(text, bucket, service="svc", le="120.0") == 4
    assert sample(text, bucket, service="svc", le="+Inf") == 5
    assert sample(text, "corral_lb_request_seconds_count", service="svc") == 5
    assert sample(text, "corral_lb_requests_total", service="svc", code="502") == 1
    assert sample(text, "corral_lb_retries_total", service="svc") == 1
    assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1
    assert sample(text, "corral_lb_in_flight", service="svc", replica="2") == 0
    assert CONTENT_TYPE_LATEST.startswith("text/plain")
    # twice in a row: a throwaway registry each time, nothing global
    assert render({"svc": merged}) == render({"svc": merged})


def test_a_p99_stays_near_the_slowest_it_counted() -> None:
    """Quantiles are interpolated inside their bucket; with a bucket 2.5-5 s wide, streams
    whose first token took at most 2.8 s read as a TTFT p99 of 3.75 s (a review saw 4.6 s).
    Bounds at most 1.5x apart from 10 ms up keep it within the slowest's bucket."""
    from corral.balancer.metrics import quantile

    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    buckets[LATENCY_BUCKETS.index(0.025)] = 98  # cache hits: 20-25 ms
    buckets[bisect.bisect_left(LATENCY_BUCKETS, 2.8)] = 2  # two slow ones of 2.8 s
    p99 = quantile(0.99, buckets)
    assert p99 is not None and 2.5 <= p99 <= 3.0, p99
    assert max(b / a for a, b in itertools.pairwise(LATENCY_BUCKETS) if a >= 0.01) <= 1.5


def test_a_worker_with_other_bounds_is_left_out_of_the_histogram() -> None:
    """A worker of another corral version (until `daemon restart-workers`) has other bounds:
    its counts added bucket by bucket would land in the wrong ones, so they are left out."""
    ours = _fake_stats("svc", requests=1, buckets={4: 1}, sum=0.01)
    other = _fake_stats("svc", requests=2, buckets={4: 2}, sum=0.02)
    other["latency"]["buckets"] = other["latency"]["buckets"][:18]  # the 17 bounds of before
    merged = merge_stats([ours, other])
    assert merged["requests"] == 3  # the counters still add up
    assert merged["latency"]["buckets"][4] == 1 and merged["latency"]["count"] == 1


def test_stats_count_and_are_json_serialisable() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            lb.set_ready({})
            async with s.get(lb.url + "/") as resp:
                assert resp.status == 503
            stats = lb.stats()
            assert stats["errors_by_reason"] == {"no_replica": 1}
            assert stats["codes"] == {"503": 1}
            assert stats["latency"]["count"] == 1
            assert len(stats["latency"]["buckets"]) == len(LATENCY_BUCKETS) + 1
            assert json.loads(json.dumps(stats)) == stats

    run(main())


def test_qps_from_request_timestamps() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            assert lb.qps() == 0.0
            for _ in range(12):
                async with s.get(lb.url + "/") as resp:
                    assert resp.status == 200
            assert lb.qps() == pytest.approx(12 / 60)
            assert lb.qps(window=30) == pytest.approx(12 / 30)
            assert len(lb.request_timestamps()) == 12
            with pytest.raises(ValueError):
                lb.qps(window=0)

    run(main())

    # the window boundary, on timestamps placed by hand
    lb = LoadBalancer(name="s")
    now = time.monotonic()
    for age in (120.0, 90.0, 50.0, 20.0, 10.0, 1.0):
        lb._timestamps.append(now - age)
    assert lb.qps(60.0) == pytest.approx(4 / 60)
    assert lb.qps(15.0) == pytest.approx(2 / 15)
    assert lb.request_timestamps(30.0) == [now - 20.0, now - 10.0, now - 1.0]
    assert len(lb.request_timestamps(1000.0)) == 6


def test_ttft_is_exposed_per_replica_too() -> None:
    """docs/llm.md: TTFT per service and per replica in /metrics (the slow replica is found
    in Prometheus, not only in `status --json`)."""
    ttft = [0] * (len(LATENCY_BUCKETS) + 1)
    ttft[LATENCY_BUCKETS.index(0.05)] = 2
    slow = [0] * (len(LATENCY_BUCKETS) + 1)
    slow[LATENCY_BUCKETS.index(2.5)] = 1
    one = _fake_stats(
        "svc",
        replicas={
            "1": {"ready": True, "ttft": {"buckets": ttft, "sum": 0.08, "count": 2}},
            "2": {"ready": True, "ttft": {"buckets": slow, "sum": 2.0, "count": 1}},
        },
    )
    text = render({"svc": merge_stats([one])}).decode()
    name = "corral_lb_replica_ttft_seconds"
    assert sample(text, f"{name}_count", service="svc", replica="1") == 2
    assert sample(text, f"{name}_count", service="svc", replica="2") == 1
    assert sample(text, f"{name}_bucket", service="svc", replica="2", le="1.0") == 0
    assert sample(text, f"{name}_bucket", service="svc", replica="2", le="2.5") == 1


def test_what_a_gone_balancer_leaves_is_its_counters_not_its_gauges() -> None:
    """A worker that ended counted requests (kept in the sums) but has none in flight any
    more: its gauges must not stay in the service's figures forever."""
    gone = merge_stats([])
    gone.update(requests=40, retries=3, in_flight=5, streaming=2, held=4, held_total=9)
    gone["codes"] = {"200": 40}
    gone["replicas"] = {"7": {"in_flight": 5, "served": 40}}
    kept = counters_only(gone)
    assert (kept["requests"], kept["retries"], kept["held_total"], kept["codes"]) == (
        40, 3, 9, {"200": 40},
    )  # fmt: skip
    assert (kept["in_flight"], kept["streaming"], kept["held"]) == (0, 0, 0)
    assert kept["replicas"]["7"]["in_flight"] == 0 and not kept["replicas"]["7"]["ready"]
    assert kept["replicas"]["7"]["served"] == 40  # a counter: kept


def test_a_replicas_ttft_series_does_not_go_down_when_its_balancer_is_replaced() -> None:
    """corral_lb_replica_ttft_seconds is a histogram (counters): a route change that retires
    a balancer must not take the replica's part of it away (Prometheus reads a reset)."""
    old, new = merge_stats([]), merge_stats([])
    for stats, n in ((old, 5), (new, 1)):
        ttft = {"buckets": [n] + [0] * len(LATENCY_BUCKETS), "sum": 0.01 * n, "count": n}
        stats["ttft"] = dict(ttft)
        stats["replicas"] = {"1": {"ready": True, "in_flight": 1, "ttft": dict(ttft)}}
    text = render({"svc": merge_stats([new, counters_only(old)])}).decode()
    assert sample(text, "corral_lb_ttft_seconds_count", service="svc") == 6
    name = "corral_lb_replica_ttft_seconds_count"
    assert sample(text, name, service="svc", replica="1") == 6
    assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1


def test_a_carried_replica_the_live_balancers_forgot_is_not_brought_back() -> None:
    """The live balancer drops a replica's counts once it left and drained: what was carried
    of it must not bring its series back."""
    from corral.dataplane.carried import Carried

    gone = merge_stats([])
    gone["replicas"] = {"1": {"served": 4}, "2": {"served": 3}}
    live = merge_stats([])
    live["replicas"] = {"2": {"ready": True, "served": 1}}
    carried = Carried()
    carried.add("svc", gone)
    summed = carried.summed("svc", [live])
    assert list(summed["replicas"]) == ["2"] and summed["replicas"]["2"]["served"] == 4


def test_the_engines_counters_are_counters_and_their_levels_gauges() -> None:
    """An engine's prefix-cache hits and lookups and its generated tokens only grow (vLLM's
    ``*_total``): exposed as gauges, rate() and increase() would not read an engine's restart
    as a reset. Its queue, batch, KV-cache use and token rate are levels: gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    stats = merge_stats([_fake_stats("svc")])
    stats["engines"] = {
        "1": {
            "waiting": 2, "running": 3, "kv_usage": 0.5, "tokens_per_second": 90.0,
            "prefix_hits": 80.0, "prefix_queries": 100.0, "generation_tokens": 400.0,
        },
    }  # fmt: skip
    text = render({"svc": stats}).decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for key in ("prefix_hits", "prefix_queries", "generation_tokens"):
        assert types[f"corral_engine_{key}"] == "counter", key
    for key in ("waiting", "running", "kv_usage", "tokens_per_second"):
        assert types[f"corral_engine_{key}"] == "gauge", key
    assert sample(text, "corral_engine_prefix_hits_total", service="svc", replica="1") == 80
    assert sample(text, "corral_engine_generation_tokens_total", service="svc", replica="1") == 400
    assert sample(text, "corral_engine_waiting", service="svc", replica="1") == 2
