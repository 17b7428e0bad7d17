"""The balancer's fast path (corral.balancer.fast) against its general path, byte for byte.

Why: the fast path re-implements, for the common request, what the general path does
(header rewriting, framing, metrics, pooling). Driving both with the same bytes over fake
transports and comparing what each side receives catches any drift between them, including on
heads the fast path must leave alone (it has to hand those over untouched).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.balancer import LoadBalancer, fast, plain_answer
from corral.balancer.client import ClientConnection
from corral.balancer.upstream import UpstreamConnection


class FakeTransport:
    """Records writes; enough of asyncio.Transport for the balancer's protocols."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False
        self.protocol: Any = None  # set only by set_protocol (a live stream's relay)
        self.protocols_set = 0  # how many times (uvloop restarts reading at each)
        self.fail: Exception | None = None  # raised by write, to stand for a bug there

    def write(self, data: bytes) -> None:
        if self.fail is not None:
            raise self.fail
        self.out.append(data)

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol
        self.protocols_set += 1

    def get_protocol(self) -> Any:
        return self.protocol

    def take(self) -> bytes:
        data, self.out = b"".join(self.out), []
        return data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.1.2.3", 5555) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None: ...


class Rig:
    """A balancer with two replicas, one pooled connection each, and one client connection."""

    def __init__(self, **settings: Any) -> None:
        self.lb = LoadBalancer(name="svc", policy="round_robin", **settings)
        self.lb.set_ready({1: "http://127.0.0.1:9001", 2: "http://127.0.0.1:9002/pre"})
        self.ups: dict[int, tuple[UpstreamConnection, FakeTransport]] = {}
        for rid, target in self.lb._ready.items():
            conn = UpstreamConnection(target)
            transport = FakeTransport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            conn.reusable = True
            self.lb._pool.put(conn)
            self.ups[rid] = (conn, transport)
        self.client = ClientConnection(self.lb)
        self.ct = FakeTransport()
        self.client.connection_made(self.ct)  # type: ignore[arg-type]

    def exchange(self, request: bytes, responses: list[bytes]) -> tuple[bytes, bytes]:
        """Send a request, answer it from whichever replica got it; (sent upstream, client
        got)."""
        self.client.data_received(request)
        sent = b""
        for rid, (conn, transport) in self.ups.items():
            data = transport.take()
            if data:
                sent = b"%d:" % rid + data
                for response in responses:
                    conn.data_received(response)
        return sent, self.ct.take()


REQUESTS = [
    b"GET / HTTP/1.1\r\nHost: a.example:8080\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n",
    b"GET /x?q=1 HTTP/1.1\r\nhOsT:  b.example \r\n\r\n",
    b"GET /nohost HTTP/1.0\r\nAccept: */*\r\n\r\n",
    b"GET /ka HTTP/1.0\r\nConnection: Keep-Alive\r\nHost: h\r\n\r\n",
    b"GET /close HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    b"GET /xff HTTP/1.1\r\nX-Forwarded-For: 1.1.1.1, 2.2.2.2\r\nHost: h\r\n\r\n",
    b"GET /xff2 HTTP/1.1\r\nX-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 3.3.3.3\r\nHost: h\r\n"
    b"\r\n",
    b"GET /proto HTTP/1.1\r\nHost: h\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: evil\r\n\r\n",
    b"GET /named HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, X-Secret\r\nX-Secret: 1\r\n\r\n",
    b"GET /te HTTP/1.1\r\nHost: h\r\nTE: trailers\r\nProxy-Authorization: x\r\n\r\n",
    b"GET /twohosts HTTP/1.1\r\nHost: h\r\nHost: i\r\n\r\n",
    b"GET http://other.example/abs?x HTTP/1.1\r\nHost: other.example\r\n\r\n",
    b"HEAD /head HTTP/1.1\r\nHost: h\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
    b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n"
    b'{"a":1}',
    b"POST /zero HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
    b"PUT /cl HTTP/1.1\r\nContent-Length:  3 \r\nHost: h\r\n\r\nabc",
    b"POST /chunked HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"PATCH /expect HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
    b"DELETE /d HTTP/1.1\r\nHost: h\r\nKeep-Alive: 5\r\n\r\n",
    # request lines the fast path's one split must not misread
    b"GET  /double-space HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /bare\rcr HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /bare-lf HTTP/1.1\nHost: h\r\n\r\n",
    b"GET /trailing-space HTTP/1.1 \r\nHost: h\r\n\r\n",
    b"GET /two words HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /v HTTP/1.10\r\nHost: h\r\n\r\n",
]
RESPONSES = [
    [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"],
    [b"HTTP/1.1 404 Not Found\r\nContent-length: 0\r\nServer: x\r\n\r\n"],
    [
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n"
        b"Content-Length: 1\r\n\r\nz"
    ],
    [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nz"],
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"],
    [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok", b"ok"],
    [b"HTTP/1.1 204 No Content\r\n\r\n"],
    [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n"],
    [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 1\r\n\r\nc"],
    [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"],
    [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"],
    [b"HTTP/1.1 200 OK\r\nX-Bad : 1\r\nContent-Length: 2\r\n\r\nok"],
    [b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 3\r\n\r\nerr"],
]


# A request, then the same request line and Host line with other header lines after them.
LEAD_BASE = b"GET /poll HTTP/1.1\r\nHost: h.example\r\nAccept: */*\r\n\r\n"
LEAD_TAILS = [
    [b"X-Request-Id: %d\r\n\r\n" % n for n in range(3)],
    [b"Cookie: a=1\r\n\r\n", b"Connection: close\r\n\r\n"],
    [b"X-Id: 1\r\n\r\n", b"Content-Length: 2\r\n\r\nhi", b"X-Id: 3\r\n\r\n"],
    [b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"],
    [b"Host: other\r\n\r\n"],  # a second Host
    [b"hOST: h.example\r\n\r\n"],
    [b"X-Forwarded-For: 1.1.1.1\r\n\r\n", b"X-Forwarded-Host: evil\r\n\r\n"],
    [b"Expect: 100-continue\r\n\r\n", b"Upgrade: websocket\r\n\r\n"],
    [b"Keep-Alive: 5\r\n\r\n", b"TE: trailers\r\n\r\n", b"X-Id: 2\r\n\r\n"],
    # lines llhttp refuses: the general path's 400, never a request sent on
    [b"X-Bad : 1\r\n\r\n"],
    [b"X-Bad\x01: 1\r\n\r\n"],
    [b"X-Bad: a\x00b\r\n\r\n"],
    [b"X-Fold: a\r\n b\r\n\r\n"],
    [b"X-Lf: a\nTransfer-Encoding: chunked\r\n\r\n"],
    [b": empty-name\r\n\r\n"],
    [b"No-Colon\r\n\r\n"],
    # long lines (a big cookie): past the heads the memos keep, and past the header limit
    [b"Cookie: " + b"c" * 3000 + b"\r\n\r\n", b"Cookie: " + b"d" * 9000 + b"\r\n\r\n"],
    # pipelined: the general path keeps them in order
    [b"X-Id: 1\r\n\r\nGET /next HTTP/1.1\r\nHost: h.example\r\n\r\n"],
]
# A lead with Connection: keep-alive too (python-requests sends it with every request), then
# requests that keep, drop, repeat or change that line.
LEAD_KA = b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\nAccept: */*\r\n\r\n"
LEAD_KA_NEXT = [
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\nX-Id: 1\r\n\r\n",
    b"GET /other HTTP/1.1\r\nConnection: keep-alive\r\nX-Id: 2\r\nHost: h.example\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id: 3\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: close\r\nX-Id: 4\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: Keep-Alive\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive, X-Secret\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\n"
    b"Connection: keep-alive\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nConnection: keep-alive\r\nX-Id: 5\r\n\r\n",
    b"GET /poll HTTP/1.0\r\nHost: h.example\r\nConnection: keep-alive\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\nX-Id: 6\r\n\r\n",
]

# A POST with a body as a lead, then requests with other bodies and lengths (taken only when the
# bytes after the head are exactly Content-Length's value), bodies the general path must frame,
# and Content-Length values or spellings the general path must judge.
LEAD_POST = b'POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 7\r\n\r\n{"a":1}'
LEAD_POST_NEXT = [
    b'POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 9\r\nX-Id: 1\r\n\r\n{"a":22}',
    b"POST /v1/chat HTTP/1.1\r\nX-Id: 2\r\nContent-Length: 2\r\nHost: h.example\r\n\r\nhi",
    b"PUT /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 0\r\n\r\n",
    b"GET /api HTTP/1.1\r\nHost: h.example\r\nX-Id: 3\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length:  2 \r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length:\t2\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 002\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\ncontent-length: 2\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: +2\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2 2\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 1_0\r\n\r\n0123456789",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: \r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 5\r\n\r\nhi",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\n\r\nhiGET / HTTP/1.1\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\n\r\nhi\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 4\r\n\r\n\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 70000\r\n\r\n" + b"b" * 70000,
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
]

# Other request lines with the remembered Host line (a client that varies its path or method),
# taken on the fast path's own request-line grammar, and ones that grammar must refuse.
LEAD_LINES = [
    b"GET /item/1 HTTP/1.1\r\n",
    b"DELETE /item/2?force=1&x=%20y HTTP/1.1\r\n",
    b"OPTIONS /a#frag HTTP/1.1\r\n",
    b"HEAD /h HTTP/1.1\r\n",
    b"GET / HTTP/1.0\r\n",
    b"GET http://h.example/abs HTTP/1.1\r\n",
    b"GET * HTTP/1.1\r\n",
    b"get /lower HTTP/1.1\r\n",
    b"PROPFIND /dav HTTP/1.1\r\n",
    b"GET  /two-spaces HTTP/1.1\r\n",
    b"GET /sp ace HTTP/1.1\r\n",
    b"GET /tab\t HTTP/1.1\r\n",
    b"GET /ctl\x01 HTTP/1.1\r\n",
    b"GET /del\x7f HTTP/1.1\r\n",
    b"GET /high\xff HTTP/1.1\r\n",
    b"GET /x HTTP/1.1 \r\n",
    b"GET /x HTTP/1.2\r\n",
    b"GET /x HTTP/1.1\n",
    b"GET /x\r\n",
    # line ends inside the request line, which llhttp reads as an HTTP/0.9 line and headers
    *(
        LINE_ENDS := [
            # (no space in them: the request line splits at its spaces)
            b"GET /a\r\nX-Forwarded-For:6.6.6.6\r\nTransfer-Encoding:chunked\r\nX:y HTTP/1.1\r\n"
            b"Host: h\r\n\r\n",
            b"GET /a\nX-Forwarded-For:6.6.6.6 HTTP/1.1\r\nHost: h\r\n\r\n",
        ]
    ),
    b"GET /pc HTTP/1.1\r\nHost: h\r\nProxy-Connection: close\r\n\r\n",
]


def _lead_line(line: bytes) -> bytes:
    """LEAD_BASE's Host and Accept lines under another request line."""
    return line + LEAD_BASE[LEAD_BASE.index(b"\r\n") + 2 :]


# The same request line with another Host line, none, or the same one elsewhere.
LEAD_HOSTS = [
    b"GET /poll HTTP/1.1\r\nHost: h.example.evil\r\nAccept: */*\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.exampl\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nAccept: */*\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nAccept: */*\r\nHost: h.example\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nAccept: */*\r\nHost: h.example\r\nHost: h.example\r\n\r\n",
]


def _with_id(first: bool, n: int) -> bytes:
    """wrk's varied requests, with the request id before or after the Host line."""
    lines = [b"Host: 127.0.0.1:8080", b"X-Request-Id: %d" % n]
    if first:
        lines.reverse()
    return b"GET / HTTP/1.1\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"


def _no_fast_path(cl: ClientConnection, data: bytes) -> bool:
    """ClientConnection.fast_request turned off: every request takes the general path."""
    return False


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def _run(loop: asyncio.AbstractEventLoop, request: bytes, responses: list[bytes]) -> Any:
    async def go() -> Any:
        rig = Rig()
        sent, got = rig.exchange(request, responses)
        stats = rig.lb.stats()
        stats["latency"] = stats["latency"]["count"]  # the buckets depend on timing
        stats["ttft"] = stats["ttft"]["count"]  # so does time to first token
        for replica in stats["replicas"].values():
            replica["ttft"] = replica["ttft"]["count"]
        for conn, _ in rig.ups.values():
            assert conn.fast_client is None or rig.client.fast is not None
        idle = sorted(len(t.idle) for t in rig.lb._ready.values())
        return sent, got, stats, idle, rig.ct.closed, rig.client.fast is None

    return loop.run_until_complete(go())


@pytest.mark.parametrize("request_bytes", REQUESTS, ids=lambda r: r.split(b"\r\n")[0].decode())
@pytest.mark.parametrize("responses", RESPONSES, ids=lambda r: r[0].split(b"\r\n")[1].decode())
def test_fast_path_sends_what_the_general_path_sends(
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    request_bytes: bytes,
    responses: list[bytes],
) -> None:
    fast_result = _run(loop, request_bytes, responses)
    monkeypatch.setattr(ClientConnection, "fast_request", _no_fast_path)
    general_result = _run(loop, request_bytes, responses)
    assert fast_result == general_result


@pytest.mark.parametrize("request_bytes", LINE_ENDS, ids=["CRLF", "bare LF"])
def test_a_line_end_in_the_request_line_is_a_400_on_either_path(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch, request_bytes: bytes
) -> None:
    """What follows a line end there would reach the replica as header lines of the client's
    making, past the balancer's checks (its own X-Forwarded-For, a Transfer-Encoding it
    never framed): refused before anything goes upstream, whichever path reads it."""
    for on_fast_path in (True, False):
        if not on_fast_path:
            monkeypatch.setattr(ClientConnection, "fast_request", _no_fast_path)
        sent, got, *_ = _run(loop, request_bytes, RESPONSES[0])
        assert sent == b"" and b" 400 " in got.split(b"\r\n")[0], (on_fast_path, got)


def test_proxy_connection_close_ends_the_connection_on_either_path(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old clients' Connection header, which llhttp reads as one: after "close" in it the
    connection ends with the answer, on either path (the parser would refuse the next
    request: the general path answered it 400 and the fast path served it)."""
    first = b"GET /pc HTTP/1.1\r\nHost: h\r\nProxy-Connection: close\r\n\r\n"
    pairs = [(first, RESPONSES[0]), (REQUESTS[0], RESPONSES[0])]
    for on_fast_path in (True, False):
        if not on_fast_path:
            monkeypatch.setattr(ClientConnection, "fast_request", _no_fast_path)
        seen, _ = _repeat(loop, pairs)
        assert len(seen) == 1 and seen[0][2], (on_fast_path, seen)  # closed after the first answer
        assert b"Connection: close" in seen[0][1]


def test_common_request_takes_the_fast_path(loop: asyncio.AbstractEventLoop) -> None:
    async def go() -> None:
        rig = Rig()
        rig.client.data_received(REQUESTS[0])
        assert rig.client.fast is not None and rig.client.exchange is None
        (conn, transport) = rig.ups[1]
        assert transport.take().startswith(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:9001\r\n")
        conn.data_received(RESPONSES[0][0])
        assert rig.client.fast is None and rig.client.exchange is None
        assert rig.ct.take() == RESPONSES[0][0]
        assert rig.lb.in_flight() == 0 and len(rig.lb._ready[1].idle) == 1

    loop.run_until_complete(go())


def test_replica_closing_before_answering_retries_a_fast_get(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def go() -> None:
        rig = Rig()
        rig.client.data_received(REQUESTS[0])
        conn, _ = rig.ups[1]
        conn.connection_lost(None)  # the replica closed the pooled connection
        # retried on replica 2, through its pooled connection
        assert rig.client.exchange is not None and rig.client.fast is None
        conn2, transport2 = rig.ups[2]
        assert transport2.take().startswith(b"GET /pre/ HTTP/1.1\r\n")
        conn2.data_received(RESPONSES[0][0])
        assert rig.ct.take() == RESPONSES[0][0]
        stats = rig.lb.stats()
        assert stats["retries"] == 1 and stats["in_flight"] == 0

    loop.run_until_complete(go())


def test_replica_closing_before_answering_a_fast_post_is_a_502(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def go() -> None:
        rig = Rig()
        rig.client.data_received(REQUESTS[14])
        rig.ups[1][0].connection_lost(None)
        got = rig.ct.take()
        assert got.startswith(b"HTTP/1.1 502 ") and b"POST not retried" in got
        assert rig.lb.stats()["in_flight"] == 0

    loop.run_until_complete(go())


def test_first_byte_timeout_and_client_loss_on_a_fast_request(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def go() -> None:
        rig = Rig()
        rig.client.data_received(REQUESTS[0])
        assert rig.client.deadline > time.monotonic()
        rig.client.on_timeout()
        assert rig.ct.take().startswith(b"HTTP/1.1 504 ")
        assert rig.ups[1][1].closed
        assert rig.lb.stats()["errors_by_reason"] == {"first_byte_timeout": 1}

        rig.client.data_received(REQUESTS[0])
        assert rig.client.fast is not None
        rig.client.connection_lost(None)
        stats = rig.lb.stats()
        assert stats["client_disconnects"] == 1 and stats["codes"]["499"] == 1
        assert stats["in_flight"] == 0

    loop.run_until_complete(go())


def _repeat(loop: asyncio.AbstractEventLoop, pairs: list[tuple[bytes, list[bytes]]]) -> Any:
    """Every exchange of ``pairs`` on one client connection (and the same two replica
    connections): what went upstream and back each time, and the counters at the end."""

    async def go() -> Any:
        rig = Rig()
        seen = []
        for request, responses in pairs:
            sent, got = rig.exchange(request, responses)
            seen.append((sent[2:], got, rig.ct.closed))  # either replica: same bytes
            if rig.ct.closed:
                break
        stats = rig.lb.stats()
        stats["latency"] = stats["latency"]["count"]
        return seen, stats

    return loop.run_until_complete(go())


def _differing(
    loop: asyncio.AbstractEventLoop, cases: list[list[tuple[bytes, list[bytes]]]]
) -> list[bytes]:
    """The second request of each case whose exchanges differ between the fast path and the
    general path."""
    fast_results = [_repeat(loop, pairs) for pairs in cases]
    with mock.patch.object(ClientConnection, "fast_request", _no_fast_path):
        general_results = [_repeat(loop, pairs) for pairs in cases]
    return [c[1][0] for c, f, g in zip(cases, fast_results, general_results, strict=True) if f != g]


def _assert_fast_matches_general(pairs: list[tuple[bytes, list[bytes]]]) -> None:
    """What the fast path sends and answers for ``pairs`` is what the general path does (on a
    loop of its own: hypothesis runs a test many times within one use of a fixture)."""
    loop = asyncio.new_event_loop()
    try:
        fast_result = _repeat(loop, pairs)
        with mock.patch.object(ClientConnection, "fast_request", _no_fast_path):
            general_result = _repeat(loop, pairs)
    finally:
        loop.close()
    assert fast_result == general_result


@pytest.mark.parametrize(
    "pairs",
    [
        # the same request and answer again and again: remembered heads on both sides
        [(REQUESTS[0], RESPONSES[0])] * 4,
        [(REQUESTS[1], RESPONSES[2])] * 3,
        [(REQUESTS[3], RESPONSES[1])] * 3,
        # a remembered good head, then bad or different answers with the same start
        [(REQUESTS[0], RESPONSES[0])] * 2
        + [(REQUESTS[0], [RESPONSES[0][0][:-2], b"ok"])]
        + [(REQUESTS[0], RESPONSES[0])]
        + [(REQUESTS[0], [RESPONSES[0][0] + b"x"])],
        [(REQUESTS[0], RESPONSES[0])] * 2 + [(REQUESTS[0], RESPONSES[10])],
        [(REQUESTS[0], RESPONSES[0])] * 2 + [(REQUESTS[0], RESPONSES[11])],
        [(REQUESTS[0], RESPONSES[0]), (REQUESTS[12], RESPONSES[0]), (REQUESTS[0], RESPONSES[0])],
        # remembered request, then the same bytes with a body, and a close
        [(REQUESTS[0], RESPONSES[0])] * 2
        + [(REQUESTS[0][:-2] + b"Content-Length: 2\r\n\r\nhi", RESPONSES[0])]
        + [(REQUESTS[0], RESPONSES[0]), (REQUESTS[4], RESPONSES[0]), (REQUESTS[0], RESPONSES[0])],
        [(REQUESTS[2], RESPONSES[0])] * 2,
        # the same header lines under other request lines: remembered header blocks
        [
            (b"GET /a HTTP/1.1\r\nHost: h\r\nAccept: */*\r\n\r\n", RESPONSES[0]),
            (b"GET /b?c HTTP/1.1\r\nHost: h\r\nAccept: */*\r\n\r\n", RESPONSES[0]),
            (b"DELETE /d HTTP/1.1\r\nHost: h\r\nAccept: */*\r\n\r\n", RESPONSES[0]),
            (b"GET /e\x01 HTTP/1.1\r\nHost: h\r\nAccept: */*\r\n\r\n", RESPONSES[0]),
        ],
        [
            (b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n", RESPONSES[0]),
            (b"GET /b HTTP/1.0\r\nHost: h\r\n\r\n", RESPONSES[0]),
        ],
        # the same request line and Host line, other lines new each time: the remembered lead
        *(
            [(LEAD_BASE, RESPONSES[0])] + [(LEAD_BASE[:-2] + line, RESPONSES[0]) for line in lines]
            for lines in LEAD_TAILS
        ),
        [(LEAD_BASE, RESPONSES[0])] + [(request, RESPONSES[0]) for request in LEAD_HOSTS],
        *([(LEAD_BASE, RESPONSES[0]), (_lead_line(line), RESPONSES[0])] for line in LEAD_LINES),
        *(
            [(LEAD_KA, RESPONSES[0])] + [(LEAD_KA[:-2] + line, RESPONSES[0]) for line in lines]
            for lines in LEAD_TAILS
        ),
        *([(LEAD_KA, RESPONSES[0]), (request, RESPONSES[0])] for request in LEAD_KA_NEXT),
        [(LEAD_KA, RESPONSES[0])] + [(request, RESPONSES[0]) for request in LEAD_KA_NEXT],
        [(b"GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n", RESPONSES[0])]
        + [(request, RESPONSES[0]) for request in LEAD_KA_NEXT],
        *([(LEAD_POST, RESPONSES[0]), (request, RESPONSES[0])] for request in LEAD_POST_NEXT),
        [(LEAD_POST, RESPONSES[0])] + [(request, RESPONSES[0]) for request in LEAD_POST_NEXT],
        *([(LEAD_BASE, RESPONSES[0]), (request, RESPONSES[0])] for request in LEAD_POST_NEXT),
        [(LEAD_POST.replace(b"Content-Length", b"content-length"), RESPONSES[0])]
        + [(request, RESPONSES[0]) for request in LEAD_POST_NEXT],
        [(LEAD_BASE, RESPONSES[0])] + [(_lead_line(line), RESPONSES[0]) for line in LEAD_LINES],
        *([(_with_id(first, n), RESPONSES[0]) for n in range(4)] for first in (True, False)),
    ],
)
def test_repeated_exchanges_match_the_general_path(
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    pairs: list[tuple[bytes, list[bytes]]],
) -> None:
    fast_result = _repeat(loop, pairs)
    monkeypatch.setattr(ClientConnection, "fast_request", _no_fast_path)
    general_result = _repeat(loop, pairs)
    assert fast_result == general_result


def test_remembered_heads_are_used(loop: asyncio.AbstractEventLoop) -> None:
    async def go() -> None:
        rig = Rig()
        for _ in range(3):
            rig.exchange(REQUESTS[0], RESPONSES[0])
        assert rig.client.memo is not None and rig.client.memo[0] == REQUESTS[0]
        assert rig.lb._ready[1].memo is not None and rig.lb._ready[2].memo is not None
        # a client that closed its side gets its answer with Connection: close, then EOF
        rig.client.eof_received()
        _sent, got = rig.exchange(REQUESTS[0], RESPONSES[0])
        assert got.endswith(b"Connection: close\r\n\r\nok") and rig.ct.closed

    loop.run_until_complete(go())


def test_a_head_turned_down_is_remembered_for_what_it_says_only(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A stream's head is turned down for the general path once per replica, then by the
    memo with no check; a plain answer whose body had not all come yet is not remembered as
    turned down, and any other head is checked as before."""
    stream = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
    plain = RESPONSES[0][0]

    async def go() -> None:
        rig = Rig()
        checked = mock.Mock(wraps=plain_answer.check_head)
        with mock.patch.object(fast, "check_head", checked):
            for _ in range(4):  # round robin: twice to each replica
                _sent, got = rig.exchange(REQUESTS[0], [stream])
                assert got.endswith(b"1\r\nx\r\n0\r\n\r\n")
            assert checked.call_count == 2
            head = stream[: stream.index(b"\r\n\r\n") + 4]
            assert rig.lb._ready[1].turned_down == head
            # its body in two reads: not a verdict on the head
            _sent, got = rig.exchange(REQUESTS[0], [plain[:-1], plain[-1:]])
            assert got.endswith(b"\r\n\r\nok")
            assert rig.lb._ready[1].turned_down == head  # the stream's, still
            checked.reset_mock()
            for _ in range(3):  # replicas 2, 1, 2
                _sent, got = rig.exchange(REQUESTS[0], [plain])
                assert got == plain
            assert rig.client.exchange is None and rig.lb._ready[1].memo is not None
            assert checked.call_count == 2  # each replica's plain head, checked once

    loop.run_until_complete(go())


def test_a_remembered_lead_spares_the_full_parse(loop: asyncio.AbstractEventLoop) -> None:
    async def go() -> None:
        rig = Rig()
        rig.exchange(_with_id(True, 0), RESPONSES[0])
        first_block = rig.client.blocks
        assert rig.client.lead is not None and rig.client.lead[0] == b"GET / HTTP/1.1\r\n"
        for n in range(1, 4):
            sent, got = rig.exchange(_with_id(True, n), RESPONSES[0])
            assert b"\r\nX-Request-Id: %d\r\n" % n in sent and got == RESPONSES[0][0]
        # the header-block memo is set by the full parse only: it ran for the first request
        assert rig.client.blocks is first_block

    loop.run_until_complete(go())


def test_a_remembered_host_spares_the_full_parse_of_varied_paths(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def go() -> None:
        rig = Rig()
        rig.exchange(_with_id(True, 0), RESPONSES[0])
        first_block = rig.client.blocks
        for n in range(1, 4):
            request = _with_id(True, n).replace(b"GET / ", b"GET /item/%d?q=%d " % (n, n))
            sent, got = rig.exchange(request, RESPONSES[0])
            assert b"/item/%d?q=%d HTTP/1.1\r\n" % (n, n) in sent, sent
            assert got == RESPONSES[0][0]
        # the header-block memo is set by the full parse only: it ran for the first request
        assert rig.client.blocks is first_block

    loop.run_until_complete(go())


def test_a_remembered_connection_line_spares_the_full_parse(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A client that sends Connection: keep-alive with every request (python-requests) and
    varies its path and request id has its lines checked, not scanned and fed to llhttp."""

    async def go() -> None:
        rig = Rig()
        rig.exchange(LEAD_KA, RESPONSES[0])
        assert rig.client.lead is not None
        assert rig.client.lead[4] == b"\r\nConnection: keep-alive\r\n"
        parser = rig.client._parser = mock.Mock()  # records what llhttp would have been fed
        with mock.patch.object(fast, "scan_common_request", wraps=fast.scan_common_request) as scan:
            for n in range(1, 4):
                request = LEAD_KA.replace(b"/poll", b"/item/%d" % n)
                sent, got = rig.exchange(request[:-2] + b"X-Id: %d\r\n\r\n" % n, RESPONSES[0])
                assert b"Connection" not in sent and b"\r\nX-Id: %d\r\n" % n in sent, sent
                assert got == RESPONSES[0][0]
        assert scan.call_count == 0 and parser.feed_data.call_count == 0

    loop.run_until_complete(go())


def test_a_remembered_lead_spares_the_full_parse_of_posts(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A client that POSTs small JSON bodies (an inference API's clients) has each request's
    lines checked and its body framed by Content-Length, without the scan or llhttp."""

    async def go() -> None:
        rig = Rig()
        rig.exchange(LEAD_POST, RESPONSES[0])
        assert rig.client.lead is not None and rig.client.lead[5] == b"\r\nContent-Length:"
        parser = rig.client._parser = mock.Mock()  # records what llhttp would have been fed
        with mock.patch.object(fast, "scan_common_request", wraps=fast.scan_common_request) as scan:
            for n in range(1, 4):
                body = b'{"n":%d}' % (10**n)
                request = b"POST /api/%d HTTP/1.1\r\nHost: h.example\r\nX-Id: %d\r\n" % (n, n)
                request += b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
                sent, got = rig.exchange(request, RESPONSES[0])
                assert sent.endswith(b"\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
                assert got == RESPONSES[0][0]
        assert scan.call_count == 0 and parser.feed_data.call_count == 0

    loop.run_until_complete(go())


_LENGTH_VALUES = [
    b"%d",
    b" %d ",
    b"0%d",
    b"+%d",
    b"%d ,%d",
    b"-%d",
    b"%d_0",
    b"0x%d",
    b"",
    b"%d\x00",
]


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=24),
    st.sampled_from(_LENGTH_VALUES),
    st.integers(min_value=-2, max_value=2),
    st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH"]),
    st.booleans(),
)
def test_any_body_after_a_remembered_lead_matches_the_general_path(
    body: bytes, value: bytes, off: int, name: bytes, lead_post: bool
) -> None:
    """Whatever Content-Length line and body follow a remembered lead (right, short, long,
    malformed, spelled otherwise), the fast path sends and answers what the general path does."""
    length = max(len(body) + off, 0)
    line = name + b": " + (value % ((length,) * value.count(b"%d")))
    request = b"POST /api HTTP/1.1\r\nHost: h.example\r\n%b\r\n\r\n%b" % (line, body)
    lead = LEAD_POST if lead_post else LEAD_BASE
    pairs = [(lead, RESPONSES[0]), (request, RESPONSES[0]), (lead, RESPONSES[0])]
    _assert_fast_matches_general(pairs)


def _bodies_past_the_limits(loop: asyncio.AbstractEventLoop, held: int) -> Any:
    """After a POST lead, on balancers holding bodies up to ``held`` bytes and taking up to 6:
    a PUT of 4 bytes whose replica closes before answering, and (on a fresh connection, with a
    pooled replica connection free) a POST of 8 bytes."""
    lead = LEAD_POST.replace(b'7\r\n\r\n{"a":1}', b"2\r\n\r\nhi")

    async def go() -> Any:
        rig = Rig(max_buffered_body=held, max_body_bytes=6)
        seen = [rig.exchange(lead, RESPONSES[0])]
        rig.client.data_received(
            b"PUT /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 4\r\n\r\nabcd"
        )
        for conn, transport in rig.ups.values():
            if transport.take():
                conn.connection_lost(None)  # the replica closed before answering
        retried = [t.take() for _, t in rig.ups.values()]
        for (conn, _), sent in zip(rig.ups.values(), retried, strict=True):
            if sent:
                conn.data_received(RESPONSES[0][0])
        seen.append((rig.ct.take(), retried))
        stats = [rig.lb.stats()]
        rig = Rig(max_buffered_body=held, max_body_bytes=6)
        seen.append(rig.exchange(lead, RESPONSES[0]))
        too_long = b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 8\r\n\r\n12345678"
        seen.append(rig.exchange(too_long, RESPONSES[0]))
        stats.append(rig.lb.stats())
        for one in stats:
            one["latency"] = one["latency"]["count"]
        return seen, stats

    return loop.run_until_complete(go())


@pytest.mark.parametrize("held", [3, 1 << 20])
def test_bodies_past_the_limits_after_a_lead_are_the_general_paths(
    loop: asyncio.AbstractEventLoop, held: int
) -> None:
    """A body over max_buffered_body is not held for a retry (a PUT whose replica closed is a
    502, else retried), one over max_body_bytes is a 413: the same after a remembered lead as
    on the general path."""
    fast_result = _bodies_past_the_limits(loop, held)
    with mock.patch.object(ClientConnection, "fast_request", _no_fast_path):
        general_result = _bodies_past_the_limits(loop, held)
    assert fast_result == general_result
    _, (put_answer, retried), _, (_, post_answer) = fast_result[0]
    if held < 4:
        assert put_answer.startswith(b"HTTP/1.1 502 ") and retried == [b"", b""]
    else:
        assert put_answer == RESPONSES[0][0] and retried[0].startswith(b"PUT /api HTTP/1.1\r\n")
    assert b" 413 " in post_answer.split(b"\r\n")[0]


def test_every_byte_in_a_request_line_after_a_remembered_host_gets_the_general_paths_verdict(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Request lines under a remembered Host pass on a grammar of the fast path's own: each of
    the 256 bytes in a path, a query, a fragment and a method must be taken or refused as the
    general path (llhttp) takes or refuses it."""
    lines = [b"GET /a%cb HTTP/1.1\r\n" % c for c in range(256)]
    lines += [b"GET /a?b=%c HTTP/1.1\r\n" % c for c in range(256)]
    lines += [b"GET /a#%c HTTP/1.1\r\n" % c for c in range(256)]
    lines += [b"GE%c /a HTTP/1.1\r\n" % c for c in range(256)]
    lines += [b"GET /a HTTP/1.%c\r\n" % c for c in range(256)]
    cases = [[(LEAD_BASE, RESPONSES[0]), (_lead_line(line), RESPONSES[0])] for line in lines]
    differ = _differing(loop, cases)
    assert not differ, differ[:5]


_TARGET_BYTES = b"/?#%&=aZ09-._~!$'()*+,;:@[]{}|\\^`\"<> \t\x00\x01\x7f\x80\xff\r\n"


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([b"GET", b"POST", b"HEAD", b"OPTIONS", b"get", b"PURGE", b"", b"GET "]),
    st.binary(max_size=16).map(lambda b: bytes(_TARGET_BYTES[c % len(_TARGET_BYTES)] for c in b)),
    st.sampled_from([b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", b"  HTTP/1.1\r\n", b" HTTP/1.1\n"]),
)
def test_any_request_line_after_a_remembered_host_matches_the_general_path(
    method: bytes, target: bytes, version: bytes
) -> None:
    """Whatever request line comes with a remembered Host line, the fast path sends and
    answers what the general path does."""
    request = _lead_line(method + b" " + target + version)
    pairs = [(LEAD_BASE, RESPONSES[0]), (request, RESPONSES[0]), (LEAD_BASE, RESPONSES[0])]
    _assert_fast_matches_general(pairs)


# Targets that hide header lines: a path, a line end (or none), then "name:value" lines.
_HIDDEN = st.builds(
    lambda path, lines: path + b"".join(lines),
    st.sampled_from([b"/", b"/a", b"/a?b=1", b"*"]),
    st.lists(
        st.builds(
            bytes.__add__,
            st.sampled_from([b"\r\n", b"\n", b"\r", b"", b"\t"]),
            st.sampled_from(
                [b"X-Forwarded-For:6.6.6.6", b"Transfer-Encoding:chunked", b"X:y", b"Host:evil"]
            ),
        ),
        max_size=3,
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([b"GET", b"POST", b"HEAD", b"get", b""]),
    st.one_of(
        _HIDDEN,
        st.binary(max_size=24).map(
            lambda b: bytes(_TARGET_BYTES[c % len(_TARGET_BYTES)] for c in b)
        ),
    ),
    st.sampled_from([b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", b" HTTP/1.1\n"]),
)
def test_any_first_request_line_goes_up_as_one_line_on_either_path(
    method: bytes, target: bytes, version: bytes
) -> None:
    """A connection's first request, whatever its line: the fast path does what the general
    path does, and whatever reaches the replica starts with one request line, with no line
    end before its version (else the rest would be header lines of the client's making)."""
    request = method + b" " + target + version + b"Host: h\r\nX-Id: 1\r\n\r\n"
    pairs = [(request, RESPONSES[0])]
    _assert_fast_matches_general(pairs)
    loop = asyncio.new_event_loop()
    try:
        (sent, _, _), *_ = _repeat(loop, pairs)[0]
    finally:
        loop.close()
    if sent:
        line = sent.split(b"\r\n", 1)[0]
        assert b"\n" not in line and line.endswith((b" HTTP/1.1", b" HTTP/1.0")), sent


_NAMES = [b"X-Id", b"Cookie", b"Host", b"hoSt", b"Connection", b"Content-Length"]
_NAMES += [b"Transfer-Encoding", b"X-Forwarded-For", b"Bad Name", b"X\x01", b"", b"X-Id "]
_NAMES += [b"X(1)", b"X@", b"X/Y", b"X=Y", b'X"', b"X\t", b"\xffX", b"TE", b"Upgrade", b"Hostx"]
_VALUE_BYTES = b"aZ09 \t:;,=/-\x00\x01\x0b\x1f\x7f\x80\xff\r\n"


def _after_lead(line: bytes) -> list[tuple[bytes, list[bytes]]]:
    return [(LEAD_BASE, RESPONSES[0]), (LEAD_BASE[:-2] + line + b"\r\n\r\n", RESPONSES[0])]


def test_every_byte_in_a_line_after_a_remembered_lead_gets_the_general_paths_verdict(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Lines after a remembered lead pass on a grammar of the fast path's own, not llhttp's:
    each of the 256 bytes, in a header name and in a value, must be taken or refused as the
    general path (llhttp) takes or refuses it."""
    cases = [_after_lead(b"X-%c: v" % c) for c in range(256)]
    cases += [_after_lead(b"X-V: a%cb" % c) for c in range(256)]
    cases += [_after_lead(b"%cX: v" % c) for c in range(256)]
    differ = _differing(loop, cases)
    assert not differ, differ[:5]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_NAMES), st.binary(max_size=12)).map(
            lambda nv: nv[0] + b": " + bytes(_VALUE_BYTES[c % len(_VALUE_BYTES)] for c in nv[1])
        ),
        max_size=4,
    ),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_any_lines_after_a_remembered_lead_match_the_general_path(
    lines: list[bytes], host_first: bool, keep_alive_lead: bool, keep_alive: bool
) -> None:
    """Whatever lines follow a remembered request line and Host line (good, bad, or ones the
    balancer must act on), with or without a remembered Connection: keep-alive, the fast path
    sends and answers what the general path does."""
    host = b"Host: h.example"
    head = [host, *lines] if host_first else [*lines, host]
    if keep_alive:
        head.insert(len(head) // 2, b"Connection: keep-alive")
    request = b"GET /poll HTTP/1.1\r\n" + b"".join(line + b"\r\n" for line in head) + b"\r\n"
    lead = LEAD_KA if keep_alive_lead else LEAD_BASE
    pairs = [(lead, RESPONSES[0]), (request, RESPONSES[0]), (lead, RESPONSES[0])]
    _assert_fast_matches_general(pairs)


@pytest.mark.parametrize("fast_path", [True, False])
def test_long_content_lengths_are_read_or_refused_not_internal_errors(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture, fast_path: bool
) -> None:
    """A Content-Length of more than 4300 digits (CPython's limit for int()): zero-padded, as
    llhttp accepts it, it is read as its value on both sides; too large, it is the general
    path's 400. Never an internal error."""

    async def go() -> None:
        padded = b"0" * 4400 + b"2"
        rig = Rig()
        sent, got = rig.exchange(
            b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: %b\r\n\r\nhi" % padded, RESPONSES[0]
        )
        assert sent.endswith(b"\r\nContent-Length: 2\r\n\r\nhi") and got == RESPONSES[0][0]
        sent, got = rig.exchange(
            b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
            [b"HTTP/1.1 200 OK\r\nContent-Length: %b\r\n\r\nok" % padded],
        )
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nok"), got[-80:]
        sent, got = rig.exchange(
            b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: %b\r\n\r\nhi" % (b"9" * 4400),
            RESPONSES[0],
        )
        assert sent == b"" and got.split(b"\r\n")[0].endswith(b" 400 Bad Request"), got
        assert b"Content-Length overflow" in got

    with (
        caplog.at_level(logging.ERROR),
        mock.patch.object(
            ClientConnection,
            "fast_request",
            ClientConnection.fast_request if fast_path else _no_fast_path,
        ),
    ):
        loop.run_until_complete(go())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
