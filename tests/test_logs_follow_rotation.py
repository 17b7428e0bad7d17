"""A followed log rotated under its follower (corral.api_logs with corral.logfiles).

corral.logfiles moves a log over its cap to ``.1`` and empties it in place; the follower of
``GET /v1/services/{name}/logs?follow=true`` then starts over at 0. What the app wrote after the
follower's last read and before the rotation is in ``.1``: it must reach the follower too, or
every rotation silently drops up to a poll's worth (0.2 s) of lines from `corral logs`.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from corral import api_logs
from corral.logfiles import rotate_if_over

pytestmark = pytest.mark.timeout(60)


class FakeDaemon:
    """What the logs route reads of the daemon, and nothing else."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.home = log.parent
        self.finished = False
        self.stop_requested = asyncio.Event()

    def controller(self, name: str) -> None:
        return None

    def log_path(self, name: str, kind: str, replica: int | None) -> Path:
        return self.log

    def log_finished(self, name: str, replica: int | None) -> bool:
        return self.finished

    def has_service(self, name: str) -> bool:
        return True


def _append(log: Path, first: int, count: int) -> None:
    with log.open("a") as f:
        f.writelines(f"line {n:06d} {'x' * 60}\n" for n in range(first, first + count))


def test_lines_written_just_before_a_rotation_reach_the_follower(tmp_path: Path) -> None:
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"")
    daemon = FakeDaemon(log)
    rounds, per_write = 6, 100

    async def follow() -> bytes:
        async def logs(request: web.Request) -> web.StreamResponse:
            return await api_logs.logs(request, daemon)  # type: ignore[arg-type]

        app = web.Application()
        app.router.add_get("/v1/services/{name}/logs", logs)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/v1/services/web/logs"
        got = b""
        try:
            async with aiohttp.ClientSession() as session:
                params = {"follow": "true", "replica": "1"}
                async with session.get(url, params=params) as answer:
                    n = 0
                    for _ in range(rounds):
                        _append(log, n, per_write)  # the follower reads these...
                        n += per_write
                        while f"line {n - 1:06d} ".encode() not in got:
                            got += await asyncio.wait_for(answer.content.readany(), 10)
                        # ...and these are written right before a rotation: a follower polling
                        # every 0.2 s almost never reads them from the log itself.
                        _append(log, n, per_write)
                        n += per_write
                        assert rotate_if_over(log, 1) is not None
                    _append(log, n, per_write)
                    daemon.finished = True
                    got += await asyncio.wait_for(answer.content.read(), 10)
        finally:
            await runner.cleanup()
        return got

    got = asyncio.run(follow())
    numbers = [int(n) for n in re.findall(rb"^line (\d+) x+$", got, re.M)]
    total = (2 * rounds + 1) * per_write
    missing = sorted(set(range(total)) - set(numbers))
    assert not missing, f"{len(missing)} lines never reached the follower, from {missing[0]}"
    assert numbers == list(range(total)), "lines repeated or out of order"
