"""The balancer at the edges of HTTP/1.1 that reviews of it found: uploads in a transfer
coding it cannot carry, a WebSocket client that sends before the 101, a replica refusing an
upgrade, an upload held while every replica is full. Real sockets on 127.0.0.1: a replica
that answers by a script on the raw connection, and raw clients.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from corral.balancer import LoadBalancer

HOST = "127.0.0.1"
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WS = (
    b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: k\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def run(script: Script, body: Callable[[LoadBalancer], Awaitable[None]], **options: Any) -> None:
    """``body`` against a balancer (on uvloop, as the workers run it) in front of one replica
    that answers each connection by ``script``."""

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await script(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, HOST, 0)
        lb = LoadBalancer(name="svc", **options)
        await lb.start()
        try:
            lb.set_ready({1: f"http://{HOST}:{server.sockets[0].getsockname()[1]}"})
            await body(lb)
        finally:
            await lb.stop()
            server.close()
        assert not any(lb._in_flight.values()), lb._in_flight

    uvloop.run(asyncio.wait_for(main(), 30))


def recording(got: list[bytes]) -> Script:
    """A replica that answers every request "ok" on a kept connection and keeps each request's
    head in ``got``: what reached it, or that nothing did."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            got.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    return script


async def answer_of(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A whole answer with a Content-Length: (its status line, its body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head.split(b"\r\n", 1)[0], await reader.readexactly(length)


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"gzip\r\nTransfer-Encoding: chunked"])
def test_an_upload_in_a_transfer_coding_other_than_chunked_is_a_501(coding: bytes) -> None:
    """The chunks come off at the balancer and the header is hop-by-hop: the replica would
    get the body still gzip'd with nothing saying so. Refused, as nginx does, before any of
    it reaches the replica."""
    got: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(65536))

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(
            b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + b"\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n"
        )
        status, text = await asyncio.wait_for(answer_of(reader), 10)
        assert status.endswith(b" 501 Not Implemented") and b"transfer coding" in text
        writer.close()

    run(script, body)
    assert got == []


@pytest.mark.parametrize("remembered", [False, True])
def test_an_http10_request_with_transfer_encoding_is_a_400(remembered: bool) -> None:
    """RFC 9112 section 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing,
    and the connection MUST be closed after it (nginx answers 400). HTTP/1.0 has no transfer
    codings, so a proxy in front may have framed the body otherwise (as none, or by its
    Content-Length) and sent on as this body what the balancer took, on the kept-alive
    connection, for a second request: the request smuggled in it reached the replica."""
    got: list[bytes] = []

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        if remembered:  # the fast path remembers this one (its lead, its Host line)
            writer.write(b"POST /a HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n")
            assert (await asyncio.wait_for(answer_of(reader), 10))[1] == b"ok"
        writer.write(
            b"POST /a HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
        )
        status, text = await asyncio.wait_for(answer_of(reader), 10)
        assert b" 400 " in status and b"Transfer-Encoding" in text, (status, text)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing more read
        writer.close()

    run(recording(got), body)
    lines = [head.split(b"\r\n", 1)[0] for head in got]
    assert lines == ([b"POST /a HTTP/1.1"] if remembered else []), got


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /a HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: a\r\nX-Id: 1\r\nhost: b\r\n\r\n",
        b"GET /a HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
        b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nHost: b\r\n\r\nhi",
        b"GET /a HTTP/1.1\r\n\r\n",
        b"GET /a HTTP/1.1\r\nX-Id: 1\r\n\r\n",
        b"GET /a HTTP/1.1\r\nConnection: keep-alive\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
        b"GET http://a/abs HTTP/1.1\r\n\r\n",
    ],
    ids=[
        "plain",
        "other-header",
        "http10-same",
        "with-body",
        "no-host",
        "no-host-other-header",
        "no-host-scanned",
        "no-host-with-body",
        "no-host-absolute",
    ],
)
def test_a_request_with_two_host_lines_or_none_is_a_400(request_bytes: bytes) -> None:
    """RFC 9112 section 3.2: a server MUST answer 400 to a request with more than one Host
    line, and to an HTTP/1.1 request with none (nginx does both). Passed on, the replica would
    hear of one Host (X-Forwarded-Host: the first) while a proxy in front of the balancer may
    have acted on the other, or of none while the client named nothing. Refused before
    anything reaches a replica, on a fresh connection and after a remembered request alike."""
    got: list[bytes] = []

    async def body(lb: LoadBalancer) -> None:
        for first in (b"", b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n"):
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            if first:  # the fast path remembers this one (its lead, its Host line)
                writer.write(first)
                assert (await asyncio.wait_for(answer_of(reader), 10))[1] == b"ok"
            writer.write(request_bytes)
            status, text = await asyncio.wait_for(answer_of(reader), 10)
            assert b" 400 " in status and b"Host" in text, (status, text)
            writer.close()

    run(recording(got), body)
    assert all(head.startswith(b"GET /a HTTP/1.1\r\n") for head in got), got
    assert len(got) == 1  # only the remembered request of the second connection


def test_an_http10_request_without_host_is_passed_on() -> None:
    """HTTP/1.0 has no Host requirement: such a request reaches a replica, with no
    X-Forwarded-Host, on a fresh connection and after a remembered request."""
    got: list[bytes] = []

    async def body(lb: LoadBalancer) -> None:
        for first in (b"", b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"):
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            if first:
                writer.write(first)
                assert (await asyncio.wait_for(answer_of(reader), 10))[1] == b"ok"
            writer.write(b"GET /b HTTP/1.0\r\n\r\n")
            assert (await asyncio.wait_for(answer_of(reader), 10))[1] == b"ok"
            writer.close()

    run(recording(got), body)
    assert [head.split(b" ", 2)[1] for head in got] == [b"/b", b"/a", b"/b"], got
    assert not any(b"x-forwarded-host" in head.lower() for head in got), got


@pytest.mark.parametrize(
    ("target", "forwarded_host"),
    [
        (b"http://other.example:8080/abs?x=1", b"other.example:8080"),
        (b"http://evil/", b"evil"),
        (b"http://user@h.example/p", b"h.example"),
        (b"http://[::1]:81/v6", b"[::1]:81"),
        (b"/origin", b"a"),  # origin-form: the Host line, as before
    ],
)
def test_an_absolute_form_target_names_the_forwarded_host(
    target: bytes, forwarded_host: bytes
) -> None:
    """RFC 9112 section 3.2.2: with an absolute-form target the Host header is ignored and
    the target's authority used instead. The replica gets the path alone, so what the client
    named is what X-Forwarded-Host must say, not the Host line it was told to ignore."""
    got: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(b"GET %b HTTP/1.1\r\nHost: a\r\n\r\n" % target)
        status, text = await asyncio.wait_for(answer_of(reader), 10)
        assert b" 200 " in status and text == b"ok"
        writer.close()

    run(script, body)
    [head] = got
    assert head.startswith(b"GET /")
    lines = [line for line in head.split(b"\r\n") if line.startswith(b"X-Forwarded-Host:")]
    assert lines == [b"X-Forwarded-Host: " + forwarded_host], head


def test_a_websocket_client_that_sends_before_the_101_is_not_stalled() -> None:
    """Frames a client sends before the replica's 101 wait in the balancer (reading pauses
    past a bound) and go once the tunnel opens; then reading resumes: every byte arrives."""
    size = 600_000

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.5)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n")
        writer.write(b"Connection: Upgrade\r\n\r\n")
        await reader.readexactly(size)
        writer.write(b"GOT-ALL")
        await writer.drain()
        await reader.read()  # until the client leaves

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(WS + b"x" * (size // 2))
        await asyncio.sleep(0.1)
        writer.write(b"y" * (size // 2))
        await asyncio.wait_for(reader.readuntil(b"GOT-ALL"), 10)
        writer.close()

    run(script, body)


@pytest.mark.parametrize("status", [b"403 Forbidden", b"426 Upgrade Required", b"200 OK"])
def test_a_replica_refusing_an_upgrade_is_heard_by_the_client(status: bytes) -> None:
    """A replica that answers an upgrade with anything but 101 (an auth failure, say) has
    its answer relayed, not turned into a 502 against its name; the connection then ends
    (what the client sent next may be frames, not a request)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 6\r\n\r\ndenied")
        await writer.drain()
        await reader.read()

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(WS + b"\x81\x02hi")  # a frame sent before any answer
        line, text = await asyncio.wait_for(answer_of(reader), 10)
        assert line == b"HTTP/1.1 " + status and text == b"denied"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then closed
        assert not lb._failed, lb._failed
        writer.close()

    run(script, body)


async def read_chunked(reader: asyncio.StreamReader) -> int:
    """The size of a chunked body's data, read to its end."""
    size = 0
    while True:
        n = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if n == 0:
            await reader.readuntil(b"\r\n")
            return size
        await reader.readexactly(n + 2)
        size += n


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_an_upload_held_for_room_is_read_no_further_than_the_buffer(chunked: bool) -> None:
    """A large upload whose request waits in the balancer (every replica at its limit):
    past ``max_buffered_body`` the balancer stops reading the client instead of keeping what
    it sends (it was kept whole: 150 MiB in a few seconds), its body's deadline off while it
    waits (a chunked one was cut with a 408 at ``idle_timeout``), and once a replica has room
    the whole body goes through."""
    total = 64 << 20
    gate = asyncio.Event()
    received: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /slow"):
                await gate.wait()
            elif head.startswith(b"POST"):
                if b"chunked" in head.lower():
                    received.append(await read_chunked(reader))
                else:
                    await reader.readexactly(total)
                    received.append(total)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def body(lb: LoadBalancer) -> None:
        busy_r, busy_w = await asyncio.open_connection(HOST, lb.port)
        busy_w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        while not lb._in_flight.get(1):
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % total
        writer.write(b"POST /up HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n")
        block = b"x" * (1 << 20)
        if chunked:
            block = b"%x\r\n%b\r\n" % (len(block), block)

        async def upload() -> None:
            for _ in range(total >> 20):
                writer.write(block)
                await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")

        sending = asyncio.create_task(upload())
        await asyncio.sleep(1.5)  # the client sends as fast as it may meanwhile
        (held,) = [c.exchange for c in lb._clients if c.exchange and c.exchange.method == b"POST"]
        kept = sum(map(len, held.body))
        assert kept <= lb._max_buffered_body + (4 << 20), kept  # plus one read's worth
        gate.set()
        await asyncio.wait_for(sending, 20)
        assert (await asyncio.wait_for(answer_of(reader), 20))[0].endswith(b"200 OK")
        assert received == [total]
        assert (await answer_of(busy_r))[0].endswith(b"200 OK")
        writer.close()
        busy_w.close()

    routing = {"max_in_flight_per_replica": 1, "hold_timeout": 30}
    run(script, body, routing=routing, idle_timeout=0.5, first_byte_timeout=30)


async def slow_reader(
    lb: LoadBalancer,
) -> tuple[socket.socket, asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection whose socket takes 4 KiB at a time: the balancer's transport to it
    fills as soon as it does not read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, lb.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    return sock, reader, writer


def test_a_client_that_sends_and_does_not_read_has_no_answers_kept_for_it() -> None:
    """Pipelined requests from a client that does not read: once its transport is over its
    high-water mark the next request waits (it used to start, and with it the whole next
    answer went into memory, a reviewer's 100 MiB one included); once the client
    reads, every answer arrives, whole and in order."""
    small, large, count = 200_000, 4_000_000, 20

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            size = large if head.startswith(b"GET /b") else small
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // small):
                writer.write(b"x" * small)
                await writer.drain()

    async def body(lb: LoadBalancer) -> None:
        sock, reader, writer = await slow_reader(lb)
        writer.write(
            b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * count + b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        await asyncio.sleep(1.0)  # not reading
        (client,) = lb._clients
        assert client.transport is not None
        assert client.transport.get_write_buffer_size() < 2 * small, "answers kept for it"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # now it reads
        for size in [small] * count + [large]:
            line, text = await asyncio.wait_for(answer_of(reader), 20)
            assert line.endswith(b"200 OK") and len(text) == size
        writer.close()

    # A short header timeout: the requests waiting for it to read are not cut by it.
    run(script, body, header_timeout=0.5)


def test_a_client_that_sends_and_does_not_read_is_read_no_further_than_a_bound() -> None:
    """While its next request waits for it to read (the last answer done, its transport
    full), what it goes on sending is read up to the bound on pipelined bytes, then not at
    all (the kernel holds the rest)."""
    from corral.balancer.client import PIPELINE_LIMIT

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + b"x" * 200_000)
            await writer.drain()

    async def body(lb: LoadBalancer) -> None:
        _, _, writer = await slow_reader(lb)
        request = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        writer.write(request * 20)
        (client,) = list(lb._clients)
        for _ in range(500):  # an answer done, the next request waiting for the client
            if client._write_paused and client.exchange is None and client.fast is None:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the client's transport never filled")
        writer.write(request * (4 * PIPELINE_LIMIT // len(request)))  # far past the bound
        await asyncio.sleep(0.5)
        assert len(client._buf) <= PIPELINE_LIMIT + (256 << 10), len(client._buf)
        writer.close()

    run(script, body)


@pytest.mark.parametrize("method", [b"GET", b"DELETE", b"POST", b"PUT"])
def test_an_asterisk_target_is_only_for_options(method: bytes) -> None:
    """RFC 9112 section 3.2.4: the asterisk-form target is used only with OPTIONS. Any other
    method with it is malformed (nginx answers 400); the balancer rewrote it to ``/``, so a
    ``DELETE *`` reached the replica as a DELETE of its root, which no client asked for."""
    got: list[bytes] = []

    async def body(lb: LoadBalancer) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(method + b" * HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
        status, text = await asyncio.wait_for(answer_of(reader), 10)
        assert b" 400 " in status and b"OPTIONS" in text, (status, text)
        writer.close()
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (await asyncio.wait_for(answer_of(reader), 10))[1] == b"ok"
        writer.close()

    run(recording(got), body)
    assert [head.split(b" ", 1)[0] for head in got] == [b"OPTIONS"], got
