"""The load balancer: a lean streaming HTTP/1.1 reverse proxy for one service.

The process hosting it (a balancer worker, several per service on one port with
``reuse_port=True``) tells it which replicas are ready by calling :meth:`LoadBalancer.set_ready`,
so a replica that stops being ready gets no new request from the very next one, and reads load
back through :meth:`LoadBalancer.in_flight`, :meth:`LoadBalancer.wait_drained`,
:meth:`LoadBalancer.timestamps_after` and :meth:`LoadBalancer.stats`.

Design points:

* No framework on the hot path: asyncio Protocols on both sides (``loop.create_server`` for
  clients, ``loop.create_connection`` for replicas), httptools (llhttp) to validate request heads
  and parse responses, header blocks passed through as byte strings, a keep-alive pool per
  replica. On uvloop a proxied request costs about what it costs nginx (4 syscalls: one read and
  one write per side), against 8-12x with the aiohttp engine this replaced. It runs on the stock
  asyncio loop too (tests), as nothing here depends on the loop's implementation.
* The common request (whole in one read, a pooled connection ready, a plain Content-Length
  answer) takes the fast path (:mod:`corral.balancer.fast`): no per-request object, about a
  third of the Python work. Everything else, and every failure of a fast request, is a
  callback-driven :class:`~corral.balancer.exchange.Exchange` (retry rules are in its module
  docstring); only connecting and waiting for a first ready replica are coroutines.
* Three timeouts instead of one total: ``connect_timeout`` (a dead host), ``first_byte_timeout``
  (a replica that accepted the request but never answers) and ``idle_timeout`` (silence between
  two chunks of a response). A token stream that keeps sending is never cut however long it
  runs. All deadlines are checked by one ticker per balancer (a few wake-ups a second) instead
  of a timer per request.
* Limits (``max_header_bytes``, ``max_body_bytes``) and malformed HTTP are answered with a JSON
  4xx and one rate-limited log line, never a traceback: garbage sent to the port (a port
  scanner, TLS to the plain port) must not fill the log or reach a replica.
* Metrics are plain counters (an int, a dict entry, one bisect per request) read through
  :meth:`LoadBalancer.stats`; :mod:`corral.balancer.metrics` sums several workers' and renders
  Prometheus text.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from corral.balancer.client import ClientConnection
from corral.balancer.failures import describe, refused
from corral.balancer.metrics import LATENCY_BUCKETS
from corral.balancer.policies import make_policy
from corral.balancer.upstream import Pool, Target

__all__ = ["LoadBalancer"]

logger = logging.getLogger("corral.balancer")

# The longest request line / header field by default (aiohttp's, so the limit did not change).
_DEFAULT_HEADER_BYTES: Final = 8190
# Seconds a client has to send a whole request head (and longest idle keep-alive); above the
# 15 s an aiohttp client keeps a pooled connection, so such a client closes an idle one first.
DEFAULT_HEADER_TIMEOUT: Final = 30.0

# Kept for callers and tests of the previous engine's helpers.
_refused = refused
_describe = describe


class LoadBalancer:
    """Reverse proxy for one service; see the module docstring for the design."""

    # Accepted-request timestamps kept for the autoscaler: at most this many (memory stays
    # bounded, ~10 MB, at any rate) ...
    TIMESTAMP_CAPACITY: Final = 1 << 18
    # ... and only for this many seconds (10x the autoscaler's 60 s window).
    TIMESTAMP_HORIZON: Final = 600.0
    # How long a replica that could not be connected to is passed over (unless all are).
    EJECT_SECONDS: Final = 2.0
    # Retry-After on a 503: scale-from-zero or a replacement is expected within seconds.
    RETRY_AFTER_SECONDS: Final = 1
    # stop() lets in-flight requests finish for up to this long before cutting them.
    STOP_GRACE_SECONDS: Final = 5.0
    # A replica's failures are logged at most once per this many seconds.
    FAILURE_LOG_INTERVAL: Final = 5.0

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
        reuse_port: bool = False,
        on_drained: Callable[[int], None] | None = None,
        max_connections: int | None = None,
    ) -> None:
        """Configure; nothing binds until :meth:`start`.

        Timeouts, in seconds:

        * ``connect_timeout``: to open a connection to a replica. A replica that cannot be
          reached is retried on another one (the request never reached it).
        * ``first_byte_timeout``: from the request (body included) being sent to the replica's
          response headers; 504, not retried (the replica may be working on it).
        * ``idle_timeout``: longest silence between two chunks of a response once its headers
          are out (the response is then cut, as it cannot become an error any more); also the
          deadline for reading a buffered request body from the client (408).
        * ``request_timeout``: the former single timeout, kept as the default of both
          ``first_byte_timeout`` and ``idle_timeout``; 120 s when neither is given.
        * ``header_timeout``: a client connection that has not sent a whole request head this
          long after connecting, or after its previous response, is closed (slowloris, or an
          idle keep-alive connection).

        ``max_attempts`` bounds the attempts that may have reached a replica; refused
        connections are not counted, so a request is never failed while an untried ready
        replica is left. ``max_header_bytes`` is the longest request line and header field
        accepted (431 beyond); ``max_body_bytes`` the largest request body (413 beyond, whether
        announced by Content-Length or streamed chunked; None = no limit: bodies above
        ``max_buffered_body`` are streamed, not held in memory).

        ``max_connections``: client connections this balancer keeps open at once (None: no
        cap); one more is answered 503 and closed at once. Every connection costs a file
        descriptor (two while proxied), and a process's descriptors are shared by all the
        services it serves: without a cap, one service's idle connections could leave none
        for the others.

        ``reuse_port``: bind with SO_REUSEPORT, so several processes serve one port.
        ``on_drained(rid)`` is called on the loop when the in-flight count of a replica that
        is not in the ready set reaches 0.
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
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections must be >= 1 or None")
        self._max_connections = max_connections
        self._name = name
        self._host = host
        self._requested_port = port
        self._policy_name = policy
        self._policy = make_policy(policy)  # ValueError on a bad name, before anything binds
        self._ssl_context = ssl_context
        self._scheme = "https" if ssl_context is not None else "http"
        self._proto_line = b"X-Forwarded-Proto: %b\r\n" % self._scheme.encode()
        self._max_attempts = max_attempts
        self._connect_timeout = connect_timeout
        self._first_byte_timeout = first_byte
        self._idle_timeout = idle
        self._no_replica_wait = no_replica_wait
        self._max_buffered_body = max_buffered_body
        self._max_body = max_body_bytes
        self._max_header_bytes = max_header_bytes
        # Whole request head: every line may be long, but not all of them.
        self._head_limit = max(64 * 1024, 2 * max_header_bytes)
        self._header_timeout = header_timeout
        self._reuse_port = reuse_port
        self._on_drained = on_drained
        # Deadlines are checked this often (a fraction of the shortest timeout).
        self._tick_interval = max(0.01, min(0.1, header_timeout / 4, first_byte / 4, idle / 4))

        # Ready set: id -> Target; ids kept as a sorted tuple for the policy.
        self._ready: dict[int, Target] = {}
        self._ready_ids: tuple[int, ...] = ()
        self._ready_event = asyncio.Event()  # set while the ready set is non-empty
        self._pool = Pool()
        self._client_ssl: ssl.SSLContext | None = None

        self._in_flight: dict[int, int] = {}
        self._total_in_flight = 0
        self._served: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._drained: dict[int, asyncio.Event] = {}

        self._timestamps: deque[float] = deque(maxlen=self.TIMESTAMP_CAPACITY)
        self._requests = 0
        self._errors = 0
        self._error_reasons: dict[str, int] = {}
        self._codes: dict[int, int] = {}
        self._latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._latency_count = 0
        self._retries = 0
        self._bad_requests = 0
        self._aborted = 0
        self._client_gone = 0
        self._quiet_until: dict[int, float] = {}  # per replica: failures only counted until then
        # Replicas that could not be connected to: passed over for EJECT_SECONDS. A replica
        # whose process died has no requests in flight, so least_load would otherwise prefer it
        # until the controller notices (up to a probe tick).
        self._ejected: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}
        self._parse_log_until = 0.0  # malformed-request log lines: at most one per interval
        self._parse_suppressed = 0

        self._clients: set[ClientConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._next_expire = 0.0
        self._port = 0
        self._owner_thread: int | None = None
        self._started = False
        self._stopping = False
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Bind the listener; return the bound port."""
        if self._started:
            raise RuntimeError(f"load balancer {self._name!r} already started")
        self._started = True
        self._owner_thread = threading.get_ident()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ClientConnection(self),
            self._host or None,
            self._requested_port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=min(60.0, self._header_timeout) if self._ssl_context else None,
            reuse_port=self._reuse_port or None,
            backlog=1024,
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        self._tick_handle = loop.call_later(self._tick_interval, self._tick)
        logger.info("balancer %s listening on %s (policy %s)", self._name, self.url, self._policy)
        return self._port

    async def stop(self, idle_grace: float = 0.0) -> None:
        """Stop accepting, answer what is already on the way, then close every connection.

        The listener closes first, but only after the connections the kernel has already
        completed (its accept queue) are taken: closing a listener resets them, and with
        SO_REUSEPORT a client cannot know its connection landed on the one closing. Requests
        on open connections are still served, each answer saying ``Connection: close``.
        ``idle_grace``: how long an idle keep-alive connection is left open for its next
        request (served, then closed by the client's own hand); closing it at once races a
        request the client may be writing that instant, which then meets a reset. A worker
        handing its port to a new one passes a grace; a service going away does not. After
        the grace an idle keep-alive connection gets a lingering close (FIN, then what still
        arrives is read and dropped); a new connection is left to send its first request.
        Whatever is still open after STOP_GRACE_SECONDS is cut. Safe to call twice or before
        start."""
        if self._stopping:
            return
        self._stopping = True
        server, self._server = self._server, None
        adopting: list[asyncio.Task[Any]] = []
        if server is not None:
            adopting = self._take_accept_queue(server)
            server.close()
        start = time.monotonic()
        if adopting:
            await asyncio.wait(adopting, timeout=self.STOP_GRACE_SECONDS)
        idle_until = start + idle_grace
        deadline = start + self.STOP_GRACE_SECONDS
        lingering = False
        while self._clients:
            now = time.monotonic()
            if now >= deadline:
                break
            if not lingering and now >= idle_until:
                lingering = True
                for client in list(self._clients):
                    client.close_if_idle()
            await asyncio.sleep(0.02)
        self._stopped = True
        for client in list(self._clients):
            client.abort()
        self._clients.clear()
        self._pool.close_all()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if server is not None:
            await server.wait_closed()
        logger.info("balancer %s stopped", self._name)

    def _take_accept_queue(self, server: asyncio.AbstractServer) -> list[asyncio.Task[Any]]:
        """Accept, synchronously, every connection already waiting on the listener, right
        before it closes: the window where a new one can land and be reset shrinks from an
        event-loop turn to the microseconds until close()."""
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Any]] = []
        for listener in getattr(server, "sockets", ()):
            loop.remove_reader(listener.fileno())
            with listener.dup() as sock:
                sock.setblocking(False)
                while True:
                    try:
                        conn, _ = sock.accept()
                    except OSError:  # BlockingIOError: the queue is empty
                        break
                    conn.setblocking(False)
                    tasks.append(
                        loop.create_task(
                            loop.connect_accepted_socket(
                                lambda: ClientConnection(self),
                                conn,
                                ssl=self._ssl_context,
                                ssl_handshake_timeout=(
                                    min(60.0, self._header_timeout) if self._ssl_context else None
                                ),
                            )
                        )
                    )
        return tasks

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

    def _tick(self) -> None:
        """Fire passed deadlines; once a second, close expired pooled connections and drop
        request times older than the horizon."""
        now = time.monotonic()
        try:
            for client in list(self._clients):
                deadline = client.deadline
                if deadline and deadline <= now:
                    client.on_timeout()
            if now >= self._next_expire:
                self._next_expire = now + 1.0
                self._pool.expire(now)
                stamps = self._timestamps
                horizon = now - self.TIMESTAMP_HORIZON
                while stamps and stamps[0] < horizon:  # each timestamp leaves once
                    stamps.popleft()
        except Exception:
            logger.exception("balancer %s: error in the deadline ticker", self._name)
        finally:
            if not self._stopped:
                loop = asyncio.get_running_loop()
                self._tick_handle = loop.call_later(self._tick_interval, self._tick)

    def _upstream_ssl(self) -> ssl.SSLContext:
        if self._client_ssl is None:
            self._client_ssl = ssl.create_default_context()
        return self._client_ssl

    # ------------------------------------------------------------------ controller interface

    def set_ready(self, replicas: Mapping[int, str]) -> None:
        """Replace the ready set; the very next request picks from the new one.

        Replicas that leave keep their in-flight counts until those requests finish, which is
        what :meth:`wait_drained` waits on. The mapping is copied, never kept. Event-loop
        thread only.
        """
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise RuntimeError("LoadBalancer.set_ready must be called from the event loop thread")
        ready: dict[int, Target] = {}
        for rid, base in replicas.items():
            rid = int(rid)
            old = self._ready.get(rid)
            base = base.rstrip("/")
            ready[rid] = old if old is not None and old.base == base else _target(rid, base)
        for rid, target in self._ready.items():
            if ready.get(rid) is not target:
                target.retired = True
                self._pool.close_target(target)
        self._ready = ready
        self._ready_ids = tuple(sorted(ready))
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        known = set(self._in_flight) | set(self._served) | set(self._failed)
        for rid in known | set(self._quiet_until):
            self._forget_if_idle(rid)

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
        start = bisect.bisect_left(self._timestamps, time.monotonic() - window)
        return list(itertools.islice(self._timestamps, start, None))

    def timestamps_after(self, t: float) -> list[float]:
        """Accepted-request times strictly after ``t``, oldest first: what a worker reports
        since its last report."""
        start = bisect.bisect_right(self._timestamps, t)
        return list(itertools.islice(self._timestamps, start, None))

    def qps(self, window: float = 60.0) -> float:
        """Accepted requests per second over the last ``window`` seconds."""
        if window <= 0:
            raise ValueError("window must be > 0")
        start = bisect.bisect_left(self._timestamps, time.monotonic() - window)
        return (len(self._timestamps) - start) / window

    def stats(self) -> dict[str, Any]:
        """Counters for status output, metrics and tests; JSON-serialisable (string keys), a
        fresh dict safe to keep or mutate. See :mod:`corral.balancer.metrics`."""
        ids = sorted(set(self._ready) | set(self._in_flight) | set(self._served))
        return {
            "service": self._name,
            "policy": self._policy_name,
            "url": self.url if self._port else None,
            "ready": list(self._ready_ids),
            "requests": self._requests,
            "errors": self._errors,
            "errors_by_reason": dict(self._error_reasons),
            "codes": {str(code): n for code, n in self._codes.items()},
            "latency": {
                "buckets": list(self._latency),
                "sum": self._latency_sum,
                "count": self._latency_count,
            },
            "retries": self._retries,
            "bad_requests": self._bad_requests,
            "aborted": self._aborted,
            "client_disconnects": self._client_gone,
            "in_flight": self._total_in_flight,
            "replicas": {
                str(rid): {
                    "ready": rid in self._ready,
                    "in_flight": self._in_flight.get(rid, 0),
                    "served": self._served.get(rid, 0),
                    "failed": self._failed.get(rid, 0),
                }
                for rid in ids
            },
        }

    # ------------------------------------------------------------------ used by exchanges

    def _count_request(self, t0: float) -> None:
        self._requests += 1
        self._timestamps.append(t0)  # trimmed to the horizon by the ticker, not per request

    def _record(self, status: int, seconds: float) -> None:
        """A response went out (its headers): by code, and its latency."""
        codes = self._codes
        codes[status] = codes.get(status, 0) + 1
        self._latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds
        self._latency_count += 1

    def _count_code(self, status: int) -> None:
        self._codes[status] = self._codes.get(status, 0) + 1

    def _count_reason(self, reason: str) -> None:
        self._error_reasons[reason] = self._error_reasons.get(reason, 0) + 1

    def _rejected(self, peer: bytes, status: int, reason: str, detail: str) -> None:
        """Count and log (rate-limited) a request the parser or a limit rejected."""
        self._bad_requests += 1
        self._count_reason(reason)
        self._count_code(status)
        now = time.monotonic()
        if now < self._parse_log_until:
            self._parse_suppressed += 1
            return
        self._parse_log_until = now + self.FAILURE_LOG_INTERVAL
        skipped, self._parse_suppressed = self._parse_suppressed, 0
        more = f" ({skipped} more not logged)" if skipped else ""
        logger.info(
            "balancer %s: rejected malformed request from %s with %d: %s%s",
            self._name,
            peer.decode("latin-1") or "?",
            status,
            detail or reason,
            more,
        )

    def _pick(self, tried: Sequence[int]) -> int | None:
        """Choose a ready replica not tried yet; None when there is none."""
        ids = self._ready_ids
        if not tried:
            if not ids:
                return None
            return self._policy.select(self._healthy(ids), self._in_flight)
        candidates = [rid for rid in ids if rid not in tried]
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
            if rid not in self._ready:
                self._forget_if_idle(rid)
                if self._on_drained is not None:
                    try:
                        self._on_drained(rid)
                    except Exception:
                        logger.exception("balancer %s: on_drained(%s) failed", self._name, rid)

    def _forget_if_idle(self, rid: int) -> None:
        """Drop the counters of a replica that left the ready set and has drained, so a
        long-lived service with replica churn does not accumulate dead entries."""
        if rid not in self._ready and self._in_flight.get(rid, 0) == 0:
            self._in_flight.pop(rid, None)
            self._served.pop(rid, None)
            self._failed.pop(rid, None)
            self._quiet_until.pop(rid, None)
            self._suppressed.pop(rid, None)

    def _warn(self, rid: int, text: str) -> None:
        """Log a replica failure, at most once per FAILURE_LOG_INTERVAL per replica.

        A dead replica fails every request sent its way until the controller takes it out of the
        ready set; one line per request would flood the log at full load. The next line after a
        quiet period says how many were left out.
        """
        now = time.monotonic()
        if now < self._quiet_until.get(rid, 0.0):
            self._suppressed[rid] = self._suppressed.get(rid, 0) + 1
            return
        self._quiet_until[rid] = now + self.FAILURE_LOG_INTERVAL
        skipped = self._suppressed.pop(rid, 0)
        more = f" ({skipped} more failure(s) not logged)" if skipped else ""
        logger.warning("balancer %s: replica %s: %s%s", self._name, rid, text, more)


def _target(rid: int, base: str) -> Target:
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
