"""The fast path for streams (corral.balancer.fast_stream), on real sockets on 127.0.0.1.

A replica's first stream goes through the general path, which remembers its head; the next
ones whose head is the same bytes go out with no Exchange, relayed by ``LiveChunks`` from the
head on. These tests hold that path to what the general one does: the same bytes to the client,
the same counts (codes, time to first token, streams, in-flight), the replica connection
reused, and every way a stream can end early (replica lost, client gone, a silent replica, a
client that stops reading) handled as a stream is, by the Exchange it turns into.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import uvloop
from chunked import HOST, STREAM_HEAD, Replica, Script, frame, read_answer, replica_paused

from corral.balancer import LoadBalancer, fast, speedups, upstream
from corral.balancer import client as client_module

GET = b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n"

needs_compiled = pytest.mark.skipif(
    speedups.LiveChunks is None, reason="the compiled build is not built, or this run is pure"
)


async def events(writer: asyncio.StreamWriter, first: int, count: int) -> None:
    """Events ``first`` .. ``first + count - 1``, each written on its own 2 ms apart."""
    for i in range(first, first + count):
        await writer.drain()
        await asyncio.sleep(0.002)
        writer.write(frame(b"data: %d\n\n" % i))


async def whole_stream(n: int, writer: asyncio.StreamWriter) -> None:
    """The head with the first event in one write (as the benchmark's replica writes it)."""
    writer.write(STREAM_HEAD + frame(b"data: 0\n\n"))
    await events(writer, 1, 4)
    writer.write(b"0\r\n\r\n")


async def head_alone(n: int, writer: asyncio.StreamWriter) -> None:
    """The head on its own, the first event later (as an engine sends it after the prompt)."""
    writer.write(STREAM_HEAD)
    await writer.drain()
    await asyncio.sleep(0.02)
    await events(writer, 0, 5)
    writer.write(b"0\r\n\r\n")


WANT = b"".join(b"data: %d\n\n" % i for i in range(5))


@contextlib.contextmanager
def fast_streams_counted() -> Iterator[list[object]]:
    """Every fast stream that ends (``ClientConnection.stream_done``), recorded."""
    ended: list[object] = []
    done = client_module.ClientConnection.stream_done

    def counted(cl: Any, conn: Any, last: bytes) -> None:
        ended.append(conn)
        done(cl, conn, last)

    with mock.patch.object(client_module.ClientConnection, "stream_done", counted):
        yield ended


@contextlib.contextmanager
def fast_streams_turned() -> Iterator[list[object]]:
    """Every fast stream turned into its Exchange mid-way (``fast.live_exchange``), recorded:
    the failure under test met the fast path, not the general one."""
    turned: list[object] = []
    live_exchange = fast.live_exchange

    def counted(ex: Any, conn: Any) -> None:
        turned.append(ex)
        live_exchange(ex, conn)

    with mock.patch.object(fast, "live_exchange", counted):
        yield turned


def settled(lb: LoadBalancer) -> None:
    """Nothing left counted as in flight or streaming."""
    assert not any(lb._in_flight.values()), lb._in_flight
    assert not any(lb._streaming.values()), lb._streaming


def ttft_count(lb: LoadBalancer) -> float:
    """Streams whose time to first token was taken (the histogram's buckets; its sum last)."""
    return sum(lb._ttft.get(None, [0.0])[:-1])


async def with_balancer(
    script: Script, body: Callable[[LoadBalancer, Replica], Awaitable[None]], **options: Any
) -> None:
    async with Replica(script) as replica:
        lb = LoadBalancer(name="svc", **options)
        await lb.start()
        try:
            lb.set_ready({1: f"http://{HOST}:{replica.port}"})
            await body(lb, replica)
        finally:
            await lb.stop()


def run(
    script: Script,
    body: Callable[[LoadBalancer, Replica], Awaitable[None]],
    timeout: float = 30,
    **options: Any,
) -> tuple[int, int]:
    """``body`` against a balancer in front of one replica answering by ``script``, on
    uvloop; how many fast streams ended, and how many turned into their Exchange mid-way."""
    with fast_streams_counted() as ended, fast_streams_turned() as turned:
        uvloop.run(asyncio.wait_for(with_balancer(script, body, **options), timeout))
    return len(ended), len(turned)


async def streams(port: int, count: int) -> None:
    """``count`` streams, one after the other on a new client connection, each read whole."""
    reader, writer = await asyncio.open_connection(HOST, port)
    for _ in range(count):
        writer.write(GET)
        assert await asyncio.wait_for(read_answer(reader), 10) == WANT
    writer.close()


async def second_stream(
    port: int, limit: int = 1 << 16
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new client connection whose first stream was read whole (its replica's head is
    known now) and whose second was asked for: the one the test is about."""
    reader, writer = await asyncio.open_connection(HOST, port, limit=limit)
    writer.write(GET)
    assert await asyncio.wait_for(read_answer(reader), 10) == WANT
    writer.write(GET)
    return reader, writer


@pytest.mark.parametrize("build", ["compiled", "pure"])
@pytest.mark.parametrize("script", [whole_stream, head_alone], ids=["with its head", "head alone"])
def test_streams_after_the_first_go_out_unparsed(build: str, script: Script) -> None:
    """Four streams on one client connection: each reaches the client whole; the first went
    through the general path, the three after it through the fast one (none in the pure
    build), counted as the general path counts them, on one replica connection throughout."""
    if build == "compiled" and speedups.LiveChunks is None:
        pytest.skip("the compiled build is not built, or this run is pure")

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        await streams(lb.port, 4)
        assert lb._codes.get(200) == 4
        assert ttft_count(lb) == 4  # taken at each stream's first event, head alone or not
        assert replica.connections == 1
        settled(lb)

    pure = build == "pure"
    with mock.patch.object(upstream, "LiveChunks", None if pure else upstream.LiveChunks):
        assert run(script, body) == ((0, 0) if pure else (3, 0))


@needs_compiled
@pytest.mark.parametrize("when", ["after its first event", "before its first event"])
def test_a_replica_lost_mid_stream_cuts_the_client_and_the_next_one_is_served(when: str) -> None:
    """The replica's connection dies during a fast stream: the client is cut (no last chunk:
    it cannot take the stream for whole), counted as aborted, and the next requests are
    answered on a new replica connection, the fast way again once it is pooled."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n != 1:
            await whole_stream(n, writer)
            return
        first = frame(b"data: 0\n\n") if when == "after its first event" else b""
        writer.write(STREAM_HEAD + first)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # a reset, mid-stream

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await second_stream(lb.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_answer(reader), 10)
        writer.close()
        assert lb._aborted == 1
        await streams(lb.port, 2)
        assert replica.connections == 2
        settled(lb)

    # The fourth stream: the third had no pooled connection to take the fast path on.
    assert run(script, body) == (1, 1)


@needs_compiled
def test_a_client_gone_mid_stream_ends_the_replicas_work() -> None:
    """The client closes during a fast stream: the balancer drops the replica connection (the
    replica sees it end, and stops generating for nobody), counts the client gone, and
    holds nothing in flight."""
    gone = asyncio.Event()

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n != 1:
            await whole_stream(n, writer)
            return
        writer.write(STREAM_HEAD + frame(b"data: 0\n\n"))
        await gone.wait()
        for _ in range(500):  # until the balancer's reset reaches this side
            writer.write(frame(b"data: more\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await second_stream(lb.port)
        await asyncio.wait_for(reader.readuntil(b"data: 0\n\n"), 10)
        writer.transport.abort()
        gone.set()
        await asyncio.wait_for(replica.lost.wait(), 10)
        assert lb._client_gone == 1
        settled(lb)

    assert run(script, body) == (0, 1)


@needs_compiled
def test_a_silent_replica_mid_stream_is_cut_at_the_idle_timeout() -> None:
    """A fast stream whose replica goes quiet: cut at the idle timeout, as any stream."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n != 1:
            await whole_stream(n, writer)
            return
        writer.write(STREAM_HEAD + frame(b"data: 0\n\n"))
        await asyncio.sleep(5)

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await second_stream(lb.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_answer(reader), 10)
        writer.close()
        assert lb._error_reasons.get("idle_timeout") == 1, lb._error_reasons
        settled(lb)

    assert run(script, body, idle_timeout=0.3) == (0, 1)


@needs_compiled
def test_a_client_that_stops_reading_pauses_the_replica_mid_stream() -> None:
    """Flow control in a fast stream: a client that reads nothing has the balancer stop
    reading the replica (the stream turns into its Exchange, which pauses the connection)
    rather than buffer it, and once it reads every byte arrives."""
    piece = frame(b"d" * 16000)
    count = 3000  # 48 MB: well over what loopback's socket buffers hold on both hops
    state = {"written": 0}

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n != 1:
            await whole_stream(n, writer)
            return
        writer.write(STREAM_HEAD + frame(b"first"))
        for _ in range(count):
            await writer.drain()
            writer.write(piece)
            state["written"] += 1
        writer.write(b"0\r\n\r\n")

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await second_stream(lb.port)
        await replica_paused(lb, state)  # the client reads nothing meanwhile
        await asyncio.sleep(0.3)
        assert state["written"] < count * 3 // 4, state
        assert await asyncio.wait_for(read_answer(reader), 30) == b"first" + b"d" * 16000 * count
        writer.close()
        settled(lb)

    assert run(script, body, timeout=60) == (0, 1)


@needs_compiled
def test_what_the_fast_path_leaves_to_the_general_one() -> None:
    """A stream whose framing needs httptools mid-way (an extension, a trailer) turns into its
    Exchange there and still reaches the client whole (its time to first token taken there
    when no event had come yet); a stream whose head changed (a new
    header, as a new Date does each second) and one whole in one read take the general path
    from the start; the one after them goes the fast way again."""
    other_head = STREAM_HEAD.replace(b"\r\n\r\n", b"\r\nX-Replica: 2\r\n\r\n")

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n == 1:  # an extension mid-stream, a trailer at its end
            writer.write(STREAM_HEAD + frame(b"data: 0\n\n"))
            await events(writer, 1, 1)
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(b"9;id=2\r\ndata: 2\n\n\r\n")
            await events(writer, 3, 2)
            writer.write(b"0\r\nX-Done: yes\r\n\r\n")
        elif n == 2:  # another head
            writer.write(other_head + frame(b"data: 0\n\n"))
            await events(writer, 1, 4)
            writer.write(b"0\r\n\r\n")
        elif n == 6:  # the head alone, then a first event with an extension
            writer.write(STREAM_HEAD)
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"9;id=0\r\ndata: 0\n\n\r\n")
            await events(writer, 1, 4)
            writer.write(b"0\r\n\r\n")
        elif n == 4:  # the whole answer in one write
            whole = b"".join(frame(b"data: %d\n\n" % i) for i in range(5))
            writer.write(STREAM_HEAD + whole + b"0\r\n\r\n")
        else:
            await whole_stream(n, writer)

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        await streams(lb.port, 7)
        assert replica.connections == 1
        assert ttft_count(lb) == 7  # stream 6's at its first event, in its Exchange
        settled(lb)

    # Stream 0 general (no head known), 1 fast then turned, 2 general (a new head, now the one
    # known), 3 general (the first head again, known again), 4 general (whole), 5 fast, 6 fast
    # then turned before its first event.
    assert run(script, body) == (1, 2)
