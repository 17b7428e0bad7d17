"""The client side: one asyncio Protocol per accepted connection.

A request that arrives whole in one read and needs nothing unusual goes through the fast path
(:mod:`corral.balancer.fast`, no per-request object); the rest as follows. It finds request
heads in the byte stream (httptools validates each one; the head itself is sliced out whole,
see :mod:`corral.balancer.http1`), enforces the header limits, and hands each request to an
:class:`~corral.balancer.exchange.Exchange`, one at a time: bytes of a pipelined request that
arrive while one is being answered, or while the client has not read the last answer, wait
(reading pauses past ``PIPELINE_LIMIT``), so answers go out in order and none is kept for it.

Deadlines are a float on the connection (``deadline``) that :mod:`corral.balancer.ticker`
checks: arming one costs an attribute store, not a timer. It is, in turn: the next request's
head (``header_timeout``: a slowloris or idle keep-alive client is closed), the body, the
replica's first byte and its silence mid-response (set by the exchange), a lingering close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Final, cast

import httptools

from corral.balancer import fast, fast_stream
from corral.balancer.exchange import DL_HEAD, DL_LINGER, DL_NONE, Exchange
from corral.balancer.headers import (
    coding_refusal,
    connection_tokens,
    forwarded,
    forwarded_host,
    scan_request,
)
from corral.balancer.http1 import (
    BadRequest,
    content_length,
    error_response,
    origin_form,
    parse_request_line,
    request_host,
)

if TYPE_CHECKING:
    from typing import Protocol

    from corral.balancer.roles import Balancer, Pending
    from corral.balancer.upstream import UpstreamConnection

    class Listener(Balancer, Protocol):
        """The balancer as its clients see it: it keeps the set of them (roles.py can't)."""

        _clients: set[ClientConnection]
        _tick_idle: bool

        def _tick_soon(self) -> None: ...


__all__ = ["MAX_HEADERS", "ClientConnection"]

logger = logging.getLogger("corral.balancer")

# Most header fields in one request (aiohttp's default, kept so the limit did not change).
MAX_HEADERS: Final = 128
# Bytes of pipelined requests held while one is answered before reading pauses.
PIPELINE_LIMIT: Final = 256 * 1024
# After an early answer (413, 400 ...) what the client still sends is dropped this long.
LINGER_SECONDS: Final = 2.0

_PAUSE_UPSTREAM: Final = 1
_PAUSE_PIPELINE: Final = 2


class ClientConnection(asyncio.Protocol):
    """One client connection; see the module docstring."""

    # Slots: what the compiled fast path (corral.balancer.speedups) uses at fixed offsets.
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_buf",
        "_closing",
        "_eof",
        "_paused",
        "_write_paused",
        "deadline",
        "deadline_kind",
        "fast",
        "kept_alive",
        "lb",
        "lead",
        "memo",
        "transport",
        "xff_line",
    )

    # The fast path, as methods (no extra call on the way).
    fast_request = fast.try_request
    fast_response = fast.try_response
    try_stream = fast_stream.try_stream
    stream_done = fast_stream.finish
    materialize = fast.materialize

    def __init__(self, lb: Listener) -> None:
        self.lb = lb
        self.transport: asyncio.Transport | None = None
        self.peer = b""
        self.xff_line = b""  # X-Forwarded-For of a request that has none
        self.exchange: Exchange | None = None
        self.fast: fast.FastState | None = None  # a fast-path request in flight
        # The last fast request's bytes with what fast.try_request found in them.
        self.memo: fast.Memo | None = None
        self.blocks: fast.Blocks | None = None  # the same for its header lines
        self.lead: fast.Lead | None = None  # and for its request line and Host line
        self.deadline = 0.0
        self.deadline_kind = DL_HEAD
        # Back to waiting after an answer: a stopping balancer may close it (not a new one).
        self.kept_alive, self.idle_since = False, 0.0  # since when it waits (close_if_idle)
        self._buf = b""
        self._fed = 0  # bytes of _buf already given to the parser
        self._parser: httptools.HttpRequestParser | None = None
        self._closing = False
        self._lingering = False
        self._in_process = False
        self._eof = False
        self._paused = 0
        self._write_paused = False  # over the high-water mark: no next request starts (above)
        self._spliced: UpstreamConnection | None = None
        # The LiveChunks whose stream the pump relays here: taken back before a close or cut.
        self.pumped: Any = None

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0]).encode()
            self.xff_line = b"X-Forwarded-For: %b\r\n" % self.peer
        lb = self.lb
        cap = lb._max_connections
        if cap is not None and len(lb._clients) >= cap:
            lb._count_reason("too_many_connections")
            lb._count_code(503)
            message = f"too many connections to this service (limit {cap} per balancer worker)"
            self.transport.write(
                error_response(503, message, lb._name, close=True, extra=b"Retry-After: 1\r\n")
            )
            self.transport.close()
            return
        lb._clients.add(self)
        self.set_deadline(DL_HEAD, lb._header_timeout)
        if lb._tick_idle:
            lb._tick_soon()

    def data_received(self, data: bytes) -> None:
        try:
            if (
                self.exchange is None
                and self.fast is None
                and not self._buf
                and not self._write_paused
                and not self._closing
                and not self._lingering
                and self.fast_request(data)
            ):
                return
            self._received(data)
        except Exception:
            self._internal_error()

    def _received(self, data: bytes) -> None:
        if self._spliced is not None:
            self._spliced.write(data)
            return
        if self._lingering or self._closing:
            return
        ex = self.exchange
        if ex is not None and ex.body_open:
            data = ex.feed_body(data)
            if not data or self._lingering or self._closing:
                return
        self._buf = self._buf + data if self._buf else data
        if self.exchange is None and self.fast is None:
            self._process()
            if not self._write_paused:
                return  # whatever is left is a head still coming (_next_request bounds it)
        if len(self._buf) > PIPELINE_LIMIT:
            self._set_paused(_PAUSE_PIPELINE, True)

    def eof_received(self) -> bool | None:
        # A client that closes its side is treated as gone (as aiohttp and nginx do): the
        # exchange is cancelled, so a replica does not work for nobody. Cut where an answer
        # waits for it: a close would wait for that to reach a client that may never read.
        self._eof = True
        if (t := self.transport) is not None and self.busy and t.get_write_buffer_size():
            t.abort()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pumped is not None:
            self.pumped.reclaim(False)
        if self.fast is not None:
            self.materialize()
        self._closing = True
        self.lb._clients.discard(self)
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.client_lost()
        self._spliced = None

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.fast is not None:
            self.materialize()
        if self.exchange is not None:
            self.exchange.on_client_paused(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.fast is not None:
            self.materialize()
        if self.exchange is not None:
            self.exchange.on_client_paused(False)
        elif self._buf and self.fast is None and not self._closing:
            self.set_deadline(DL_HEAD, self.lb._header_timeout)
            self._process()  # what waited for the client to read

    # ------------------------------------------------------------------ request heads

    def _process(self) -> None:
        if self._in_process:
            return  # an exchange finished inside _start: the loop below goes on
        self._in_process = True
        try:
            while self.exchange is None and self.fast is None and self._buf and not self._closing:
                if self._write_paused or not self._next_request():
                    break
        finally:
            self._in_process = False

    def _next_request(self) -> bool:
        """Start the request at the head of the buffer; False when more bytes are needed."""
        buf = self._buf
        if not self._fed and buf[:1] in (b"\r", b"\n"):
            buf = self._buf = buf.lstrip(b"\r\n")  # blank lines between requests (RFC 9112)
            if not buf:
                return False
        lb = self.lb
        fed = self._fed
        end = buf.find(b"\r\n\r\n", fed - 3 if fed > 3 else 0)
        parser = self._parser
        if parser is None:
            parser = self._parser = httptools.HttpRequestParser(self)
        upgrade = False
        try:
            if end < 0:  # incomplete: validate what came, for an early 400
                parser.feed_data(buf[fed:] if fed else buf)
            else:
                head_end = end + 4
                parser.feed_data(buf[fed:head_end] if fed or head_end < len(buf) else buf)
        except httptools.HttpParserUpgrade:
            upgrade = True
        except httptools.HttpParserError as exc:
            self._reject(400, str(exc))
            return False
        if end < 0:
            self._fed = len(buf)
            if len(buf) > lb._head_limit or len(buf) - buf.rfind(b"\n") > lb._max_header_bytes:
                self._reject(431, "")
            return False
        head = buf[:head_end] if head_end < len(buf) else buf
        self._buf = buf[head_end:]
        self._fed = 0
        if len(head) > lb._max_header_bytes and (
            len(head) > lb._head_limit
            or max(len(line) for line in head.split(b"\r\n")) > lb._max_header_bytes
        ):
            self._reject(431, "")
            return False
        if head.count(b"\r\n") - 2 > MAX_HEADERS:
            self._reject(431, "")
            return False
        try:
            method, target, http11, eol = parse_request_line(head)
        except BadRequest as exc:
            self._reject(400, str(exc))
            return False
        self._start(head, method, target, http11, eol, upgrade)
        return True

    def _start(
        self, head: bytes, method: bytes, target: bytes, http11: bool, eol: int, upgrade: bool
    ) -> None:
        lb = self.lb
        kept, found = scan_request(head[eol:-2])
        tokens = connection_tokens(found.get(b"connection"))
        proxy = found.get(b"proxy-connection")
        # Old clients' Connection, which llhttp reads as one: after "close" in it the parser
        # takes no further request, so the connection must not wait for one either.
        persist = tokens | connection_tokens(proxy) if proxy else tokens
        keep_alive = b"close" not in persist if http11 else b"keep-alive" in persist
        if self._eof:
            keep_alive = False
        ws: bytes | None = None
        if upgrade and b"upgrade" in tokens:
            value = found.get(b"upgrade", [b""])[0]
            if value.lower() == b"websocket":
                ws = value
        prev = found.get(b"x-forwarded-for")
        if prev:
            chain = b", ".join(prev)
            xff_line = b"X-Forwarded-For: %b\r\n" % (
                chain + b", " + self.peer if self.peer else chain
            )
        else:
            xff_line = self.xff_line
        try:
            fhost = forwarded_host(request_host(target, found.get(b"host"), http11))
        except BadRequest as exc:
            self._reject(400, str(exc))
            return
        fwd = forwarded(kept, xff_line, lb._proto_line, fhost)
        ex = Exchange(lb, self, method, origin_form(target), http11, keep_alive, fwd, ws)
        expect = found.get(b"expect")
        ex.expect = expect is not None and expect[0].lower() == b"100-continue"
        length = found.get(b"content-length")
        coding = found.get(b"transfer-encoding")  # llhttp accepts chunked only as the last
        refusal = None if coding is None else coding_refusal(coding, http11)
        if refusal is not None:
            self._reject(*refusal)
            return
        chunked = coding is not None
        if chunked or length or upgrade:
            self._parser = None  # the parser saw no body: a fresh one for the next request
        self._run(ex, content_length(length[0]) if length else None, chunked, None)

    def _run(self, ex: Exchange, length: int | None, chunked: bool, picked: int | None) -> None:
        """Hand the buffer (the body, and any pipelined request) to a new exchange."""
        self.exchange = ex
        self.deadline = 0.0
        rest, self._buf = self._buf, b""
        rest = ex.begin(length, chunked, rest, picked)
        if self._lingering or self._closing:
            return
        self._buf = rest + self._buf if self._buf else rest
        if self.exchange is not None and len(self._buf) > PIPELINE_LIMIT:
            self._set_paused(_PAUSE_PIPELINE, True)

    def _reject(self, status: int, detail: str) -> None:
        """Answer a request the parser or a limit rejected, and close."""
        lb = self.lb
        detail = " ".join(detail.split())[:200]  # one line, bounded
        reason = {431: "header_too_large", 501: "not_implemented"}.get(status, "bad_request")
        lb._rejected(self.peer, status, reason, detail)
        if status == 431:
            message = (
                f"request line or header too large (limits: {lb._max_header_bytes} bytes "
                f"per line, {MAX_HEADERS} header fields)"
            )
        else:
            message = detail if status == 501 else f"malformed HTTP request: {detail}"
        self.write(error_response(status, message, lb._name, close=True, version=b"HTTP/1.0"))
        self._linger()

    # ------------------------------------------------------------------ used by the exchange

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self._closing:
            transport.write(data)

    def set_deadline(self, kind: int, seconds: float) -> None:
        self.deadline_kind = kind
        self.deadline = time.monotonic() + seconds if kind != DL_NONE else 0.0

    def exchange_done(self, ex: Pending, keep_alive: bool, body_unread: bool) -> None:
        """The exchange answered; go on with the next request or close."""
        if self.exchange is not ex:
            return
        self.exchange = None
        self._set_paused(_PAUSE_UPSTREAM, False)
        if self._closing:
            return
        if not keep_alive:  # not when a stopping balancer sent the head before it stopped:
            if body_unread:  # that said keep-alive, so the next request may be on its way
                self._linger()
            else:
                self._close()
            return
        self.kept_alive, self.idle_since = True, time.monotonic()
        lb = self.lb  # a request waiting for it to read waits as long as a stream may go quiet
        self.set_deadline(DL_HEAD, lb._idle_timeout if self._write_paused else lb._header_timeout)
        self._set_paused(_PAUSE_PIPELINE, False)
        if self._buf:
            self._process()

    def pause_for_upstream(self, paused: bool) -> None:
        self._set_paused(_PAUSE_UPSTREAM, paused)

    def splice(self, conn: UpstreamConnection) -> bytes:
        """From now on, bytes from the client go to ``conn`` as they are; returns what was
        received after the upgrade request already."""
        self._spliced = conn
        self.deadline = 0.0
        pending, self._buf = self._buf, b""
        self._set_paused(_PAUSE_PIPELINE, False)  # the tunnel reads on: its own flow control
        return pending

    def on_timeout(self) -> None:
        """The ticker found the deadline passed."""
        pumped = self.pumped
        if pumped is not None and pumped.extend():
            return  # the pump relayed a batch since: the deadline moved on
        self.deadline = 0.0
        if self.fast is not None:
            self.materialize()
        ex = self.exchange
        if ex is None or self.deadline_kind == DL_LINGER:
            self._close()
        else:
            ex.on_timeout(self.deadline_kind)

    def abort(self) -> None:
        """Drop the connection now (the balancer stops)."""
        if self.pumped is not None:
            self.pumped.reclaim(False)
        if self.fast is not None:
            self.materialize()
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.client_lost()
        self._closing = True
        if self.transport is not None:
            self.transport.abort()

    def close_if_idle(self, before: float) -> None:
        """The balancer stops: a keep-alive connection idle since ``before`` gets a lingering
        close, so a request written as the FIN left is read and dropped, not reset."""
        if self.kept_alive and not self.busy and not self._lingering and self.idle_since <= before:
            self._linger()

    @property
    def busy(self) -> bool:
        """A request is being answered."""
        return self.exchange is not None or self.fast is not None

    # ------------------------------------------------------------------ internals

    def _unpause(self) -> None:
        self._set_paused(_PAUSE_UPSTREAM | _PAUSE_PIPELINE, False)

    def _set_paused(self, reason: int, paused: bool) -> None:
        before = self._paused
        after = before | reason if paused else before & ~reason
        if bool(before) == bool(after) or self.transport is None or self._closing:
            self._paused = after
            return
        self._paused = after
        if after:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _close(self) -> None:
        if self.pumped is not None:
            self.pumped.reclaim(False)
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def _linger(self) -> None:
        """Close after an early answer, reading and dropping what the client still sends."""
        transport = self.transport
        self._buf = b""
        if transport is None or self._closing:
            return
        if self._eof or self.lb._ssl_context is not None or not transport.can_write_eof():
            self._close()
            return
        self._lingering = True
        self._set_paused(_PAUSE_PIPELINE | _PAUSE_UPSTREAM, False)
        transport.write_eof()
        self.set_deadline(DL_LINGER, LINGER_SECONDS)

    def _internal_error(self) -> None:
        """A bug: never a traceback to the client, at most a clean 502 and a closed socket."""
        logger.exception("balancer %s: unexpected error on a client connection", self.lb._name)
        if self.fast is not None:
            self.materialize()
        ex = self.exchange
        if ex is not None and not ex.started:
            ex.internal_error()
        else:
            if ex is not None:
                self.lb._count_reason("internal")
                ex.client_lost()
            self.exchange = None
            self._close()
