"""An engine autoscaler at zero replicas: the requests waiting in the balancer for a first
replica are its queue (docs/llm.md, "Autoscaling on the engines' load": at once from zero, a
request waiting for the first replica counts)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from corral.autoscale_queue import EngineAutoscaler, queue_depth
from corral.balancer import LoadBalancer
from corral.balancer.metrics import counters_only, merge_stats
from corral.spec import parse_spec


async def _burst_at_zero(count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``count`` requests sent to a balancer with no ready replica; its stats while they wait
    and after they gave up."""
    lb = LoadBalancer(name="chat", no_replica_wait=1.5)
    await lb.start()
    try:
        async with aiohttp.ClientSession() as session:

            async def one() -> int:
                timeout = aiohttp.ClientTimeout(total=10)
                async with session.post(
                    lb.url + "/v1/completions", data=b"{}", timeout=timeout
                ) as r:
                    return r.status

            sent = [asyncio.create_task(one()) for _ in range(count)]
            deadline = time.monotonic() + 5
            while lb.stats().get("awaiting") != count and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            waiting = lb.stats()
            assert await asyncio.gather(*sent) == [503] * count  # no replica came: no hang
            return waiting, lb.stats()
    finally:
        await lb.stop()


def test_a_burst_waiting_for_the_first_replica_is_the_queue_it_scales_on() -> None:
    """40 requests waiting at zero asked for one replica ("0 request(s) waiting in engines and
    balancer ... up from zero to 1 at once"), and the other 38 were held behind it for the
    whole upscale hold; they are the queue: ceil(40 / 4), clipped to the most, at once."""
    waiting, after = asyncio.run(asyncio.wait_for(_burst_at_zero(40), 20))
    merged = merge_stats([waiting])
    assert queue_depth(merged) == 40
    assert queue_depth(merge_stats([after])) == 0  # gone with them
    assert counters_only(waiting)["awaiting"] == 0  # a gauge: a gone worker's is not carried
    policy = parse_spec(
        "run: x\nservice:\n  readiness_probe: /health\n  replicas: 0\n  max_replicas: 3\n"
        "  autoscaling:\n    upscale_delay: 60\n    metrics:\n"
        "      - {type: queue_depth, target: 4}\n"
    ).service.replica_policy
    scaler = EngineAutoscaler(policy)
    scaler.sample(merged, list)
    decision = scaler.decide(100.0, [99.5] * 40)
    assert decision.target == 3, decision.reason
    assert decision.reason.startswith("40 request(s) waiting in engines and balancer")
