"""Load policies weigh every balancer worker's requests (corral.balancer.load_board).

``least_load``, ``power_of_two`` and ``instance_aware_least_load`` once read only the requests of
the worker they run in: with two workers on a port, two concurrent requests accepted by
different workers reached the same idle replica about half the time. Now the workers of a
service share their counts on a board, as ``prefix_affinity`` already did, and a load policy
reads every worker's; ``round_robin`` reads no load and shares nothing.

In-process tests run a real balancer (corral.balancer.LoadBalancer) in slot 0 of 2 in front of
real aiohttp replicas, and stand for the other worker by writing its row of the board; the last
test brings a service up through the CLI with two real worker processes.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import wait_until

from corral.balancer import LoadBalancer
from corral.balancer.load_board import HeldMarks, LoadBoard, board_path, streams_path

HOST = "127.0.0.1"


class Replica:
    """Answers its own id; ``/hold`` only once ``gate`` opens, ``/hold/NAME`` once the gate of
    that name in ``gates`` does (``arrived`` counts both)."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.gate = asyncio.Event()
        self.gates: dict[str, asyncio.Event] = {}
        self.arrived = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Replica:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, 0).start()
        self.url = f"http://{HOST}:{self._runner.addresses[0][1]}"
        return self

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        if request.path == "/hold":
            self.arrived += 1
            await self.gate.wait()
        elif request.path.startswith("/hold/"):
            self.arrived += 1
            await self.gates.setdefault(request.path[6:], asyncio.Event()).wait()
        return web.json_response({"replica": self.rid})


@asynccontextmanager
async def worker_of_two(
    tmp_path: Path, policy: str, n: int = 2
) -> AsyncIterator[tuple[LoadBalancer, list[Replica], LoadBoard]]:
    """A balancer in slot 0 of 2 under ``policy`` in front of ``n`` replicas (ids 1..n), and
    the row of the board that the worker in slot 1 writes."""
    path = board_path(tmp_path, "svc")
    replicas = [await Replica(i + 1).start() for i in range(n)]
    lb = LoadBalancer(
        name="svc", policy=policy, routing={"load_file": str(path), "slot": 0, "workers": 2}
    )
    await lb.start()
    ready = {r.rid: r.url for r in replicas}
    lb.set_ready(ready)
    other = LoadBoard.open(path, 1, 2)
    assert other is not None
    other.arrange(tuple(sorted(ready)), {})
    try:
        yield lb, replicas, other
    finally:
        other.close()
        await lb.stop()
        for r in replicas:
            assert r._runner is not None
            await r._runner.cleanup()


@pytest.mark.parametrize("policy", ["least_load", "power_of_two", "instance_aware_least_load"])
def test_a_load_policy_passes_over_a_replica_the_other_worker_filled(
    tmp_path: Path, policy: str
) -> None:
    """The other worker has 3 requests in flight on replica 1: every request this worker
    sends, on a new replica connection (the general path) or a pooled one (the fast path),
    goes to replica 2. Alone, least_load rotates between the two idle replicas."""

    async def go() -> None:
        async with (
            worker_of_two(tmp_path, policy) as (lb, _, other),
            aiohttp.ClientSession() as http,
        ):
            other.publish(1, 3)
            url = f"http://{HOST}:{lb.port}/"
            went = [(await (await http.get(url)).json())["replica"] for _ in range(6)]
            assert went == [2] * 6
            other.publish(1, 0)  # its requests ended: both idle again, both used
            # 30, not 6: power_of_two breaks a tie by its random first pick, and 6 requests
            # all went to one idle replica once in about 32 runs (a fresh-clone CI run).
            went = [(await (await http.get(url)).json())["replica"] for _ in range(30)]
            assert set(went) == {1, 2}

    asyncio.run(asyncio.wait_for(go(), 60))


def test_round_robin_shares_no_board(tmp_path: Path) -> None:
    """Round robin reads no load: its requests pay no board."""

    async def go() -> None:
        async with worker_of_two(tmp_path, "round_robin") as (lb, _, _):
            assert lb._board is None and lb._stream_board is None

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_request_under_least_load_is_on_the_board_while_in_flight(tmp_path: Path) -> None:
    """From the moment it is sent until its answer is back, on the general path and the fast
    path alike, a request counts on the board the other workers read; and a choice by load
    weighs the other worker's streams as this worker's (streams board beside it)."""

    async def go() -> None:
        async with (
            worker_of_two(tmp_path, "least_load", n=1) as (lb, replicas, other),
            aiohttp.ClientSession() as http,
        ):
            replica = replicas[0]
            assert lb._board is not None and lb._board.streams is lb._stream_board
            url = f"http://{HOST}:{lb.port}"
            for sent in range(1, 3):  # the first on a new connection, the second pooled
                held = asyncio.create_task(http.get(url + "/hold"))
                await wait_until(lambda s=sent: replica.arrived == s, 10, "the request sent")  # type: ignore[misc]
                assert other.totals((1,), {}) == {1: 1}
                replica.gate.set()
                assert (await held).status == 200
                await wait_until(lambda: lb.in_flight(1) == 0, 10, "the answer back")
                assert other.totals((1,), {}) == {1: 0}
                replica.gate = asyncio.Event()
            assert streams_path(board_path(tmp_path, "svc")).exists()

    asyncio.run(asyncio.wait_for(go(), 60))


# ------------------------------------------------------------------ two real worker processes

HOLD_APP = """
import os, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
MARKS = Path(os.environ["MARKS"])
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.startswith("/hold/"):
            key = self.path.rsplit("/", 1)[1]
            me = os.environ["CORRAL_REPLICA_ID"]
            (MARKS / f"{key}-{me}-{time.monotonic_ns()}").touch()
            deadline = time.monotonic() + 20
            while not (MARKS / f"{key}-go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        body = os.environ["CORRAL_REPLICA_ID"].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


def test_two_workers_send_two_concurrent_requests_to_two_replicas(
    corral_home: Any, tmp_path: Path
) -> None:
    """Two balancer worker processes, least_load (the default), two replicas. In each round a
    request is held by its replica, then a second is sent on a new connection (which either
    worker may accept): it goes to the other replica, every round. Each worker alone chose by
    its own requests, and the second request went to the busy replica in about a quarter of
    the rounds (half of them reach the other worker, whose idle view was a coin toss)."""
    from conftest import spec_text, write_spec

    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "hold.py").write_text(HOLD_APP)
    run = f"exec {sys.executable} hold.py"
    text = spec_text("pair", 2, run=run, workdir=tmp_path, envs={"MARKS": str(marks)})
    corral_home.run("up", str(write_spec(tmp_path / "pair.yaml", text)), "-y", timeout=120)
    url = str(corral_home.wait_replicas("pair", 2, timeout=60)["endpoint"])
    assert len(corral_home.worker_pids()) == 2

    def held_on(key: str, count: int) -> list[str]:
        corral_home.wait_for(
            lambda: len(list(marks.glob(f"{key}-*"))) >= count or None, 20, f"{count} at {key}"
        )
        return sorted(p.name.split("-")[1] for p in marks.glob(f"{key}-*"))

    def get(key: str, answers: list[str]) -> None:
        with urllib.request.urlopen(f"{url}/hold/{key}", timeout=30) as answer:
            answers.append(answer.read().decode())

    for round_ in range(10):
        key = f"r{round_}"
        answers: list[str] = []
        sent = [threading.Thread(target=get, args=(key, answers)) for _ in range(2)]
        sent[0].start()
        held_on(key, 1)
        sent[1].start()
        replicas = held_on(key, 2)
        (marks / f"{key}-go").touch()
        for thread in sent:
            thread.join(30)
        assert len(set(replicas)) == 2, (round_, replicas)
        assert sorted(answers) == replicas
    corral_home.run("down", "pair", timeout=60)


def _one_slot(tmp_path: Path, replica: Replica) -> tuple[Any, Callable[..., Any], str]:
    """A worker in slot 0 of 2 (the daemon's tables applied to it as to a worker process),
    ``route(policy, limit)``: the table of one service in front of ``replica`` (limit 0: no
    ``max_in_flight_per_replica``), and the service's URL."""
    from test_balancer import closed_port

    from corral.dataplane.worker import Worker

    (tmp_path / "dataplane").mkdir()  # the daemon makes it
    worker = Worker(tmp_path, 0)
    worker.fleet = 2
    port = closed_port()

    def route(policy: str, limit: int = 0) -> dict[str, Any]:
        ready = {"1": {"url": replica.url, "version": 1}}
        config: dict[str, Any] = {"policy": policy}
        if limit:
            config["routing"] = {"max_in_flight_per_replica": limit, "hold_timeout": 20}
        return {"svc": {"port": port, "host": HOST, "config": config, "ready": ready}}

    return worker, route, f"http://{HOST}:{port}"


async def _busy_and_late(
    first: aiohttp.ClientSession,
    second: aiohttp.ClientSession,
    url: str,
    replica: Replica,
    lb: LoadBalancer,
) -> tuple[asyncio.Task[aiohttp.ClientResponse], asyncio.Task[aiohttp.ClientResponse]]:
    """With a limit of 1: ``busy``, a request the replica holds (``url + "busy"``), and
    ``late``, a second one the balancer ``lb`` holds."""
    busy = asyncio.create_task(first.get(url + "busy"))
    await wait_until(lambda: replica.arrived == 1, 10, "the replica busy")
    late = asyncio.create_task(second.get(url + "late"))
    await wait_until(lambda: lb.held() == 1, 10, "the second request held")
    return busy, late


@dataclass
class _Busy:
    """A worker in slot 0 of 2 in front of one replica, ``max_in_flight_per_replica`` 1:
    ``busy`` on the replica, ``late`` held by the worker's balancer ``lb``."""

    replica: Replica
    worker: Any
    route: Callable[..., Any]
    url: str
    lb: LoadBalancer
    session: aiohttp.ClientSession  # the one ``busy`` went on, for more requests
    busy: asyncio.Task[aiohttp.ClientResponse]
    late: asyncio.Task[aiohttp.ClientResponse]
    running: asyncio.Task[None] | None = None

    def exit(self) -> asyncio.Task[None]:
        """What the daemon's "exit" (restart-workers) does: the worker stops listening and
        drains; its run, ended by the test or the context's end."""
        self.running = asyncio.create_task(self.worker.run())
        self.worker.stop.set()
        return self.running


@asynccontextmanager
async def _busy_worker(tmp_path: Path, **config: float) -> AsyncIterator[_Busy]:
    """:class:`_Busy`, the service's ``config`` (``drain_timeout``) and ``hold_timeout``
    as given. At the end every gate is open, the worker's run has ended (or, not exited, its
    balancers are gone), and the replica is stopped."""
    replica = await Replica(1).start()
    worker, route, base = _one_slot(tmp_path, replica)
    table = route("least_load", 1)
    if "hold_timeout" in config:
        table["svc"]["config"]["routing"]["hold_timeout"] = config.pop("hold_timeout")
    table["svc"]["config"].update(config)
    state = None
    try:
        await worker._apply(table)
        lb = worker.services["svc"].lb
        url = f"{base}/hold/"
        async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
            busy, late = await _busy_and_late(first, second, url, replica, lb)
            state = _Busy(replica, worker, route, url, lb, first, busy, late)
            yield state
    finally:
        for gate in ("busy", "late", "newer"):
            replica.gates.setdefault(gate, asyncio.Event()).set()
        if state is not None and state.running is not None:
            await asyncio.wait_for(state.running, 30)
        else:
            await worker._apply({})
            await wait_until(lambda: not worker.retiring, 20, "every balancer gone")
        assert replica._runner is not None
        await replica._runner.cleanup()


async def _held_and_marked(
    tmp_path: Path, lb: LoadBalancer, replica: Replica, arrived: int = 1
) -> None:
    """``lb``, retired, still holds its one request (the replica full, having seen
    ``arrived``), and marks it for the balancers of other processes (``load_board.HeldMarks``)."""
    marks = HeldMarks.open(board_path(tmp_path / "dataplane", "svc"), 2)
    assert marks is not None
    try:
        await wait_until(lambda: marks.total() == 1, 10, "the held request marked")
        assert lb.held() == 1 and replica.arrived == arrived
    finally:
        marks.close()


def test_a_route_change_leaves_the_new_balancers_counts_on_the_board(tmp_path: Path) -> None:
    """An update of a balancer setting (here the policy) gives the service a new balancer in
    the worker, in the same slot and so the same row of the board, and retires the old one.
    The old one once rewrote that row from its own counts (the worker tells it the ready set)
    and cleared it at its end: either way the other workers lost sight of the new balancer's
    requests in flight."""

    async def go() -> None:
        replica = await Replica(1).start()
        worker, route, base = _one_slot(tmp_path, replica)
        other = None
        try:
            await worker._apply(route("least_load"))
            old = worker.services["svc"].lb
            other = LoadBoard.open(board_path(tmp_path / "dataplane", "svc"), 1, 2)
            assert other is not None
            other.arrange((1,), {})
            url = f"{base}/hold"
            async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
                on_old = asyncio.create_task(first.get(url))
                await wait_until(lambda: replica.arrived == 1, 10, "a request on the old one")
                await worker._apply(route("power_of_two"))  # the update
                assert worker.services["svc"].lb is not old and worker.retiring
                on_new = asyncio.create_task(second.get(url))
                await wait_until(lambda: replica.arrived == 2, 10, "a request on the new one")
                # The old one's request still loads the replica: it counts, on the hand-over row.
                assert other.totals((1,), {}) == {1: 2}
                on_old.cancel()  # its client leaves: the old balancer's request ends, then it
                await first.close()
                await wait_until(lambda: not worker.retiring, 20, "the old balancer gone")
                assert other.totals((1,), {}) == {1: 1}  # the new balancer's, still there
                replica.gate.set()
                assert (await on_new).status == 200
        finally:
            replica.gate.set()
            await worker._apply({})
            await wait_until(lambda: not worker.retiring, 20, "every balancer gone")
            if other is not None:
                other.close()
            assert replica._runner is not None
            await replica._runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 60))


async def _end_both(
    replica: Replica,
    gates: tuple[str, ...],
    old: Any,
    running: asyncio.Task[None] | None,
    new: Any,
    other: LoadBoard | None,
) -> None:
    """The end of a test of two workers of one slot (``old`` draining in ``running``): every
    gate open, the old one's drain over, the new one's balancers gone, the replica stopped."""
    for gate in gates:
        replica.gates.setdefault(gate, asyncio.Event()).set()
    old.stop.set()
    if running is not None:
        await asyncio.wait_for(running, 20)
    await new._apply({})
    await wait_until(lambda: not new.retiring, 20, "every balancer gone")
    if other is not None:
        other.close()
    assert replica._runner is not None
    await replica._runner.cleanup()


def test_a_worker_replaced_in_its_slot_leaves_the_row_to_its_successor(tmp_path: Path) -> None:
    """``corral daemon restart-workers`` starts a new worker process in each slot, then stops
    the old one, which drains its requests. The old one kept writing the slot's row (each of
    its requests that ended published its count, and its end cleared the row), wiping the new
    worker's counts from the other workers' view. Two workers of one slot in this process
    stand for the two processes."""
    from test_balancer import closed_port

    from corral.dataplane.worker import Worker

    async def go() -> None:
        replica = await Replica(1).start()
        (tmp_path / "dataplane").mkdir()  # the daemon makes it
        old, new = Worker(tmp_path, 0), Worker(tmp_path, 0)
        port = closed_port()
        ready = {"1": {"url": replica.url, "version": 1}}
        route = {"svc": {"port": port, "host": HOST, "config": {}, "ready": ready}}
        other = None
        running = None
        try:
            old.fleet = new.fleet = 2
            await old._apply(route)
            other = LoadBoard.open(board_path(tmp_path / "dataplane", "svc"), 1, 2)
            assert other is not None
            other.arrange((1,), {})
            url = f"http://{HOST}:{port}/hold/"
            async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
                on_old = asyncio.create_task(first.get(url + "old"))
                await wait_until(lambda: replica.arrived == 1, 10, "a request on the old one")
                await new._apply(route)  # the new worker binds the port too
                running = asyncio.create_task(old.run())
                old.stop.set()  # the daemon's "exit": it stops listening, then drains
                lb = old.services["svc"].lb
                await wait_until(lambda: lb._server is None, 10, "the old one's listener closed")
                on_new = asyncio.create_task(second.get(url + "new"))
                await wait_until(lambda: replica.arrived == 2, 10, "a request on the new one")
                assert other.totals((1,), {}) == {1: 2}  # the old one's too, while it runs
                replica.gates["old"].set()  # the old one's request ends, and the old one
                assert (await on_old).status == 200
                await asyncio.wait_for(running, 20)
                assert other.totals((1,), {}) == {1: 1}  # the new one's, still there
                replica.gates["new"].set()
                assert (await on_new).status == 200
        finally:
            await _end_both(replica, ("old", "new"), old, running, new, other)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_route_change_keeps_the_limit_while_the_old_balancers_requests_run(
    tmp_path: Path,
) -> None:
    """With ``max_in_flight_per_replica`` 1 and the retired balancer's request still on the
    one replica, the new balancer holds its request until that one ends: before, the retired
    balancer's requests counted nowhere and the replica took both."""

    async def go() -> None:
        replica = await Replica(1).start()
        worker, route, base = _one_slot(tmp_path, replica)
        try:
            await worker._apply(route("least_load", 1))
            url = f"{base}/hold/"
            async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
                on_old = asyncio.create_task(first.get(url + "old"))
                await wait_until(lambda: replica.arrived == 1, 10, "a request on the old one")
                await worker._apply(route("power_of_two", 1))  # the update
                new = worker.services["svc"].lb
                on_new = asyncio.create_task(second.get(url + "new"))
                await wait_until(lambda: new._held, 10, "the new one's request held")
                assert replica.arrived == 1
                replica.gates["old"].set()  # the old one's request ends: room for the new one
                assert (await on_old).status == 200
                await wait_until(lambda: replica.arrived == 2, 10, "the held request sent")
                replica.gates["new"].set()
                assert (await on_new).status == 200
        finally:
            for gate in ("old", "new"):
                replica.gates.setdefault(gate, asyncio.Event()).set()
            await worker._apply({})
            await wait_until(lambda: not worker.retiring, 20, "every balancer gone")
            assert replica._runner is not None
            await replica._runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_balancers_retiring_in_one_slot_count_together_until_the_last_ends(
    tmp_path: Path, build: str
) -> None:
    """Two route changes in a row leave two retiring balancers in one slot of one process:
    their hand-over row holds the sum of their counts, and the first to end leaves the
    other's; what they hold is marked as their sum and counts on no replica. The daemon zeroes
    the row once the slot's process is gone (a process killed while retiring)."""
    import corral.balancer.load_board as load_board

    if build == "compiled" and load_board._BUILD is LoadBoard:
        pytest.skip("no compiled build here")
    path = board_path(tmp_path, "svc")
    reader_class = LoadBoard if build == "pure" else load_board._BUILD
    mapped = load_board.map_shared(path, load_board.ROWS * 8 * load_board.COLUMNS, "test")
    assert mapped is not None
    reader = reader_class(mapped, 1, 4)  # slot 1 of 2: rows 0-1, hand-over rows 2-3
    reader.arrange((1, 2), {})
    first, second = {1: 2}, {1: 1, 2: 3}
    board_a, streams_a = load_board.retired(path, 0, 2, (1, 2), first, {})
    board_b, _ = load_board.retired(path, 0, 2, (1, 2), second, None)
    assert board_a is not None and board_b is not None and streams_a is not None
    assert reader.totals((1, 2), {}) == {1: 3, 2: 3}
    marks = load_board.HeldMarks.open(path, 2)
    assert marks is not None and marks.total() == 0
    board_a.hold(2)  # what each holds: marked together, and no replica's count
    board_b.hold(1)
    assert marks.total() == 3 and reader.totals((1, 2), {}) == {1: 3, 2: 3}
    first[1] = 1
    board_a.publish(1, 1)
    assert reader.totals((1, 2), {}) == {1: 2, 2: 3} and marks.total() == 3
    board_a.clear()  # the first one ends
    assert reader.totals((1, 2), {}) == {1: 1, 2: 3} and marks.total() == 1
    load_board.clear_hand_over(tmp_path, 0, 2)  # its process gone
    assert reader.totals((1, 2), {}) == {1: 0, 2: 0} and marks.total() == 0
    marks.close()
    board_b.clear()
    assert reader.totals((1, 2), {}) == {1: 0, 2: 0}
    for board in (board_a, board_b, streams_a):
        board.close()


@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_the_held_mark_takes_the_64th_replicas_cell_on_a_hand_over_row(
    tmp_path: Path, build: str
) -> None:
    """The mark of what a retiring balancer holds lives in a hand-over row's last cell, under
    an id no replica has: readers take it as no count, and that row leaves off the 64th ready
    replica's count (the docstring of ``load_board`` says so)."""
    import corral.balancer.load_board as load_board

    if build == "compiled" and load_board._BUILD is LoadBoard:
        pytest.skip("no compiled build here")
    path = board_path(tmp_path, "svc")
    reader_class = LoadBoard if build == "pure" else load_board._BUILD
    mapped = load_board.map_shared(path, load_board.ROWS * 8 * load_board.COLUMNS, "test")
    assert mapped is not None
    ready = tuple(range(1, 65))
    reader = reader_class(mapped, 1, 4)
    reader.arrange(ready, {})
    board, _ = load_board.retired(path, 0, 2, ready, {63: 2, 64: 5}, None)
    assert board is not None
    board.hold(7)
    assert reader.totals((63, 64), {}) == {63: 2, 64: 0}
    marks = load_board.HeldMarks.open(path, 2)
    assert marks is not None and marks.total() == 7
    board.clear()
    assert marks.total() == 0
    marks.close()
    board.close()


def test_forget_own_takes_back_only_what_the_leaving_balancer_wrote(tmp_path: Path) -> None:
    """``load_board.forget_own``: a cell still holding the leaving balancer's count goes to 0;
    one its successor wrote since keeps the successor's."""
    from corral.balancer.load_board import forget_own

    path = board_path(tmp_path, "svc")
    reader, leaving, successor = (LoadBoard.open(path, slot, 2) for slot in (1, 0, 0))
    assert reader is not None and leaving is not None and successor is not None
    reader.arrange((1, 2), {})
    leaving.arrange((1, 2), {1: 2, 2: 3})
    successor.arrange((1, 2), {2: 1})  # the successor's table: its own row from its counts
    leaving.publish(1, 2)  # the leaving one wrote after it, for replica 1
    forget_own(path, 0, 2, (1, 2), {1: 2, 2: 3})
    assert reader.totals((1, 2), {}) == {1: 0, 2: 1}
    for board in (reader, leaving, successor):
        board.close()


@pytest.mark.parametrize("how", ["update", "bound", "raised", "restart-workers"])
def test_what_a_retired_balancer_holds_waits_for_room_after_an_update(
    tmp_path: Path, how: str
) -> None:
    """An update retires the balancer; what it holds (every replica at its limit) once went
    out at once, past the limit. Its counts now stay on the board and it goes first when room
    frees (an elder of its successor), so it waits within the limit: ``update``. ``bound``: the
    replica stays full, and it goes out past the limit after half the drain, never a 503.
    ``raised``: the update raises the limit, which the retired balancer's requests take at once.
    ``restart-workers``: the successor is another process; what the old worker holds waits
    under its own limit, marked on the hand-over row for that process, and goes when room
    frees (it once went out at once, past the limit)."""

    async def go() -> None:
        async with _busy_worker(tmp_path) as b:
            replica, worker, route, old, url = b.replica, b.worker, b.route, b.lb, b.url
            busy, late = b.busy, b.late
            if how == "restart-workers":
                b.exit()
                await _held_and_marked(tmp_path, old, replica)
                replica.gates["busy"].set()  # room: the held request takes it
                assert (await busy).status == 200
                await wait_until(lambda: replica.arrived == 2, 10, "sent once room frees")
            elif how == "raised":
                await worker._apply(route("least_load", 8))  # the update
                await wait_until(lambda: replica.arrived == 2, 10, "sent under the new limit")
                assert old._release_at > time.monotonic()  # not by the bound: it has room
            else:
                await worker._apply(route("power_of_two", 1))  # the update
                assert old._stopping and old.held() == 1 and replica.arrived == 1
                old._expire_held(time.monotonic())  # what its ticker does
                old._send_held()  # what a wake for room does
                assert old.held() == 1 and replica.arrived == 1  # the replica is full
                newer = None
                if how == "update":  # a request to the successor waits behind the old one's
                    new = worker.services["svc"].lb
                    newer = asyncio.create_task(b.session.get(url + "newer"))
                    await wait_until(lambda: new.held() == 1, 10, "the newer one held")
                    replica.gates["busy"].set()  # room: the older held request takes it
                    assert (await busy).status == 200
                await wait_until(lambda: replica.arrived == 2, 10, "the held request sent")
                assert list(replica.gates)[1] == "late"  # the older one first
            replica.gates["late"].set()
            answer = await asyncio.wait_for(late, 10)
            assert answer.status == 200 and (await answer.json())["replica"] == 1
            if how == "update":
                assert newer is not None
                replica.gates.setdefault("newer", asyncio.Event()).set()
                assert (await asyncio.wait_for(newer, 10)).status == 200
            replica.gates["busy"].set()
            assert (await busy).status == 200

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_replaced_workers_held_request_takes_the_room_its_own_request_frees(
    tmp_path: Path,
) -> None:
    """restart-workers, limit 1: the old worker holds a request behind its own on the replica.
    Its own count stayed on the slot's row after it moved to the hand-over row, so when that
    request ended the replica still looked full, to the old worker itself too, and the held
    one went only at its bound (here 20 s, half the drain). Now the old worker takes back
    what it wrote on the row as it leaves it (``load_board.forget_own``), and the held
    request goes when the room frees."""

    async def go() -> None:
        async with _busy_worker(tmp_path, drain_timeout=40.0) as b:
            running = b.exit()
            await _held_and_marked(tmp_path, b.lb, b.replica)
            b.replica.gates["busy"].set()
            assert (await asyncio.wait_for(b.busy, 10)).status == 200
            await wait_until(lambda: b.replica.arrived == 2, 5, "sent as the room freed")
            assert b.lb._release_at > time.monotonic()  # not by its bound
            b.replica.gates["late"].set()
            assert (await asyncio.wait_for(b.late, 10)).status == 200
            await asyncio.wait_for(running, 20)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_replaced_workers_held_requests_go_before_it_is_killed(tmp_path: Path) -> None:
    """restart-workers: what a replaced worker holds waits within the limit, at most half the
    drain or its own hold_timeout_seconds; but the daemon kills the old process at most
    ``MAX_OLD_WORKER_GRACE`` (+1 s) after telling it to exit. With a long drain and a long
    hold (an LLM service: drain_timeout_seconds 300, hold_timeout_seconds 200) a held request
    waited past the kill and was cut unsent, where before it went out at once."""
    from corral.dataplane.processes import MAX_OLD_WORKER_GRACE

    async def go() -> None:
        async with _busy_worker(tmp_path, drain_timeout=300.0, hold_timeout=200.0) as b:
            b.exit()  # it drains, and is killed at ~61 s
            await wait_until(lambda: b.lb._stopping, 10, "stopping")
            left = b.lb._release_at - time.monotonic()
            assert 0 < left <= MAX_OLD_WORKER_GRACE / 2, left
            b.lb._release_at = time.monotonic()  # the bound, now: the test need not wait
            for gate in ("busy", "late"):
                b.replica.gates.setdefault(gate, asyncio.Event()).set()
            assert (await asyncio.wait_for(b.busy, 10)).status == 200
            assert (await asyncio.wait_for(b.late, 10)).status == 200

    asyncio.run(asyncio.wait_for(go(), 90))


def test_a_worker_exiting_after_an_update_sends_what_its_retired_balancer_holds(
    tmp_path: Path,
) -> None:
    """An update retires a balancer that holds a request (its replica full), then the worker
    is told to exit (restart-workers): the successor stops with no heir, and the retired one,
    which waited on the successor's limit, is not left waiting on it: it waits on the fleet's
    room, marked for the next process, and sends what it holds once room frees; and the
    worker's run ends only once the retired balancer's requests are answered (the process exits
    then, and would cut them)."""

    async def go() -> None:
        async with _busy_worker(tmp_path) as b:
            worker, old, replica = b.worker, b.lb, b.replica
            await worker._apply(b.route("power_of_two", 1))  # the update
            assert old._stopping and old.held() == 1
            running = b.exit()
            await wait_until(lambda: worker.services["svc"].lb._stopping, 10, "stopping")
            await _held_and_marked(tmp_path, old, replica)
            replica.gates["busy"].set()
            assert (await asyncio.wait_for(b.busy, 10)).status == 200
            await wait_until(lambda: replica.arrived == 2, 1.5, "the held request sent")
            await asyncio.sleep(0.2)
            assert not running.done()  # the retired balancer's requests are under way
            replica.gates["late"].set()
            assert (await asyncio.wait_for(b.late, 10)).status == 200
            await asyncio.wait_for(running, 20)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_new_worker_process_lets_what_the_old_one_holds_go_first(tmp_path: Path) -> None:
    """restart-workers with ``max_in_flight_per_replica`` 1: the old worker process holds a
    request (the replica full with the other slot's) as it drains, and the new one receives a
    newer request. The old one's request once went out at once, past the limit; now it waits
    for room, and the new process, seeing it marked on the hand-over row, lets it take that
    room first, though the new one is woken first. Two workers of one slot in this process
    stand for the two processes; the test writes the other slot's row."""
    from corral.dataplane.worker import Worker

    async def go() -> None:
        replica = await Replica(1).start()
        old, route, base = _one_slot(tmp_path, replica)
        new = Worker(tmp_path, 0)
        new.fleet = 2
        other = LoadBoard.open(board_path(tmp_path / "dataplane", "svc"), 1, 2)
        assert other is not None
        other.arrange((1,), {1: 1})  # the other slot's request fills the replica
        running = None
        try:
            await old._apply(route("least_load", 1))
            lb = old.services["svc"].lb
            url = f"{base}/hold/"
            async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
                late = asyncio.create_task(first.get(url + "late"))
                await wait_until(lambda: lb.held() == 1, 10, "the old one's request held")
                await new._apply(route("least_load", 1))  # the new process binds the port too
                running = asyncio.create_task(old.run())
                old.stop.set()  # the daemon's "exit" for the old one: it drains
                await wait_until(lambda: lb._server is None, 10, "the old one's listener closed")
                await _held_and_marked(tmp_path, lb, replica, arrived=0)
                newer = asyncio.create_task(second.get(url + "newer"))
                successor = new.services["svc"].lb
                await wait_until(lambda: successor.held() == 1, 10, "the newer one held")
                other.publish(1, 0)  # the other slot's request ends: room for one
                successor._send_held()  # what a wake for room does, before the old one's
                assert successor.held() == 1 and replica.arrived == 0
                await wait_until(lambda: replica.arrived == 1, 10, "the old one's sent")
                assert list(replica.gates) == ["late"] and successor.held() == 1
                replica.gates["late"].set()  # room again: the newer one's turn
                assert (await asyncio.wait_for(late, 10)).status == 200
                await wait_until(lambda: replica.arrived == 2, 10, "the newer one sent")
                replica.gates["newer"].set()
                assert (await asyncio.wait_for(newer, 10)).status == 200
                await asyncio.wait_for(running, 20)
        finally:
            await _end_both(replica, ("late", "newer"), old, running, new, other)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_replaced_worker_leaves_no_count_on_its_successors_row(tmp_path: Path) -> None:
    """restart-workers: the new process writes the slot's row from the table it applies, and
    the old one serves on until it is told to exit, writing that row too (a request it sends
    or ends meanwhile). Once it left the row (its counts on the hand-over row, then gone),
    what it wrote there last stayed: a replica loaded by nothing, full under a limit, until
    the new process happened to send it a request. It now takes back what it wrote as it
    leaves the row (``load_board.forget_own``); and for an old process that does not (an
    earlier corral, being upgraded), once it is gone the daemon pushes the table again, and
    every worker writes its row anew from its own counts."""
    from corral.dataplane.replace import replace_worker
    from corral.state import WorkerRow

    path = board_path(tmp_path, "svc")
    (tmp_path / "dataplane").mkdir()
    routing = {"load_file": str(path), "slot": 0, "workers": 2}
    old, new = (LoadBalancer(name="svc", policy="least_load", routing=routing) for _ in "ab")
    ready = {1: "http://127.0.0.1:9"}
    reader = LoadBoard.open(path, 1, 2)
    assert reader is not None
    reader.arrange((1,), {})
    old.set_ready(ready)
    new.set_ready(ready)  # the new process applied the table: the row is its own
    old._acquire(1)  # the old one still serves: a request it sends lands on the row
    old.leave_boards()  # told to exit: it takes back what it wrote on the row
    assert reader.totals((1,), {}) == {1: 1}  # on the hand-over row while it runs
    old._release(1)
    assert old._board is not None
    old._board.clear()
    assert reader.totals((1,), {}) == {1: 0}
    # An old process of an earlier corral (restart-workers is how an upgrade goes) took
    # nothing back: its count stays on the row until the push once it is gone.
    earlier = LoadBoard.open(path, 0, 2)
    assert earlier is not None
    earlier.arrange((1,), {1: 1})
    earlier.close()
    assert reader.totals((1,), {}) == {1: 1}

    class Conn:
        seq = 1

    class Plane:
        home, size, routes = tmp_path, 2, {}
        _conns = {2: Conn()}

        def current_seq(self) -> int:
            return 1

        async def wait_until(self, predicate: Any, timeout: float) -> bool:
            return bool(predicate())

        def changed(self) -> int:
            new.set_ready(ready)  # what the worker does with a table
            return 2

    gone = WorkerRow(slot=0, pid=2**22 + 7, created=0.0, started_at=0.0)  # no such process
    asyncio.run(replace_worker(Plane(), 0, gone, 2, 1.0))  # type: ignore[arg-type]
    assert reader.totals((1,), {}) == {1: 0}
    reader.close()
