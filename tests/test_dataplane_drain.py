"""A drain means every balancer worker stopped routing to the replica, not only the ones the
daemon happens to hear from.

A replica is ended after its drain, so a drain that returns while some worker still routes to
it sends that worker's requests to a dead port (the 502s of a chaos round where a restarted
daemon retired replicas before it pushed any table). Real :class:`DataPlane`, real worker
processes, a real SQLite state file; the replica URL needs no server (nothing is requested).
Last, what goes when a service is taken out of the table: the files its workers share.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from conftest import pid_alive

from corral.dataplane.plane import DataPlane
from corral.dataplane.protocol import Route
from corral.ports import free_port
from corral.state import Store

pytestmark = pytest.mark.timeout(120)

REPLICA = "http://127.0.0.1:9"  # never asked: the tests only change the ready set


@asynccontextmanager
async def plane_of(home: Path, workers: int) -> AsyncIterator[DataPlane]:
    home.mkdir(exist_ok=True)
    plane = DataPlane(home, Store(home / "state.db"), workers=workers, respawn=None)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop(workers=True)
    for row in (plane.slots.rows() or {}).values():  # stop(workers=True) ended them all
        assert not pid_alive(row.pid), row


def connected_pids(plane: DataPlane) -> list[int]:
    return [w["pid"] for w in plane.workers() if w["connected"]]


async def connected(plane: DataPlane, count: int) -> None:
    assert await plane.wait_until(lambda: len(connected_pids(plane)) >= count, 30), plane.workers()


def test_a_drain_counts_from_the_first_table_the_daemon_pushes(tmp_path: Path) -> None:
    """A restarted daemon pushes nothing until its controllers re-adopted (``open``); a drain
    that timed out meanwhile ended a replica the workers still routed to."""

    async def scenario() -> None:
        async with plane_of(tmp_path / "home", 1) as plane:
            route = plane.route("svc", Route(port=free_port()))
            route.set_ready({1: REPLICA})
            await connected(plane, 1)
            route.set_ready({})
            drain = asyncio.ensure_future(route.wait_drained(1, 0.2))
            done, _ = await asyncio.wait([drain], timeout=1.5)  # 7x the drain's own timeout
            assert not done, "the drain ended before any table without the replica went out"
            plane.open()
            assert await asyncio.wait_for(drain, 30) is True

    asyncio.run(scenario())


def test_a_drain_waits_for_a_worker_that_is_not_connected(tmp_path: Path) -> None:
    """A worker reconnecting (or replaced after a crash) serves its old table until it gets
    the new one: the drain waits for every slot, not only the workers connected now."""

    async def scenario() -> None:
        async with plane_of(tmp_path / "home", 2) as plane:
            plane.open()
            route = plane.route("svc", Route(port=free_port()))
            route.set_ready({1: REPLICA})
            await connected(plane, 2)
            victim = connected_pids(plane)[0]
            os.kill(victim, signal.SIGKILL)
            assert await plane.wait_until(lambda: victim not in connected_pids(plane), 10)
            route.set_ready({})
            assert await route.wait_drained(1, 60) is True
            now = connected_pids(plane)
            assert len(now) == 2 and victim not in now, (victim, now, plane.workers())

    asyncio.run(scenario())


def test_a_service_taken_down_leaves_none_of_its_shared_files(tmp_path: Path) -> None:
    """The files the balancer workers of a service share (the conversation table, the board of
    counts in flight, the board of streams under way) go with the service, so a service of
    that name later starts afresh (docs/llm.md)."""
    from corral.balancer.affinity import table_path
    from corral.balancer.load_board import board_path, streams_board_path

    home = tmp_path / "home"
    shared = home / "dataplane"
    shared.mkdir(parents=True)
    plane = DataPlane(home, Store(home / "state.db"), workers=1, respawn=None)
    files = [where(shared, "svc") for where in (table_path, board_path, streams_board_path)]
    for path in files:
        path.write_bytes(b"\0" * 64)
    other = board_path(shared, "other")
    other.write_bytes(b"\0" * 64)

    async def scenario() -> None:
        plane.route("svc", Route(port=free_port()))
        assert plane.remove("svc")

    asyncio.run(scenario())
    assert [path for path in files if path.exists()] == []
    assert other.exists()  # another service's is left alone


def test_a_worker_that_reconnects_is_not_counted_twice(tmp_path: Path) -> None:
    """A worker whose channel dropped (a send that timed out) reconnects, alive, and reports
    its counters from where they were: what the daemon carried of it when the channel dropped
    (dataplane.carried) must not be added on top."""
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    replica = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=replica.serve_forever, daemon=True).start()

    def total(plane: DataPlane) -> int:
        return sum((plane.stats().get("svc") or {}).get("codes", {}).values())

    async def scenario() -> None:
        async with plane_of(tmp_path / "home", 1) as plane:
            plane.open()
            port = free_port()
            route = plane.route("svc", Route(port=port))
            route.set_ready({1: f"http://127.0.0.1:{replica.server_port}"})
            await connected(plane, 1)
            assert await route.wait_drained(2, 30)  # the worker applied a table
            url = f"http://127.0.0.1:{port}/"
            for _ in range(10):
                await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            assert await plane.wait_until(lambda: total(plane) == 10, 10), plane.stats()
            pid = connected_pids(plane)[0]
            plane._conns[pid].writer.close()  # the channel drops; the worker lives on
            assert await plane.wait_until(lambda: pid not in plane._conns, 10)
            assert await plane.wait_until(lambda: pid in connected_pids(plane), 10)
            assert await plane.wait_until(lambda: bool(plane._conns[pid].reports), 10)
            await asyncio.sleep(0.6)  # a few more reports
            assert total(plane) == 10, plane.stats()

    try:
        asyncio.run(scenario())
    finally:
        replica.shutdown()


def test_a_new_daemons_tables_come_after_every_table_of_the_one_before(tmp_path: Path) -> None:
    """Workers judge a drain by the last table seq they applied: a daemon that started its
    tables again below its predecessor's would see every worker past a table it had not sent
    yet, and end drains before any worker dropped the replica. Each daemon's seq starts from
    the clock (ms) and only grows."""
    store = Store(tmp_path / "state.db")

    async def last_seq_of_a_busy_daemon() -> int:
        plane = DataPlane(tmp_path, store, workers=1, respawn=None)
        seq = 0
        for _ in range(500):  # far more changes than milliseconds pass
            seq = plane.changed()
            await asyncio.sleep(0)
        return seq

    async def first_seq_of_the_next() -> int:
        return DataPlane(tmp_path, store, workers=1, respawn=None).changed()

    before = asyncio.run(last_seq_of_a_busy_daemon())
    assert asyncio.run(first_seq_of_the_next()) > before
