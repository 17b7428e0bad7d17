"""The response half of an :class:`~corral.balancer.exchange.Exchange`: relaying an answer.

Split from the exchange to keep each module readable; the two halves are one object. What a
replica's connection reports (head, body, end, upgrade, errors) lands here and is decided
here: how the answer reaches the client (whole, streamed as is, re-chunked, or spliced after
a WebSocket upgrade) and which failures may still be retried (an answer nothing of which went
to the client yet) or must cut the client's connection (one already under way).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Final

from corral.balancer.failures import Failure, describe
from corral.balancer.headers import Found, only_chunked, scan_response
from corral.balancer.http1 import LAST_CHUNK, content_length
from corral.balancer.speedups import StreamBatch

if TYPE_CHECKING:
    from corral.balancer.roles import Balancer, Downstream
    from corral.balancer.upstream import UpstreamConnection

__all__ = ["BUFFER_RESPONSE_BYTES", "ResponseRelay"]

# Answers up to this size to idempotent requests are read whole before they are sent, so a
# replica dying mid-answer is retried on another one.
BUFFER_RESPONSE_BYTES: Final = 256 * 1024
# A stream's head up to this size is remembered for the fast path (Target.stream_memo).
STREAM_MEMO_MAX: Final = 2048
_CHUNKED_LINE: Final = b"Transfer-Encoding: chunked\r\n"

# Response modes
_HEAD, _WHOLE, _RAW, _CHUNK, _NONE, _SPLICE = range(6)
# ... and the two a stream moves to once its head and first bytes went out (_RAW, _CHUNK as
# they are, but the body's pieces are collected raw by list.append, no Python call, and sent
# once per batch: see ResponseRelay._go_live).
_LIVE_RAW, _LIVE_CHUNK = 6, 7
# What the client connection's deadline means: while an exchange runs ...
DL_NONE, DL_BODY, DL_FIRST_BYTE, DL_IDLE = range(4)
# ... and between requests: waiting for a request head (header_timeout), lingering after an
# early answer.
DL_HEAD: Final = -1
DL_LINGER: Final = -2


class ResponseRelay:
    """The response side of an exchange (see the module docstring)."""

    # The exchange's state this half reads and writes (set by Exchange.__init__).
    lb: Balancer
    client: Downstream
    conn: UpstreamConnection | None
    streaming_to: UpstreamConnection | None
    rid: int | None
    upgrade: bytes | None
    pending_failure: Failure | None
    http11: bool
    keep_alive: bool
    idempotent: bool
    head_only: bool
    streamed: bool
    body_open: bool
    close_client: bool
    eof_ends: bool
    done: bool
    status: int
    mode: int
    ttft_from: float  # when the request arrived (once sent), until its first streamed bytes
    stream_counted: bool  # its first streamed bytes went out: the balancer counts a stream
    reply_head: bytes
    out: list[bytes]
    whole: list[bytes]

    def _failed(self, failure: Failure) -> None:
        raise NotImplementedError

    def _abort(self, reason: str, message: str) -> None:
        raise NotImplementedError

    def _finish(self, keep_alive: bool) -> None:
        raise NotImplementedError

    def _record(self, status: int) -> None:
        raise NotImplementedError

    def _resendable(self) -> tuple[bool, str]:
        raise NotImplementedError

    def on_response_head(self, status: int, head: bytes, keep_alive: bool) -> bool:
        """Decide how the answer goes to the client (whole, streamed as is, re-chunked)."""
        if status == 101:
            if self.upgrade is not None:
                return False  # the connection reports the switch next (on_upgraded)
            msg = "sent an unasked 101"
            self.pending_failure = Failure(502, msg, "upstream_error", retryable=False)
            return True
        if self.upgrade is not None:
            # The replica refused the upgrade (401, 403, 426, ...): its answer is the client's
            # to read, as nginx relays it. What the client sent after its request may be frames
            # of the tunnel it expected, not a request: the connection ends with this answer.
            self.close_client = True
        eol = head.find(b"\r\n")
        block = head[eol:-2]
        kept, found = self._scan_head(block)
        coding = found.get(b"transfer-encoding")
        bodiless = self.head_only or status in (204, 304)
        if coding is not None and not bodiless and not only_chunked(coding):
            # httptools takes the chunks off and nothing else, and the header is hop-by-hop:
            # relayed, the body would reach the client still gzip'd with nothing saying so.
            # As nginx does: the replica's answer is refused.
            shown = b", ".join(coding).decode("latin-1")[:80]
            msg = f"sent a transfer coding the balancer cannot relay ({shown})"
            self.pending_failure = Failure(502, msg, "upstream_error", retryable=False)
            return True
        self.status = status
        lb = self.lb
        if self.rid is not None:
            lb._served[self.rid] = lb._served.get(self.rid, 0) + 1
        status_line = head[:eol]
        if status_line[:9] != b"HTTP/1.1 ":
            status_line = b"HTTP/1.1 " + status_line[9:]
        length = found.get(b"content-length")
        if length is not None:
            self.ttft_from = 0.0  # a whole answer, not a stream: no first token to time
        mode, extra = self._body_mode(bodiless, length, coding)
        if self.lb._stopping:
            self.close_client = True  # the balancer drains: this connection ends after this
        if not self.keep_alive or self.close_client or self.body_open:
            extra += b"Connection: close\r\n"
        elif not self.http11:
            extra += b"Connection: keep-alive\r\n"
        if kept is block and not extra and status_line is head[:eol]:
            reply = head
        else:
            reply = b"".join((status_line, kept, extra, b"\r\n"))
        self.mode = mode
        if mode == _WHOLE:
            self.reply_head = reply
        else:
            self.out.append(reply)
            self._record(status)
            if extra is _CHUNKED_LINE:
                self._remember_stream(head, status, reply, keep_alive)
        return self.head_only

    def _body_mode(
        self, bodiless: bool, length: list[bytes] | None, coding: list[bytes] | None
    ) -> tuple[int, bytes]:
        """How the answer's body goes (whole, as is, re-chunked) and the header line that
        says so to the client (``_CHUNKED_LINE`` itself for a re-chunked one)."""
        if bodiless:
            return _NONE, b""
        if length is not None:
            if self.idempotent and not self.streamed:
                size = content_length(length[0])
                if 0 < size <= BUFFER_RESPONSE_BYTES:
                    return _WHOLE, b""
            return _RAW, b""
        self.eof_ends = coding is None
        if self.http11:
            self._follow_chunks(coding)
            return _CHUNK, _CHUNKED_LINE
        self.close_client = True
        return _RAW, b""

    def _remember_stream(self, head: bytes, status: int, reply: bytes, keep_alive: bool) -> None:
        """A stream's head sent on as the fast path would send it (its framing followed, no
        Connection header added): remembered on the replica, for the next stream to go
        unparsed (corral.balancer.fast_stream)."""
        conn = self.conn
        if conn is not None and conn.chunks is not None and len(head) <= STREAM_MEMO_MAX:
            conn.target.stream_memo = (head, status, reply, keep_alive)

    def _scan_head(self, block: bytes) -> tuple[bytes, Found]:
        """``scan_response``, remembered per replica: a stream's head (or any answer the fast
        path does not take) is the same block each time but for a Date header, and the scan
        is most of what the general path does with it (measured: 2.3 us of 21 per short
        stream in a hot loop). What it found is only read, never changed."""
        conn = self.conn
        target = conn.target if conn is not None else None
        memo = target.scanned if target is not None else None
        if memo is not None and memo[0] == block:
            return memo[1], memo[2]
        kept, found = scan_response(block)
        if target is not None:
            target.scanned = (block, kept, found)
        return kept, found

    def _follow_chunks(self, coding: list[bytes] | None) -> None:
        """Have the connection follow the framing, so a live stream can go as framed
        (_go_live), when Transfer-Encoding says ``chunked`` (on_response_head refused any
        other coding): only then is the body the plain chunks ChunkScan follows."""
        conn = self.conn
        if conn is not None and coding is not None:
            conn.follow_chunks()

    def on_response_body(self, data: bytes) -> None:
        """One piece of the body, until the answer's first batch went out (then _go_live)."""
        mode = self.mode
        if self.ttft_from and data:
            self.on_first_bytes()
        if mode == _CHUNK:
            self.out.append(b"%x\r\n%b\r\n" % (len(data), data))
        elif mode == _RAW or mode >= _LIVE_RAW:  # live: a fast stream's Exchange (materialize)
            self.out.append(data)
        elif mode == _WHOLE:
            self.whole.append(data)

    def on_first_bytes(self) -> None:
        """The first bytes of a streamed answer: its time to first token, and its replica's
        load drops to a stream's (corral.balancer.gate)."""
        if not self.ttft_from:
            return
        self.lb._observe_ttft(self.rid, time.monotonic() - self.ttft_from)
        self.ttft_from = 0.0
        if self.rid is not None:
            self.lb._stream_began(self.rid)
            self.stream_counted = True

    def on_upstream_data_done(self, complete: bool) -> None:
        """End of one batch from the replica: send what it carried, or end the answer.

        This is the relay's one Python call per event of a stream once it is live: the batch's
        pieces are framed as one chunk (one bytes object), written, and the client's idle
        deadline moved, inline rather than through ``_flush`` and ``ClientConnection.write``
        and ``set_deadline`` (the same effect, three calls fewer per event).
        """
        if self.pending_failure is not None:
            self._failed(self.pending_failure)
            return
        mode = self.mode
        if complete or mode < _NONE:  # _HEAD, _WHOLE, and _RAW, _CHUNK until live
            self._batch_done(complete)
            return
        out = self.out
        client = self.client
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if mode == _LIVE_CHUNK:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            transport = client.transport
            if transport is not None and not client._closing:
                transport.write(data)
        client.deadline_kind = DL_IDLE
        client.deadline = time.monotonic() + self.lb._idle_timeout

    def on_live_chunks_done(self, last: bytes) -> None:
        """``LiveChunks`` ended a live chunked answer (``UpstreamConnection.raw_done``).

        ``last`` is the answer's final batch as the replica framed it, held back by the reader
        so that it and the last chunk leave in one write: one syscall fewer per stream, and
        the client gets the end of the stream in the segment that carries its last event.
        """
        if self.pending_failure is not None:
            self._failed(self.pending_failure)
            return
        self._flush(last + LAST_CHUNK)
        self._response_done()

    def _batch_done(self, complete: bool) -> None:
        """The rarer ends of a batch: the answer complete, nothing sent yet, or a stream's
        first batches."""
        mode = self.mode
        if mode == _HEAD:
            return
        if complete:
            if mode == _WHOLE:
                self.client.write(self.reply_head + b"".join(self.whole))
                self._record(self.status)
                self.whole = []
            else:
                self._flush(LAST_CHUNK if mode in (_CHUNK, _LIVE_CHUNK) else b"")
            self._response_done()
            return
        if mode != _WHOLE:
            self._flush()
            if (mode in (_RAW, _CHUNK)) and not self.ttft_from:
                self._go_live(mode)
        self.client.set_deadline(DL_IDLE, self.lb._idle_timeout)

    def _go_live(self, mode: int) -> None:
        """From now on the connection's body callback appends to ``out`` directly.

        Why: per event of a stream, a Python call costs more than the work it does. The
        instance attribute shadows the method for this exchange only (a new exchange starts
        with the method again); it is set once the head went out and the first bytes were
        timed, so nothing else the method does is skipped, and ``on_upstream_data_done`` frames
        what gathered (``_LIVE_CHUNK``) when the batch ends. In the compiled build that method
        is shadowed too, by ``StreamBatch`` (corral.balancer.speedups): the same steps in C.

        And in the compiled build a stream of plain chunks (the connection followed its framing
        from the first body byte: ``UpstreamConnection.follow_chunks``) skips all that: the
        ``LiveChunks`` reader in front of the replica's connection (``UpstreamConnection.go_raw``)
        is armed and relays each batch as the replica framed it with no Python call (measured at
        64 connections: 382 against 404 us of CPU per 50-event stream, docs/benchmarks.md).
        What it leaves to httptools comes back to the path above, which is why both are set up.
        """
        self.mode = live = _LIVE_CHUNK if mode == _CHUNK else _LIVE_RAW
        out = self.out
        attrs = self.__dict__
        attrs["on_response_body"] = out.append
        transport = self.client.transport
        conn = self.conn
        # Only from a chunk's start: what came before was framed here (``_flush``), so a chunk
        # the last batch cut would reach the client with no size line. Such a stream stays
        # on the path below (a replica that flushes whole events never cuts one).
        if live == _LIVE_CHUNK and transport is not None and conn is not None:
            chunks = conn.chunks
            if chunks is not None and chunks.at_boundary:
                conn.go_raw(self.client, transport.write, self.lb._idle_timeout, DL_IDLE)
        if StreamBatch is not None and transport is not None:
            attrs["on_upstream_data_done"] = StreamBatch(
                weakref.ref(self),
                ResponseRelay.on_upstream_data_done,
                self.client,
                transport.write,
                out,
                live == _LIVE_CHUNK,
                self.lb._idle_timeout,
                DL_IDLE,
            )

    def _flush(self, tail: bytes = b"") -> None:
        """Send what ``out`` holds (a live chunked stream's pieces framed as one chunk), then
        ``tail``."""
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if self.mode == _LIVE_CHUNK:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            self.client.write(data + tail if tail else data)
        elif tail:
            self.client.write(tail)

    def _response_done(self) -> None:
        conn, self.conn = self.conn, None
        self.streaming_to = None
        if conn is not None:
            if self.body_open:
                conn.reusable = False  # the replica answered before the whole body came
            self.lb._pool.put(conn)
        self._finish(self.keep_alive and not self.close_client and not self.body_open)

    def on_upgraded(self, status: int, head: bytes, rest: bytes) -> None:
        """The replica switched protocols: answer the client and relay bytes both ways."""
        conn = self.conn
        if self.upgrade is None or status != 101 or conn is None:
            self._failed(Failure(502, "sent an unasked 101", "upstream_error", retryable=False))
            return
        lb = self.lb
        if self.rid is not None:
            lb._served[self.rid] = lb._served.get(self.rid, 0) + 1
        eol = head.find(b"\r\n")
        kept, found = scan_response(head[eol:-2])
        upgrade = found.get(b"upgrade", [self.upgrade])[0]
        self.mode = _SPLICE
        self.client.set_deadline(DL_NONE, 0.0)
        self.client.write(
            b"HTTP/1.1 101 Switching Protocols%b"
            b"Connection: Upgrade\r\nUpgrade: %b\r\n\r\n%b" % (kept, upgrade, rest)
        )
        self._record(101)
        pending = self.client.splice(conn)
        if pending:
            conn.write(pending)

    def on_spliced_data(self, data: bytes) -> None:
        self.client.write(data)

    def on_upstream_error(self, message: str) -> None:
        if self.mode in (_HEAD, _WHOLE):
            self._failed(Failure(502, message, "upstream_error", retryable=False))
        else:
            self._abort("upstream_aborted", message)

    def on_upstream_lost(self, exc: Exception | None) -> None:
        """The replica's connection closed (``exc`` None: cleanly)."""
        if self.done:
            return
        mode = self.mode
        if mode == _HEAD:
            ok, why = self._resendable()
            what = describe(exc) if exc is not None else "connection closed"
            message = f"{what} before the response{why}"
            conn = self.conn
            pooled = conn is not None and conn.uses > 1
            if pooled and conn is not None:
                # Its other idle connections are likely as dead (a killed replica): the next
                # attempt there opens a fresh one, which a dead replica refuses at once.
                self.lb._pool.close_target(conn.target)
            failure = Failure(
                502, message, "upstream_unreachable", retryable=ok, free=ok and pooled
            )
            self._failed(failure)
        elif mode == _WHOLE:
            what = describe(exc) if exc is not None else "connection closed"
            message = f"failed mid-response: {what}"
            self._failed(Failure(502, message, "upstream_aborted", retryable=True))
        elif mode == _SPLICE or (exc is None and self.eof_ends):
            self._flush(LAST_CHUNK if mode in (_CHUNK, _LIVE_CHUNK) else b"")
            self.conn = None
            self.close_client = mode == _SPLICE or self.close_client
            self._finish(not self.close_client and self.keep_alive and not self.body_open)
        else:
            what = describe(exc) if exc is not None else "connection closed"
            self._abort("upstream_aborted", f"failed mid-response: {what}")

    def on_upstream_paused(self, paused: bool) -> None:
        self.client.pause_for_upstream(paused)

    def on_client_paused(self, paused: bool) -> None:
        if self.conn is not None:
            self.conn.pause_reading(paused)
