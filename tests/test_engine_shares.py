"""The balancer workers split the reading of the engines' metrics (corral.dataplane.engine_shares).

Against real HTTP servers on 127.0.0.1 that count the scrapes they answer: with two workers each
engine is read once an interval, not twice, and both workers still see every engine's load;
a worker that stops reading has its engines read by the other; an engine that does not answer
is not waited on by every worker in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from corral.balancer import LoadBalancer
from corral.dataplane import engine_shares, engines
from corral.dataplane.engine_shares import Share, share_dir

HOST = "127.0.0.1"


class MetricsServer:
    """Answers ``GET /metrics`` with a vLLM queue gauge of ``waiting`` (or never answers, when
    ``silent``), counting the connections it accepted."""

    def __init__(self, waiting: int, *, silent: bool = False) -> None:
        self.waiting = waiting
        self.silent = silent
        self.scrapes = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.url = f"http://{HOST}:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.scrapes += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.silent:
                await asyncio.sleep(engines.TIMEOUT * 2)
                return
            body = b"vllm:num_requests_waiting %d\nvllm:num_requests_running 1\n" % self.waiting
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def servers(*specs: tuple[int, bool]) -> AsyncIterator[list[MetricsServer]]:
    made = [MetricsServer(waiting, silent=silent) for waiting, silent in specs]
    for server in made:
        await server.start()
    try:
        yield made
    finally:
        for server in made:
            await server.stop()


class Worker:
    """One balancer worker's part: its slot, its balancer, what it read last."""

    def __init__(self, directory: Path, slot: int, workers: int = 2) -> None:
        self.share = Share(directory, slot, workers)
        self.lb = LoadBalancer(name="chat")
        self.seen: dict[int, Any] = {}

    async def refresh(self, ready: dict[int, str]) -> dict[int, Any]:
        self.seen = await engine_shares.refresh(self.lb, ready, "/metrics", self.seen, self.share)
        return self.seen


def waiting(seen: dict[int, Any]) -> dict[int, float]:
    return {rid: s["waiting"] for rid, s in seen.items()}


def test_two_workers_read_each_engine_once_and_both_see_every_engine(tmp_path: Path) -> None:
    async def go() -> None:
        async with servers((10, False), (11, False), (12, False), (13, False)) as fleet:
            ready = {rid: s.url for rid, s in enumerate(fleet, start=1)}
            directory = share_dir(tmp_path, "chat")
            first, second = Worker(directory, 0), Worker(directory, 1)
            await first.refresh(ready)  # nothing shared yet: it reads all four
            await second.refresh(ready)
            for server in fleet:
                server.scrapes = 0
            for _ in range(3):
                for worker in (first, second):
                    assert waiting(await worker.refresh(ready)) == {1: 10, 2: 11, 3: 12, 4: 13}
                    assert {rid: load.waiting for rid, load in worker.lb._engines.items()} == {
                        1: 10,
                        2: 11,
                        3: 12,
                        4: 13,
                    }
            assert [s.scrapes for s in fleet] == [3, 3, 3, 3]
            assert sorted(p.name for p in directory.iterdir()) == ["slot-0.json", "slot-1.json"]

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_worker_that_stops_reading_has_its_engines_read_by_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_shares, "STALE", 0.3)

    async def go() -> None:
        async with servers((1, False), (2, False), (3, False), (4, False)) as fleet:
            ready = {rid: s.url for rid, s in enumerate(fleet, start=1)}
            directory = share_dir(tmp_path, "chat")
            first, second = Worker(directory, 0), Worker(directory, 1)
            await second.refresh(ready)
            await first.refresh(ready)
            for server in fleet:
                server.scrapes = 0
            await first.refresh(ready)  # the second's readings are fresh: half the fleet
            assert sum(s.scrapes for s in fleet) == 2
            # The second worker reads no more (dead, stopped): once its readings are stale,
            # the first reads all four itself, and still sees every engine.
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                before = [s.scrapes for s in fleet]
                seen = await first.refresh(ready)
                if all(s.scrapes > b for s, b in zip(fleet, before, strict=True)):
                    break
                assert asyncio.get_running_loop().time() < deadline, "never read them all"
                await asyncio.sleep(0.05)
            assert waiting(seen) == {1: 1, 2: 2, 3: 3, 4: 4}

    asyncio.run(asyncio.wait_for(go(), 30))


def test_an_engine_that_does_not_answer_is_waited_on_by_one_worker_only(tmp_path: Path) -> None:
    async def go() -> None:
        async with servers((5, False), (0, True)) as (talking, silent):
            ready = {1: talking.url, 2: silent.url}  # replica 2 is slot 1's to read
            directory = share_dir(tmp_path, "chat")
            first, second = Worker(directory, 0), Worker(directory, 1)
            assert waiting(await second.refresh(ready)) == {1: 5}  # tried both, one answered
            assert silent.scrapes == 1
            assert waiting(await first.refresh(ready)) == {1: 5}
            assert silent.scrapes == 1  # written down as tried: the first did not wait on it

    asyncio.run(asyncio.wait_for(go(), 30))


def test_one_worker_shares_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        async with servers((7, False)) as (server,):
            directory = share_dir(tmp_path, "chat")
            alone = Worker(directory, 0, workers=1)
            assert waiting(await alone.refresh({1: server.url})) == {1: 7}
            assert not directory.exists()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_file_caught_mid_write_is_not_used(tmp_path: Path) -> None:
    """The other slot's file with a byte changed (as a reader that met a write under way sees
    it) fails its check: its engines are read again, and what it says is not taken."""

    async def go() -> None:
        async with servers((1, False), (2, False)) as fleet:
            ready = {rid: s.url for rid, s in enumerate(fleet, start=1)}
            directory = share_dir(tmp_path, "chat")
            first, second = Worker(directory, 0), Worker(directory, 1)
            await second.refresh(ready)
            path = directory / "slot-1.json"
            whole = path.read_bytes()
            path.write_bytes(whole.replace(b'"waiting": 2.0', b'"waiting": 9.0'))
            for server in fleet:
                server.scrapes = 0
            assert waiting(await first.refresh(ready)) == {1: 1, 2: 2}
            assert [s.scrapes for s in fleet] == [1, 1]
            path.write_bytes(whole)  # whole again: taken, replica 2 not read
            await first.refresh(ready)
            assert [s.scrapes for s in fleet] == [2, 1]

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_service_with_no_ready_replica_keeps_no_engine_readings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its last replica gone (replaced, scaled to zero, not ready), a service's engines said
    nothing since: the readings of the replica that left are not reported on (`status` showed
    its queue, running requests and tokens per second for as long as none was ready)."""
    from corral.dataplane.worker import Worker, _Service

    class Balancer:
        load: Any = "never given"

        def set_engine_load(self, load: Any) -> None:
            self.load = load

    async def scenario() -> None:
        worker = Worker(tmp_path, 0)
        lb = Balancer()
        last = {1: {"waiting": 3.0, "running": 4.0, "tokens_per_second": 850.0}}
        svc = _Service(key="k", lb=cast(Any, lb), ready={}, engine_path="/metrics", engines=last)
        worker.services["chat"] = svc
        monkeypatch.setattr(engines, "INTERVAL", 0.001)
        loop = asyncio.create_task(worker._engines_loop())
        await asyncio.sleep(0.1)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        assert svc.engines == {}
        assert lb.load == {}

    asyncio.run(scenario())
