"""Prometheus metrics and QPS of the load balancer, read back from the exposition text.

Reuses the replicas and helpers of tests/test_balancer.py; everything on 127.0.0.1 and bounded
by ``run``'s deadline.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from test_balancer import HOST, Replica, cluster, run

from corral.balancer import CONTENT_TYPE_LATEST, BalancerMetrics, LoadBalancer, render
from corral.balancer.metrics import ERROR_REASONS


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


def exposition(metrics: BalancerMetrics) -> str:
    return render(metrics.registry).decode()


def test_requests_codes_latency_and_retries_are_counted() -> None:
    async def main() -> None:
        metrics = BalancerMetrics(CollectorRegistry())
        async with (
            cluster(2, dead=1, policy="round_robin", metrics=metrics) as (lb, _, ready),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(7):
                async with s.get(lb.url + "/") as resp:
                    assert resp.status == 200
            for _ in range(3):
                async with s.get(lb.url + "/500") as resp:
                    assert resp.status == 500
            # replica 3 is dead: every request that picked it first was retried once
            failed = lb.stats()["replicas"][3]["failed"]
            assert failed > 0
            lb.set_ready({})
            async with s.get(lb.url + "/") as resp:
                assert resp.status == 503
            lb.set_ready(ready)
            text = exposition(metrics)
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
        # stop() removed the service's series
        text = exposition(metrics)
        assert "service=" not in text

    run(main())


def test_in_flight_gauge_follows_requests_and_is_removed_after_drain() -> None:
    async def main() -> None:
        metrics = BalancerMetrics(CollectorRegistry())
        async with (
            cluster(2, policy="round_robin", metrics=metrics) as (lb, reps, ready),
            aiohttp.ClientSession() as s,
        ):
            held = asyncio.ensure_future(s.get(lb.url + "/hold"))
            await asyncio.wait_for(reps[0].arrived.wait(), 5)
            text = exposition(metrics)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") == 0
            lb.set_ready({2: ready[2]})  # replica 1 leaves while busy: kept until drained
            text = exposition(metrics)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") == 1
            reps[0].gate.set()
            resp = await held
            assert resp.status == 200
            resp.release()
            assert await lb.wait_drained(1, 5)
            text = exposition(metrics)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="1") is None
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") == 0
            lb.set_ready({})  # an idle replica that leaves goes at once
            text = exposition(metrics)
            assert sample(text, "corral_lb_in_flight", service="svc", replica="2") is None

    run(main())


def test_proxy_errors_client_disconnects_and_malformed_requests() -> None:
    async def main() -> None:
        metrics = BalancerMetrics(CollectorRegistry())
        async with cluster(1, metrics=metrics, max_body_bytes=100) as (lb, reps, _):
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
            text = exposition(metrics)

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


def test_one_registry_for_several_services() -> None:
    async def main() -> None:
        metrics = BalancerMetrics(CollectorRegistry())
        replica = await Replica(1).start()
        a = LoadBalancer(name="a", metrics=metrics)
        b = LoadBalancer(name="b", metrics=metrics)
        try:
            for lb in (a, b):
                await lb.start()
                lb.set_ready({1: replica.url})
            async with aiohttp.ClientSession() as s:
                for lb, n in ((a, 2), (b, 3)):
                    for _ in range(n):
                        async with s.get(lb.url + "/") as resp:
                            assert resp.status == 200
            text = exposition(metrics)
            assert sample(text, "corral_lb_requests_total", service="a", code="200") == 2
            assert sample(text, "corral_lb_requests_total", service="b", code="200") == 3
            await a.stop()
            text = exposition(metrics)
            assert sample(text, "corral_lb_requests_total", service="a", code="200") is None
            assert sample(text, "corral_lb_requests_total", service="b", code="200") == 3
        finally:
            await a.stop()
            await b.stop()
            await replica.stop()

    run(main())


def test_bind_is_counted_per_service() -> None:
    metrics = BalancerMetrics(CollectorRegistry())
    first = metrics.bind("svc")
    second = metrics.bind("svc")  # e.g. a restarted balancer overlapping the old one
    first.response(200, 0.01)
    second.response(200, 0.01)
    first.close()
    first.close()  # idempotent
    text = exposition(metrics)
    assert sample(text, "corral_lb_requests_total", service="svc", code="200") == 2
    second.close()
    assert "service=" not in exposition(metrics)
    assert CONTENT_TYPE_LATEST.startswith("text/plain")


def test_metrics_off_by_default_and_stats_still_count() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            assert lb._m is None
            lb.set_ready({})
            async with s.get(lb.url + "/") as resp:
                assert resp.status == 503
            assert lb.stats()["errors_by_reason"] == {"no_replica": 1}

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
