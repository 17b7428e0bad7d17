"""The load balancer: a streaming HTTP/1.1 reverse proxy for one service.

It runs inside the daemon's single event loop. The controller tells it which replicas are ready
by calling :meth:`LoadBalancer.set_ready` (in-process, so a replica that stops being ready gets no
new request from the very next one, unlike SkyServe's 20 s sync), and reads load back through
:meth:`LoadBalancer.in_flight`, :meth:`LoadBalancer.wait_drained` and
:meth:`LoadBalancer.request_timestamps`.

Design points, each answering a failure seen in SkyServe (see skyserve-facts.md):

* The request body is read once, before the first attempt, when it fits in
  ``max_buffered_body``; every retry resends those bytes. A retry can therefore never wait for a
  body that an earlier attempt consumed. Bigger bodies are streamed and retried only while not a
  byte of them has been read from the client.
* A retry never goes to a replica this request already tried.
* An answer of at most ``BUFFER_RESPONSE_BYTES`` with a Content-Length, to an idempotent request,
  is read whole before anything goes to the client: a replica killed between writing its headers
  and its body (seen under SIGKILL churn) is then retried like a refused connection instead of
  leaving the client a cut-off answer. Larger or unframed answers (streams, SSE) are relayed as
  they come, and a failure mid-way can only cut the client's connection.
* A refused connection does not use up one of ``max_attempts``: the request provably reached no
  replica, so it may go on to every other ready replica. When several replicas die at once
  (a host lost, a bad deploy), least_load prefers exactly those dead ones (nothing is in flight
  on them) until each has refused once; with the refusals counted, one request could meet three
  dead replicas in a row and get a 502 while a live one was ready (seen in
  tests/chaos/test_balancer_churn.py). A connect *timeout* still counts: it costs
  ``connect_timeout`` per replica, and the client should not wait that long times N.
* The in-flight count of a replica is incremented right before the request is sent and
  decremented in a ``finally`` around the whole exchange, response streaming included, so every
  exit (error, timeout, client gone, cancellation) gives it back exactly once.
* The low-level aiohttp server is used instead of an ``Application``: a proxy needs no router or
  middlewares, and skipping them saves CPU on every request. Handler cancellation is turned on
  so a client that goes away cancels the upstream exchange instead of letting it run to the end.
* Three timeouts instead of one total: ``connect_timeout`` (a dead host), ``first_byte_timeout``
  (a replica that accepted the request but never answers) and ``idle_timeout`` (silence between
  two chunks of a response). A token stream that keeps sending is never cut however long it
  runs, and a model that thinks for a minute before its first token can be allowed to without
  letting a stalled stream hang for as long.
* Limits (``max_header_bytes``, ``max_body_bytes``) and malformed HTTP are answered with a JSON
  4xx and one rate-limited log line, never a traceback: garbage sent to the port (a port
  scanner, TLS to the plain port) must not fill the log or reach a replica.
* Metrics (optional, :class:`~corral.balancer.metrics.BalancerMetrics`) are written on the hot
  path through pre-resolved children; without them the path has one ``is None`` test more.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import itertools
import json
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from yarl import URL

from corral.balancer.headers import request_headers, response_headers
from corral.balancer.metrics import BalancerMetrics, ServiceMetrics
from corral.balancer.policies import make_policy

__all__ = ["LoadBalancer"]

logger = logging.getLogger("corral.balancer")

# Headers aiohttp's client would invent when the client did not send them. A transparent proxy
# must not add them: an invented "Accept-Encoding: gzip" would make the replica compress a body
# the client cannot decode (auto-decompression is off so bytes pass through unchanged), and an
# invented Content-Type would change what the replica sees.
_SKIP_AUTO_HEADERS: Final = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})

# Failures that happen before the replica sent response headers and that say "could not talk to
# this replica": connection refused, reset, closed before answering, connect timeout. Another
# replica may well succeed. A read timeout (SocketTimeoutError) is not among them: the replica
# got the request and may be working on it, so resending could run it twice.
_UNREACHABLE: Final = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
)

# Pooled upstream connections are dropped after this many idle seconds. It is below the idle
# timeout of common Python servers (uvicorn closes after 5 s), so the balancer rarely picks a
# pooled connection the replica is closing at that moment.
_UPSTREAM_KEEPALIVE: Final = 4.0

# aiohttp's own default for the longest request line / header field; also the floor of the limit
# on the replica's response headers, so a small max_header_bytes (meant to protect the balancer
# from clients) does not start rejecting a replica's ordinary Set-Cookie headers.
_DEFAULT_HEADER_BYTES: Final = 8190
# Most header fields in one request (aiohttp's default, stated so the 431 message can say it).
_MAX_HEADERS: Final = 128
# Seconds a client has to send a whole request head (and longest idle keep-alive); above the
# 15 s an aiohttp client keeps a pooled connection, so such a client closes an idle one first.
DEFAULT_HEADER_TIMEOUT: Final = 30.0

# Failure reasons that are the client's doing: they do not count against the replica.
_CLIENT_FAULTS: Final = frozenset({"body_too_large", "bad_request"})
# Failures that say the replica cannot be reached at all (not that it answered badly).
_UNREACHABLE_REASONS: Final = frozenset({"upstream_unreachable", "connect_timeout"})

# Sendable WebSocket close codes; others (1005, 1006, 1015) only describe what happened locally.
_SENDABLE_CLOSE: Final = frozenset(range(1000, 1004)) | frozenset(range(1007, 1012))


def _close_code(code: int | None) -> int:
    if code is not None and (code in _SENDABLE_CLOSE or 3000 <= code <= 4999):
        return code
    return 1000


@dataclass(slots=True)
class _Body:
    """The client's request body as the attempts see it.

    ``data`` is the whole body when it was small enough to buffer (or None when there is none).
    Otherwise ``prefix`` holds what was read before the buffer limit was hit and the rest is still
    in the request stream; ``consumed`` turns True once an attempt reads from that stream, after
    which no other attempt can send the body again.
    """

    data: bytes | None
    streamed: bool = False
    prefix: bytes = b""
    consumed: bool = False
    # set by _stream_body when the client's streamed body broke a rule mid-way; the attempt
    # that was sending it then answers for the client instead of blaming the replica
    too_large: bool = False
    malformed: bool = False

    @property
    def replayable(self) -> bool:
        return not self.consumed


@dataclass(slots=True)
class _Failure:
    """An attempt that ended before any response was sent to the client."""

    status: int
    message: str
    retryable: bool
    reason: str  # a metrics.ERROR_REASONS key
    # the connection was refused: the request reached no replica, and trying another ready
    # replica does not count against max_attempts (see the module docstring)
    refused: bool = False


class _BodyTooLarge(Exception):
    """Raised inside the upload of a streamed body that went past max_body_bytes."""


class _ParseErrorHook(Protocol):
    def __call__(self, request: web.BaseRequest, exc: HttpProcessingError) -> web.Response: ...


class _ProxyProtocol(RequestHandler):
    """aiohttp's per-connection handler, with the balancer answering parse errors.

    aiohttp answers malformed HTTP itself with a plain-text 400 and logs it with a full
    traceback at ERROR level (except a garbage first request, at DEBUG), outside any handler the
    balancer sees. That lets any client flood the log, and the rejection never reaches the
    metrics. Overriding :meth:`handle_error` for the parser's 400 keeps aiohttp's behaviour
    (the response closes the connection) but with the balancer's JSON body, status (431 for
    size limits), counting and rate-limited log line.
    """

    __slots__ = ("_on_parse_error",)
    _on_parse_error: _ParseErrorHook

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status == 400 and isinstance(exc, HttpProcessingError):
            return self._on_parse_error(request, exc)
        return super().handle_error(request, status, exc, message)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # aiohttp's C parser reports broken framing inside a body (a bad chunk size arriving
        # after the headers) by queueing a 400 "message" behind the request being handled,
        # without failing that request's body stream: the handler would wait for the rest of
        # the body until its idle timeout, then answer 408 instead of 400. Fail the stream so
        # the handler answers at once. Read defensively: these are aiohttp internals, and if
        # they change this degrades to the timeout, never to an error.
        messages = getattr(self, "_messages", None)
        if not messages:
            return
        exc = getattr(messages[-1][0], "exc", None)  # only aiohttp's _ErrInfo has .exc
        request = getattr(self, "_current_request", None)
        if isinstance(exc, HttpProcessingError) and request is not None:
            content = request.content
            if not content.is_eof() and content.exception() is None:
                content.set_exception(RequestPayloadError(str(exc.message)))


class _ProxyServer(web.Server):
    """``web.Server`` building :class:`_ProxyProtocol` handlers.

    Keeps its own copy of the handler arguments instead of reading web.Server's private ones.
    """

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *,
        on_parse_error: _ParseErrorHook,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=True, **kwargs)
        self._proxy_loop = asyncio.get_running_loop()
        self._proxy_kwargs = kwargs
        self._on_parse_error = on_parse_error

    def __call__(self) -> RequestHandler:
        protocol = _ProxyProtocol(self, loop=self._proxy_loop, **self._proxy_kwargs)
        protocol._on_parse_error = self._on_parse_error
        return protocol


class LoadBalancer:
    """Reverse proxy for one service; see the module docstring for the design."""

    # Accepted-request timestamps kept for the autoscaler. At most this many are kept, so memory
    # stays bounded (~10 MB) at any rate; the autoscaler can measure up to this/60 req/s over a
    # 60 s window, above what one balancer can serve.
    TIMESTAMP_CAPACITY: Final = 1 << 18
    # ... and only for this many seconds (10x the autoscaler's 60 s window). Without it the
    # deque filled up to its capacity at any rate: at 20 req/s that is 3.6 h of timestamps
    # nobody reads, ~8 MB per service, which bench/soak.py saw as RSS creeping for hours.
    TIMESTAMP_HORIZON: Final = 600.0
    # How long a replica that refused a connection is passed over (unless all are).
    EJECT_SECONDS: Final = 2.0
    # Retry-After on a 503: scale-from-zero or a replacement is expected within seconds.
    RETRY_AFTER_SECONDS: Final = 1
    # stop() lets in-flight requests finish for up to this long before cancelling them.
    STOP_GRACE_SECONDS: Final = 5.0
    # A replica's failures are logged at most once per this many seconds.
    FAILURE_LOG_INTERVAL: Final = 5.0
    # Largest WebSocket message relayed (either way); bigger ones close the socket.
    WS_MAX_MESSAGE: Final = 16 << 20

    def __init__(
        self,
        *,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        policy: str = "least_load",
        ssl_context: ssl.SSLContext | None = None,
        max_attempts: int = 3,
        connect_timeout: float = 5.0,
        first_byte_timeout: float | None = None,
        idle_timeout: float | None = None,
        request_timeout: float | None = None,
        no_replica_wait: float = 0.0,
        max_buffered_body: int = 1 << 20,
        max_body_bytes: int | None = None,
        max_header_bytes: int = _DEFAULT_HEADER_BYTES,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        metrics: BalancerMetrics | None = None,
    ) -> None:
        """Configure; nothing binds until :meth:`start`.

        Timeouts, in seconds:

        * ``connect_timeout``: to open a connection to a replica. A replica that cannot be
          reached is retried on another one (the request never reached it).

        ``max_attempts`` bounds the attempts that may have reached a replica (sent on a
        connection that then broke, or timed out connecting); refused connections are not
        counted, so a request is never failed while an untried ready replica is left.
        * ``first_byte_timeout``: from the request (body included) being sent to the replica's
          response headers; 504, not retried (the replica may be working on it).
        * ``idle_timeout``: longest silence between two chunks of a response once its headers
          are out (the response is then cut, as it cannot become an error any more); also the
          deadline for reading a buffered request body from the client (408).
        * ``request_timeout``: the former single timeout, kept as the default of both
          ``first_byte_timeout`` and ``idle_timeout``; 120 s when neither is given, like
          SkyServe's stream timeout.

        Limits: ``max_header_bytes`` is the longest request line and header field accepted
        (431 beyond); ``max_body_bytes`` the largest request body (413 beyond, whether announced
        by Content-Length or streamed chunked; None = no limit: bodies above
        ``max_buffered_body`` are streamed, not held in memory, so the limit is a policy of the
        service, not a memory guard).

        ``header_timeout``: a client connection that has not sent a whole request line and
        headers this long after connecting, or after its previous response, is closed (a
        slowloris client trickling header bytes, or an idle keep-alive connection).
        """
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")
        default_timeout = request_timeout if request_timeout is not None else 120.0
        first_byte = first_byte_timeout if first_byte_timeout is not None else default_timeout
        idle = idle_timeout if idle_timeout is not None else default_timeout
        if connect_timeout <= 0 or first_byte <= 0 or idle <= 0:
            raise ValueError("connect_timeout, first_byte_timeout and idle_timeout must be > 0")
        if no_replica_wait < 0:
            raise ValueError("no_replica_wait must be >= 0")
        if max_buffered_body < 0:
            raise ValueError("max_buffered_body must be >= 0")
        if max_body_bytes is not None and max_body_bytes < 0:
            raise ValueError("max_body_bytes must be >= 0 or None")
        if max_header_bytes < 256:
            raise ValueError("max_header_bytes must be >= 256")
        if header_timeout <= 0:
            raise ValueError("header_timeout must be > 0")
        self._header_timeout = header_timeout
        self._name = name
        self._host = host
        self._requested_port = port
        self._policy_name = policy
        self._policy = make_policy(policy)  # ValueError on a bad name, before anything binds
        self._ssl_context = ssl_context
        self._scheme = "https" if ssl_context is not None else "http"
        self._max_attempts = max_attempts
        self._connect_timeout = connect_timeout
        self._first_byte_timeout = first_byte
        self._idle_timeout = idle
        self._no_replica_wait = no_replica_wait
        self._max_buffered_body = max_buffered_body
        self._max_body = max_body_bytes
        self._max_header_bytes = max_header_bytes
        self._metrics_owner = metrics
        self._m: ServiceMetrics | None = None  # bound in start(), released in stop()

        # Ready set: id -> base URL without trailing slash; ids kept as a tuple so the common
        # first attempt hands the policy a ready-made sequence.
        self._ready: dict[int, str] = {}
        self._ready_ids: tuple[int, ...] = ()
        self._ready_event = asyncio.Event()  # set while the ready set is non-empty

        self._in_flight: dict[int, int] = {}
        self._total_in_flight = 0
        self._served: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._drained: dict[int, asyncio.Event] = {}

        self._timestamps: deque[float] = deque(maxlen=self.TIMESTAMP_CAPACITY)
        self._requests = 0
        self._errors = 0
        self._error_reasons: dict[str, int] = {}
        self._bad_requests = 0
        self._aborted = 0
        self._client_gone = 0
        self._quiet_until: dict[int, float] = {}  # per replica: failures only counted until then
        # Replicas that refused a connection: passed over for EJECT_SECONDS. A replica whose
        # process died has no requests in flight, so least_load would otherwise prefer it
        # until the controller notices (up to a probe tick).
        self._ejected: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}
        self._parse_log_until = 0.0  # malformed-request log lines: at most one per interval
        self._parse_suppressed = 0

        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._port = 0
        self._owner_thread: int | None = None
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Bind the listener and open the upstream pool; return the bound port."""
        if self._started:
            raise RuntimeError(f"load balancer {self._name!r} already started")
        self._started = True
        self._owner_thread = threading.get_ident()
        connector = aiohttp.TCPConnector(
            limit=0,  # no pool cap: long streams must not make short requests queue
            keepalive_timeout=_UPSTREAM_KEEPALIVE,
        )
        upstream_header_bytes = max(self._max_header_bytes, _DEFAULT_HEADER_BYTES)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # never mix one client's cookies into another's
            max_line_size=upstream_header_bytes,
            max_field_size=upstream_header_bytes,
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=None,
                sock_connect=self._connect_timeout,
                # aiohttp's read timeout is an idle timer, re-armed on every packet and started
                # once the request body is sent: until the headers it is the first-byte timeout;
                # _relay switches it to idle_timeout when they differ. Set on the session so the
                # common request builds no ClientTimeout of its own.
                sock_read=self._first_byte_timeout,
            ),
        )
        if self._metrics_owner is not None:
            self._m = self._metrics_owner.bind(self._name)
            self._publish_replicas()
        server = _ProxyServer(
            self._handle,
            on_parse_error=self._parse_error,
            access_log=None,
            max_line_size=self._max_header_bytes,
            max_field_size=self._max_header_bytes,
            max_headers=_MAX_HEADERS,
            # aiohttp's keep-alive timer is its only header timeout: it closes a connection
            # still waiting for a complete request this long after the connection opened or
            # the last response went out. Its default is an hour: a few hundred slowloris
            # clients would hold that many sockets (and file descriptors) for that long.
            keepalive_timeout=self._header_timeout,
            # The body must reach the replica as the client encoded it: with the server's
            # default, a gzip-encoded request body would be inflated here and forwarded still
            # labelled Content-Encoding: gzip.
            auto_decompress=False,
        )
        runner = web.ServerRunner(server, shutdown_timeout=self.STOP_GRACE_SECONDS)
        try:
            await runner.setup()
            site = web.TCPSite(
                runner, self._host, self._requested_port, ssl_context=self._ssl_context
            )
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self._session.close()
            self._session = None
            if self._m is not None:
                self._m.close()
                self._m = None
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        logger.info("balancer %s listening on %s (policy %s)", self._name, self.url, self._policy)
        return self._port

    async def stop(self) -> None:
        """Close the listener, then the upstream pool. Safe to call twice or before start."""
        if self._stopped:
            return
        self._stopped = True
        runner, self._runner = self._runner, None
        session, self._session = self._session, None
        if runner is not None:
            await runner.cleanup()
        if session is not None:
            await session.close()
        if self._m is not None:
            self._m.close()
            self._m = None
        logger.info("balancer %s stopped", self._name)

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = self._host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self._scheme}://{host}:{self._port}"

    # ------------------------------------------------------------------ controller interface

    def set_ready(self, replicas: Mapping[int, str]) -> None:
        """Replace the ready set; the very next request picks from the new one.

        Replicas that leave keep their in-flight counts until those requests finish, which is
        what :meth:`wait_drained` waits on. The mapping is copied, never kept.
        """
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise RuntimeError("LoadBalancer.set_ready must be called from the event loop thread")
        ready: dict[int, str] = {}
        for rid, base in replicas.items():
            url = URL(base)
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError(
                    f"replica {rid}: base URL must be http(s)://host:port, got {base!r}"
                )
            ready[int(rid)] = str(url).rstrip("/")
        self._ready = ready
        self._ready_ids = tuple(sorted(ready))
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        self._publish_replicas()
        known = set(self._in_flight) | set(self._served) | set(self._failed)
        if self._m is not None:
            known |= set(self._m.replicas)
        for rid in known | set(self._quiet_until):
            self._forget_if_idle(rid)

    def _publish_replicas(self) -> None:
        """Give every ready replica an in-flight series (0 when idle, rather than missing)."""
        m = self._m
        if m is None:
            return
        for rid in self._ready_ids:
            m.replica(rid, _counter_reader(self._in_flight, rid))

    def in_flight(self, replica_id: int | None = None) -> int:
        """Requests in flight to one replica, or to all of them."""
        if replica_id is None:
            return self._total_in_flight
        return self._in_flight.get(replica_id, 0)

    async def wait_drained(self, replica_id: int, timeout: float) -> bool:
        """Wait until the replica has no request in flight; False if ``timeout`` passes first.

        Woken by the decrement that reaches zero, not by polling. The caller should take the
        replica out of the ready set first, or new requests may keep it busy.
        """
        if self._in_flight.get(replica_id, 0) == 0:
            return True
        event = self._drained.get(replica_id)
        if event is None:
            event = self._drained[replica_id] = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return self._in_flight.get(replica_id, 0) == 0
        return True

    def request_timestamps(self, window: float = 60.0) -> list[float]:
        """``time.monotonic()`` of the requests accepted in the last ``window`` seconds, oldest
        first (at most TIMESTAMP_HORIZON seconds are kept)."""
        start = self._window_start(window)
        return list(itertools.islice(self._timestamps, start, None))

    def qps(self, window: float = 60.0) -> float:
        """Accepted requests per second over the last ``window`` seconds (SkyServe's autoscaler
        signal: requests in the last 60 s / 60).

        Capped by TIMESTAMP_CAPACITY / window (about 4.4k req/s over 60 s) when older
        timestamps were already dropped.
        """
        if window <= 0:
            raise ValueError("window must be > 0")
        return (len(self._timestamps) - self._window_start(window)) / window

    def _window_start(self, window: float) -> int:
        """Index of the first timestamp inside the window: a binary search, since timestamps
        are appended in monotonic order; O(log n) even with 2^18 of them kept."""
        return bisect.bisect_left(self._timestamps, time.monotonic() - window)

    def stats(self) -> dict[str, Any]:
        """Counters for status output and tests; a fresh dict, safe to keep or mutate."""
        ids = sorted(set(self._ready) | set(self._in_flight) | set(self._served))
        return {
            "service": self._name,
            "policy": self._policy_name,
            "url": self.url if self._port else None,
            "ready": list(self._ready_ids),
            "requests": self._requests,
            "errors": self._errors,
            "errors_by_reason": dict(self._error_reasons),
            "bad_requests": self._bad_requests,
            "aborted": self._aborted,
            "client_disconnects": self._client_gone,
            "in_flight": self._total_in_flight,
            "replicas": {
                rid: {
                    "ready": rid in self._ready,
                    "in_flight": self._in_flight.get(rid, 0),
                    "served": self._served.get(rid, 0),
                    "failed": self._failed.get(rid, 0),
                }
                for rid in ids
            },
        }

    # ------------------------------------------------------------------ counters

    def _acquire(self, rid: int) -> None:
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._total_in_flight += 1

    def _release(self, rid: int) -> None:
        count = self._in_flight.get(rid, 0)
        if count <= 0:  # would be a bug; never let it go negative
            logger.error("balancer %s: in-flight count of replica %s already 0", self._name, rid)
            return
        self._total_in_flight -= 1
        count -= 1
        self._in_flight[rid] = count
        if count == 0:
            event = self._drained.pop(rid, None)
            if event is not None:
                event.set()
            self._forget_if_idle(rid)

    def _forget_if_idle(self, rid: int) -> None:
        """Drop the counters of a replica that left the ready set and has drained, so a
        long-lived service with replica churn does not accumulate dead entries."""
        if rid not in self._ready and self._in_flight.get(rid, 0) == 0:
            self._in_flight.pop(rid, None)
            self._served.pop(rid, None)
            self._failed.pop(rid, None)
            self._quiet_until.pop(rid, None)
            self._suppressed.pop(rid, None)
            if self._m is not None:
                self._m.forget_replica(rid)

    def _warn(self, rid: int, text: str) -> None:
        """Log a replica failure, at most once per FAILURE_LOG_INTERVAL per replica.

        A dead replica fails every request sent its way until the controller takes it out of the
        ready set; one line per request would flood the balancer log at full load. The next line
        after a quiet period says how many were left out.
        """
        now = time.monotonic()
        if now < self._quiet_until.get(rid, 0.0):
            self._suppressed[rid] = self._suppressed.get(rid, 0) + 1
            return
        self._quiet_until[rid] = now + self.FAILURE_LOG_INTERVAL
        skipped = self._suppressed.pop(rid, 0)
        more = f" ({skipped} more failure(s) not logged)" if skipped else ""
        logger.warning("balancer %s: replica %s: %s%s", self._name, rid, text, more)

    # ------------------------------------------------------------------ request handling

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.monotonic()
        self._requests += 1
        stamps = self._timestamps
        stamps.append(t0)
        horizon = t0 - self.TIMESTAMP_HORIZON
        while stamps[0] < horizon:  # amortized O(1): each timestamp leaves once
            stamps.popleft()
        m = self._m
        try:
            if request.method == "CONNECT":
                response: web.StreamResponse = self._error(
                    405, "CONNECT is not supported by a reverse proxy", "bad_request"
                )
            else:
                path = _path_qs(request)
                if _is_websocket(request):
                    response = await self._proxy_websocket(request, path, t0)
                else:
                    response = await self._proxy_http(request, path, t0)
        except asyncio.CancelledError:
            self._client_gone += 1
            if m is not None and request.writer.output_size == 0:
                m.response(499, None)  # nginx's "client closed request"
            raise
        except Exception:
            # Reached only through a bug: every expected failure is answered where it happens.
            # The client gets a clean 502 (or a closed connection if the response had started),
            # never a traceback.
            logger.exception("balancer %s: unexpected error on %s", self._name, request.path)
            if request.writer.output_size > 0:
                _close_client(request)
                self._count_error("internal")
                return web.StreamResponse()
            response = self._error(502, "internal proxy error", "internal")
        # A relayed response was counted when its headers went out (_relay / websocket); a
        # response built here (errors) goes out right after this return.
        if m is not None and not response.prepared:
            m.response(response.status, time.monotonic() - t0)
        return response

    def _count_error(self, reason: str) -> None:
        self._error_reasons[reason] = self._error_reasons.get(reason, 0) + 1
        if self._m is not None:
            self._m.error(reason)

    def _error(
        self,
        status: int,
        message: str,
        reason: str,
        headers: Mapping[str, str] | None = None,
    ) -> web.Response:
        """A JSON error generated by the balancer itself (counted in ``errors`` when 5xx, and
        by ``reason`` always)."""
        if status >= 500:
            self._errors += 1
        self._count_error(reason)
        body = json.dumps({"error": message, "service": self._name})
        return web.Response(
            status=status, text=body, content_type="application/json", headers=headers
        )

    def _no_ready(self) -> web.Response:
        return self._error(
            503,
            "no ready replicas",
            "no_replica",
            headers={"Retry-After": str(self.RETRY_AFTER_SECONDS)},
        )

    def _too_large(self, size: int | None) -> web.Response:
        """413 for a body above max_body_bytes, closing the connection after it. Nothing of the
        body goes further; aiohttp reads and drops what the client is still sending for at most
        its lingering time (10 s) before closing, so the client reads the 413 rather than a
        connection reset."""
        got = f"{size} bytes" if size is not None else "more"
        resp = self._error(
            413,
            f"request body too large: {got}, limit {self._max_body} bytes",
            "body_too_large",
        )
        resp.force_close()
        return resp

    def _body_error(self, request: web.BaseRequest, message: str) -> web.Response:
        """400 for a request body whose framing broke mid-way; the connection is closed.

        The failed body stream is marked finished first: otherwise aiohttp, seeing an unread
        body after the handler, tries to drain it ("lingering close"), meets the stored
        parse error again and logs it with a traceback.
        """
        with contextlib.suppress(Exception):
            request.content.feed_eof()
        resp = self._error(400, message, "bad_request")
        resp.force_close()
        return resp

    def _parse_error(self, request: web.BaseRequest, exc: HttpProcessingError) -> web.Response:
        """Answer a request aiohttp's parser rejected (see :class:`_ProxyProtocol`)."""
        self._bad_requests += 1
        too_big = isinstance(exc, LineTooLong) or "too many headers" in exc.message.lower()
        status, reason = (431, "header_too_large") if too_big else (400, "bad_request")
        detail = " ".join(str(exc.message).split())[:200]  # one line, bounded
        now = time.monotonic()
        if now >= self._parse_log_until:
            self._parse_log_until = now + self.FAILURE_LOG_INTERVAL
            skipped, self._parse_suppressed = self._parse_suppressed, 0
            more = f" ({skipped} more not logged)" if skipped else ""
            logger.info(
                "balancer %s: rejected malformed request from %s with %d: %s%s",
                self._name,
                request.remote,
                status,
                detail,
                more,
            )
        else:
            self._parse_suppressed += 1
        if too_big:
            message = (
                f"request line or header too large (limits: {self._max_header_bytes} bytes "
                f"per line, {_MAX_HEADERS} header fields)"
            )
        else:
            message = f"malformed HTTP request: {detail}"
        resp = self._error(status, message, reason)
        resp.force_close()
        if self._m is not None:
            self._m.response(status, None)
        return resp

    async def _read_body(self, request: web.BaseRequest) -> _Body | web.Response:
        """Read the body once, up to ``max_buffered_body``, so any attempt can resend it."""
        if not request.body_exists:
            return _Body(data=None)
        length = request.content_length
        max_body = self._max_body
        if max_body is not None and length is not None and length > max_body:
            # Before any "100 Continue": a client that asked first never sends the body.
            return self._too_large(length)
        if (
            request.version >= aiohttp.HttpVersion11
            and request.headers.get("Expect", "").lower() == "100-continue"
        ):
            # The low-level server does not answer Expect itself; without this, clients like
            # curl pause before sending the body.
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        limit = self._max_buffered_body
        if length is not None and length > limit:
            return _Body(data=None, streamed=True)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._idle_timeout):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    if max_body is not None and size > max_body:
                        return self._too_large(None)
                    if size > limit:
                        return _Body(data=None, streamed=True, prefix=b"".join(chunks))
        except TimeoutError:
            resp = self._error(408, "timed out reading the request body", "client_timeout")
            resp.force_close()
            return resp
        except (
            aiohttp.ClientError,
            ConnectionError,
            ValueError,
            RequestPayloadError,
            HttpProcessingError,
        ) as exc:
            # RequestPayloadError / HttpProcessingError: broken chunked framing or a length
            # mismatch, found by the parser after the handler started (a later packet).
            return self._body_error(request, f"could not read the request body: {exc}")
        return _Body(data=b"".join(chunks))

    async def _stream_body(self, request: web.BaseRequest, body: _Body) -> AsyncIterator[bytes]:
        """A large body for one attempt: what was read already, then the rest from the client.

        Enforces max_body_bytes on chunked bodies as they flow (a Content-Length body was
        checked up front and the parser holds it to its length).
        """
        body.consumed = True
        max_body = self._max_body
        size = len(body.prefix)
        if body.prefix:
            yield body.prefix
        while True:
            try:
                chunk = await request.content.readany()
            except (RequestPayloadError, HttpProcessingError):
                body.malformed = True
                raise
            if not chunk:
                return
            size += len(chunk)
            if max_body is not None and size > max_body:
                body.too_large = True
                raise _BodyTooLarge()
            yield chunk

    async def _pick(self, tried: Sequence[int]) -> int | None:
        """Choose a replica not tried yet; None when there is none.

        Only the first attempt waits (``no_replica_wait``) for a replica to appear: a retry
        found the set non-empty a moment ago and should fail fast rather than hold the client.
        """
        if not tried:
            if not self._ready_ids and self._no_replica_wait > 0:
                await self._wait_for_ready(self._no_replica_wait)
            if not self._ready_ids:
                return None
            return self._policy.select(self._healthy(self._ready_ids), self._in_flight)
        candidates = [rid for rid in self._ready_ids if rid not in tried]
        if not candidates:
            return None
        return self._policy.select(self._healthy(candidates), self._in_flight)

    def _healthy(self, candidates: Sequence[int]) -> Sequence[int]:
        """Candidates minus recently unreachable ones (all of them if every one is)."""
        if not self._ejected:
            return candidates
        now = time.monotonic()
        for rid, until in list(self._ejected.items()):
            if until <= now:
                del self._ejected[rid]
        healthy = [rid for rid in candidates if rid not in self._ejected]
        return healthy or candidates

    async def _wait_for_ready(self, wait: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # A loop, not one wait: the set may become non-empty and empty again before this
        # task runs, and then the event has been cleared.
        while not self._ready_ids:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                async with asyncio.timeout(remaining):
                    await self._ready_event.wait()
            except TimeoutError:
                return

    async def _proxy_http(
        self, request: web.BaseRequest, path: str, t0: float
    ) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        headers = request_headers(
            request.headers,
            peer=request.remote,
            scheme=self._scheme,
            keep_content_length=body.streamed,
        )
        tried: list[int] = []
        counted = 0  # attempts against max_attempts: every one but a refused connection
        failures: list[str] = []
        last: _Failure | None = None
        while counted < self._max_attempts:
            rid = await self._pick(tried)
            if rid is None:
                break
            if tried and self._m is not None:
                self._m.retry()
            tried.append(rid)
            base = self._ready[rid]
            self._acquire(rid)
            try:
                outcome = await self._attempt(request, rid, base + path, headers, body, t0)
                if isinstance(outcome, _Failure) and outcome.reason not in _CLIENT_FAULTS:
                    # counted before the release, which may forget a replica that has left
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    self._warn(rid, f"{request.method} {request.path} failed: {outcome.message}")
            finally:
                self._release(rid)
            if not isinstance(outcome, _Failure):
                return outcome
            if not outcome.refused:
                counted += 1
            if outcome.reason in _UNREACHABLE_REASONS:
                self._ejected[rid] = time.monotonic() + self.EJECT_SECONDS
            if outcome.reason == "body_too_large":
                return self._too_large(None)
            if outcome.reason == "bad_request":
                return self._body_error(request, outcome.message)
            failures.append(f"replica {rid}: {outcome.message}")
            last = outcome
            if not outcome.retryable:
                break
        if last is None:
            return self._no_ready()
        detail = "; ".join(failures)
        if last.status == 504:
            return self._error(504, f"upstream timed out: {detail}", last.reason)
        return self._error(502, f"{len(failures)} attempt(s) failed: {detail}", last.reason)

    async def _attempt(
        self,
        request: web.BaseRequest,
        rid: int,
        url: str,
        headers: Mapping[str, str],
        body: _Body,
        t0: float,
    ) -> web.StreamResponse | _Failure:
        """Send the request to one replica and relay its response.

        Returns a _Failure only while nothing has been sent to the client yet; once the
        response headers are out, every outcome is a (possibly aborted) response.
        """
        session = self._session
        if session is None:
            return _Failure(503, "balancer is stopped", retryable=False, reason="stopped")
        data: bytes | AsyncIterator[bytes] | None
        data = self._stream_body(request, body) if body.streamed else body.data
        try:
            upstream = await session.request(
                request.method,
                URL(url, encoded=True),
                headers=headers,
                data=data,
                allow_redirects=False,
                skip_auto_headers=_SKIP_AUTO_HEADERS,
            )
        except Exception as exc:
            return self._classify(exc, body)
        self._served[rid] = self._served.get(rid, 0) + 1
        try:
            if _bufferable(request, upstream, body):
                return await self._relay_whole(upstream)
            return await self._relay(request, rid, upstream, t0)
        finally:
            # Returns the connection to the pool only if the body was read to the end;
            # otherwise aiohttp closes it, so a half-read response never gets reused.
            upstream.release()

    def _classify(self, exc: Exception, body: _Body) -> _Failure:
        """What an exception from sending a request (before any response header) means."""
        if body.too_large:
            return _Failure(413, "request body too large", retryable=False, reason="body_too_large")
        if body.malformed:
            cause = exc.__cause__ if exc.__cause__ is not None else exc  # aiohttp wraps it
            detail = " ".join(_describe(cause).split())
            return _Failure(400, f"malformed request body: {detail}", False, reason="bad_request")
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return _Failure(
                504,
                f"could not connect within {self._connect_timeout:g}s",
                retryable=body.replayable,
                reason="connect_timeout",
            )
        if isinstance(exc, aiohttp.SocketTimeoutError):
            return _Failure(
                504,
                f"no response within {self._first_byte_timeout:g}s",
                retryable=False,
                reason="first_byte_timeout",
            )
        if isinstance(exc, _UNREACHABLE):
            message = _describe(exc)
            if not body.replayable:
                message += " (request body already streamed, not retried)"
            return _Failure(
                502,
                message,
                retryable=body.replayable,
                reason="upstream_unreachable",
                refused=_refused(exc),
            )
        if isinstance(exc, (TimeoutError, aiohttp.ClientError)):
            return _Failure(502, _describe(exc), retryable=False, reason="upstream_error")
        raise exc

    async def _relay_whole(self, upstream: aiohttp.ClientResponse) -> web.Response | _Failure:
        """Read a small answer to an idempotent request whole, then send it.

        A replica killed between writing its headers and its body would otherwise leave the
        client with a cut-off answer that nothing can retry (the headers are out). Read first,
        a broken body is a _Failure like a refused connection, and the request goes to another
        replica: safe, because repeating an idempotent request is harmless by definition. Costs
        one body's time to first byte, which for a body of at most BUFFER_RESPONSE_BYTES on
        loopback is noise; streams (no Content-Length, or larger) are relayed as they come.
        """
        try:
            data = await upstream.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            upstream.close()
            if isinstance(exc, TimeoutError):
                return _Failure(
                    504,
                    f"no whole answer within {self._idle_timeout:g}s",
                    retryable=False,
                    reason="idle_timeout",
                )
            return _Failure(
                502,
                f"failed mid-response: {_describe(exc)}",
                retryable=True,
                reason="upstream_aborted",
            )
        headers = response_headers(upstream.headers)
        headers.popall("Content-Length", None)
        # Not prepared yet: _handle counts it in the metrics as it goes out.
        return web.Response(
            status=upstream.status, reason=upstream.reason, headers=headers, body=data
        )

    async def _relay(
        self, request: web.BaseRequest, rid: int, upstream: aiohttp.ClientResponse, t0: float
    ) -> web.StreamResponse:
        """Stream the replica's response to the client chunk by chunk, flushing each one."""
        content = upstream.content
        if self._idle_timeout != self._first_byte_timeout and not content.is_eof():
            # Switch aiohttp's read timer from the first-byte to the idle timeout for the rest
            # of this response (it is re-armed with the new value on every packet). Skipped
            # when the body is already complete: the timer is off then, and re-arming it would
            # let it fire on the idle pooled connection.
            connection = upstream.connection
            protocol = connection.protocol if connection is not None else None
            if protocol is not None:
                protocol.read_timeout = self._idle_timeout
                protocol.start_timeout()
        out = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=response_headers(upstream.headers),
        )
        try:
            await out.prepare(request)
        except ConnectionError:
            self._client_gone += 1
            upstream.close()
            return out
        if self._m is not None:
            self._m.response(upstream.status, time.monotonic() - t0)
        while True:
            try:
                chunk = await content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # Headers are out, a 5xx is impossible: cut the client connection so it sees
                # a truncated response rather than one that looks complete.
                self._aborted += 1
                timed_out = isinstance(exc, TimeoutError)  # SocketTimeoutError is one
                self._count_error("idle_timeout" if timed_out else "upstream_aborted")
                self._warn(rid, f"failed mid-response on {request.path}: {_describe(exc)}")
                upstream.close()
                _close_client(request)
                return out
            if not chunk:
                break
            try:
                await out.write(chunk)
            except ConnectionError:
                self._client_gone += 1
                upstream.close()
                return out
        try:
            await out.write_eof()
        except ConnectionError:
            self._client_gone += 1
        return out

    # ------------------------------------------------------------------ websockets

    async def _proxy_websocket(
        self, request: web.BaseRequest, path: str, t0: float
    ) -> web.StreamResponse:
        """Relay a WebSocket: handshake with a replica first (retrying unreachable ones),
        then accept the client and pump messages both ways until either side closes."""
        session = self._session
        if session is None:
            return self._error(503, "balancer is stopped", "stopped")
        headers = request_headers(
            request.headers, peer=request.remote, scheme=self._scheme, keep_content_length=False
        )
        for key in (
            "Sec-WebSocket-Key",
            "Sec-WebSocket-Version",
            "Sec-WebSocket-Extensions",
            "Sec-WebSocket-Protocol",
        ):
            headers.popall(key, None)
        protocols = tuple(
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        )
        tried: list[int] = []
        counted = 0  # as in _proxy_http: a refused connection does not count
        failures: list[str] = []
        while counted < self._max_attempts:
            rid = await self._pick(tried)
            if rid is None:
                break
            if tried and self._m is not None:
                self._m.retry()
            tried.append(rid)
            self._acquire(rid)
            try:
                try:
                    upstream = await session.ws_connect(
                        URL(self._ready[rid] + path, encoded=True),
                        headers=headers,
                        protocols=protocols,
                        max_msg_size=self.WS_MAX_MESSAGE,
                        timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=10.0),
                    )
                except (*_UNREACHABLE, aiohttp.ConnectionTimeoutError) as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    failures.append(f"replica {rid}: {_describe(exc)}")
                    if not _refused(exc):
                        counted += 1
                    continue
                except aiohttp.WSServerHandshakeError as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    return self._error(
                        502,
                        f"replica {rid} refused the WebSocket upgrade (HTTP {exc.status})",
                        "upstream_error",
                    )
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    return self._error(502, f"replica {rid}: {_describe(exc)}", "upstream_error")
                self._served[rid] = self._served.get(rid, 0) + 1
                try:
                    client = web.WebSocketResponse(
                        protocols=(upstream.protocol,) if upstream.protocol else (),
                        max_msg_size=self.WS_MAX_MESSAGE,
                    )
                    await client.prepare(request)
                    if self._m is not None:
                        self._m.response(101, time.monotonic() - t0)
                    await _pump_websockets(client, upstream)
                    return client
                finally:
                    await upstream.close()
            finally:
                self._release(rid)
        if not tried:
            return self._no_ready()
        return self._error(
            502,
            f"{len(failures)} attempt(s) failed: {'; '.join(failures)}",
            "upstream_unreachable",
        )


async def _pump_websockets(
    client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse
) -> None:
    """Copy messages both ways; when one side closes, close the other with the same code."""

    async def copy(
        src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
        dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    ) -> None:
        async for msg in src:
            if msg.type is WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
        await dst.close(code=_close_code(src.close_code))

    tasks = {
        asyncio.ensure_future(copy(client, upstream)),
        asyncio.ensure_future(copy(upstream, client)),
    }
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await client.close()


def _counter_reader(counts: dict[int, int], rid: int) -> Callable[[], float]:
    """A scrape-time reader of one replica's in-flight count (a dict read is atomic under the
    GIL, so a scrape from another thread never sees a half-updated value)."""
    return lambda: counts.get(rid, 0)


def _is_websocket(request: web.BaseRequest) -> bool:
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return False
    connection = request.headers.get("Connection", "").lower()
    return "upgrade" in (token.strip() for token in connection.split(","))


def _path_qs(request: web.BaseRequest) -> str:
    """Path and query exactly as the client sent them (no re-quoting)."""
    raw = request.raw_path
    if raw.startswith("/"):
        return raw
    # absolute-form ("GET http://host/x HTTP/1.1") or asterisk-form: keep only path and query
    rel = request.rel_url.raw_path_qs
    return rel if rel.startswith("/") else "/"


def _close_client(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()


# Answers up to this size to idempotent requests are read whole before they are sent, so a
# replica dying mid-answer is retried on another one (see LoadBalancer._relay_whole).
BUFFER_RESPONSE_BYTES = 256 * 1024
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


def _bufferable(request: web.BaseRequest, upstream: aiohttp.ClientResponse, body: _Body) -> bool:
    length = upstream.content_length
    return (
        request.method in _IDEMPOTENT
        and body.replayable
        and length is not None
        and 0 < length <= BUFFER_RESPONSE_BYTES
        and request.method != "HEAD"
    )


def _refused(exc: BaseException) -> bool:
    """The replica's host answered "nothing listens here" (ECONNREFUSED): the request reached
    no app, and the answer came at once. An unreachable host or a failed DNS lookup is also a
    connector error, but can take seconds each, so those still count against the attempts."""
    if not isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return getattr(exc.os_error, "errno", None) == errno.ECONNREFUSED


def _describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
