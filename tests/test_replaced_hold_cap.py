"""restart-workers: what a replaced worker holds waits within the limit (gate, "held marks"),
at most half the drain or its own hold_timeout_seconds; but the daemon kills the old process
at most ``MAX_OLD_WORKER_GRACE`` (+1 s) after telling it to exit. With a long drain and a long
hold (an LLM service: drain_timeout_seconds 300, hold_timeout_seconds 200) a held request
waited past the kill and was cut unsent, where before it went out at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
from conftest import wait_until
from test_shared_load import Replica, _busy_and_late, _one_slot

from corral.dataplane.processes import MAX_OLD_WORKER_GRACE


def test_a_replaced_workers_held_requests_go_before_it_is_killed(tmp_path: Path) -> None:

    async def go() -> None:
        replica = await Replica(1).start()
        worker, route, base = _one_slot(tmp_path, replica)
        table = route("least_load", 1)
        table["svc"]["config"]["drain_timeout"] = 300.0
        table["svc"]["config"]["routing"]["hold_timeout"] = 200.0
        running = None
        try:
            await worker._apply(table)
            lb = worker.services["svc"].lb
            async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
                busy, late = await _busy_and_late(first, second, f"{base}/hold/", replica, lb)
                running = asyncio.create_task(worker.run())
                worker.stop.set()  # the daemon's "exit": it drains, and is killed at ~61 s
                await wait_until(lambda: lb._stopping, 10, "stopping")
                left = lb._release_at - time.monotonic()
                assert 0 < left <= MAX_OLD_WORKER_GRACE / 2, left
                lb._release_at = time.monotonic()  # the bound, now: the test need not wait
                for gate in ("busy", "late"):
                    replica.gates.setdefault(gate, asyncio.Event()).set()
                assert (await asyncio.wait_for(busy, 10)).status == 200
                assert (await asyncio.wait_for(late, 10)).status == 200
        finally:
            for gate in ("busy", "late"):
                replica.gates.setdefault(gate, asyncio.Event()).set()
            worker.stop.set()
            if running is not None:
                await asyncio.wait_for(running, 30)
            assert replica._runner is not None
            await replica._runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 90))
