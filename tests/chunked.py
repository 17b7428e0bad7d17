"""Chunked streams on real sockets, for the balancer's stream tests: a replica on 127.0.0.1
that answers each request by a script, and a client's reading of a chunked answer.

Why a module: the live stream's tests (tests/test_balancer_live_chunks.py), the fast path
for streams' (tests/test_balancer_fast_stream.py) and the stream pump's
(tests/test_balancer_pump.py) drive the same kind of replica and read the same kind of
answer; the relay's (tests/test_balancer_relay.py) and the pump's decode raw chunked bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

HOST = "127.0.0.1"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# The n-th request the replica gets (over all its connections), and where to write its answer.
Script = Callable[[int, asyncio.StreamWriter], Awaitable[None]]


def frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def written(pieces: list[bytes], gap: float = 0.003) -> Script:
    """A script that writes the stream head with ``pieces[0]``, then each other piece on its
    own, ``gap`` seconds apart."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        first, *rest = pieces
        writer.write(STREAM_HEAD + first)
        for piece in rest:
            await writer.drain()
            await asyncio.sleep(gap)
            writer.write(piece)

    return script


class Replica:
    """Answers each request (TLS with ``context``) by ``script``; keeps each connection for the
    next request; counts requests and connections, and tells when one of its connections
    ended (EOF or reset)."""

    def __init__(self, script: Script, context: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.context = context
        self.requests = 0
        self.connections = 0
        self.lost = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Replica:
        self._server = await asyncio.start_server(self._serve, HOST, 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                n, self.requests = self.requests, self.requests + 1
                await self.script(n, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.lost.set()
            writer.close()


def dechunk(body: bytes) -> tuple[bytes, bool]:
    """The data of a chunked body, and whether its last chunk came (strict framing). The body
    may stop inside a chunk's data, as a stream relayed as framed does between batches."""
    data, at = b"", 0
    while at < len(body):
        eol = body.index(b"\r\n", at)
        size = int(body[at:eol], 16)
        if size == 0:
            assert body[eol:] == b"\r\n\r\n", body[eol:]
            return data, True
        data += body[eol + 2 : eol + 2 + size]
        if eol + 2 + size >= len(body):
            return data, False  # the rest of this chunk is still to come
        assert body[eol + 2 + size : eol + 4 + size] == b"\r\n"
        at = eol + 4 + size
    return data, False


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One chunked answer's data, read to its last chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head, head
    return await read_answer_body(reader)


async def read_answer_body(reader: asyncio.StreamReader) -> bytes:
    """A chunked body's data, read to its last chunk (the head already read)."""
    data = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        if size == 0:
            assert await reader.readexactly(2) == b"\r\n"
            return bytes(data)
        data += (await reader.readexactly(size + 2))[:-2]


async def replica_paused(lb: Any, state: object, timeout: float = 10) -> None:
    """Wait until ``lb`` (a LoadBalancer) has stopped reading a replica connection for a
    client that reads nothing; ``state``: what the assertion shows when it does not."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(
        c.exchange is not None and c.exchange.conn is not None and c.exchange.conn.read_paused
        for c in lb._clients
    ):
        assert asyncio.get_running_loop().time() < deadline, state
        await asyncio.sleep(0.02)
