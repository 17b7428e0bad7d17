"""The balancer's LLM routing: held requests, session and prefix affinity, engine metrics.

Real balancers (corral.balancer.LoadBalancer) on 127.0.0.1 in front of real HTTP replicas: small
aiohttp apps whose answers the test controls, and the project's LLM engine simulator
(corral.llmsim) where the engines' own behaviour matters. Two balancers on one port stand for
two balancer workers: they share no state, as worker processes do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from conftest import wait_until

from corral.balancer import LoadBalancer, merge_stats, render
from corral.balancer.policies import EngineLoad, RequestView
from corral.dataplane import engines
from corral.llm_view import replica_llm, service_llm
from corral.llmsim import EngineConfig, SimServer

T = TypeVar("T")
HOST = "127.0.0.1"


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class Replica:
    """Answers ``/hold`` when its gate opens, anything else at once, naming itself; on
    ``/stream`` sends a first event at once and ends the stream when its gate opens."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.gate = asyncio.Event()
        self.arrived = 0
        self.streams = 0  # open on /stream
        self.paths: list[str] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Replica:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.url = f"http://{HOST}:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.paths.append(request.path)
        if request.path == "/stream":
            answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await answer.prepare(request)
            await answer.write(b"data: %d\n\n" % self.rid)
            self.streams += 1
            try:
                await self.gate.wait()
                await answer.write(b"data: [DONE]\n\n")
                await answer.write_eof()
            finally:
                self.streams -= 1
            return answer
        if request.path == "/hold":
            self.arrived += 1
            await self.gate.wait()
        return web.json_response({"replica": self.rid})


@asynccontextmanager
async def fleet(n: int) -> AsyncIterator[list[Replica]]:
    replicas = [await Replica(i + 1).start() for i in range(n)]
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


@asynccontextmanager
async def balancer(replicas: dict[int, str], **kwargs: Any) -> AsyncIterator[LoadBalancer]:
    lb = LoadBalancer(name="llm", **kwargs)
    await lb.start()
    lb.set_ready(replicas)
    try:
        yield lb
    finally:
        await lb.stop()


# -- holding requests while every replica is at its limit ----------------------------------------


def test_a_request_waits_in_the_balancer_until_a_replica_has_room() -> None:
    """With one request in flight allowed per replica, a third request to two busy replicas
    waits in the balancer (never reaching an engine queue) and goes out the moment one of them
    answers; FIFO order is kept."""

    async def go() -> None:
        async with fleet(2) as (one, two):
            ready = {1: one.url, 2: two.url}
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 20}
            async with balancer(ready, routing=routing) as lb, aiohttp.ClientSession() as http:
                url = f"http://{HOST}:{lb.port}"
                first = [asyncio.create_task(http.get(url + "/hold")) for _ in range(2)]
                await wait_until(lambda: one.arrived + two.arrived == 2, 10, "two held requests")
                third = asyncio.create_task(http.get(url + "/after"))
                await wait_until(lambda: lb.held() == 1, 10, "the third request held")
                await asyncio.sleep(0.2)
                assert "/after" not in one.paths + two.paths  # not sent while both are full
                one.gate.set()
                answer = await third
                assert answer.status == 200
                assert (await answer.json())["replica"] == 1  # the one that had room
                two.gate.set()
                for task in first:
                    assert (await task).status == 200
                assert lb.stats()["held_total"] == 1 and lb.held() == 0

    run(go())


def test_a_held_request_gets_503_with_retry_after_at_its_bound() -> None:
    async def go() -> None:
        async with fleet(1) as (one,):
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 0.5}
            async with (
                balancer({1: one.url}, routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                busy = asyncio.create_task(http.get(url + "/hold"))
                await wait_until(lambda: one.arrived == 1, 10, "the replica busy")
                answer = await http.get(url + "/late", timeout=aiohttp.ClientTimeout(total=10))
                assert answer.status == 503
                assert answer.headers["Retry-After"] == "1"
                assert "in flight" in (await answer.json())["error"]
                assert lb.stats()["held_expired"] == 1
                text = render({"llm": lb.stats()}).decode()  # and for Prometheus, as counters
                assert 'corral_lb_held_requests_total{service="llm"} 1.0' in text, text
                assert 'corral_lb_held_expired_total{service="llm"} 1.0' in text, text
                one.gate.set()
                assert (await busy).status == 200

    run(go())


def test_ttft_counts_the_time_a_request_was_held_in_the_balancer() -> None:
    """TTFT is what the client waits for its first token: a stream held behind a full replica
    waited that long too (it was timed from its sending to the replica, so `status` said
    TTFT 100 ms while clients waited seconds in the hold)."""

    async def go() -> None:
        async with fleet(1) as (one,), aiohttp.ClientSession() as http:
            lb = await one_at_a_time(one)
            try:
                url = f"http://{HOST}:{lb.port}/stream"
                first = await http.get(url)
                await first.content.readany()  # its first event came: under way
                second = asyncio.create_task(http.get(url))
                await wait_until(lambda: lb.held() == 1, 10, "the second stream held")
                await asyncio.sleep(0.6)
                one.gate.set()
                await first.read()
                await (await second).read()
                ttft = lb.stats()["ttft"]
                assert ttft["count"] == 2
                assert ttft["sum"] >= 0.6, ttft  # the second's client waited 0.6 s at least
            finally:
                await lb.stop()

    run(go())


@pytest.mark.parametrize("policy", ["least_load", "prefix_affinity"])
def test_a_replica_that_joins_takes_what_is_held(policy: str) -> None:
    """Scaling up while requests are held (the moment it is done for): the held request
    goes to the new replica at once, not at its bound."""

    async def go() -> None:
        async with fleet(2) as (one, two):
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 20}
            async with (
                balancer({1: one.url}, routing=routing, policy=policy) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                busy = asyncio.create_task(http.get(url + "/hold"))
                await wait_until(lambda: one.arrived == 1, 10, "the replica busy")
                held = asyncio.create_task(http.post(url + "/v1/completions", json={"prompt": "x"}))
                await wait_until(lambda: lb.held() == 1, 10, "a request held")
                lb.set_ready({1: one.url, 2: two.url})
                answer = await asyncio.wait_for(held, 5)
                assert answer.status == 200 and (await answer.json())["replica"] == 2
                one.gate.set()
                assert (await busy).status == 200

    run(go())


async def one_at_a_time(replica: Replica) -> LoadBalancer:
    """A started balancer in front of ``replica`` that sends it one request at a time and
    holds the others; stopped by the test itself."""
    lb = LoadBalancer(name="llm", routing={"max_in_flight_per_replica": 1, "hold_timeout": 20})
    await lb.start()
    lb.set_ready({1: replica.url})
    return lb


def test_a_balancer_stopping_answers_what_it_holds_at_once() -> None:
    """Held requests never reached a replica: when the balancer stops they get a 503 with
    Retry-After right away (a retry is safe), not an empty reply when the stop's grace ends."""

    async def go() -> None:
        async with fleet(1) as (one,), aiohttp.ClientSession() as http:
            lb = await one_at_a_time(one)
            url = f"http://{HOST}:{lb.port}"
            busy = asyncio.create_task(http.get(url + "/hold"))
            await wait_until(lambda: one.arrived == 1, 10, "the replica busy")
            held = asyncio.create_task(http.get(url + "/late"))
            await wait_until(lambda: lb.held() == 1, 10, "a request held")
            stopping = asyncio.create_task(lb.stop())
            answer = await asyncio.wait_for(held, 2)  # the stop's grace is 5 s
            assert answer.status == 503 and answer.headers["Retry-After"] == "1"
            assert "stopping" in (await answer.json())["error"]
            one.gate.set()
            await stopping
            await busy

    run(go())


def test_the_prompt_is_recorded_where_the_request_went_not_where_the_policy_chose() -> None:
    """The policy's choice by load is full (two streams under way weigh little), so the
    balancer sends the document's first question to the other replica: the index records it
    there, and the next question goes straight there (it was recorded on the full one, and
    the next question was held for a replica that never saw the document)."""

    async def go() -> None:
        async with fleet(2) as (one, two):
            routing = {"max_in_flight_per_replica": 2, "hold_timeout": 10, "hold_patience": 5}
            async with (
                balancer({1: one.url}, routing=routing, policy="prefix_affinity") as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                streams = [asyncio.create_task(http.get(url + "/stream")) for _ in range(2)]
                await wait_until(lambda: one.streams == 2, 10, "two streams under way")
                lb.set_ready({1: one.url, 2: two.url})
                busy = asyncio.create_task(http.get(url + "/hold"))
                await wait_until(lambda: two.arrived == 1, 10, "the other replica busy")
                document = "D" * 2000
                for q in range(2):
                    body = {"prompt": f"{document} question {q}"}
                    answer = await asyncio.wait_for(
                        http.post(url + "/v1/completions", json=body), 3
                    )
                    assert (await answer.json())["replica"] == 2
                policy: Any = lb._policy
                assert policy.index.size(1) == 0 and policy.index.size(2) > 0
                assert lb.stats()["held_total"] == 0
                one.gate.set()
                two.gate.set()
                await busy
                for stream in streams:
                    await (await stream).read()

    run(go())


def test_a_request_that_would_wait_once_the_balancer_stops_is_answered_at_once() -> None:
    """After stop() began (a worker handing its port over leaves kept-alive connections a
    grace), a request that would be held gets its 503 with Retry-After at once: no room
    will come to a balancer that stops."""

    async def go() -> None:
        async with fleet(1) as (one,), aiohttp.ClientSession() as http:
            lb = await one_at_a_time(one)
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            writer.write(b"GET /warm HTTP/1.1\r\nHost: x\r\n\r\n")  # a kept-alive connection
            await reader.readuntil(b"}")
            busy = asyncio.create_task(http.get(f"http://{HOST}:{lb.port}/hold"))
            await wait_until(lambda: one.arrived == 1, 10, "the replica busy")
            stopping = asyncio.create_task(lb.stop(idle_grace=3))
            await asyncio.sleep(0.1)
            writer.write(b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1)
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
            one.gate.set()
            await stopping
            await busy
            writer.close()

    run(go())


def test_the_limit_is_shared_between_balancer_workers() -> None:
    """Each worker sees only its own requests: a limit of 4 with 2 workers lets each send 2."""

    async def go() -> None:
        async with fleet(1) as (one,):
            routing = {"max_in_flight_per_replica": 4, "hold_timeout": 20, "workers": 2}
            async with (
                balancer({1: one.url}, routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                tasks = [asyncio.create_task(http.get(url + "/hold")) for _ in range(3)]
                await wait_until(lambda: one.arrived == 2 and lb.held() == 1, 10, "2 out, 1 held")
                one.gate.set()
                for task in tasks:
                    assert (await task).status == 200

    run(go())


def _held_for_home(patience: float) -> tuple[int, int, int, int]:
    """Two replicas, one request each at most, prefix_affinity. A document's first question
    holds its replica (its home); a second question arrives while only the other replica has
    room. Returns (home, where the second was answered, requests held while the home was
    busy, how many times the policy chose)."""

    async def go() -> tuple[int, int, int, int]:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            routing = {
                "max_in_flight_per_replica": 1,
                "hold_timeout": 20,
                "hold_patience": patience,
            }
            doc = "The shared document. " * 100
            async with (
                balancer(ready, policy="prefix_affinity", routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                chose = 0
                select = lb._policy.select

                def counted(*args: Any) -> int:
                    nonlocal chose
                    chose += 1
                    return select(*args)  # type: ignore[no-any-return]

                lb._policy.select = counted  # type: ignore[method-assign]
                first = asyncio.create_task(http.post(url + "/hold", json={"prompt": doc + "Q0?"}))
                await wait_until(lambda: sum(r.arrived for r in replicas) == 1, 10, "the home busy")
                home = next(r for r in replicas if r.arrived)
                second = asyncio.create_task(
                    http.post(url + "/after", json={"prompt": doc + "Q1?"})
                )
                if patience > 1:
                    await wait_until(lambda: lb.held() == 1, 10, "the question held")
                    await asyncio.sleep(0.3)
                    held = lb.held()
                    home.gate.set()
                else:
                    await asyncio.sleep(0)
                    held = lb.held()
                answer = await second
                where = (await answer.json())["replica"]
                home.gate.set()
                assert (await first).status == 200 and answer.status == 200
                assert lb.held() == 0
                return home.rid, where, held, chose

    return run(go())


def test_a_held_request_waits_for_the_replica_that_has_its_prefix() -> None:
    """With room only on the other replica, a question of a document cached on a busy one
    waits for it (within its patience) rather than compute the document elsewhere."""
    home, where, held, chose = _held_for_home(patience=10)
    assert held == 1
    assert where == home  # FIFO to any replica would answer from the other: the test can fail
    # Once per question: a second choice (the fast path's pick, then the exchange's) would
    # count the held question twice in the replica's share and index.
    assert chose == 2


def test_past_its_patience_a_held_request_takes_any_replica_with_room() -> None:
    home, where, _, _ = _held_for_home(patience=0.2)
    assert where != home  # the home stays busy until the answer came


def test_requests_waiting_for_a_replica_count_as_its_load() -> None:
    """A hot document's questions wait for its busy replica only until those waiting there put
    it over the load bound (with 2 replicas and a limit of 1 request per replica, the
    document's slack is that 1: at 1 in flight and 2 waiting); the next one goes to the other
    replica. Were the waiting not counted, or the slack not capped by the limit, every
    question would wait for the one replica."""

    async def go() -> None:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 20, "hold_patience": 20}
            doc = "The hot document. " * 100
            async with (
                balancer(ready, policy="prefix_affinity", routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}/hold"
                tasks = [asyncio.create_task(http.post(url, json={"prompt": doc + "Q0?"}))]
                await wait_until(lambda: sum(r.arrived for r in replicas) == 1, 10, "home busy")
                home = next(r for r in replicas if r.arrived)
                other = next(r for r in replicas if r is not home)
                for q in range(1, 6):
                    tasks.append(
                        asyncio.create_task(http.post(url, json={"prompt": doc + f"Q{q}?"}))
                    )
                    await wait_until(
                        lambda q=q: lb.held() + other.arrived == q, 10, f"question {q} placed"
                    )
                assert (lb.held(), home.arrived, other.arrived) == (4, 1, 1)
                home.gate.set()
                other.gate.set()
                for task in tasks:
                    assert (await task).status == 200

    run(go())


def test_a_request_chosen_by_load_does_not_wait_for_a_full_replica() -> None:
    """Under session affinity over round robin, a request without a session has no replica of
    its own: with one replica full it is given the other, never held for the full one. With a
    session, it waits for the session's replica."""

    async def go() -> None:
        routing = {
            "options": {"session_header": "X-Session"},
            "max_in_flight_per_replica": 1,
            "hold_patience": 10,
        }
        lb = LoadBalancer(name="x", policy="round_robin", routing=routing)
        lb.set_ready({1: "http://127.0.0.1:9", 2: "http://127.0.0.1:9"})
        lb._in_flight[1] = 1
        plain = RequestView(b"/", None, b"Host: x\r\n")
        for _ in range(4):  # round robin names replica 1 for half of them
            assert lb._pick((), plain) == 2
        homes = set()
        for session in range(20):
            view = RequestView(b"/", None, b"Host: x\r\nX-Session: s%d\r\n" % session)
            rid = lb._pick((), view)
            homes.add(rid if rid is not None else ("held", lb._want))
        assert homes == {2, ("held", 1)}  # the sessions of replica 1 wait for it

    run(go())


# -- session affinity -----------------------------------------------------------------------------


def test_a_session_stays_on_one_replica_from_every_worker_and_moves_only_when_it_leaves() -> None:
    async def go() -> None:
        async with fleet(4) as replicas:
            ready = {r.rid: r.url for r in replicas}
            options = {"options": {"session_header": "X-Session-ID"}}
            async with (
                balancer(ready, routing=options) as a,
                balancer(ready, routing=options) as b,
                aiohttp.ClientSession() as http,
            ):
                sessions = [f"user-{i}" for i in range(40)]

                async def where(lb: LoadBalancer, session: str) -> int:
                    headers = {"X-Session-ID": session}
                    async with http.get(f"http://{HOST}:{lb.port}/x", headers=headers) as r:
                        return int((await r.json())["replica"])

                home = {s: await where(a, s) for s in sessions}
                for s in sessions:  # the other "worker", and again, agree
                    assert await where(b, s) == home[s], s
                    assert await where(a, s) == home[s], s
                assert len(set(home.values())) >= 3  # spread, not all on one
                gone = home[sessions[0]]
                rest = {rid: url for rid, url in ready.items() if rid != gone}
                a.set_ready(rest)
                b.set_ready(rest)
                for s in sessions:
                    now = await where(a, s)
                    assert now == await where(b, s)
                    assert now != gone
                    if home[s] != gone:
                        assert now == home[s], "a session of a replica still there moved"

    run(go())


# -- prefix affinity -------------------------------------------------------------------------------


SYSTEMS = [f"You are assistant number {i}. " + "Follow the house rules. " * 100 for i in range(5)]


def chat(system: str, turns: list[str]) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i} to {text}"})
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 4}).encode()


def view(body: bytes, path: bytes = b"/v1/chat/completions") -> RequestView:
    return RequestView(path, body, b"Host: x\r\n")


def test_a_conversation_reaches_one_replica_whichever_worker_takes_each_turn() -> None:
    """Two policies (two workers, no shared state), turns dealt between them at random: every
    turn of a conversation reaches the replica of its first turn; conversations spread over
    the replicas; a replica that leaves moves only its own conversations."""
    from corral.balancer.routing import make_policy

    workers = [make_policy("prefix_affinity"), make_policy("cache_aware")]
    ready = (1, 2, 3, 4)
    for policy in workers:
        policy.update(ready, {})
    rng = random.Random(7)
    homes: dict[int, int] = {}
    for turn in range(1, 6):
        for conv in range(60):
            body = chat(SYSTEMS[conv % 5], [f"question {conv}.{t}" for t in range(turn)])
            rid = rng.choice(workers).select(ready, {}, view(body))
            assert homes.setdefault(conv, rid) == rid, (conv, turn)
    shares = Counter(homes.values())
    assert max(shares.values()) <= 0.4 * 60, shares  # not one family per replica
    left = (1, 2, 3)
    for policy in workers:
        policy.update(left, {})
    for conv in range(60):
        body = chat(SYSTEMS[conv % 5], [f"question {conv}.{t}" for t in range(6)])
        rid = workers[conv % 2].select(left, {}, view(body))
        if homes[conv] != 4:
            assert rid == homes[conv]


def worker_pairs(table: Path, ready: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
    """Two workers' prefix_affinity policies sharing the table at ``table``, and two without
    one, each told ``ready``."""
    from corral.balancer.routing import make_policy

    shared = [make_policy("prefix_affinity", affinity_file=str(table)) for _ in range(2)]
    alone = [make_policy("prefix_affinity") for _ in range(2)]
    for policy in shared + alone:
        policy.update(ready, {})
    return shared, alone


def test_a_spilled_conversation_is_followed_by_every_worker(tmp_path: Path) -> None:
    """Worker A sees a conversation's first choice over the load bound and sends its first
    turn to the next replica; worker B, seeing no load, would send the next turn back to the
    first choice and compute the whole history again. With the table the workers share
    (corral.balancer.affinity), every later turn follows the spill, from either worker."""
    from corral.balancer.affinity import AffinityTable, table_path

    ready = (1, 2, 3, 4)
    path = table_path(tmp_path, "chat")
    shared, alone = worker_pairs(path, ready)
    assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    moved = 0
    for conv in range(20):
        first = chat(SYSTEMS[conv % 5], [f"q {conv}.0"])
        favourite = alone[0].select(ready, {}, view(first))
        busy = {favourite: 10}  # as worker A sees it: far over the bound
        for a, b in (shared, alone):
            spilled = a.select(ready, busy, view(first))
            assert spilled != favourite
            for turn in range(1, 4):
                later = chat(SYSTEMS[conv % 5], [f"q {conv}.{t}" for t in range(turn + 1)])
                rid = b.select(ready, {}, view(later))
                if a is shared[0]:
                    assert rid == spilled, (conv, turn)
                else:
                    moved += rid != spilled
    assert moved >= 20, moved  # without the table, B sends them back: the test can fail
    table = AffinityTable.open(path, slots=1 << 16)
    assert table is not None
    table.put(12345, 3)
    assert table.get(12345) == 3
    assert table.get(12345 + (1 << 40)) is None  # same slot, another key: not its replica
    table.put(12345 + (1 << 40), 2)  # a collision overwrites: approximate, like a cache
    assert table.get(12345) is None and table.get(12345 + (1 << 40)) == 2
    table.close()


def test_the_workers_share_their_counts_in_flight(tmp_path: Path) -> None:
    """Each worker writes its own row of the board; a reader sums every row, takes a cell
    that names another replica (a worker on an older ready set) as 0, and a worker that
    stops counts nowhere."""
    from corral.balancer.load_board import LoadBoard, board_path

    path = board_path(tmp_path, "chat")
    a, b = (LoadBoard.open(path, slot, 2) for slot in (0, 1))
    assert a is not None and b is not None
    assert path.stat().st_mode & 0o777 == 0o600
    assert LoadBoard.open(path, 0, 1) is None  # a worker alone has nothing to share
    assert LoadBoard.open(tmp_path / "no such directory" / "x.bin", 0, 2) is None
    ready = (3, 5, 8)
    a.arrange(ready, {3: 1})
    b.arrange(ready, {})
    b.publish(5, 4)
    b.publish(8, 2)
    a.publish(3, 2)
    assert a.totals(ready, {3: 2}) == {3: 2, 5: 4, 8: 2}
    assert b.totals(ready, {5: 4, 8: 2}) == {3: 2, 5: 4, 8: 2}
    b.arrange((3, 6, 8), {8: 2})  # B has a newer ready set: its column 1 is replica 6 now
    b.publish(6, 7)
    assert a.totals(ready, {3: 2}) == {3: 2, 5: 0, 8: 2}
    b.clear()
    assert a.totals(ready, {3: 2}) == {3: 2, 5: 0, 8: 0}
    a.close()
    b.close()


@asynccontextmanager
async def one_of_two_workers(
    tmp_path: Path,
) -> AsyncIterator[tuple[LoadBalancer, aiohttp.ClientSession, Replica, Any, Any]]:
    """A balancer worker (slot 0 of 2, prefix_affinity, one replica: 1) and the other worker's
    view of the boards they share: requests in flight, and streams under way."""
    from corral.balancer.load_board import LoadBoard, board_path, streams_path

    path = board_path(tmp_path, "llm")
    async with fleet(1) as replicas:
        routing = {"load_file": str(path), "slot": 0, "workers": 2}
        async with (
            balancer({1: replicas[0].url}, policy="prefix_affinity", routing=routing) as lb,
            aiohttp.ClientSession() as http,
        ):
            counts = LoadBoard.open(path, 1, 2)
            streams = LoadBoard.open(streams_path(path), 1, 2)
            assert counts is not None and streams is not None
            counts.arrange((1,), {})
            streams.arrange((1,), {})
            try:
                yield lb, http, replicas[0], counts, streams
            finally:
                counts.close()
                streams.close()


def test_a_request_on_the_fast_path_is_on_the_board_while_in_flight(tmp_path: Path) -> None:
    """A request written on a pooled connection (the fast path) counts on the board the other
    workers read from the moment it is sent until its answer is back. It once counted only in
    this worker's own view there, so the other workers saw the replica idle."""

    async def go() -> None:
        async with one_of_two_workers(tmp_path) as (lb, http, replica, other, _):
            url = f"http://{HOST}:{lb.port}"
            warm = await http.post(url + "/warm", json={"prompt": "hello"})
            assert warm.status == 200 and other.totals((1,), {}) == {1: 0}
            held = asyncio.create_task(http.post(url + "/hold", json={"prompt": "hi"}))
            await wait_until(lambda: replica.arrived == 1, 10, "the request sent")
            assert other.totals((1,), {}) == {1: 1}
            replica.gate.set()
            assert (await held).status == 200
            assert other.totals((1,), {}) == {1: 0}

    run(go())


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_load"])
def test_the_limit_counts_every_workers_requests_where_they_share_them(
    tmp_path: Path, policy: str
) -> None:
    """Two workers share ``max_in_flight_per_replica: 4`` (2 each by their own counts), but
    connections reach the workers unevenly: with the board they share, the limit is every
    worker's requests to the replica. A worker with 2 in flight while the other has none sends
    a third (it was held, and turned away with a 503 at the hold's bound, the fleet half
    empty), and one with 1 in flight while the other has 3 holds the next (4 in all)."""
    from corral.balancer.load_board import LoadBoard, board_path

    path = board_path(tmp_path, "llm")

    async def go() -> None:
        async with fleet(1) as replicas:
            replica = replicas[0]
            routing = {
                "load_file": str(path),
                "slot": 0,
                "workers": 2,
                "max_in_flight_per_replica": 4,
                "hold_timeout": 20,
            }
            async with (
                balancer({1: replica.url}, policy=policy, routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                other = LoadBoard.open(path, 1, 2)
                assert other is not None
                other.arrange((1,), {})
                url = f"http://{HOST}:{lb.port}/hold"

                def send(i: int) -> asyncio.Task[aiohttp.ClientResponse]:
                    return asyncio.create_task(http.post(url, json={"prompt": f"p{i}"}))

                async def held_while(arrived: int) -> None:
                    await wait_until(lambda: lb.held() == 1, 10, "a request held")
                    await asyncio.sleep(0.3)
                    assert replica.arrived == arrived and lb.held() == 1

                other.publish(1, 3)  # the other worker has 3 in flight
                sent = [send(0)]
                await wait_until(lambda: replica.arrived == 1, 10, "the first sent")
                sent.append(send(1))  # 1 here + 3 there: the whole limit, under this share
                await held_while(1)
                other.publish(1, 0)  # the other worker's requests ended
                await wait_until(lambda: replica.arrived == 2, 10, "the second sent")
                sent.append(send(2))  # past this worker's share, the fleet under the limit
                await wait_until(lambda: replica.arrived == 3, 10, "the third sent")
                assert lb.held() == 0
                other.publish(1, 1)  # 3 here + 1 there
                sent.append(send(3))
                await held_while(3)
                other.publish(1, 0)
                await wait_until(lambda: replica.arrived == 4, 10, "the fourth sent")
                replica.gate.set()
                assert [(await t).status for t in sent] == [200] * 4
                other.close()

    run(go())


async def _first_event(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A stream opened through the balancer, once its first event has reached the client."""
    stream = await http.get(url + "/stream")
    assert stream.status == 200
    assert (await stream.content.readline()).startswith(b"data:")
    return stream


@pytest.mark.parametrize("policy", ["least_load", "prefix_affinity"])
def test_a_streaming_request_weighs_less_than_one_waiting_for_its_first_bytes(policy: str) -> None:
    """Two replicas: one carries two streams under way, the other one request that has not
    answered yet. A plain count sends the next request (one chosen by load: no prompt) to the
    second (1 < 2); weighing what each costs a new request (corral.balancer.gate, "What a
    load is") sends it to the first, where only decoding is going on. The streams' weight
    leaves with them, also when a client goes away mid-stream."""

    async def go() -> None:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            async with (
                balancer(ready, policy=policy) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                streams = [await _first_event(http, url) for _ in range(3)]
                busy = next(r for r in replicas if r.streams == 2)
                other = next(r for r in replicas if r is not busy)
                other.gate.set()  # its one stream ends
                await wait_until(lambda: lb.in_flight(other.rid) == 0, 10, "its stream done")
                other.gate = asyncio.Event()
                assert lb._streaming == {busy.rid: 2}
                two = merge_stats([lb.stats(), lb.stats()])  # as if two workers had them
                assert two["streaming"] == 4 and two["replicas"][str(busy.rid)]["streaming"] == 4
                assert service_llm(two)["streaming"] == 4  # corral status --json
                assert replica_llm(two["replicas"][str(busy.rid)], None)["streaming"] == 4
                gauge = f'corral_lb_streaming{{replica="{busy.rid}",service="llm"}} 2.0'
                assert gauge in render({"llm": lb.stats()}).decode().splitlines()
                held = asyncio.create_task(http.get(url + "/hold"))
                await wait_until(lambda: other.arrived == 1, 10, "a request awaiting its answer")
                answer = await http.get(url + "/next")
                assert (await answer.json())["replica"] == busy.rid
                for stream in streams:
                    stream.close()  # the clients go away mid-stream
                await wait_until(lambda: lb.in_flight(busy.rid) == 0, 10, "the streams gone")
                assert lb._streaming == {}
                other.gate.set()
                assert (await held).status == 200

    run(go())


def test_a_stream_under_way_is_on_the_workers_board_of_streams(tmp_path: Path) -> None:
    """The other workers weigh this worker's streams as it does: one whose first event went
    out is on the board of streams (beside its count on the board of requests in flight)
    until it ends."""

    async def go() -> None:
        async with one_of_two_workers(tmp_path) as (lb, http, replica, counts, streams):
            stream = await _first_event(http, f"http://{HOST}:{lb.port}")
            assert counts.totals((1,), {}) == {1: 1} and streams.totals((1,), {}) == {1: 1}
            replica.gate.set()
            assert (await stream.read()).endswith(b"[DONE]\n\n")
            await wait_until(lambda: lb.in_flight(1) == 0, 10, "the stream done")
            assert counts.totals((1,), {}) == {1: 0} and streams.totals((1,), {}) == {1: 0}

    run(go())


def test_a_choice_by_load_weighs_the_other_workers_streams(tmp_path: Path) -> None:
    """prefix_affinity in one worker, choosing by load (a request with no prompt): the other
    worker has two streams under way on replica 1 and one request waiting on replica 2. Read
    from the two boards, replica 1 weighs 2/16 and replica 2 weighs 1, so 1 is chosen; with
    the streams board left out the plain counts choose 2."""
    from corral.balancer.load_board import LoadBoard, board_path, streams_path
    from corral.balancer.routing import make_policy

    counts_path = board_path(tmp_path, "llm")
    ready = (1, 2)
    boards = {}
    for path in (counts_path, streams_path(counts_path)):
        mine, theirs = LoadBoard.open(path, 0, 2), LoadBoard.open(path, 1, 2)
        assert mine is not None and theirs is not None
        mine.arrange(ready, {})
        boards[path] = (mine, theirs)
    counts, streams = boards[counts_path], boards[streams_path(counts_path)]
    counts[1].arrange(ready, {1: 2, 2: 1})
    streams[1].arrange(ready, {1: 2})
    request = RequestView(b"/next", None, b"")
    weighed = make_policy("prefix_affinity", load_board=counts[0], stream_board=streams[0])
    weighed.update(ready, {})
    assert weighed.select(ready, {}, request) == 1
    plain = make_policy("prefix_affinity", load_board=counts[0])
    plain.update(ready, {})
    assert plain.select(ready, {}, request) == 2
    for pair in boards.values():
        for board in pair:
            board.close()


def test_a_worker_passes_over_a_replica_another_worker_filled(tmp_path: Path) -> None:
    """Worker A has filled a conversation's first choice; worker B, which has sent it
    nothing, would send the conversation there too, past the load bound. With the board the
    workers share, B sees A's requests and sends it to the next replica."""
    from corral.balancer.load_board import LoadBoard, board_path
    from corral.balancer.routing import make_policy

    ready = (1, 2, 3, 4)
    path = board_path(tmp_path, "chat")
    boards = [LoadBoard.open(path, slot, 2) for slot in (0, 1)]
    for board in boards:
        assert board is not None
        board.arrange(ready, {})
    b_shared = make_policy("prefix_affinity", load_board=boards[1])
    b_alone = make_policy("prefix_affinity")
    for policy in (b_shared, b_alone):
        policy.update(ready, {})
    passed_over = 0
    for conv in range(20):
        body = view(chat(SYSTEMS[conv % 5], [f"q {conv}.0"]))
        favourite = make_policy("prefix_affinity").select(ready, {}, body)
        a_sent = {favourite: 6}  # A's requests in flight: far over the bound with them counted
        for rid in ready:
            boards[0].publish(rid, a_sent.get(rid, 0))  # type: ignore[union-attr]
        assert b_alone.select(ready, {}, body) == favourite  # alone, B cannot know
        passed_over += b_shared.select(ready, {}, body) != favourite
    assert passed_over == 20, passed_over


def test_a_placed_conversation_stays_up_to_one_request_past_the_bound(tmp_path: Path) -> None:
    """Moving a conversation makes another replica compute its whole history: it stays on its
    replica while that one is less than STICKY requests past the load bound, not further."""
    from corral.balancer.affinity import table_path
    from corral.balancer.prefix_policy import PULL_SLACK, STICKY, bound
    from corral.balancer.routing import make_policy

    ready = (1, 2, 3, 4)
    policy = make_policy("prefix_affinity", affinity_file=str(table_path(tmp_path, "chat")))
    policy.update(ready, {})
    home = policy.select(ready, {}, view(chat(SYSTEMS[0], ["hi"])))
    others = {rid: 2 for rid in ready if rid != home}

    def loads(n: int) -> dict[int, int]:
        return {**others, home: n}

    def limit(n: int) -> float:  # a chat under the shared table: the pull's slack
        return bound(loads(n), ready, 1.25, PULL_SLACK)

    over = next(n for n in range(100) if n >= limit(n))
    assert over < limit(over) + STICKY
    later = view(chat(SYSTEMS[0], ["hi", "and then?"]))
    assert policy.select(ready, loads(over), later) == home  # past the bound, within STICKY
    far = next(n for n in range(100) if n >= limit(n) + STICKY)
    assert policy.select(ready, loads(far), later) != home


@pytest.mark.parametrize("letter", ["a", "\u4e2d"], ids=["ascii", "cjk"])
def test_two_workers_send_a_documents_questions_to_one_replica_in_any_script(
    tmp_path: Path, letter: str
) -> None:
    """Documents sharing a preamble, in ASCII or CJK: a document one worker placed gets all
    its questions on that replica from both workers. (The anchor's length was counted in
    characters and the blocks in UTF-8 bytes: a CJK preamble another document had left
    elsewhere counted as this document's own, and the workers split its questions.)"""
    from corral.balancer.routing import make_policy

    ready = (1, 2, 3, 4)
    table = str(tmp_path / "affinity.bin")
    one, two = (make_policy("prefix_affinity", affinity_file=table) for _ in range(2))
    for worker in (one, two):
        worker.update(ready, {})

    def ask(prompt: str) -> RequestView:
        return view(json.dumps({"prompt": prompt}).encode(), b"/v1/completions")

    preamble = letter * 500
    other = two.select(ready, {}, ask(preamble + "C" * 1500 + " q"))
    doc = preamble + "".join(chr(0x4E00 + i % 500) for i in range(1500))
    busy = {rid: 5 if rid == other else 0 for rid in ready}  # not where the other went
    home = one.select(ready, busy, ask(doc + " q0"))
    assert home != other
    for q in range(1, 6):
        assert one.select(ready, {}, ask(doc + f" q{q}")) == home
        assert two.select(ready, {}, ask(doc + f" q{q}")) == home


def test_without_a_writable_table_routing_goes_on_alone(tmp_path: Path) -> None:
    from corral.balancer.affinity import AffinityTable
    from corral.balancer.routing import make_policy

    missing = tmp_path / "no such directory" / "affinity-chat.bin"
    assert AffinityTable.open(missing) is None
    policy = make_policy("prefix_affinity", affinity_file=str(missing))
    policy.update((1, 2), {})
    assert policy.select((1, 2), {}, view(chat(SYSTEMS[0], ["hello"]))) in (1, 2)


def test_the_shared_files_are_allocated_whole(tmp_path: Path) -> None:
    """Every block of a shared file is allocated before it is mapped, also one an older
    version left sparse: a write to a mapped page the disk cannot hold would be a SIGBUS."""
    from corral.balancer.shared_file import map_shared

    path = tmp_path / "table.bin"
    size = 1 << 20
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: no block allocated
    assert os.stat(path).st_blocks * 512 < size
    mapped = map_shared(path, size, "table")
    assert mapped is not None and len(mapped) == size
    mapped.close()
    assert os.stat(path).st_blocks * 512 >= size


def test_a_full_disk_leaves_the_table_unshared_not_the_worker_dead(tmp_path: Path) -> None:
    """On a full filesystem (a tmpfs of 64 KiB, filled) the table cannot be made: the policy
    goes on alone, and the process that tried lives (a sparse file would have mapped, and its
    first write ended the process with a SIGBUS)."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with contextlib.suppress(OSError), open(small / "filler", "wb") as f:
            f.write(b"x" * (1 << 20))
        code = (
            "from corral.balancer.affinity import AffinityTable\n"
            f"t = AffinityTable.open({str(small / 'affinity-svc.bin')!r})\n"
            "print('unshared' if t is None else 'mapped')\n"
            "if t is not None:\n"
            "    for k in range(0, 1 << 16, 512): t.put(k, 3)\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        assert (run.returncode, run.stdout.strip()) == (0, b"unshared"), run
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("questions", [40, 400])
def test_a_hot_prompt_family_spreads_no_further_than_its_load_bound(questions: int) -> None:
    """One document asked about by many concurrent requests: its first replica takes them
    up to the bound (the mean plus DOC_SLACK at low load, balance x the mean at high load),
    then the next replicas of its order do."""
    from corral.balancer.prefix_policy import DOC_SLACK
    from corral.balancer.routing import make_policy

    policy = make_policy("prefix_affinity", balance=1.25)
    ready = (1, 2, 3, 4)
    policy.update(ready, {})
    document = "The shared document. " * 200
    in_flight: Counter[int] = Counter()
    for q in range(questions):  # none finishes: the load only grows
        body = json.dumps({"model": "m", "prompt": document + f"Question {q}?"}).encode()
        rid = policy.select(ready, in_flight, view(body, b"/v1/completions"))
        in_flight[rid] += 1
    mean = questions / 4
    assert max(in_flight.values()) <= max(1.25 * mean, mean + DOC_SLACK) + 1, in_flight
    assert len(in_flight) > 1, "a family over the bound spreads"
    # with little load it stays on one replica: the document is computed once
    policy = make_policy("prefix_affinity")
    policy.update(ready, {})
    firsts = {
        policy.select(
            ready,
            {},
            view(json.dumps({"prompt": document + f"Q{q}"}).encode(), b"/v1/completions"),
        )
        for q in range(10)
    }
    assert len(firsts) == 1


def test_a_document_stays_on_its_replica_until_doc_slack_past_the_mean() -> None:
    """Moving a document makes another replica compute all of it, so its questions stay where
    it is cached while that replica carries fewer than DOC_SLACK requests over the mean."""
    from corral.balancer.prefix_policy import DOC_SLACK
    from corral.balancer.routing import make_policy

    policy = make_policy("prefix_affinity")
    ready = (1, 2, 3, 4)
    policy.update(ready, {})
    document = "The shared document. " * 200

    def ask(q: int, in_flight: dict[int, float]) -> int:
        body = json.dumps({"prompt": document + f"Question {q}?"}).encode()
        return policy.select(ready, in_flight, view(body, b"/v1/completions"))

    first = ask(0, {})
    # the mean counts this request: (10 + 1) / 4 = 2.75, and 10 is under 2.75 + 8
    assert DOC_SLACK == 8 and ask(1, {first: 10}) == first
    assert ask(2, {first: 11}) != first, "at the mean plus DOC_SLACK it spills"


def test_an_engine_queue_counts_as_load() -> None:
    """A replica whose engine reports a long queue is passed over for a new conversation."""
    from corral.balancer.routing import make_policy

    policy = make_policy("prefix_affinity")
    ready = (1, 2)
    policy.update(ready, {})
    body = chat(SYSTEMS[0], ["hello"])
    first = policy.select(ready, {}, view(body))
    other = 2 if first == 1 else 1
    policy = make_policy("prefix_affinity")
    policy.update(ready, {first: EngineLoad(waiting=50, running=8)})
    assert policy.select(ready, {}, view(body)) == other


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"prompt": 42}',
        b'{"messages": "hello"}',
        b'{"prompt": "trunc',
        b"[1, 2, 3]",
        json.dumps({"prompt": None}).encode(),
    ],
    ids=["not-json", "prompt-int", "messages-str", "truncated", "array", "null"],
)
def test_a_request_without_a_readable_prompt_goes_by_load(body: bytes) -> None:
    from corral.balancer.routing import make_policy

    policy = make_policy("prefix_affinity")
    policy.update((1, 2), {})
    assert policy.select((1, 2), {1: 3}, view(body, b"/v1/completions")) == 2


def test_bad_bodies_are_proxied_not_failed() -> None:
    """Through a real balancer under prefix_affinity: bodies that are not a prompt (not JSON,
    the wrong type, cut short by Content-Length) and a 100 MB body (over the buffer: streamed,
    routed by load) each reach a replica or get a 4xx; never a 500, never a stalled worker."""

    async def go() -> None:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            routing = {"options": {"balance": 1.25}}
            async with (
                balancer(ready, policy="prefix_affinity", routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}/v1/completions"
                for body in (b"not json", b'{"prompt": 42}', b'{"prompt": [null]}'):
                    async with http.post(url, data=body) as r:
                        assert r.status == 200, body
                big = b'{"prompt": "' + b"x" * (100 << 20) + b'"}'
                async with http.post(url, data=big) as r:
                    assert r.status == 200
                reader, writer = await asyncio.open_connection(HOST, lb.port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                    b'Connection: close\r\n\r\n{"prompt": "cut'
                )
                writer.write_eof()
                head = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert not head or head.startswith(b"HTTP/1.1 4"), head[:100]
                async with http.post(url, data=b'{"prompt": "still serving"}') as r:
                    assert r.status == 200

    run(go(), timeout=120)


# -- the engines' own metrics ---------------------------------------------------------------------


def test_engine_metrics_are_read_from_a_real_engine() -> None:
    """corral.dataplane.engines reads a simulated vLLM's /metrics: the queue it reports is the
    load the policy weighs."""

    async def go() -> None:
        config = EngineConfig(max_batch=1, step_base_ms=50, speed=1.0)
        async with SimServer(config) as sim, aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 40}
            tasks = [
                asyncio.create_task(http.post(sim.url + "/v1/completions", json=body))
                for _ in range(3)
            ]
            got: dict[int, Any] = {}
            lb = LoadBalancer(name="x")

            async def queued() -> bool:
                got.update(await engines.refresh(lb, {1: sim.url}, "/metrics"))
                return bool(got) and got[1].get("waiting", 0) >= 1

            for _ in range(100):
                if await queued():
                    break
                await asyncio.sleep(0.05)
            assert got[1]["waiting"] >= 1 and got[1]["running"] == 1, got
            assert lb._engines[1].waiting == got[1]["waiting"]
            for task in tasks:
                (await task).release()

    run(go())


def test_engine_metric_text_is_summed_over_label_sets() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
        'vllm:num_requests_waiting{model_name="b"} 3\n'
        "sglang:num_running_reqs 4\n"
        'vllm:kv_cache_usage_perc{model_name="a",x="}"} 0.5\n'
        "garbage line\n"
    )
    got = engines.parse(text)
    assert got["waiting"] == 5.0 and got["running"] == 4.0 and got["kv_usage"] == 0.5


def test_a_tgi_engines_queue_and_batch_are_read() -> None:
    """docs/llm.md counts "TGI's queue size" in the queue depth the autoscaler and the policy
    weigh. TGI publishes it as ``tgi_queue_size`` and its batch as ``tgi_batch_current_size``
    (its /metrics reference); read as nothing, a TGI engine was "a replica that publishes
    none", its queue the balancer's in-flight count, running requests included."""
    text = (
        "# TYPE tgi_queue_size gauge\n"
        "tgi_queue_size 3\n"
        "# TYPE tgi_batch_current_size gauge\n"
        "tgi_batch_current_size 4\n"
        'tgi_request_count{method="POST"} 120\n'
    )
    got = engines.parse(text)
    assert got.get("waiting") == 3.0 and got.get("running") == 4.0, got


# -- through a real daemon and its balancer workers -----------------------------------------------


def test_conversations_find_their_cache_through_corral_across_workers_and_a_daemon_kill(
    corral_home: Any, tmp_path: Any
) -> None:
    """A service of 3 simulated engines under prefix_affinity, 2 balancer workers, a new
    connection per turn: every later turn of a conversation finds its earlier turns in the
    engine's prefix cache (it reached the same replica), also after the daemon is SIGKILLed
    mid-way (the workers route on with what they hold)."""
    import signal
    import sys
    import urllib.request

    from conftest import spec_text, write_spec

    corral_home.env["CORRAL_BALANCER_WORKERS"] = "2"
    run_line = f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT --speed 5"
    extra = "  load_balancing_policy: prefix_affinity\n"
    text = spec_text("chat", 3, run=run_line).replace("service:\n", "service:\n" + extra)
    spec = write_spec(tmp_path / "chat.yaml", text)
    corral_home.run("up", str(spec), "-y", timeout=120)
    svc = corral_home.wait_replicas("chat", 3, timeout=60)
    url = str(svc["endpoint"]) + "/v1/chat/completions"

    def ask(conv: int, turns: int) -> tuple[int, int]:
        body = json.loads(chat(SYSTEMS[conv % 5], [f"q{conv}.{t}" for t in range(turns)]))
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:  # a new connection each
            usage = json.loads(answer.read())["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    previous: dict[int, int] = {}
    for turn in range(1, 6):
        if turn == 3:
            corral_home.stop_daemon(signal.SIGKILL)
        for conv in range(12):
            prompt, cached = ask(conv, turn)
            if conv in previous:  # all of the last turn's prompt but its last block
                assert cached >= previous[conv] - 16, (conv, turn, cached, previous[conv])
            previous[conv] = prompt

    # What an operator sees: TTFT of streamed answers, the engines' queue and hit rate.
    corral_home.start_daemon()
    body = json.loads(chat(SYSTEMS[0], ["stream this"]))
    body["stream"] = True
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        events = answer.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]", events[-3:]

    def reported() -> dict[str, Any] | None:
        now = corral_home.service("chat")
        llm = now["llm"] if now else None
        if not llm or not llm["streams"] or llm["prefix_hit_rate"] is None:
            return None
        return dict(now)

    shown = corral_home.wait_for(reported, 30, "the LLM figures in the service view")
    assert shown["llm"]["prefix_hit_rate"] > 0.5, shown["llm"]
    assert shown["llm"]["ttft_p50_seconds"] is not None and shown["llm"]["queue"] == 0
    assert all(r["llm"] and r["llm"]["running"] is not None for r in shown["replicas"])
    metrics = corral_home.api("GET", "/metrics").body.decode()
    assert 'corral_lb_ttft_seconds_count{service="chat"}' in metrics
    assert "corral_engine_prefix_queries_total{" in metrics
    # The workers' shared conversation table, board of counts and engine readings (each
    # worker reads some engines and leaves what it read for the other) live with them, and go
    # with the service.
    table = corral_home.path / "dataplane" / "affinity-chat.bin"
    board = corral_home.path / "dataplane" / "load-chat.bin"
    readings = corral_home.path / "dataplane" / "engines-chat"
    assert table.exists() and board.exists()
    assert sorted(p.name for p in readings.glob("slot-*")) == ["slot-0.json", "slot-1.json"]
    corral_home.run("down", "chat", timeout=60)
    assert not table.exists() and not board.exists()
    # A reading under way when the service went is written, then deleted when it ends.
    corral_home.wait_for(lambda: not readings.exists(), 10, "the engine readings deleted")


# -- the spec ------------------------------------------------------------------------------------


def test_the_llm_settings_are_checked_and_reach_the_route() -> None:
    from corral.service_route import route_of
    from corral.spec import SpecError, parse_spec

    base = "run: x\nservice:\n  readiness_probe: /health\n  replicas: 2\n"
    spec = parse_spec(
        base + "  load_balancing_policy: Cache_Aware\n"
        "  load_balancer:\n    max_in_flight_per_replica: 8\n    session_header: X-Session-ID\n"
    )
    assert spec.service.load_balancing_policy == "prefix_affinity"
    config = route_of(spec, 8080).config
    assert config["routing"]["options"] == {"session_header": "X-Session-ID", "balance": 1.25}
    assert config["routing"]["max_in_flight_per_replica"] == 8
    assert config["routing"]["hold_patience"] == 0.5
    assert config["engine_metrics_path"] == "/metrics"
    LoadBalancer(name="x", policy=config["policy"], routing=config["routing"])  # it builds
    plain = route_of(parse_spec(base), 8080).config
    assert "routing" not in plain and "engine_metrics_path" not in plain  # no cost, no change
    for bad, field in (
        ("max_in_flight_per_replica: 0", "max_in_flight_per_replica"),
        ("session_header: 'a b'", "session_header"),
        ("session_header: X-Forwarded-For", "the balancer drops or sets itself"),
        ("session_header: host", "the balancer drops or sets itself"),
        ("balance_factor: 0.5", "balance_factor"),
        ("hold_patience_seconds: -1", "hold_patience_seconds"),
        ("engine_metrics_path: metrics", "engine_metrics_path"),
    ):
        with pytest.raises(SpecError) as caught:
            parse_spec(base + f"  load_balancer:\n    {bad}\n")
        assert field in str(caught.value), (bad, str(caught.value))


def test_a_session_header_is_one_the_balancer_leaves_alone() -> None:
    """The spec refuses as a session header exactly what the balancer drops or sets itself
    before a policy reads the headers (the two lists are kept apart so that reading a spec
    does not load the balancer)."""
    from corral.balancer.headers import REQUEST_DROP
    from corral.spec.service import BALANCER_OWNED_HEADERS

    assert {name.encode() for name in BALANCER_OWNED_HEADERS} == REQUEST_DROP


def test_a_new_document_goes_by_load_and_its_next_questions_follow_it() -> None:
    """Four documents first seen together land on four replicas (by load, not by a hash
    that may put two on one), and each one's later questions find it there."""
    from corral.balancer.routing import make_policy

    policy = make_policy("prefix_affinity")
    ready = (1, 2, 3, 4)
    policy.update(ready, {})
    docs = [f"Document {d}. " + "Its shared text goes on. " * 150 for d in range(4)]
    in_flight: Counter[int] = Counter()
    homes = {}
    for d, doc in enumerate(docs):  # all four in flight at once
        body = json.dumps({"prompt": doc + "First question?"}).encode()
        homes[d] = policy.select(ready, in_flight, view(body, b"/v1/completions"))
        in_flight[homes[d]] += 1
    assert sorted(homes.values()) == [1, 2, 3, 4]
    for d, doc in enumerate(docs):
        body = json.dumps({"prompt": doc + "Another question?"}).encode()
        assert policy.select(ready, in_flight, view(body, b"/v1/completions")) == homes[d]


def test_one_offs_do_not_crowd_a_documents_blocks_out_of_the_index() -> None:
    """A prompt that shares nothing is recorded one block past its anchor, not whole: its
    later prompts (if any) still follow it, and a stream of one-offs no longer evicts from
    the bounded index the blocks of a document whose questions go on coming."""
    from corral.balancer.prefix_policy import DEFAULT_ANCHOR_CHARS, PrefixAffinity

    ready = (1, 2, 3, 4)
    policy = PrefixAffinity(index_blocks=256)
    policy.update(ready, {})
    to_two = {1: 1, 2: 0, 3: 1, 4: 1}  # by load, everything goes to replica 2
    doc = "The shared document. " + "Its text goes on. " * 200
    for question in ("First?", "Second?"):
        body = json.dumps({"prompt": doc + question}).encode()
        assert policy.select(ready, to_two, view(body, b"/v1/completions")) == 2
    held = policy.index.size(2)
    rng = random.Random(7)
    for _ in range(8):
        one_off = " ".join(str(rng.random()) for _ in range(200))  # ~3,800 characters
        before = policy.index.size(2)
        policy.select(
            ready, to_two, view(json.dumps({"prompt": one_off}).encode(), b"/v1/completions")
        )
        assert policy.index.size(2) - before == DEFAULT_ANCHOR_CHARS // 64 + 1
    assert policy.index.size(2) == held + 8 * 17
    # By load the question would go elsewhere; its document's blocks keep it on replica 2.
    body = json.dumps({"prompt": doc + "Third?"}).encode()
    assert policy.select(ready, {1: 0, 2: 1, 3: 0, 4: 0}, view(body, b"/v1/completions")) == 2


def test_after_a_spill_a_documents_first_replica_still_shares_its_questions() -> None:
    """A document's first question (a one-off, recorded short) went to one replica, its second
    spilled to another (recorded whole). Both hold the document: the less loaded takes the
    next question. With the first copy known only as far as its anchor, the second took them
    all until over its bound while the first, idle, held the document too."""
    from corral.balancer.prefix_policy import PrefixAffinity

    ready = (1, 2, 3, 4)
    policy = PrefixAffinity(share_balance=100.0)  # the share bound aside: loads decide here
    policy.update(ready, {})
    doc = "The shared document. " + "Its text goes on. " * 200

    def ask(question: str, in_flight: dict[int, int]) -> int:
        body = json.dumps({"prompt": doc + question}).encode()
        return policy.select(ready, in_flight, view(body, b"/v1/completions"))

    assert ask("First?", {1: 1, 2: 0, 3: 1, 4: 1}) == 2  # a new document: by load
    spilled = ask("Second?", {1: 0, 2: 30, 3: 0, 4: 0})  # replica 2 far over the bound
    assert spilled != 2
    for busier in (spilled, 2):
        loads = {rid: 3 for rid in ready}
        loads[busier] = 1
        loads[2 if busier == spilled else spilled] = 0
        assert ask("Next?", loads) == (2 if busier == spilled else spilled)


def test_a_document_on_two_replicas_goes_to_the_less_loaded_of_them() -> None:
    """After a spill, two replicas hold a document: a question goes to whichever of them has
    less in flight (never to a replica without it), so the copies share the document's
    questions. Taking the first of its order, as before, sent it to the busier one."""
    from corral.balancer.prefix import PrefixIndex, rendezvous_order
    from corral.balancer.prefix_policy import DEFAULT_ANCHOR_CHARS, PrefixAffinity

    ready = (1, 2, 3, 4)
    doc = "The shared document. " + "Its text goes on. " * 150
    body = json.dumps({"prompt": doc + "A question?"}).encode()

    def choose(in_flight: dict[int, int]) -> int:
        policy = PrefixAffinity()
        policy.update(ready, {})
        for rid in order[:2]:
            policy.index.insert(rid, policy.index.hashes(doc))
        return policy.select(ready, in_flight, view(body, b"/v1/completions"))

    index = PrefixIndex()
    order = rendezvous_order(index.anchor_key(doc[:DEFAULT_ANCHOR_CHARS], index.hashes(doc)), ready)
    assert choose({}) == order[0]  # idle: the first of its order, as every worker would choose
    # The first holder busier (under the bound); idle replicas without it are not taken.
    assert choose({order[0]: 1}) == order[1]


def test_a_new_document_is_placed_once_for_every_worker(tmp_path: Path) -> None:
    """Worker A places a new document by its own view of the load; worker B, seeing that
    replica busier than the others, would place it elsewhere and compute it a second time.
    With the table the workers share, B's questions go where A put the document."""
    from corral.balancer.affinity import table_path

    ready = (1, 2, 3, 4)
    shared, alone = worker_pairs(table_path(tmp_path, "rag"), ready)
    apart = 0
    for d in range(12):
        doc = f"Document {d}. " + "Its shared text goes on. " * 150
        first = json.dumps({"prompt": doc + "First question?"}).encode()
        later = json.dumps({"prompt": doc + "Another question?"}).encode()
        seen_by_a = {rid: 3 for rid in ready if rid != 1 + d % 4}  # A: one replica idle
        for a, b in (shared, alone):
            home = a.select(ready, seen_by_a, view(first, b"/v1/completions"))
            assert home == 1 + d % 4
            seen_by_b = {home: 2}  # B: that replica busier than the rest, under the bound
            rid = b.select(ready, seen_by_b, view(later, b"/v1/completions"))
            if a is shared[0]:
                assert rid == home, d
            else:
                apart += rid != home
    assert apart == 12, apart  # without the table, B places it elsewhere: the test can fail


# -- a replica killed mid-stream -------------------------------------------------------------------


def test_a_replica_killed_mid_stream_fails_its_streams_and_loses_its_conversations() -> None:
    """Two simulated engines (child processes) behind one balancer under prefix_affinity. The
    replica streaming a conversation's first turn is SIGKILLed: that stream ends with an error
    at once (the body cut short, never a hang, never a `[DONE]`), its in-flight count drops to
    0; the conversation's next turn reaches the live replica at once (before any ready-set
    change); when the ready set drops the dead one (as the daemon's does) the policy forgets
    what it sent there, and the turn after finds its prefix cached on the live replica."""
    import signal
    import time

    from corral.llmsim import spawn

    async def go(urls: dict[int, str], processes: dict[int, Any]) -> None:
        async with (
            balancer(urls, policy="prefix_affinity", routing={"options": {"balance": 1.25}}) as lb,
            aiohttp.ClientSession() as http,
        ):
            url = f"http://{HOST}:{lb.port}/v1/chat/completions"
            first = json.loads(chat(SYSTEMS[1], ["tell me a long story"]))
            stream = await http.post(url, json={**first, "stream": True, "max_tokens": 4000})
            assert stream.status == 200
            assert (await stream.content.readline()).startswith(b"data:")
            home = next(rid for rid in urls if lb.in_flight(rid) == 1)
            live = next(rid for rid in urls if rid != home)
            assert lb._policy.index.size(home) > 0  # it learned where the prompt went
            os.kill(processes[home].pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(aiohttp.ClientPayloadError):
                async with asyncio.timeout(10):
                    body = await stream.content.read()
                    assert b"[DONE]" not in body  # an end that looks whole is a lie
                    raise aiohttp.ClientPayloadError("body ended without an error")
            assert time.monotonic() - started < 5
            stream.release()
            # Reaped, so its listener is closed too: a POST that meets a replica in the instant
            # of its death (connected, then reset) is a 502 by design, never resent.
            await asyncio.to_thread(processes[home].wait, 10)
            await wait_until(lambda: lb.in_flight(home) == 0, 10, "the dead one's count at 0")
            assert lb._streaming == {}  # its stream's weight left with it

            async def turn(turns: list[str]) -> dict[str, Any]:
                body = json.loads(chat(SYSTEMS[1], turns))
                async with asyncio.timeout(10), http.post(url, json=body) as answer:
                    assert answer.status == 200, await answer.text()
                    return dict(await answer.json())

            second = ["tell me a long story", "and then?"]
            await turn(second)  # refused by the dead one: retried on the live one
            assert lb.stats()["replicas"][str(live)]["served"] == 1, lb.stats()
            lb.set_ready({live: urls[live]})  # what the daemon pushes once it saw the exit
            assert lb._policy.index.size(home) == 0 and home not in lb._policy.index.replicas()
            third = await turn([*second, "and at the end?"])
            cached = third["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0.5 * third["usage"]["prompt_tokens"], third["usage"]

    processes: dict[int, Any] = {}
    try:
        urls = {}
        for rid in (1, 2):
            processes[rid], urls[rid] = spawn(EngineConfig(speed=0.5))
        run(go(urls, processes))
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
            process.wait(10)


def test_the_shared_files_grow_sparse_where_the_filesystem_cannot_allocate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without allocation ahead (some FUSE and network ones, or a C library
    without its emulation: EOPNOTSUPP) gets the sparse file it had before, still shared."""
    import errno

    from corral.balancer.shared_file import map_shared

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    mapped = map_shared(tmp_path / "board.bin", 1 << 16, "board")
    assert mapped is not None and len(mapped) == 1 << 16
    mapped.close()


def test_ttft_quantiles_are_interpolated_not_the_buckets_upper_bound() -> None:
    """36 streams whose clients waited 4-12 s (measured): TTFT p50 read "10000 ms" and p99
    "30000 ms", the upper bounds of their buckets. Interpolated as histogram_quantile does, the
    figures land inside the buckets, where the streams were."""
    from corral.balancer.metrics import LATENCY_BUCKETS

    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    buckets[LATENCY_BUCKETS.index(5.0)] = 12  # (4, 5]
    buckets[LATENCY_BUCKETS.index(10.0)] = 20  # (7.5, 10]
    buckets[LATENCY_BUCKETS.index(15.0)] = 4  # (10, 15]
    llm = service_llm({"ttft": {"buckets": buckets, "sum": 230.0, "count": 36}})
    assert llm is not None
    assert llm["ttft_p50_seconds"] == 7.5 + 2.5 * (18 - 12) / 20  # 8.25 s, not 10
    assert 10.0 < llm["ttft_p99_seconds"] < 15.0
    one = [0] * (len(LATENCY_BUCKETS) + 1)
    one[LATENCY_BUCKETS.index(0.1)] = 1  # a single stream of (50, 100] ms
    figures = replica_llm({"ttft": {"buckets": one, "sum": 0.06, "count": 1}}, None)
    assert 0.05 < figures["ttft_p50_seconds"] <= 0.1


async def _busy_and_held(
    http: aiohttp.ClientSession, url: str, one: Replica, lb: LoadBalancer
) -> tuple[asyncio.Task[aiohttp.ClientResponse], asyncio.Task[aiohttp.ClientResponse]]:
    """With a limit of 1: a request the replica holds, and a second one the balancer holds."""
    busy = asyncio.create_task(http.get(url + "/hold"))
    await wait_until(lambda: one.arrived == 1, 10, "the replica busy")
    late = asyncio.create_task(http.get(url + "/late"))
    await wait_until(lambda: lb.held() == 1, 10, "the second request held")
    return busy, late


def test_held_requests_go_out_when_an_update_changes_the_balancer(tmp_path: Path) -> None:
    """An update of a balancer setting (here the limit itself, 1 -> 8) gives the service a new
    balancer in each worker and retires the old one: what the old one held (every replica at
    its limit) goes to a replica, not a 503 for a request no replica had seen."""
    from test_balancer import closed_port

    from corral.dataplane.worker import Worker

    async def go() -> None:
        async with fleet(1) as (one,):
            worker = Worker(tmp_path, 0)
            port = closed_port()

            def route(limit: int) -> dict[str, Any]:
                routing = {"max_in_flight_per_replica": limit, "hold_timeout": 20}
                ready = {"1": {"url": one.url, "version": 1}}
                return {"port": port, "host": HOST, "config": {"routing": routing}, "ready": ready}

            await worker._apply({"llm": route(1)})
            lb = worker.services["llm"].lb
            url = f"http://{HOST}:{port}"
            try:
                async with aiohttp.ClientSession() as http:
                    busy, late = await _busy_and_held(http, url, one, lb)
                    await worker._apply({"llm": route(8)})  # the update: a new balancer
                    assert worker.services["llm"].lb is not lb
                    answer = await asyncio.wait_for(late, 10)
                    assert answer.status == 200, await answer.text()
                    assert (await answer.json())["replica"] == 1
                    one.gate.set()
                    assert (await busy).status == 200
            finally:
                one.gate.set()
                await worker._apply({})
                while worker.retiring:
                    await asyncio.sleep(0.05)

    run(go())


def test_held_requests_go_out_when_their_worker_is_replaced(tmp_path: Path) -> None:
    """``corral daemon restart-workers`` (an upgrade) stops each old worker while a new one
    serves the port: what the old one held (every replica at its limit, as an LLM fleet at
    saturation is) goes to a replica, as on a route change, not a 503 for a request no
    replica had seen while the streams under way drain."""
    from test_balancer import closed_port

    from corral.dataplane.worker import Worker

    async def go() -> None:
        async with fleet(1) as (one,):
            worker = Worker(tmp_path, 0)
            port = closed_port()
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 20}
            ready = {"1": {"url": one.url, "version": 1}}
            route = {"port": port, "host": HOST, "config": {"routing": routing}, "ready": ready}
            await worker._apply({"llm": route})
            lb = worker.services["llm"].lb
            url = f"http://{HOST}:{port}"
            running = asyncio.create_task(worker.run())
            try:
                async with aiohttp.ClientSession() as http:
                    busy, late = await _busy_and_held(http, url, one, lb)
                    worker.stop.set()  # what the daemon's "exit" (or SIGTERM) does
                    answer = await asyncio.wait_for(late, 10)
                    assert answer.status == 200, await answer.text()
                    assert (await answer.json())["replica"] == 1
                    one.gate.set()
                    assert (await busy).status == 200
                await asyncio.wait_for(running, 20)
            finally:
                one.gate.set()
                worker.stop.set()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(running, 20)

    run(go())


def test_a_request_waiting_for_a_first_replica_is_served_across_an_update(
    tmp_path: Path,
) -> None:
    """At zero replicas (min_replicas: 0) a request waits for the first one; an update of a
    balancer setting meanwhile (here the policy) retires the balancer it waits in. It is
    served when the replica comes, not cut when the retired balancer gives up."""
    from test_balancer import closed_port

    from corral.dataplane.worker import Worker

    async def go() -> None:
        async with fleet(1) as (one,):
            worker = Worker(tmp_path, 0)
            port = closed_port()

            def route(policy: str, ready: dict[str, Any]) -> dict[str, Any]:
                config = {"policy": policy, "no_replica_wait": 20.0, "drain_timeout": 0.5}
                return {"port": port, "host": HOST, "config": config, "ready": ready}

            await worker._apply({"llm": route("least_load", {})})
            lb = worker.services["llm"].lb
            try:
                async with aiohttp.ClientSession() as http:
                    chat = {"messages": [{"role": "user", "content": "hi"}]}  # POST: no retry
                    url = f"http://{HOST}:{port}/cold"
                    waiting = asyncio.create_task(http.post(url, json=chat))
                    await wait_until(lambda: lb.stats()["requests"] >= 1, 10, "the request in")
                    await worker._apply({"llm": route("round_robin", {})})  # the update
                    assert worker.services["llm"].lb is not lb
                    # Past the retired balancer's drain and stop grace: a cold start is long.
                    await asyncio.sleep(LoadBalancer.STOP_GRACE_SECONDS + 0.5)
                    first = {"1": {"url": one.url, "version": 2}}
                    await worker._apply({"llm": route("round_robin", first)})  # READY
                    answer = await asyncio.wait_for(waiting, 10)
                    assert answer.status == 200
                    assert (await answer.json())["replica"] == 1
            finally:
                await worker._apply({})
                while worker.retiring:
                    await asyncio.sleep(0.05)

    run(go())


def test_a_session_stays_on_its_replica_when_another_joins(tmp_path: Path) -> None:
    """docs/llm.md: a session "moves only when its replica leaves". Rendezvous hashing alone
    gives a replica that joins (a scale-up, a replacement) about 1/n of every session, and
    each session moved there computes its whole history again. Two workers sharing the
    service's table (as listeners.make_balancer gives them), new requests dealt at random:
    after a fourth replica joins, no session of the three that stay moves; the new replica
    takes new sessions."""
    from corral.balancer.routing import make_policy

    table = str(tmp_path / "affinity-svc.bin")
    workers = [
        make_policy("least_load", session_header="X-Session-ID", affinity_file=table)
        for _ in range(2)
    ]
    rng = random.Random(3)

    def where(session: str, ready: tuple[int, ...]) -> int:
        policy = rng.choice(workers)
        policy.update(ready, {})
        headers = f"Host: x\r\nX-Session-ID: {session}\r\n".encode()
        rid = policy.select(ready, {}, RequestView(b"/v1/completions", b"{}", headers))
        policy.commit(rid, policy.pending)
        return rid

    sessions = [f"user-{i}" for i in range(60)]
    home = {s: where(s, (1, 2, 3)) for s in sessions}
    assert len(set(home.values())) == 3
    moved = [s for s in sessions if where(s, (1, 2, 3, 4)) != home[s]]
    assert moved == [], f"{len(moved)} of {len(sessions)} sessions moved to the new replica"
    fresh = {where(f"new-{i}", (1, 2, 3, 4)) for i in range(40)}
    assert 4 in fresh  # new sessions do reach it


def test_a_request_held_for_its_replica_takes_another_before_its_hold_bound() -> None:
    """A patience as long as the hold's bound (hold_patience_seconds: 10 with
    hold_timeout_seconds: 1) must not turn the wait for the cached replica into a 503 while
    another replica sat idle, nor say "every replica had 1 request(s) in flight" then: the
    question goes to the replica with room before its bound."""

    async def go() -> None:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            routing = {"max_in_flight_per_replica": 1, "hold_timeout": 1, "hold_patience": 10}
            doc = "The shared document. " * 100
            async with (
                balancer(ready, policy="prefix_affinity", routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}"
                first = asyncio.create_task(http.post(url + "/hold", json={"prompt": doc + "Q0?"}))
                await wait_until(lambda: sum(r.arrived for r in replicas) == 1, 10, "home busy")
                home = next(r for r in replicas if r.arrived)
                async with http.post(url + "/after", json={"prompt": doc + "Q1?"}) as answer:
                    body = await answer.text()
                    assert answer.status == 200, body
                    assert json.loads(body)["replica"] != home.rid
                home.gate.set()
                assert (await first).status == 200
                assert lb.stats()["held_expired"] == 0

    run(go())


def test_held_requests_whose_clients_left_stop_counting_as_their_replicas_load() -> None:
    """Requests waiting for a replica count as its load in the policy's bound (see above), but
    one whose client went away waits for nothing and must stop counting. Both replicas are at
    their limit of 4 (a hot document's on one, other prompts on the other); one question of
    the document waits for its replica, eight more are held behind that one and their clients
    disconnect (a client timeout). The next question then waits for the document's replica,
    as with one request waiting, not for the other replica (where its document would be
    computed again), pushed there past the bound by eight requests that are gone: they were
    dropped only when they reached the queue's head, behind a request that waits on."""

    async def go() -> None:
        async with fleet(2) as replicas:
            ready = {r.rid: r.url for r in replicas}
            routing = {"max_in_flight_per_replica": 4, "hold_timeout": 30, "hold_patience": 20}
            doc = "The hot document. " * 100
            async with (
                balancer(ready, policy="prefix_affinity", routing=routing) as lb,
                aiohttp.ClientSession() as http,
            ):
                url = f"http://{HOST}:{lb.port}/hold"

                def ask(prompt: str) -> asyncio.Task[aiohttp.ClientResponse]:
                    return asyncio.create_task(http.post(url, json={"prompt": prompt}))

                def arrived() -> int:
                    return sum(r.arrived for r in replicas)

                tasks = [ask(doc + "Q0?")]
                await wait_until(lambda: arrived() == 1, 10, "the document sent")
                home = next(r for r in replicas if r.arrived)
                other = next(r for r in replicas if r is not home)
                for q in range(1, 4):
                    tasks.append(ask(doc + f"Q{q}?"))
                    tasks.append(ask(f"unrelated prompt {q} " * 20))
                    await wait_until(lambda q=q: arrived() == 2 * q + 1, 10, "sent")
                tasks.append(ask("one more unrelated prompt " * 20))
                await wait_until(lambda: arrived() == 8, 10, "both replicas full")
                assert home.arrived == other.arrived == 4
                tasks.append(ask(doc + "Q4?"))
                await wait_until(lambda: lb.held() == 1, 10, "question 4 held")
                gone = []
                for q in range(5, 13):
                    gone.append(ask(doc + f"Q{q}?"))
                    await wait_until(lambda q=q: lb.held() == q - 3, 10, f"question {q} held")
                for task in gone:
                    task.cancel()
                await wait_until(lambda: lb.held() == 1, 10, "the gone clients' requests dropped")
                await wait_until(
                    lambda: sum(lb._homes.values()) == 1,
                    10,
                    "the gone clients' requests no longer counted as the home's load",
                )
                tasks.append(ask(doc + "Q13?"))
                await wait_until(lambda: lb.held() == 2, 10, "question 13 held")
                assert lb._homes == {home.rid: 2}, "pushed off its replica by requests gone"
                home.gate.set()
                other.gate.set()
                for task in tasks:
                    assert (await task).status == 200

    run(go())
