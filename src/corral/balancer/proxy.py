"""The load balancer: a lean streaming HTTP/1.1 reverse proxy for one service.

The process hosting it (a balancer worker, several per service on one port with
``reuse_port=True``) tells it which replicas are ready by calling :meth:`LoadBalancer.set_ready`,
so a replica that stops being ready gets no new request from the very next one, and reads load
back through :meth:`LoadBalancer.in_flight`, :meth:`LoadBalancer.wait_drained`,
:meth:`LoadBalancer.timestamps_since` and :meth:`LoadBalancer.stats`.

Design points:

* No framework on the hot path: asyncio Protocols on both sides (uvloop's, or the stock loop's),
  httptools to check request heads and parse answers, a keep-alive pool per replica. A request
  makes nginx's syscalls and costs 1.0-1.1x its CPU (docs/benchmarks.md); a long stream goes
  to an epoll set of its own, relayed with no Python per batch (:mod:`corral.balancer.pump`).
* The common request (whole in one read, a pooled connection ready, a plain Content-Length
  answer, or a stream with a head seen before) takes the fast path (:mod:`corral.balancer.fast`,
  :mod:`corral.balancer.fast_stream`): no per-request object. Everything else, and every
  failure of a fast request, is a callback-driven :class:`~corral.balancer.exchange.Exchange`
  (retry rules in its docstring); only connecting and waiting for a replica are coroutines.
* Three timeouts instead of one total: ``connect_timeout`` (a dead host), ``first_byte_timeout``
  (a replica that accepted the request but never answers) and ``idle_timeout`` (silence between
  two chunks of a response). A token stream that keeps sending is never cut however long it
  runs. All deadlines are checked by one ticker per balancer (:mod:`corral.balancer.ticker`,
  asleep until the nearest one) instead of a timer per request.
* Limits (``max_header_bytes``, ``max_body_bytes``) and malformed HTTP are answered with a JSON
  4xx and one rate-limited log line, never a traceback: garbage sent to the port (a port
  scanner, TLS to the plain port) must not fill the log or reach a replica.
* Metrics are plain counters (an int, a dict entry, one bisect per request) read through
  :meth:`LoadBalancer.stats`; :mod:`corral.balancer.metrics` sums several workers' and renders
  Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from corral.balancer.client import ClientConnection
from corral.balancer.counting import Counters
from corral.balancer.fast_state import BalancerSlots
from corral.balancer.gate import HOLD_PATIENCE, Gate
from corral.balancer.load_board import LoadBoard, streams_path
from corral.balancer.policies import EngineLoad
from corral.balancer.pool import Pool
from corral.balancer.pump import close_stream_pump
from corral.balancer.routing import make_policy, shares_load
from corral.balancer.settings import (
    DEFAULT_HEADER_BYTES,
    DEFAULT_HEADER_TIMEOUT,
    check_settings,
    head_limit,
    ticks,
)
from corral.balancer.ticker import Ticker
from corral.balancer.upstream import Target, target_of

__all__ = ["DEFAULT_HEADER_TIMEOUT", "LoadBalancer"]

logger = logging.getLogger("corral.balancer")


class _WritesAfterLoss(logging.Filter):
    """Drops asyncio's and uvloop's "SSL connection is closed": a line for each write past
    the fifth to a TLS client whose connection was lost before its protocol heard of it. A
    client that resets mid-download (any client can) left about ten lines, naming nobody."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "SSL connection is closed"


_QUIET_TLS: Final = _WritesAfterLoss()


class LoadBalancer(BalancerSlots, Counters, Gate, Ticker):
    """Reverse proxy for one service; see the module docstring for the design."""

    # How long a replica that could not be connected to is passed over (unless all are).
    EJECT_SECONDS: Final = 2.0
    # Retry-After on a 503: scale-from-zero or a replacement is expected within seconds.
    RETRY_AFTER_SECONDS: Final = 1
    # stop() lets in-flight requests finish for up to this long before cutting them.
    STOP_GRACE_SECONDS: Final = 5.0

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
        max_header_bytes: int = DEFAULT_HEADER_BYTES,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        reuse_port: bool = False,
        on_drained: Callable[[int], None] | None = None,
        max_connections: int | None = None,
        routing: Mapping[str, Any] | None = None,
        drain_timeout: float = 0.0,
    ) -> None:
        """Configure; nothing binds until :meth:`start`. See :mod:`corral.balancer.settings`."""
        first_byte, idle = check_settings(
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            first_byte_timeout=first_byte_timeout,
            idle_timeout=idle_timeout,
            request_timeout=request_timeout,
            no_replica_wait=no_replica_wait,
            max_buffered_body=max_buffered_body,
            max_body_bytes=max_body_bytes,
            max_header_bytes=max_header_bytes,
            header_timeout=header_timeout,
            max_connections=max_connections,
        )
        self._max_connections = max_connections
        self._name = name
        self._host = host
        self._requested_port = port
        self._policy_name = policy
        self._init_routing(routing or {})
        self._ssl_context = ssl_context
        self._scheme = "https" if ssl_context is not None else "http"
        self._proto_line = b"X-Forwarded-Proto: %b\r\n" % self._scheme.encode()
        self._max_attempts = max_attempts
        self._connect_timeout = connect_timeout
        self._first_byte_timeout = first_byte
        self._idle_timeout = idle
        self._no_replica_wait = no_replica_wait
        self._max_buffered_body = max_buffered_body
        self._max_body, self._max_header_bytes = max_body_bytes, max_header_bytes
        self._head_limit = head_limit(max_header_bytes)
        self._header_timeout = header_timeout
        self._reuse_port, self._on_drained, self._drain = reuse_port, on_drained, drain_timeout
        self._tick_interval, self._tick_cap = ticks(header_timeout, first_byte, idle)
        self._init_state()
        self._init_counters()

    def _init_state(self) -> None:
        """The ready set, in-flight counts and the listener's state: empty until start."""
        # Ready set: id -> Target; ids kept as a sorted tuple for the policy.
        self._ready: dict[int, Target] = {}
        self._ready_ids: tuple[int, ...] = ()
        self._ready_event = asyncio.Event()  # set while the ready set is non-empty
        self._pool = Pool()
        self._client_ssl: ssl.SSLContext | None = None
        self._in_flight: dict[int, int] = {}
        self._drained: dict[int, asyncio.Event] = {}
        # Replicas that could not be connected to: passed over for EJECT_SECONDS. A replica
        # whose process died has no requests in flight, so least_load would otherwise prefer it
        # until the controller notices (up to a probe tick).
        self._ejected: dict[int, float] = {}
        self._clients: set[ClientConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._tick_idle = False  # no client connected at the last tick: IDLE_TICK
        self._next_expire = 0.0
        self._port = 0
        self._owner_thread: int | None = None
        self._started = False
        self._stopping = False
        self._stopped = False

    def _init_routing(self, routing: Mapping[str, Any]) -> None:
        """The policy and the hold (docs/llm.md). ``routing``: ``options`` (the policy's),
        ``max_in_flight_per_replica``, ``hold_timeout`` and ``hold_patience`` (the gate's),
        ``workers`` (how many balancer workers share the service's port, and so its limit),
        ``affinity_file`` (the table of conversations they share,
        :mod:`corral.balancer.affinity`), ``load_file`` and ``slot`` (their counts in flight,
        :mod:`corral.balancer.load_board`, and this worker's row in it)."""
        workers = int(routing.get("workers", 1))
        # Only a policy that weighs load reads the other workers' counts; round robin pays
        # one None test per request's acquire and release.
        board = routing.get("load_file") if shares_load(self._policy_name) else None
        slot = int(routing.get("slot", 0))
        self._hand_over_row = (board, slot, workers)  # where leave_boards counts (load_board)
        self._board = LoadBoard.open(board, slot, workers)
        # Requests whose streamed answer has begun, per replica (no entry at 0, so an empty
        # dict means none: the one test plain HTTP pays), and every worker's on a board.
        self._streaming: dict[int, int] = {}
        self._stream_board = (
            LoadBoard.open(streams_path(board), slot, workers) if board and self._board else None
        )
        if self._board is not None:
            self._board.streams = self._stream_board  # what a choice by load weighs less
        # ValueError on a bad name or option, before anything binds.
        self._policy = make_policy(
            self._policy_name,
            **dict(routing.get("options") or {}),
            affinity_file=routing.get("affinity_file"),
            load_board=self._board,
            streams=self._streaming,
            stream_board=self._stream_board,
            max_in_flight=routing.get("max_in_flight_per_replica"),
        )
        self._init_gate(
            routing.get("max_in_flight_per_replica"),
            float(routing.get("hold_timeout", 30.0)),
            workers,
            float(routing.get("hold_patience", HOLD_PATIENCE)),
        )
        self._engines: dict[int, EngineLoad] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Bind the listener; return the bound port."""
        if self._started:
            raise RuntimeError(f"load balancer {self._name!r} already started")
        self._started = True
        self._owner_thread = threading.get_ident()
        loop = asyncio.get_running_loop()
        if self._ssl_context is not None:
            logging.getLogger("asyncio").addFilter(_QUIET_TLS)  # once: the same filter object
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

    async def stop(
        self, idle_grace: float = 0.0, hand_over: bool = False, heir: LoadBalancer | None = None
    ) -> None:
        """Stop accepting, answer what is already on the way, then close every connection.

        The listener closes only after its accept queue is taken (closing resets it, and with
        SO_REUSEPORT a client cannot know where it landed). Requests on open connections are served,
        each answer saying ``Connection: close``; held ones get a 503 with Retry-After at once.
        ``idle_grace``: how long an idle keep-alive connection may still bring a request (closing at
        once races one being written); a worker or balancer handing over passes one, a service going
        away does not. ``hand_over`` (``heir``: the new balancer in this worker): held requests are
        not refused (``Gate._hand_over_held``), and the boards are the successor's. A stream whose
        head promised keep-alive is idle from its end. After the grace an idle connection gets a
        lingering close (FIN, late bytes read and dropped). What is open after STOP_GRACE_SECONDS,
        or ``drain_timeout`` if longer, is cut. Safe to call twice or before start."""
        if self._stopping:
            return
        self._stopping = True
        if hand_over:
            self.leave_boards()
            self._hand_over_held(max(self.STOP_GRACE_SECONDS, self._drain) / 2, heir)
        else:
            self._answer_held()
        server, self._server = self._server, None
        adopting: list[asyncio.Task[Any]] = []
        if server is not None:
            adopting = self._take_accept_queue(server)
            server.close()
        start = time.monotonic()
        if adopting:
            await asyncio.wait(adopting, timeout=self.STOP_GRACE_SECONDS)
        idle_until = start + idle_grace
        waits = self._no_replica_wait if hand_over else 0.0  # a request held for a first one
        deadline = start + max(self.STOP_GRACE_SECONDS, self._drain, waits)
        while self._clients:
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= idle_until:  # idle ``idle_grace``, since the stop or since its last answer
                for client in list(self._clients):
                    client.close_if_idle(now - idle_grace)
                idle_until = now + 0.25  # not every client every 20 ms for the whole drain
            await asyncio.sleep(0.02)
        self._close_all()
        if server is not None:
            await server.wait_closed()
        logger.info("balancer %s stopped", self._name)

    def _close_all(self) -> None:
        """The end of :meth:`stop`: what is still open is cut, and nothing counts any more."""
        self._stopped = True
        self._leave_heir()
        for client in list(self._clients):
            client.abort()
        self._clients.clear()
        self._pool.close_all()
        close_stream_pump(self)
        for board in (self._board, self._stream_board):
            if board is not None:
                board.clear()  # its requests are over: they count nowhere any more
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None

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

    def listener_inodes(self) -> list[int]:
        """The inodes of its listening sockets: how the daemon tells, from the kernel's socket
        table alone, a listener of this home from another process's on the same port."""
        inodes = []
        for listener in getattr(self._server, "sockets", ()):
            with contextlib.suppress(OSError):
                inodes.append(os.fstat(listener.fileno()).st_ino)
        return inodes

    @property
    def url(self) -> str:
        host = self._host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self._scheme}://{host}:{self._port}"

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
            ready[rid] = old if old is not None and old.base == base else target_of(rid, base)
        for rid, target in self._ready.items():
            if ready.get(rid) is not target:
                target.retired = True
                self._pool.close_target(target)
        self._ready = ready
        self._ready_ids = tuple(sorted(ready))
        if self._board is not None:
            self._board.arrange(self._ready_ids, self._in_flight)
        if self._stream_board is not None:
            self._stream_board.arrange(self._ready_ids, self._streaming)
        self._policy.update(self._ready_ids, self._engines)
        self._readiness(bool(ready))
        known = set(self._in_flight) | set(self._served) | set(self._failed)
        for rid in known | set(self._quiet_until):
            self._forget_if_idle(rid)

    def in_flight(self, replica_id: int | None = None) -> int:
        """Requests in flight to one replica, or to all of them."""
        if replica_id is None:
            return sum(self._in_flight.values())  # a handful of replicas: no running total
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

    # ------------------------------------------------------------------ used by exchanges

    def describe_replicas(self, weights: Mapping[int, float], ids: Mapping[int, int]) -> None:
        """What the route says of the ready replicas besides their URLs: what each serves
        relative to the others (its accelerator's target QPS), for a policy that weighs
        replicas (instance_aware_least_load); and the id users see each by, which the
        balancer's log lines and error answers name it by (not the internal key, which is
        another replica's id in `corral status`). A replica that left keeps its id until it
        has drained: its last failures are still named by it."""
        self._policy.weigh(weights)
        self._shown_ids.update(ids)

    def set_engine_load(self, engines: Mapping[int, EngineLoad]) -> None:
        """What the replicas' engines report of their own load (the worker reads their
        metrics): for a policy that weighs it."""
        self._engines = dict(engines)
        self._policy.update(self._ready_ids, self._engines)

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
        count = self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        if self._board is not None:
            self._board.publish(rid, count)

    def _release(self, rid: int) -> None:
        count = self._in_flight.get(rid, 0)
        if count <= 0:  # would be a bug; never let it go negative
            logger.error("balancer %s: in-flight count of replica %s already 0", self._name, rid)
            return
        count -= 1
        self._in_flight[rid] = count
        if self._board is not None:
            self._board.publish(rid, count)
        if self._held or self._elders:
            self._room_freed()
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
            self._shown_ids.pop(rid, None)
