"""Connections to replicas: one asyncio Protocol per connection, kept alive between requests.

Why keep-alive: opening a TCP connection per request costs a connect, an accept and a close on
both sides (and a TIME_WAIT socket); reusing one costs nothing (the idle ones wait in
:mod:`corral.balancer.pool`).

A response is parsed by httptools with three callbacks (headers complete, body, message
complete) and no per-header callback; the raw head is taken from the bytes received, so it
passes to the client as one block (see :mod:`corral.balancer.headers`). The connection knows
nothing of retries or clients: it reports to the :class:`Exchange` using it through the small
:class:`ResponseSink` interface. While it carries a request of the fast path
(:mod:`corral.balancer.fast`) it has no sink but a ``fast_client`` (:class:`FastClient`), which
either takes a plain answer whole, or a stream whose head it knows (and then stays the
connection's while the stream is live: ``fast_stream``), or turns the request into an Exchange
that becomes the sink.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Final, Protocol, cast
from urllib.parse import urlsplit

import httptools

from corral.balancer.headers import Found
from corral.balancer.pump import stream_pump
from corral.balancer.speedups import ChunkScan, LiveChunks

__all__ = [
    "FastClient",
    "ResponseSink",
    "Target",
    "UpstreamConnection",
]

logger = logging.getLogger("corral.balancer")

# Longest response head accepted from a replica (its Set-Cookie headers may be large).
RESPONSE_HEAD_LIMIT: Final = 64 * 1024
# What a fresh parser is fed to stand inside a chunked body (UpstreamConnection.raw_resume).
_PRIMED_HEAD: Final = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class ResponseSink(Protocol):
    """What a connection reports to the exchange using it."""

    def on_response_head(self, status: int, head: bytes, keep_alive: bool) -> bool:
        """The response's head (raw, final status); return True when it has no body even
        though its headers announce one (a HEAD request)."""
        ...

    def on_response_body(self, data: bytes) -> None: ...

    def on_upstream_data_done(self, complete: bool) -> None:
        """End of one batch of received bytes; ``complete``: the response ended."""
        ...

    def on_first_bytes(self) -> None:
        """A live stream's first body bytes came (``LiveChunks`` armed before them)."""
        ...

    def on_live_chunks_done(self, last: bytes) -> None:
        """``LiveChunks`` ended the answer; ``last``: its final bytes, framed, not yet sent."""
        ...

    def on_upgraded(self, status: int, head: bytes, rest: bytes) -> None: ...

    def on_upstream_error(self, message: str) -> None:
        """The replica sent something that is not HTTP."""
        ...

    def on_upstream_lost(self, exc: Exception | None) -> None: ...

    def on_upstream_paused(self, paused: bool) -> None:
        """The connection's write buffer is full (True) or drained (False)."""
        ...

    def on_spliced_data(self, data: bytes) -> None: ...


class FastClient(Protocol):
    """What a connection calls on the client connection whose fast-path request it carries
    (:mod:`corral.balancer.fast`)."""

    def fast_response(self, conn: UpstreamConnection, data: bytes) -> bool:
        """Relay ``data`` if it is the whole plain answer; False: nothing done, the
        connection's own parser and the exchange take it."""
        ...

    def try_stream(self, conn: UpstreamConnection, data: bytes) -> bool:
        """Send the head of a stream the replica's head memo knows, and hand the rest to
        ``LiveChunks`` (``fast_stream`` set); False: nothing done."""
        ...

    def stream_done(self, conn: UpstreamConnection, last: bytes) -> None:
        """The fast stream ended: send ``last`` with the last chunk, count, give back."""
        ...

    def materialize(self) -> object:
        """Turn the fast request into the Exchange it stands for (which becomes the sink)."""
        ...


class LiveState(Protocol):
    """A fast stream's own state while it is live (:mod:`corral.balancer.fast_stream`)."""

    def first_bytes(self) -> None: ...


class _SkipBody(Exception):
    """Raised from a callback to stop llhttp: at a body a HEAD response lacks, or at a second
    message after the answer."""


class Target:
    """A ready replica: where to connect, what to put in Host, and its idle connections."""

    __slots__ = (
        "base",
        "host",
        "host_line",
        "idle",
        "line_tail",
        "memo",
        "port",
        "prefix",
        "retired",
        "rid",
        "scanned",
        "ssl",
        "stream_memo",
        "turned_down",
    )

    def __init__(
        self, rid: int, base: str, host: str, port: int, netloc: str, prefix: str, ssl: bool
    ) -> None:
        self.rid = rid
        self.base = base
        self.host = host
        self.port = port
        self.ssl = ssl
        self.prefix = prefix.encode()
        self.host_line = b"Host: " + netloc.encode("idna")
        self.line_tail = b" HTTP/1.1\r\n" + self.host_line  # after a request line's target
        self.idle: deque[UpstreamConnection] = deque()
        self.retired = False  # left the ready set: its connections are not kept
        # The last response head the fast path validated from this replica, with what it
        # found: its bytes, status, Content-Length and rewritten head (None: unchanged).
        self.memo: tuple[bytes, int, int, bytes | None] | None = None
        # The last response header block the general path scanned from this replica, with
        # what the scan found (corral.balancer.relay): a stream's head is the same each time.
        self.scanned: tuple[bytes, bytes, Found] | None = None
        # The last head the fast path turned down for what it says (corral.balancer.
        # plain_answer): a stream's, each time.
        self.turned_down: bytes | None = None
        # The last stream head the general path relayed from this replica as the fast path
        # can (corral.balancer.fast_stream): its bytes, status, the head sent on, keep-alive.
        self.stream_memo: tuple[bytes, int, bytes, bool] | None = None


class UpstreamConnection(asyncio.Protocol):
    """One connection to a replica; carries one request at a time (no pipelining)."""

    # Slots: what the compiled fast path reads and writes (see ClientConnection's).
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_head",
        "chunks",
        "closed",
        "fast_client",
        "fast_stream",
        "front",
        "idle_since",
        "read_paused",
        "target",
        "transport",
    )

    def __init__(self, target: Target) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.sink: ResponseSink | None = None
        self.fast_client: FastClient | None = None  # carrying a fast-path request
        self.fast_stream: LiveState | None = None  # ... whose stream is live, with no sink
        self.spliced = False
        self.closed = False
        self.idle_since = 0.0
        self.uses = 0
        self.read_paused = False
        self._parser = httptools.HttpResponseParser(self)
        # A chunked answer's framing followed beside the parser (ChunkScan, compiled build),
        # so that a live stream can be relayed as framed (go_raw); None for other answers.
        self.chunks: Any = None
        # LiveChunks, once this connection carried a live stream: its transport's protocol
        # from then on, armed for each live stream and handing everything else to this one.
        self.front: Any = None
        # Validates the whole answers the fast path takes, with no callback at all.
        self.check = httptools.HttpResponseParser(None)
        self._head = b""
        self._last_head = b""
        self._in_head = True
        self._interim = False
        self._complete = False
        self._skip = False
        self._keep_alive = False
        self.reusable = False

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        client = self.fast_client
        if client is not None:
            try:
                if client.fast_response(self, data) or client.try_stream(self, data):
                    return
            except Exception:
                logger.exception("balancer: unexpected error on a replica connection")
                self.check = httptools.HttpResponseParser(None)
            if self.fast_client is None:  # committed when it failed: nothing left to save
                self.abort()
                return
            client.materialize()  # the general path below takes it from here
        try:
            self._received(data)
        except Exception:
            # A bug: logged once with its traceback; the exchange answers 502 or cuts.
            logger.exception("balancer: unexpected error on a replica connection")
            sink = self.sink
            self.abort()
            if sink is not None:
                sink.on_upstream_error("internal proxy error")

    def _received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes on an idle connection: the replica is not speaking HTTP
            self.close()
            return
        if self.spliced:
            sink.on_spliced_data(data)
            return
        if self._in_head:
            self._head = self._head + data if self._head else data
            head = self._head
            if (
                len(head) > RESPONSE_HEAD_LIMIT
                and head.find(b"\r\n\r\n", 0, RESPONSE_HEAD_LIMIT) < 0
            ):
                sink.on_upstream_error("response head too large")
                return
        chunks = self.chunks  # taken before the head that may start it: it scans its own part
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(sink, data[exc.args[0] :])
            return
        except httptools.HttpParserCallbackError as exc:
            if not self._skip:
                if isinstance(exc.__context__, Exception):
                    raise exc.__context__ from None
                raise
            self._complete = True
            self._parser = httptools.HttpResponseParser(self)  # it stopped mid-message
        except httptools.HttpParserError as exc:
            self.reusable = False
            sink.on_upstream_error(f"invalid HTTP response: {exc}")
            return
        if chunks is not None and chunks.open:
            chunks.scan(data)
        sink.on_upstream_data_done(self._complete)

    def _upgraded(self, sink: ResponseSink, rest: bytes) -> None:
        self.reusable = False
        self.spliced = True
        sink.on_upgraded(self._parser.get_status_code(), self._last_head, rest)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.fast_client is not None:
            self.fast_client.materialize()
        self.closed = True
        self.reusable = False
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_upstream_lost(exc)

    def pause_writing(self) -> None:
        if self.fast_client is not None:
            self.fast_client.materialize()
        if self.sink is not None:
            self.sink.on_upstream_paused(True)

    def resume_writing(self) -> None:
        if self.sink is not None:
            self.sink.on_upstream_paused(False)

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self._complete:
            # A second message after the answer, in the same batch: not HTTP we can reuse, and
            # not for the exchange (it asked once). Parsing stops here (as for a HEAD answer's
            # body), so its head never reaches the sink, which takes the answer as complete.
            self.reusable = False
            self._skip = True
            raise _SkipBody

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        head = self._head
        end = head.find(b"\r\n\r\n") + 4
        if 100 <= status < 200 and status != 101:  # interim (100 Continue, 103): dropped
            self._head = head[end:]
            self._interim = True
            return
        self._head = b""
        self._in_head = False
        self._keep_alive = parser.should_keep_alive()
        if status == 101:
            self._last_head = head[:end]
        if self.sink is not None and self.sink.on_response_head(
            status, head[:end], self._keep_alive
        ):
            self._skip = True
            self.reusable = self._keep_alive and len(head) == end
            raise _SkipBody
        if self.chunks is not None and len(head) > end:
            self.chunks.scan(head[end:])  # the body's first bytes, in the head's batch

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.on_response_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self.reusable = self._keep_alive

    # ------------------------------------------------------------------ used by the exchange

    def follow_chunks(self) -> None:
        """Follow this answer's chunked framing from its first body byte (the sink asks, in
        ``on_response_head``), so that it can be relayed as framed once live (go_raw)."""
        if ChunkScan is not None:
            self.chunks = ChunkScan()

    def go_raw(
        self, client: object, write: object, idle: float, kind: int, first: bool = False
    ) -> bool:
        """Hand this answer's next batches to ``LiveChunks`` (compiled build), which relays them
        to ``client`` (``write``: its transport's) as the replica framed them, with no Python
        call per batch, and moves its ``kind`` deadline ``idle`` seconds on. Nothing changes
        when the framing was not followed, or it needs httptools (an extension, a trailer).
        ``first``: no body byte came yet (``raw_first`` is called when one does). A stream
        that goes on is relayed by the balancer's stream pump (corral.balancer.pump) unless the
        replica speaks TLS. True: armed."""
        chunks, transport = self.chunks, self.transport
        if LiveChunks is None or chunks is None or not chunks.open:
            return False
        if transport is None or self.closed:
            return False
        front = self.front
        if front is None:
            # Once per connection: uvloop restarts reading on each set_protocol (LiveChunks'
            # docstring says what that cost per stream).
            self.front = front = LiveChunks(self)
            transport.set_protocol(front)
        pump = None if self.target.ssl else stream_pump(client.lb)  # type: ignore[attr-defined]
        front.arm(chunks, client, write, idle, kind, first, pump)
        return True

    def raw_done(self, extra: bool, last: bytes) -> None:
        """``LiveChunks`` saw the answer end (``extra``: bytes followed it; ``last``: the
        answer's final bytes, framed, which the sink sends with the last chunk)."""
        self.chunks = None  # the reader disarmed itself before calling
        self._complete = True
        self.reusable = self._keep_alive and not extra
        client = self.fast_client
        if self.fast_stream is not None and client is not None:
            client.stream_done(self, last)  # its parser never saw the stream: kept as it is
            return
        self._parser = httptools.HttpResponseParser(self)  # the old one stopped mid-body
        if self.sink is not None:
            self.sink.on_live_chunks_done(last)

    def raw_first(self) -> None:
        """``LiveChunks`` relays a live stream's first body bytes: its time to first token."""
        if self.fast_stream is not None:
            self.fast_stream.first_bytes()
        elif self.sink is not None:
            self.sink.on_first_bytes()

    def _leave_fast_stream(self) -> None:
        """Anything but the stream's end: the Exchange it stands for takes over."""
        if self.fast_stream is not None and self.fast_client is not None:
            self.fast_client.materialize()

    def raw_failed(self) -> None:
        """``LiveChunks`` met a bug: as ``data_received`` does, logged, cut."""
        logger.exception("balancer: unexpected error on a replica connection")
        self.chunks = None  # the reader disarmed itself before calling
        self._leave_fast_stream()
        sink = self.sink
        self.abort()
        if sink is not None:
            sink.on_upstream_error("internal proxy error")

    def raw_resume(self, prime: bytes, replay: bytes) -> None:
        """``LiveChunks`` met framing it leaves to httptools: a fresh parser is put where it
        stopped (a chunked head, then ``prime``, with nothing reported), and ``replay`` goes
        through the general path as if it had just come."""
        self._leave_fast_stream()
        self.chunks = None  # the reader disarmed itself before calling
        sink, keep_alive = self.sink, self._keep_alive
        self.sink = None  # the primed head and data are not the answer's
        self._parser = parser = httptools.HttpResponseParser(self)
        try:
            parser.feed_data(_PRIMED_HEAD + prime)
        finally:
            self.sink, self._keep_alive = sink, keep_alive
        self.data_received(replay)

    def begin(self, sink: ResponseSink) -> None:
        """Start carrying one request for ``sink``."""
        self.sink = sink
        self.chunks = None
        self.uses += 1
        self._in_head = True
        self._complete = False
        self._skip = False
        self.reusable = False

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _reclaim(self, replay: bool) -> None:
        """Take a live stream back from the stream pump (``LiveChunks.reclaim``) before this
        connection's socket is touched: paused, closed or aborted."""
        front = self.front
        if front is not None and front.pumped:
            front.reclaim(replay)

    def pause_reading(self, paused: bool) -> None:
        self._reclaim(True)
        if self.transport is None or self.closed or paused == self.read_paused:
            return
        self.read_paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def close(self) -> None:
        """Close without reuse (anything in flight on it is given up)."""
        self._reclaim(False)
        self.sink = None
        self.reusable = False
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping unsent bytes: the replica sees the request cancelled."""
        self._reclaim(False)
        self.sink = None
        self.reusable = False
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def target_of(rid: int, base: str) -> Target:
    """Validate a replica's base URL (``http(s)://host:port[/prefix]``)."""
    try:
        url = urlsplit(base)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"replica {rid}: invalid base URL {base!r}: {exc}") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"replica {rid}: base URL must be http(s)://host:port, got {base!r}")
    if port is None:
        port = 443 if url.scheme == "https" else 80
    netloc = url.netloc.rpartition("@")[2]
    return Target(rid, base, url.hostname, port, netloc, url.path, url.scheme == "https")
