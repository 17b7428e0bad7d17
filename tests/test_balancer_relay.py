"""The stream relay (corral.balancer.relay) batch by batch, over fake transports.

Why: once a stream's head and first bytes went out, the relay collects the body's pieces with a
bare ``list.append`` and frames each batch as one chunk (``_go_live``), to spend fewer Python
calls per event. These tests pin what the client must see whatever the batching: every batch
passed on before the next one comes, a chunked body that decodes to exactly what the replica
sent, the last chunk at the end (or none when the stream breaks), the first bytes timed once,
the idle deadline moved by each batch, and the next exchange on the connection unaffected.
And a live stream that fails (broken chunked framing from the replica, the client gone, a bug
met on a batch) ends as it would before going live: the client cut with no last chunk, the
replica connection closed, not pooled.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from unittest import mock

import pytest
from chunked import dechunk
from test_balancer_fastpath import FakeTransport, Rig

from corral.balancer import relay, speedups, upstream
from corral.balancer.relay import _LIVE_CHUNK, DL_IDLE
from corral.balancer.upstream import UpstreamConnection

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
GET = b"GET /sse HTTP/1.1\r\nHost: h\r\n\r\n"


@pytest.fixture(autouse=True, params=["method", "compiled", "raw"])
def batch_end(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test three times: a live stream's batches ended by the relay's method (the pure
    build), by the compiled ``StreamBatch`` that shadows it, and, the compiled build's own
    way, handled whole in C by ``LiveChunks`` where the replica's framing is plain chunks (the
    last two skipped where it is not built or the run is on the pure build)."""
    if request.param != "method" and speedups.StreamBatch is None:
        pytest.skip("the compiled build is not built, or this run is on the pure build")
    if request.param == "raw":
        yield request.param
        return
    with (
        mock.patch.object(upstream, "LiveChunks", None),
        mock.patch.object(
            relay, "StreamBatch", None if request.param == "method" else relay.StreamBatch
        ),
    ):
        yield request.param


def feed(conn: UpstreamConnection, data: bytes) -> None:
    """Bytes from the replica, to whichever protocol its transport has now (a live stream's
    ``LiveChunks``, or the connection)."""
    protocol = conn.transport.get_protocol() if conn.transport is not None else None
    (protocol if protocol is not None else conn).data_received(data)


def lose(conn: UpstreamConnection, exc: Exception | None) -> None:
    """The replica's connection lost, reported to its transport's protocol."""
    protocol = conn.transport.get_protocol() if conn.transport is not None else None
    (protocol if protocol is not None else conn).connection_lost(exc)


def frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def send(rig: Rig, request: bytes) -> UpstreamConnection:
    """Send a request from the client; the replica connection it went out on."""
    rig.client.data_received(request)
    for conn, transport in rig.ups.values():
        if transport.take():
            return conn
    raise AssertionError("the request went to no replica")


def split_head(out: bytes) -> tuple[bytes, bytes]:
    head, sep, body = out.partition(b"\r\n\r\n")
    assert sep, out
    return head, body


def test_chunked_stream_batch_by_batch() -> None:
    """Each batch reaches the client at once, however the replica's chunks fall in batches."""
    rig = Rig()
    conn = send(rig, GET)
    events = [b"data: %d\n\n" % i for i in range(8)]
    batches = [
        SSE_HEAD + frame(events[0]),
        frame(events[1]),
        frame(events[2]) + frame(events[3]),  # two chunks in one batch
        frame(events[4])[:5],  # a chunk split across batches
        frame(events[4])[5:] + frame(events[5])[:3],
        frame(events[5])[3:],
        frame(events[6]),
    ]
    sent = b""
    for i, batch in enumerate(batches):
        feed(conn, batch)
        got = rig.ct.take()
        if i == 0:
            head, got = split_head(got)
            assert b"Transfer-Encoding: chunked" in head
        sent += got
        data, ended = dechunk(sent)
        assert not ended
        # everything whole that the replica sent so far is with the client already
        assert data.startswith(b"".join(events[: min(i + 1, 4)]))
    ex = rig.client.exchange
    assert ex is not None and ex.mode == _LIVE_CHUNK  # the path these tests are for
    assert_relayed_as_framed(conn)
    feed(conn, frame(events[7]) + b"0\r\n\r\n")
    sent += rig.ct.take()
    data, ended = dechunk(sent)
    assert data == b"".join(events) and ended
    assert conn in rig.lb._ready[conn.target.rid].idle  # back in the pool, reusable
    assert rig.client.exchange is None


def test_head_alone_then_events_times_the_first_event_once() -> None:
    rig = Rig()
    conn = send(rig, GET)
    with mock.patch.object(rig.lb, "_observe_ttft") as ttft:
        feed(conn, SSE_HEAD)
        assert split_head(rig.ct.take())[1] == b"" and ttft.call_count == 0
        for i in range(5):
            feed(conn, frame(b"data: %d\n\n" % i))
            assert dechunk(rig.ct.take())[0] == b"data: %d\n\n" % i
        assert ttft.call_count == 1
        feed(conn, b"0\r\n\r\n")
        assert rig.ct.take() == b"0\r\n\r\n"


def test_each_batch_moves_the_idle_deadline() -> None:
    rig = Rig(idle_timeout=30.0)
    conn = send(rig, GET)
    feed(conn, SSE_HEAD + frame(b"a"))
    rig.ct.take()
    for _ in range(3):
        rig.client.deadline = 1.0  # as if long passed: the next batch must move it again
        feed(conn, frame(b"b"))
        assert rig.client.deadline_kind == DL_IDLE
        assert rig.client.deadline > 1000.0
    feed(conn, b"0\r\n\r\n")


def test_next_exchange_after_a_stream_is_relayed_whole() -> None:
    rig = Rig()
    conn = send(rig, GET)
    feed(conn, SSE_HEAD + frame(b"x"))
    feed(conn, frame(b"y"))
    feed(conn, b"0\r\n\r\n")
    assert dechunk(split_head(rig.ct.take())[1]) == (b"xy", True)
    conn = send(rig, b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n")
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhe")
    feed(conn, b"llo")
    head, body = split_head(rig.ct.take())
    assert b"Content-Length: 5" in head and body == b"hello"


def test_stream_ended_by_the_replica_closing() -> None:
    """No length, no chunking from the replica: the client gets chunks, then the last one."""
    rig = Rig()
    conn = send(rig, GET)
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\nab")
    feed(conn, b"cd")
    feed(conn, b"ef")
    lose(conn, None)
    head, body = split_head(rig.ct.take())
    assert b"Transfer-Encoding: chunked" in head
    assert dechunk(body) == (b"abcdef", True)


def test_stream_to_an_http10_client_passes_raw() -> None:
    rig = Rig()
    conn = send(rig, b"GET /sse HTTP/1.0\r\nHost: h\r\n\r\n")
    feed(conn, SSE_HEAD + frame(b"one"))
    feed(conn, frame(b"two"))
    feed(conn, frame(b"three") + b"0\r\n\r\n")
    head, body = split_head(rig.ct.take())
    assert b"chunked" not in head.lower() and b"Connection: close" in head
    assert body == b"onetwothree"


def test_posted_answer_with_a_length_is_streamed_as_it_comes() -> None:
    """A POST's answer is not held for retries: its pieces pass as they come."""
    rig = Rig()
    conn = send(rig, b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx")
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc")
    assert split_head(rig.ct.take())[1] == b"abc"
    feed(conn, b"def")
    assert rig.ct.take() == b"def"
    feed(conn, b"ghi")
    assert rig.ct.take() == b"ghi"
    assert rig.client.exchange is None


def test_stream_broken_mid_way_gets_no_last_chunk() -> None:
    rig = Rig()
    conn = send(rig, GET)
    feed(conn, SSE_HEAD + frame(b"a"))
    feed(conn, frame(b"b"))
    lose(conn, ConnectionResetError("reset"))
    data, ended = dechunk(split_head(rig.ct.take())[1])
    assert data == b"ab" and not ended
    assert rig.ct.closed


def test_a_finished_stream_leaves_no_cycle_to_collect() -> None:
    """The shadowing callables hold the exchange weakly: it goes when its answer ends."""
    gc.collect()
    gc.disable()
    try:
        rig = Rig()
        conn = send(rig, GET)
        feed(conn, SSE_HEAD + frame(b"a"))
        feed(conn, frame(b"b"))
        ex = rig.client.exchange
        assert ex is not None and ex.mode == _LIVE_CHUNK
        gone = weakref.ref(ex)
        del ex
        feed(conn, b"0\r\n\r\n")
        assert gone() is None
    finally:
        gc.enable()


def live_stream(rig: Rig) -> UpstreamConnection:
    """A chunked stream gone live, its head and first two events with the client."""
    conn = send(rig, GET)
    feed(conn, SSE_HEAD + frame(b"a"))
    feed(conn, frame(b"b"))
    ex = rig.client.exchange
    assert ex is not None and ex.mode == _LIVE_CHUNK
    assert_relayed_as_framed(conn)
    return conn


def assert_relayed_as_framed(conn: UpstreamConnection) -> None:
    """Where the build has it, a live stream of plain chunks is LiveChunks' to relay."""
    if upstream.LiveChunks is not None:
        assert conn.transport is not None
        front = conn.transport.get_protocol()
        assert type(front) is upstream.LiveChunks and front.armed


@pytest.mark.parametrize(
    "bad",
    [b"zz\r\n", b"3;\x01\r\nabc\r\n", b"3\r\nabcXY", b"1\r\nc\r\n0\r\nbad trailer\r\n\r\n"],
)
def test_malformed_chunking_mid_stream_cuts_the_client(bad: bytes) -> None:
    """A replica's broken framing after the stream went live: the client is cut with no last
    chunk (it must not take a truncated answer for a whole one), the connection not kept."""
    rig = Rig()
    conn = live_stream(rig)
    feed(conn, bad)
    data, ended = dechunk(split_head(rig.ct.take())[1])
    assert data.startswith(b"ab") and not ended
    assert rig.ct.closed and conn.closed
    assert conn not in rig.lb._ready[conn.target.rid].idle


def test_second_answer_after_a_stream_is_dropped_with_the_connection() -> None:
    """A replica that sends a response nobody asked for right after the stream's end, in the
    same batch: the client gets the stream and its last chunk and nothing of the extra
    response (once, its head was passed on as garbage in the chunked body), and the
    connection is not pooled."""
    rig = Rig()
    conn = live_stream(rig)
    feed(conn, b"0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert split_head(rig.ct.take())[1] == frame(b"a") + frame(b"b") + b"0\r\n\r\n"
    assert not rig.ct.closed and rig.client.exchange is None  # the client's connection goes on
    assert conn.closed and conn not in rig.lb._ready[conn.target.rid].idle


def test_second_answer_after_a_posted_answer_is_dropped() -> None:
    rig = Rig()
    conn = send(rig, b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx")
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
    assert split_head(rig.ct.take())[1] == b"hi"
    conn = send(rig, b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx")
    extra = b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + extra)
    head, body = split_head(rig.ct.take())
    assert head.startswith(b"HTTP/1.1 200 ") and body == b"ok"
    assert conn.closed and conn not in rig.lb._ready[conn.target.rid].idle


def test_client_gone_mid_stream_drops_the_replica_connection() -> None:
    rig = Rig()
    conn = live_stream(rig)
    rig.client.connection_lost(None)
    assert conn.closed
    feed(conn, frame(b"late"))  # in flight when it closed: dropped, no error
    assert conn not in rig.lb._ready[conn.target.rid].idle


def test_error_in_a_live_batch_is_logged_and_cuts() -> None:
    """A bug met while a live batch is handled is caught as on the general path."""
    rig = Rig()
    conn = live_stream(rig)
    ex = rig.client.exchange
    assert ex is not None
    rig.ct.take()
    rig.ct.fail = RuntimeError("bug")  # the client's write, in whichever code runs the batch
    with mock.patch.object(upstream.logger, "exception") as logged:
        feed(conn, frame(b"c"))
    assert logged.call_count == 1
    assert conn.closed and rig.ct.closed


def test_pooled_connection_after_a_stream_relays_a_new_answer() -> None:
    """A stream's connection goes back to the pool with nothing of the stream left: the next
    answer on it is parsed and relayed from its head."""
    rig = Rig()
    conn = live_stream(rig)
    feed(conn, b"0\r\n\r\n")
    assert conn in rig.lb._ready[conn.target.rid].idle
    rig.ct.take()
    send_to(rig, conn)
    feed(conn, SSE_HEAD + frame(b"n") + b"0\r\n\r\n")
    assert dechunk(split_head(rig.ct.take())[1]) == (b"n", True)


def send_to(rig: Rig, conn: UpstreamConnection) -> None:
    """Send GETs until one goes out on ``conn`` (round robin: within a few), answering the
    others."""
    for _ in range(4):
        again = send(rig, GET)
        if again is conn:
            return
        feed(again, b"HTTP/1.1 204 No Content\r\n\r\n")
        rig.ct.take()
    raise AssertionError("no request went out on that connection")


def test_the_reader_stays_in_front_of_a_connection_between_streams() -> None:
    """Where the build has LiveChunks, it is put in front of a replica connection at the
    connection's first live stream and left there, disarmed, when the stream ends (uvloop
    restarts reading at each set_protocol): a plain answer after it reaches the connection
    through it, and the next stream arms the same reader, with no set_protocol again."""
    rig = Rig()
    conn = live_stream(rig)
    transport = conn.transport
    assert isinstance(transport, FakeTransport)
    front = transport.get_protocol()
    feed(conn, b"0\r\n\r\n")
    assert dechunk(split_head(rig.ct.take())[1]) == (b"ab", True)
    if upstream.LiveChunks is not None:
        assert transport.get_protocol() is front and not front.armed
    send_to(rig, conn)
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert rig.ct.take().endswith(b"\r\n\r\nok")
    assert conn in rig.lb._ready[conn.target.rid].idle
    send_to(rig, conn)
    feed(conn, SSE_HEAD + frame(b"c"))
    feed(conn, frame(b"d"))
    assert_relayed_as_framed(conn)
    feed(conn, b"0\r\n\r\n")
    assert dechunk(split_head(rig.ct.take())[1]) == (b"cd", True)
    if upstream.LiveChunks is not None:
        assert transport.get_protocol() is front and not front.armed
        assert transport.protocols_set == 1


def test_each_answer_gets_its_own_head_when_a_replica_changes_it() -> None:
    """The general path remembers each replica's last header block and what its scan found:
    the same block again reuses it, a changed one (a new Date, another header) is scanned."""
    rig = Rig()
    versions = [b"1", b"1", b"2", b"2", b"1", b"1"]  # round robin: each replica 1, 2, 1
    for version in versions:
        conn = send(rig, GET)
        extra = b"Keep-Alive: timeout=5\r\n" if version == b"2" else b""
        head = SSE_HEAD.replace(b"\r\n\r\n", b"\r\nX-Version: %b\r\n%b\r\n" % (version, extra))
        feed(conn, head + frame(b"x") + b"0\r\n\r\n")
        got, body = split_head(rig.ct.take())
        assert b"X-Version: " + version in got and b"X-Version" not in body
        assert (b"Keep-Alive" in got) is False  # hop-by-hop: dropped whenever it comes
        assert dechunk(body) == (b"x", True)
    for rid in (1, 2):
        scanned = rig.lb._ready[rid].scanned
        assert scanned is not None and b"X-Version: 1" in scanned[0]  # each replica's last
