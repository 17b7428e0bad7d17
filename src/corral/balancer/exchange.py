"""One proxied request: body framing, attempts on replicas, and relaying the answer.

An :class:`Exchange` is a state machine driven by callbacks, not a coroutine: the client's
connection feeds it request bytes, the replica's connection feeds it response events, and the
balancer's ticker tells it when a deadline passed. The common request (a pooled connection is
idle, the body, if any, came with the head) therefore runs start to end inside two
``data_received`` calls with no task, future or timer created: one read and one write on each
side. Only opening a connection and waiting for a first ready replica are coroutines.

Retry rules (each answering a failure seen in SkyServe or in corral's chaos tests):

* The request body is held, when it fits in ``max_buffered_body``, so every attempt can resend
  it. A bigger body is streamed, and retried only while not a byte of it went to a replica.
* A retry never goes to a replica this request already tried. A refused connection does not use
  up one of ``max_attempts``: the request provably reached no replica.
* A request that is not idempotent (POST, PATCH ...) is resent only when provably no byte of it
  reached a replica: the connect failed, or a pooled connection was known closed before the
  write. A replica that read a POST and closed without answering may have acted on it; resending
  would run it twice, so the client gets a 502, as with nginx. Such requests take a pooled
  connection only if it was idle for at most ``NONIDEMPOTENT_MAX_IDLE`` (else a fresh one), so
  the keep-alive race (the replica closing an idle connection as the request is written) cannot
  hit them: replicas keep idle connections for seconds (uvicorn 5 s, aiohttp 75 s, gunicorn 2 s).
* An answer of at most ``BUFFER_RESPONSE_BYTES`` with a Content-Length, to an idempotent request,
  is read whole before anything goes to the client: a replica killed between its headers and its
  body is then retried instead of leaving the client a cut-off answer.
* The in-flight count of a replica is taken when it is picked and given back exactly once
  (:meth:`Exchange._release`) on every path: answer done, failure, client gone, stop.

Size: one state machine, kept in one module. Its response half already lives in
:mod:`corral.balancer.relay`; what is left (body framing, attempts, failures) shares every
field, the retry rules above are checked against the code that applies them, and its callbacks
are the per-request path of every request off the fast path (measured by bench/balancer.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final

from corral.balancer.failures import CLIENT_FAULTS, Failure, describe, refused
from corral.balancer.http1 import (
    CONTINUE,
    LAST_CHUNK,
    BadRequest,
    ChunkedDecoder,
    chunk,
    error_response,
)
from corral.balancer.policies import RequestView
from corral.balancer.relay import (
    _HEAD,
    _SPLICE,
    _WHOLE,
    BUFFER_RESPONSE_BYTES,
    DL_BODY,
    DL_FIRST_BYTE,
    DL_HEAD,
    DL_IDLE,
    DL_LINGER,
    DL_NONE,
    ResponseRelay,
)
from corral.balancer.upstream import Target, UpstreamConnection

if TYPE_CHECKING:
    from corral.balancer.roles import Balancer, Downstream

__all__ = [
    "BUFFER_RESPONSE_BYTES",
    "DL_BODY",
    "DL_FIRST_BYTE",
    "DL_HEAD",
    "DL_IDLE",
    "DL_LINGER",
    "DL_NONE",
    "IDEMPOTENT",
    "NONIDEMPOTENT_MAX_IDLE",
    "Exchange",
]

IDEMPOTENT: Final = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
# Pooled connections idle longer than this are not used for a non-idempotent request.
NONIDEMPOTENT_MAX_IDLE: Final = 1.0
_ANY_IDLE: Final = float("inf")


class Exchange(ResponseRelay):
    """One request from head to the end of its answer; see the module docstring (the answer's
    side is in :class:`~corral.balancer.relay.ResponseRelay`)."""

    # What every exchange starts with, as class attributes: an instance holds only what it
    # changed (``__init__`` sets the rest, and each its own lists). Every request off the fast
    # path, every stream among them, builds one.
    body_kind = 0  # 0 none, 1 Content-Length, 2 chunked
    body_left = 0
    body_open = False
    body_size = 0
    decoder: ChunkedDecoder | None = None
    had_length = False
    expect = False
    streamed = False
    streaming_to: UpstreamConnection | None = None
    sent_body = False
    counted = 0
    last: Failure | None = None
    rid: int | None = None
    picked: int | None = None  # the replica the fast path already picked
    placing: object | None = None  # held for a replica: what its policy keeps if it goes
    # The fast path's pick found no replica with room: the request waits, and the policy is
    # not asked again (it counted the request once: share, index, table).
    must_wait = False
    conn: UpstreamConnection | None = None
    task: asyncio.Task[None] | None = None
    waited = False
    mode = _HEAD
    reply_head = b""
    status = 0
    started = False
    close_client = False
    ttft_from = 0.0
    stream_counted = False  # in the balancer's streams (gate._stream_began)
    eof_ends = False
    pending_failure: Failure | None = None
    done = False

    def __init__(
        self,
        lb: Balancer,
        client: Downstream,
        method: bytes,
        target: bytes,
        http11: bool,
        keep_alive: bool,
        fwd: bytes,
        upgrade: bytes | None,
    ) -> None:
        self.lb = lb
        self.client = client
        self.t0 = time.monotonic()
        self.method = method
        self.target = target
        self.http11 = http11
        self.keep_alive = keep_alive
        self.fwd = fwd  # forwarded header lines: kept block + X-Forwarded-*
        self.upgrade = upgrade  # the Upgrade value of a WebSocket request
        self.idempotent = method in IDEMPOTENT
        self.head_only = method == b"HEAD"
        self.body: list[bytes] = []
        self.tried: list[int] = []
        self.failures: list[str] = []
        self.out: list[bytes] = []
        self.whole: list[bytes] = []

    # ------------------------------------------------------------------ request side

    def begin(
        self, length: int | None, chunked: bool, rest: bytes, picked: int | None = None
    ) -> bytes:
        """Start with the head parsed; ``rest`` is what followed it. Returns the bytes after
        this request's body (a pipelined request) once the body is complete. ``picked``: the
        replica for the first attempt, when the caller asked the policy already."""
        self.picked = picked
        lb = self.lb
        lb._count_request(self.t0)
        if self.method == b"CONNECT":
            msg = "CONNECT is not supported by a reverse proxy"
            self.respond_error(405, msg, "bad_request", close=True)
            return b""
        self.had_length = length is not None
        if chunked:
            self.body_kind = 2
            self.decoder = ChunkedDecoder()
            self.body_open = True
        elif length:
            self.body_kind = 1
            self.body_left = length
            self.body_open = True  # until read, so an early answer closes the connection
            if lb._max_body is not None and length > lb._max_body:
                # Before any "100 Continue": a client that asked first never sends the body.
                self.too_large(length)
                return b""
        if not self.body_open:
            self.next_attempt()
            return rest
        if self.expect and self.http11 and not rest:
            self.client.write(CONTINUE)  # clients like curl pause before the body until then
        if self.body_kind == 1 and length is not None and length > lb._max_buffered_body:
            self.streamed = True
            self.next_attempt()
        else:
            self.client.set_deadline(DL_BODY, lb._idle_timeout)
        return self.feed_body(rest) if rest else b""

    def feed_body(self, data: bytes) -> bytes:
        """Body bytes from the client; returns what came after the body."""
        rest = b""
        if self.body_kind == 1:
            left = self.body_left
            if len(data) > left:
                data, rest = data[:left], data[left:]
            self.body_left = left - len(data)
            pieces = [data]
            ended = self.body_left == 0
        else:
            assert self.decoder is not None
            try:
                pieces, used, ended = self.decoder.feed(data)
            except BadRequest as exc:
                self.bad_body(str(exc))
                return b""
            if used < len(data):
                rest = data[used:]
        size = self.body_size
        for piece in pieces:
            size += len(piece)
        self.body_size = size
        lb = self.lb
        if lb._max_body is not None and size > lb._max_body:
            self.too_large(None)
            return b""
        if ended:
            self.body_open = False
        if self.streamed:
            self._stream(pieces)
        else:
            self.body.extend(pieces)
            if ended:
                self.client.set_deadline(DL_NONE, 0.0)
                self.next_attempt()
            elif size > lb._max_buffered_body:
                self.streamed = True  # what was read goes first, the rest as it comes
                self.next_attempt()
        return rest

    def _stream(self, pieces: list[bytes]) -> None:
        conn = self.streaming_to
        if conn is None:  # not connected yet (or held for room): kept, and still replayable
            self.body.extend(pieces)
            if self.body_size > self.lb._max_buffered_body:
                # Past what it may keep: the client waits (reading paused, as for a replica
                # that reads slowly) until a connection takes the body (_send resumes it),
                # its body's deadline off meanwhile (the hold has its own bound).
                self.client.pause_for_upstream(True)
                self.client.set_deadline(DL_NONE, 0.0)
            return
        data = self._framed(pieces)
        if data:
            conn.write(data)
            self.sent_body = True
        if self.body_open:
            self.client.set_deadline(DL_BODY, self.lb._idle_timeout)
        else:
            self.client.set_deadline(DL_FIRST_BYTE, self.lb._first_byte_timeout)

    def _framed(self, pieces: list[bytes]) -> bytes:
        if self.body_kind == 1:
            return b"".join(pieces)
        data = b"".join([chunk(p) for p in pieces if p])
        return data + LAST_CHUNK if not self.body_open else data

    # ------------------------------------------------------------------ attempts

    def next_attempt(self) -> None:
        """Pick a replica not tried yet and send the request to it (or answer the failure)."""
        if self.done:
            return
        lb = self.lb
        rid = self.picked
        self.picked = None
        if self.must_wait:
            self.must_wait = False
            lb._hold(self)  # for the home the fast path's pick chose (lb._want), if any
            return
        if rid is None or rid not in lb._ready:
            rid = lb._pick(self.tried, self._view() if lb._gated else None)
        if rid is None:
            if lb._full(self.tried):  # every replica at its limit: wait here for room
                lb._hold(self)
                return
            if not self.tried and not self.waited and lb._no_replica_wait > 0:
                self.waited = True
                self.task = asyncio.get_running_loop().create_task(self._wait_ready())
                return
            self._give_up()
            return
        if self.tried:
            lb._retries += 1
        self.tried.append(rid)
        lb._acquire(rid)
        self.rid = rid
        target = lb._ready[rid]
        conn = None
        if self.upgrade is None:
            max_idle = _ANY_IDLE if self.idempotent else NONIDEMPOTENT_MAX_IDLE
            conn = lb._pool.take(target, max_idle)
        if conn is not None:
            self._send(conn, target)
        else:
            self.task = asyncio.get_running_loop().create_task(self._connect(target))

    def _view(self) -> RequestView:
        """The request as a policy sees it; the body only when held whole."""
        whole = not self.streamed and not self.body_open
        return RequestView(self.target, b"".join(self.body) if whole else None, self.fwd)

    async def _wait_ready(self) -> None:
        lb = self.lb
        lb._awaiting += 1
        try:
            await lb._wait_for_ready(lb._no_replica_wait)
        finally:
            lb._awaiting -= 1
        self.task = None
        self.next_attempt()

    async def _connect(self, target: Target) -> None:
        lb = self.lb
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(lb._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(target),
                    target.host,
                    target.port,
                    ssl=lb._upstream_ssl() if target.ssl else None,
                    server_hostname=target.host if target.ssl else None,
                )
        except TimeoutError:
            self.task = None
            msg = f"could not connect within {lb._connect_timeout:g}s"
            self._failed(Failure(504, msg, "connect_timeout", retryable=True, connect=True))
            return
        except OSError as exc:
            self.task = None
            msg = f"Connect to {target.host}:{target.port} failed: {describe(exc)}"
            failure = Failure(
                502,
                msg,
                "upstream_unreachable",
                retryable=True,
                refused=refused(exc),
                connect=True,
            )
            self._failed(failure)
            return
        self.task = None
        if self.done:
            conn.close()
            return
        self._send(conn, target)

    def _send(self, conn: UpstreamConnection, target: Target) -> None:
        """Write the request (head, and the body or what has come of it) to a connection."""
        self.conn = conn
        self.mode = _HEAD
        self.out = []
        self.whole = []
        self.pending_failure = None
        conn.begin(self)
        parts = [
            self.method,
            b" ",
            target.prefix,
            self.target,
            b" HTTP/1.1\r\n",
            target.host_line,
            self.fwd,
        ]
        if self.upgrade is not None:
            parts.append(b"Connection: Upgrade\r\nUpgrade: %b\r\n" % self.upgrade)
        if self.streamed:
            if self.body_kind == 1:
                parts.append(b"Content-Length: %d\r\n\r\n" % (self.body_size + self.body_left))
            else:
                parts.append(b"Transfer-Encoding: chunked\r\n\r\n")
            pieces, self.body = self.body, []
            parts.append(self._framed(pieces))
            self.sent_body = bool(pieces)
            self.streaming_to = conn
            self.client.pause_for_upstream(False)  # paused while it was kept (_stream)
        elif self.body_kind or self.had_length:
            parts.append(b"Content-Length: %d\r\n\r\n" % self.body_size)
            parts.extend(self.body)
        else:
            parts.append(b"\r\n")
        conn.write(b"".join(parts))
        # Timed from the request's arrival, as its client waits: the time it was held in the
        # balancer (every replica at max_in_flight_per_replica) is part of its TTFT.
        self.ttft_from = self.t0
        if self.body_open:
            self.client.set_deadline(DL_BODY, self.lb._idle_timeout)
        else:
            self.client.set_deadline(DL_FIRST_BYTE, self.lb._first_byte_timeout)

    def _resendable(self) -> tuple[bool, str]:
        """May a request that was written to a replica, which then failed before answering,
        go to another one? (And why not, for the error message.)"""
        if self.streamed and self.sent_body:
            return False, " (request body already streamed, not retried)"
        if not self.idempotent:
            method = self.method.decode("latin-1")
            return False, f" ({method} not retried: it may have reached the replica)"
        return True, ""

    def _failed(self, failure: Failure) -> None:
        """An attempt failed before anything went to the client: retry or answer."""
        conn, self.conn = self.conn, None
        self.streaming_to = None
        if conn is not None:
            conn.abort()
        lb = self.lb
        rid = self.rid
        if rid is not None:
            if failure.reason not in CLIENT_FAULTS:
                # counted before the release, which may forget a replica that has left
                lb._failed[rid] = lb._failed.get(rid, 0) + 1
                method = self.method.decode("latin-1")
                target = self.target.decode("latin-1")
                lb._warn(rid, f"{method} {target} failed: {failure.message}")
            if failure.connect:
                lb._ejected[rid] = time.monotonic() + lb.EJECT_SECONDS
            self.failures.append(f"replica {lb.shown_id(rid)}: {failure.message}")
        self._release()
        if not (failure.refused or failure.free):
            self.counted += 1
        self.last = failure
        if self.streamed and self.sent_body:
            failure.retryable = False
        self.client.set_deadline(DL_NONE, 0.0)
        if failure.retryable and self.counted < lb._max_attempts:
            self.next_attempt()
        else:
            self._give_up()

    def _give_up(self) -> None:
        last = self.last
        if last is None:
            self.respond_error(
                503,
                "no ready replicas",
                "no_replica",
                extra=b"Retry-After: %d\r\n" % self.lb.RETRY_AFTER_SECONDS,
            )
            return
        detail = "; ".join(self.failures)
        if last.status == 504:
            self.respond_error(504, f"upstream timed out: {detail}", last.reason)
        else:
            self.respond_error(
                502, f"{len(self.failures)} attempt(s) failed: {detail}", last.reason
            )

    # ------------------------------------------------------------------ endings

    def on_timeout(self, kind: int) -> None:
        lb = self.lb
        if kind == DL_BODY:
            self._client_fault(408, "timed out reading the request body", "client_timeout")
        elif kind == DL_FIRST_BYTE:
            msg = f"no response within {lb._first_byte_timeout:g}s"
            self._failed(Failure(504, msg, "first_byte_timeout", retryable=False))
        elif kind == DL_IDLE:
            if self.mode == _WHOLE:
                msg = f"no whole answer within {lb._idle_timeout:g}s"
                self._failed(Failure(504, msg, "idle_timeout", retryable=False))
            elif self.client._write_paused:  # the replica's reading paused for the client
                self._abort("client_stalled", f"read nothing for {lb._idle_timeout:g}s")
            else:
                self._abort("idle_timeout", f"sent nothing for {lb._idle_timeout:g}s mid-response")

    def _abort(self, reason: str, message: str) -> None:
        """Fail after the response headers went out: cut the client's connection, so it sees
        a truncated answer rather than one that looks complete."""
        lb = self.lb
        lb._aborted += 1
        lb._count_reason(reason)
        if self.rid is not None and reason not in CLIENT_FAULTS:
            target = self.target.decode("latin-1")
            lb._warn(self.rid, f"failed mid-response on {target}: {message}")
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()
        self._flush()
        self._finish(False)

    def too_large(self, size: int | None) -> None:
        got = f"{size} bytes" if size is not None else "more"
        msg = f"request body too large: {got}, limit {self.lb._max_body} bytes"
        self._client_fault(413, msg, "body_too_large")

    def bad_body(self, detail: str) -> None:
        msg = f"malformed request body: {detail}" if self.streamed else detail
        self._client_fault(400, msg, "bad_request")

    def internal_error(self) -> None:
        self._client_fault(502, "internal proxy error", "internal")

    def _client_fault(self, status: int, message: str, reason: str) -> None:
        if self.started:
            self._abort(reason, message)
            return
        conn, self.conn = self.conn, None
        self.streaming_to = None
        if conn is not None:
            conn.abort()
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self._release()
        self.respond_error(status, message, reason, close=True)

    def respond_error(
        self, status: int, message: str, reason: str, *, close: bool = False, extra: bytes = b""
    ) -> None:
        """Answer with a JSON error generated by the balancer (counted in ``errors`` when 5xx,
        and by ``reason`` always)."""
        if self.done:
            return
        lb = self.lb
        if status >= 500:
            lb._errors += 1
        lb._count_reason(reason)
        close = close or not self.keep_alive or self.body_open or lb._stopping
        self.client.write(error_response(status, message, lb._name, close=close, extra=extra))
        self._record(status)
        self._finish(not close)

    def _record(self, status: int) -> None:
        self.started = True
        self.lb._record(status, time.monotonic() - self.t0)

    def _release(self) -> None:
        rid, self.rid = self.rid, None
        if rid is not None:
            if self.stream_counted:
                self.stream_counted = False
                self.lb._stream_ended(rid)
            self.lb._release(rid)

    def _finish(self, keep_alive: bool) -> None:
        if self.done:
            return
        self.done = True
        self._release()
        self.client.exchange_done(self, keep_alive, self.body_open)

    def client_lost(self) -> None:
        """The client went away: give everything back, cancel the replica's work."""
        if self.done:
            return
        self.done = True
        lb = self.lb
        lb._client_gone += 1
        if not self.started:
            lb._count_code(499)  # nginx's "client closed request"
        if self.task is not None:
            self.task.cancel()
            self.task = None
        conn, self.conn = self.conn, None
        if conn is not None:
            if self.mode == _SPLICE:
                conn.close()
            else:
                conn.abort()
        self._release()
