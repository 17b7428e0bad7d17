"""ChunkScan, the compiled build's follower of a chunked answer, held to httptools.

Why: once a stream is live, the compiled build relays the replica's chunks as they were framed
(``LiveChunks``, :mod:`corral.balancer.relay`), and httptools no longer sees them. That is only
right if the scanner agrees with httptools on every byte: where the answer ends, what its data
is, and what it must leave to httptools (an extension, a trailer, any error), handing back
exactly the bytes httptools then reads from a fresh parser put where the scanner stopped. So
every body here, valid or broken, split into batches at random, is read both ways, and the
client's side (what was relayed as framed, then what httptools found after a hand-back, framed
again) must decode to httptools' own reading of the whole body.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httptools
import pytest
import uvloop
from chunked import (
    HOST,
    STREAM_HEAD,
    Replica,
    Script,
    read_answer,
    read_answer_body,
    replica_paused,
    written,
)
from conftest import OPENSSL, make_cert
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.balancer import LoadBalancer, relay, speedups, upstream
from corral.balancer import client as client_module

needs_compiled = pytest.mark.skipif(
    speedups.ChunkScan is None, reason="the compiled build is not built, or this run is pure"
)

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
MORE, DONE, BAIL = 0, 1, 2


class _Stop(Exception):
    """Raised at a second message: the answer ended before it."""


@dataclass
class Reading:
    """What an httptools parser found: the body's pieces, whether it ended, its error."""

    body: list[bytes] = field(default_factory=list)
    complete: bool = False
    error: str | None = None

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Stop

    def on_message_complete(self) -> None:
        self.complete = True

    def feed(self, parser: httptools.HttpResponseParser, data: bytes) -> None:
        if self.complete or self.error is not None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # _Stop: bytes after the answer are not its
        except httptools.HttpParserError as exc:
            self.error = str(exc)


def httptools_alone(body: bytes) -> Reading:
    reading = Reading()
    reading.feed(httptools.HttpResponseParser(reading), HEAD + body)
    return reading


def frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


@dataclass
class Relayed:
    """What the client got and how the scanner's part ended."""

    sent: bytes  # relayed as framed, then (after a hand-back) httptools' pieces framed again
    data: bytes  # the body as the relay knows it
    complete: bool
    error: str | None
    found: int
    extra: bool = False


def through_scanner(batches: list[bytes]) -> Relayed:
    """The compiled relay's path: batches through ChunkScan, relayed as framed; at a hand-back
    a fresh parser primed as ``UpstreamConnection.raw_resume`` primes it reads the rest."""
    scan = speedups.ChunkScan()
    sent = b""
    for i, batch in enumerate(batches):
        found = scan.scan(batch)
        sent += scan.forward
        if found == DONE:
            assert not scan.open
            data = decode(sent + b"0\r\n\r\n")
            assert data.complete and data.error is None, (sent, data)
            return Relayed(sent, b"".join(data.body), True, None, DONE, scan.extra)
        if found == BAIL:
            assert not scan.open
            resumed = Reading()
            parser = httptools.HttpResponseParser(resumed)
            resumed.feed(parser, HEAD + scan.prime)
            assert resumed.error is None and not resumed.complete
            resumed.body.clear()  # the primed data is not the answer's
            resumed.feed(parser, scan.replay + b"".join(batches[i + 1 :]))
            sent += b"".join(frame(piece) for piece in resumed.body)
            before = decode(sent)
            assert before.error is None, (sent, before)
            return Relayed(sent, b"".join(before.body), resumed.complete, resumed.error, BAIL)
        assert found == MORE and scan.open
    data = decode(sent)
    assert data.error is None and not data.complete, (sent, data)
    return Relayed(sent, b"".join(data.body), False, None, MORE)


def decode(sent: bytes) -> Reading:
    """The client's reading of what it was sent (a chunked body, maybe cut short)."""
    return httptools_alone(sent)


def agrees(body: bytes, cuts: list[int]) -> Relayed:
    """Split ``body`` at ``cuts``; the scanner's path must read it as httptools does."""
    points = sorted({c for c in cuts if 0 < c < len(body)})
    batches = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    batches = [b for b in batches if b] or [body]
    want = httptools_alone(body)
    got = through_scanner(batches)
    assert got.data == b"".join(want.body), (body, batches, got, want)
    assert got.complete == want.complete, (body, batches, got, want)
    assert (got.error is None) == (want.error is None), (body, batches, got, want)
    return got


SIZE_FORMS = st.sampled_from(["%x", "%X", "0%x", "00%x"])


@st.composite
def chunked_bodies(draw: st.DrawFn) -> bytes:
    """Chunked bodies as replicas send them, now and then with an extension, a trailer, a
    broken byte, or bytes after the end."""
    parts = []
    for data in draw(st.lists(st.binary(min_size=1, max_size=40), max_size=6)):
        size = (draw(SIZE_FORMS) % len(data)).encode()
        ext = b";name=v" if draw(st.integers(0, 9)) == 0 else b""
        parts.append(size + ext + b"\r\n" + data + b"\r\n")
    ending = draw(st.sampled_from(["end", "end", "trailer", "none"]))
    if ending == "end":
        parts.append(b"0\r\n\r\n")
    elif ending == "trailer":
        parts.append(b"0\r\nX-Trailer: 1\r\n\r\n")
    body = b"".join(parts)
    if body and draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(body) - 1))
        body = (
            body[:at]
            + draw(st.sampled_from([b"Z", b"\r", b"\n", b";", b" ", b"0"]))
            + body[at + 1 :]
        )
    if draw(st.integers(0, 4)) == 0:
        body += b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    return body


@needs_compiled
@settings(max_examples=600, deadline=None)
@given(chunked_bodies(), st.lists(st.integers(0, 400), max_size=8))
def test_the_scanner_reads_every_body_as_httptools_does(body: bytes, cuts: list[int]) -> None:
    agrees(body, cuts)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(chunked_bodies(), st.data())
def test_every_cut_of_a_body_byte_by_byte(body: bytes, data: st.DataObject) -> None:
    """Batches of one byte: every line and CRLF split at every place."""
    agrees(body, list(range(1, len(body))))


@needs_compiled
def test_plain_stream_is_relayed_as_framed_and_ends_at_its_last_chunk() -> None:
    body = frame(b"data: 1\n\n") + frame(b"data: 2\n\n") + b"0\r\n\r\n"
    got = agrees(body, [3, 20])
    assert got.found == DONE and not got.extra
    assert got.sent == frame(b"data: 1\n\n") + frame(b"data: 2\n\n")  # the last chunk: relay's


@needs_compiled
def test_bytes_after_the_end_are_reported() -> None:
    got = agrees(frame(b"x") + b"0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", [])
    assert got.found == DONE and got.extra


@needs_compiled
@pytest.mark.parametrize(
    "body",
    [
        b"3;ext=1\r\nabc\r\n0\r\n\r\n",  # an extension: httptools reads it (and accepts it)
        b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n",  # a trailer: the same
        b"3\r\nabcXY",  # no CRLF after the data: httptools' error
        b"zz\r\n",  # not a size
        b"00000000000000001\r\nx\r\n0\r\n\r\n",  # 17 digits: httptools judges the size
    ],
)
def test_what_the_scanner_leaves_to_httptools(body: bytes) -> None:
    for cuts in ([], [1], [2, 5], list(range(1, len(body)))):
        assert agrees(body, cuts).found == BAIL


@needs_compiled
def test_a_size_line_is_held_until_whole() -> None:
    """An extension may still come: nothing of a size line goes out before its CRLF."""
    scan = speedups.ChunkScan()
    assert scan.scan(frame(b"ab") + b"1") == MORE
    assert scan.forward == frame(b"ab")
    assert scan.scan(b"0") == MORE and scan.forward == b""
    assert scan.scan(b"\r\n" + b"x" * 5) == MORE
    assert scan.forward == b"10\r\n" + b"x" * 5


@needs_compiled
def test_a_scan_after_the_end_is_refused() -> None:
    scan = speedups.ChunkScan()
    assert scan.scan(b"0\r\n\r\n") == DONE
    with pytest.raises(ValueError):
        scan.scan(b"1\r\nx\r\n")


# ---------------------------------------------------------------------------- on real sockets


PLAIN = [frame(b"data: %d\n\n" % i) for i in range(6)] + [b"0\r\n\r\n"]
# An extension mid-stream and a trailer at the end: what LiveChunks hands back to httptools.
HANDED_BACK = [
    frame(b"data: 0\n\n"),
    frame(b"data: 1\n\n"),
    b"9;id=2\r\ndata: 2\n\n\r\n",
    frame(b"data: 3\n\n"),
    b"0\r\nX-Done: yes\r\n\r\n",
]


@pytest.mark.parametrize("build", ["compiled", "pure"])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("tls", ["plain", "tls replica", "tls client"])
@pytest.mark.parametrize("events", [PLAIN, HANDED_BACK], ids=["plain chunks", "handed back"])
def test_streams_through_a_balancer_on_real_sockets(
    tmp_path: Path, build: str, loop: str, tls: str, events: list[bytes]
) -> None:
    """Two streams, one after the other on one client connection: each decodes to what the
    replica sent, and the second reuses the replica connection the first went live on. In the
    compiled build the live part of each went through LiveChunks, put in front of that
    connection once and armed for each stream; in the pure one, the relay's general path
    (httptools, framed again) does it all."""
    if tls != "plain" and OPENSSL is None:
        pytest.skip("the openssl command is missing")
    if build == "compiled" and speedups.LiveChunks is None:
        pytest.skip("the compiled build is not built, or this run is pure")
    server_ctx = client_ctx = None
    if tls != "plain":
        cert, key = make_cert(tmp_path, "localhost", "IP:127.0.0.1")
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)
        client_ctx = ssl.create_default_context(cafile=str(cert))
    want = b"".join(b"data: %d\n\n" % i for i in range(6 if events is PLAIN else 4))
    made: list[object] = []
    armed: list[object] = []
    counted: Any = None
    if build == "compiled":

        class Counted(speedups.LiveChunks):  # type: ignore[misc, name-defined]
            def __init__(self, *args: object) -> None:
                super().__init__(*args)
                made.append(self)

            def arm(self, *args: object) -> None:
                super().arm(*args)
                armed.append(self)

        counted = Counted

    async def main() -> None:
        replica_ctx = server_ctx if tls == "tls replica" else None
        async with Replica(written(events), replica_ctx) as replica:
            scheme = "https" if replica_ctx else "http"
            lb = LoadBalancer(name="svc", ssl_context=server_ctx if tls == "tls client" else None)
            if replica_ctx is not None:
                lb._client_ssl = client_ctx  # trust the test's certificate
            await lb.start()
            try:
                lb.set_ready({1: f"{scheme}://{HOST}:{replica.port}"})
                reader, writer = await asyncio.open_connection(
                    HOST, lb.port, ssl=client_ctx if tls == "tls client" else None
                )
                for _ in range(2):
                    writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n")
                    assert await asyncio.wait_for(read_answer(reader), 10) == want
                writer.close()
            finally:
                await lb.stop()
            assert replica.connections == 1

    builds = [mock.patch.object(upstream, "LiveChunks", counted)]
    if build == "pure":
        builds += [
            mock.patch.object(relay, "StreamBatch", None),
            mock.patch.object(upstream, "ChunkScan", None),
        ]
    with contextlib.ExitStack() as stack:
        for patch in builds:
            stack.enter_context(patch)
        if loop == "uvloop":
            uvloop.run(asyncio.wait_for(main(), 30))
        else:
            asyncio.run(asyncio.wait_for(main(), 30))
    # One reader for the one replica connection (uvloop restarts reading at each
    # set_protocol), armed for each of the two streams.
    assert (len(made), len(armed)) == ((1, 2) if build == "compiled" else (0, 0))


@pytest.mark.parametrize("build", ["compiled", "pure"])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_client_that_does_not_read_pauses_the_replica(build: str, loop: str) -> None:
    """Flow control holds while a stream is live: a client that stops reading has the
    balancer stop reading the replica (its connection paused, the replica's writes waiting)
    instead of buffering the stream, and once it reads again every byte arrives."""
    if build == "compiled" and speedups.LiveChunks is None:
        pytest.skip("the compiled build is not built, or this run is pure")
    piece = frame(b"d" * 16000)
    count = 3000  # 48 MB: well over what loopback's socket buffers hold on both hops
    state: dict[str, Any] = {"written": 0, "done": False}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(STREAM_HEAD + frame(b"first"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the stream goes live on the first batch
        for _ in range(count):
            writer.write(piece)
            await writer.drain()
            state["written"] += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        state["done"] = True

    async def main() -> None:
        server = await asyncio.start_server(serve, HOST, 0)
        lb = LoadBalancer(name="svc")
        await lb.start()
        try:
            lb.set_ready({1: f"http://{HOST}:{server.sockets[0].getsockname()[1]}"})
            reader, writer = await asyncio.open_connection(HOST, lb.port, limit=1 << 16)
            writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            await replica_paused(lb, state)  # the client reads nothing meanwhile
            await asyncio.sleep(0.3)
            assert not state["done"] and state["written"] < count * 3 // 4, state
            data = await asyncio.wait_for(read_answer_body(reader), 30)
            assert data == b"first" + b"d" * 16000 * count
            writer.close()
        finally:
            await lb.stop()
            server.close()

    builds: list[Any] = []
    if build == "pure":
        builds = [
            mock.patch.object(upstream, "LiveChunks", None),
            mock.patch.object(relay, "StreamBatch", None),
            mock.patch.object(upstream, "ChunkScan", None),
        ]
    with contextlib.ExitStack() as stack:
        for patch in builds:
            stack.enter_context(patch)
        runner = uvloop.run if loop == "uvloop" else asyncio.run
        runner(asyncio.wait_for(main(), 60))


@needs_compiled
def test_a_live_streams_last_event_and_its_end_leave_in_one_write() -> None:
    """A replica that sends its last event and the last chunk together has them reach the
    client in one write from the balancer too (not the event, then the end in a write of its
    own: a syscall more per stream). Every write to the client is recorded: LiveChunks' (the
    transport's write it is armed with) and the relay's (``ClientConnection.write``)."""
    events = [frame(b"data: 0\n\n"), frame(b"data: 1\n\n"), frame(b"data: 2\n\n") + b"0\r\n\r\n"]
    writes: list[bytes] = []
    relay_write = client_module.ClientConnection.write

    class Recorded(speedups.LiveChunks):  # type: ignore[misc, name-defined]
        def arm(self, scan: object, client: object, write: Any, *rest: object) -> None:
            def recorded(data: bytes) -> None:
                writes.append(bytes(data))
                write(data)

            super().arm(scan, client, recorded, *rest)

    def recorded_relay_write(self: Any, data: bytes) -> None:
        writes.append(bytes(data))
        relay_write(self, data)

    async def main() -> None:
        async with Replica(written(events)) as replica:
            lb = LoadBalancer(name="svc")
            await lb.start()
            try:
                lb.set_ready({1: f"http://{HOST}:{replica.port}"})
                reader, writer = await asyncio.open_connection(HOST, lb.port)
                writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n")
                got = await asyncio.wait_for(read_answer(reader), 10)
                assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
                writer.close()
            finally:
                await lb.stop()

    with (
        mock.patch.object(upstream, "LiveChunks", Recorded),
        mock.patch.object(client_module.ClientConnection, "write", recorded_relay_write),
    ):
        uvloop.run(asyncio.wait_for(main(), 30))
    assert writes[-1] == events[-1], writes


# First batches that end part-way through the replica's framing: in a chunk's data, between
# its data and CRLF, between CR and LF, in the next size line. The general path frames what it
# read of that batch as chunks of its own, so the replica's framing cannot take over there.
CUT_FIRST = {
    "in data": [b"10\r\nAAAAAAAA", b"BBBBBBBB\r\n", *PLAIN],
    "before CRLF": [b"8\r\nAAAAAAAA", b"\r\n", *PLAIN],
    "between CR and LF": [b"8\r\nAAAAAAAA\r", b"\n", *PLAIN],
    "in a size line": [frame(b"AAAAAAAA") + b"1", b"0\r\n" + b"B" * 16 + b"\r\n", *PLAIN],
}


@contextlib.asynccontextmanager
async def balanced(script: Script) -> AsyncIterator[LoadBalancer]:
    """A started balancer in front of one replica that answers by ``script``."""
    async with Replica(script) as replica:
        lb = LoadBalancer(name="svc")
        await lb.start()
        try:
            lb.set_ready({1: f"http://{HOST}:{replica.port}"})
            yield lb
        finally:
            await lb.stop()


@pytest.mark.parametrize("build", ["compiled", "pure"])
@pytest.mark.parametrize("cut", list(CUT_FIRST))
def test_a_first_batch_cut_in_a_chunk_reaches_the_client_whole(build: str, cut: str) -> None:
    """Whatever the first batch cut, the client decodes every byte the replica sent, on the
    general path (a connection's first stream) and then on the fast one (its second)."""
    if build == "compiled" and speedups.LiveChunks is None:
        pytest.skip("the compiled build is not built, or this run is pure")
    pieces = CUT_FIRST[cut]
    want = _dechunked(b"".join(pieces))

    async def main() -> None:
        async with balanced(written(pieces)) as lb:
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            for _ in range(2):
                writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n")
                assert await asyncio.wait_for(read_answer(reader), 10) == want
            writer.close()

    with contextlib.ExitStack() as stack:
        if build == "pure":
            stack.enter_context(mock.patch.object(relay, "StreamBatch", None))
            stack.enter_context(mock.patch.object(upstream, "ChunkScan", None))
        uvloop.run(asyncio.wait_for(main(), 30))


def _dechunked(body: bytes) -> bytes:
    """What httptools reads from a chunked body: the data the replica meant."""
    got: list[bytes] = []

    class Sink:
        def on_body(self, data: bytes) -> None:
            got.append(data)

    parser = httptools.HttpResponseParser(Sink())
    parser.feed_data(STREAM_HEAD + body)
    return b"".join(got)


@pytest.mark.parametrize(
    ("coding", "relayed"),
    [
        (b"Transfer-Encoding: gzip, chunked\r\n", False),
        (b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", False),
        (b"Transfer-Encoding: Chunked \r\n", True),
    ],
    ids=["gzip, chunked", "on two lines", "chunked in capitals"],
)
def test_a_transfer_coding_other_than_chunked_is_refused(coding: bytes, relayed: bool) -> None:
    """The relay takes the chunks off and puts them back, and Transfer-Encoding is hop-by-hop:
    a body gzip'd as a transfer coding would reach the client gzip'd with nothing saying so.
    Such an answer is a 502 naming the coding (as nginx refuses it); ``chunked`` alone, in
    any case, is relayed."""
    body = b"data: hello\n\n"

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + coding + b"\r\n" + frame(body) + b"0\r\n\r\n")

    async def main() -> None:
        async with balanced(script) as lb:
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        head, _, rest = answer.partition(b"\r\n\r\n")
        if relayed:
            assert head.startswith(b"HTTP/1.1 200") and _dechunked(rest) == body
        else:
            assert head.startswith(b"HTTP/1.1 502"), answer
            assert b"transfer coding the balancer cannot relay" in rest

    uvloop.run(asyncio.wait_for(main(), 30))


def test_a_size_line_alone_is_not_the_first_token() -> None:
    """A replica that sends a chunk's size line, and its data a while later: the time to
    first token runs to the data, on the general path (a connection's first stream) as on
    the fast one (its second), where the compiled scanner sees the size line go by."""
    gap = 0.3

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + b"5\r\n")
        await writer.drain()
        await asyncio.sleep(gap)
        writer.write(b"hello\r\n0\r\n\r\n")

    seen: list[float] = []

    async def main() -> None:
        async with balanced(script) as lb:
            observe = lb._observe_ttft
            lb._observe_ttft = lambda rid, s: (seen.append(s), observe(rid, s))  # type: ignore[method-assign]
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            for _ in range(2):
                writer.write(b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n")
                assert await asyncio.wait_for(read_answer(reader), 10) == b"hello"
            writer.close()

    uvloop.run(asyncio.wait_for(main(), 30))
    assert len(seen) == 2 and min(seen) >= gap * 0.8, seen
