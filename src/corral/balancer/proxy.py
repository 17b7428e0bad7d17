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
* The in-flight count of a replica is incremented right before the request is sent and
  decremented in a ``finally`` around the whole exchange, response streaming included, so every
  exit (error, timeout, client gone, cancellation) gives it back exactly once.
* The low-level aiohttp server is used instead of an ``Application``: a proxy needs no router or
  middlewares, and skipping them saves CPU on every request. Handler cancellation is turned on
  so a client that goes away cancels the upstream exchange instead of letting it run to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import WSMsgType, web
from yarl import URL

from corral.balancer.headers import request_headers, response_headers
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
    aiohttp.ConnectionTimeoutError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
)

# Pooled upstream connections are dropped after this many idle seconds. It is below the idle
# timeout of common Python servers (uvicorn closes after 5 s), so the balancer rarely picks a
# pooled connection the replica is closing at that moment.
_UPSTREAM_KEEPALIVE: Final = 4.0

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

    @property
    def replayable(self) -> bool:
        return not self.consumed


@dataclass(slots=True)
class _Failure:
    """An attempt that ended before any response was sent to the client."""

    status: int
    message: str
    retryable: bool


class LoadBalancer:
    """Reverse proxy for one service; see the module docstring for the design."""

    # Accepted-request timestamps kept for the autoscaler. At most this many are kept, so memory
    # stays bounded (~10 MB) at any rate; the autoscaler can measure up to this/60 req/s over a
    # 60 s window, above what one balancer can serve.
    TIMESTAMP_CAPACITY: Final = 1 << 18
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
        request_timeout: float = 120.0,
        no_replica_wait: float = 0.0,
        max_buffered_body: int = 1 << 20,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if connect_timeout <= 0 or request_timeout <= 0:
            raise ValueError("connect_timeout and request_timeout must be > 0")
        if no_replica_wait < 0:
            raise ValueError("no_replica_wait must be >= 0")
        if max_buffered_body < 0:
            raise ValueError("max_buffered_body must be >= 0")
        self._name = name
        self._host = host
        self._requested_port = port
        self._policy_name = policy
        self._policy = make_policy(policy)  # ValueError on a bad name, before anything binds
        self._ssl_context = ssl_context
        self._scheme = "https" if ssl_context is not None else "http"
        self._max_attempts = max_attempts
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._no_replica_wait = no_replica_wait
        self._max_buffered_body = max_buffered_body

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
        self._aborted = 0
        self._client_gone = 0
        self._quiet_until: dict[int, float] = {}  # per replica: failures only counted until then
        self._suppressed: dict[int, int] = {}

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
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # never mix one client's cookies into another's
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=None,
                sock_connect=self._connect_timeout,
                # Longest silence from the replica: before the headers (-> 504) and between
                # two chunks of a stream. An idle limit, not a total one, so a long SSE stream
                # that keeps sending is never cut.
                sock_read=self._request_timeout,
            ),
        )
        server = web.Server(self._handle, handler_cancellation=True, access_log=None)
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
        first."""
        cutoff = time.monotonic() - window
        recent: list[float] = []
        for ts in reversed(self._timestamps):
            if ts < cutoff:
                break
            recent.append(ts)
        recent.reverse()
        return recent

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
        self._requests += 1
        self._timestamps.append(time.monotonic())
        try:
            if request.method == "CONNECT":
                return self._error(405, "CONNECT is not supported by a reverse proxy")
            path = _path_qs(request)
            if _is_websocket(request):
                return await self._proxy_websocket(request, path)
            return await self._proxy_http(request, path)
        except asyncio.CancelledError:
            self._client_gone += 1
            raise
        except Exception:
            # Reached only through a bug: every expected failure is answered where it happens.
            # The client gets a clean 502 (or a closed connection if the response had started),
            # never a traceback.
            logger.exception("balancer %s: unexpected error on %s", self._name, request.path)
            if request.writer.output_size > 0:
                _close_client(request)
                return web.StreamResponse()
            return self._error(502, "internal proxy error")

    def _error(
        self, status: int, message: str, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        """A JSON error generated by the balancer itself (counted in ``errors`` when 5xx)."""
        if status >= 500:
            self._errors += 1
        body = json.dumps({"error": message, "service": self._name})
        return web.Response(
            status=status, text=body, content_type="application/json", headers=headers
        )

    def _no_ready(self) -> web.Response:
        return self._error(
            503, "no ready replicas", headers={"Retry-After": str(self.RETRY_AFTER_SECONDS)}
        )

    async def _read_body(self, request: web.BaseRequest) -> _Body | web.Response:
        """Read the body once, up to ``max_buffered_body``, so any attempt can resend it."""
        if not request.body_exists:
            return _Body(data=None)
        if (
            request.version >= aiohttp.HttpVersion11
            and request.headers.get("Expect", "").lower() == "100-continue"
        ):
            # The low-level server does not answer Expect itself; without this, clients like
            # curl pause before sending the body.
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        limit = self._max_buffered_body
        length = request.content_length
        if length is not None and length > limit:
            return _Body(data=None, streamed=True)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._request_timeout):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        return _Body(data=None, streamed=True, prefix=b"".join(chunks))
        except TimeoutError:
            return self._error(408, "timed out reading the request body")
        except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
            return self._error(400, f"could not read the request body: {exc}")
        return _Body(data=b"".join(chunks))

    async def _stream_body(self, request: web.BaseRequest, body: _Body) -> AsyncIterator[bytes]:
        """A large body for one attempt: what was read already, then the rest from the client."""
        if body.prefix:
            yield body.prefix
        body.consumed = True
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return
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
            return self._policy.select(self._ready_ids, self._in_flight)
        candidates = [rid for rid in self._ready_ids if rid not in tried]
        if not candidates:
            return None
        return self._policy.select(candidates, self._in_flight)

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

    async def _proxy_http(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
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
        failures: list[str] = []
        last: _Failure | None = None
        while len(tried) < self._max_attempts:
            rid = await self._pick(tried)
            if rid is None:
                break
            tried.append(rid)
            base = self._ready[rid]
            self._acquire(rid)
            try:
                outcome = await self._attempt(request, rid, base + path, headers, body)
                if isinstance(outcome, _Failure):
                    # counted before the release, which may forget a replica that has left
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    self._warn(rid, f"{request.method} {request.path} failed: {outcome.message}")
            finally:
                self._release(rid)
            if not isinstance(outcome, _Failure):
                return outcome
            failures.append(f"replica {rid}: {outcome.message}")
            last = outcome
            if not outcome.retryable:
                break
        if last is None:
            return self._no_ready()
        if last.status == 504:
            return self._error(504, f"upstream timed out: {'; '.join(failures)}")
        return self._error(502, f"{len(failures)} attempt(s) failed: {'; '.join(failures)}")

    async def _attempt(
        self,
        request: web.BaseRequest,
        rid: int,
        url: str,
        headers: Mapping[str, str],
        body: _Body,
    ) -> web.StreamResponse | _Failure:
        """Send the request to one replica and relay its response.

        Returns a _Failure only while nothing has been sent to the client yet; once the
        response headers are out, every outcome is a (possibly aborted) response.
        """
        session = self._session
        if session is None:
            return _Failure(503, "balancer is stopped", retryable=False)
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
        except aiohttp.SocketTimeoutError:
            return _Failure(504, f"no response within {self._request_timeout:g}s", retryable=False)
        except _UNREACHABLE as exc:
            message = _describe(exc)
            if not body.replayable:
                message += " (request body already streamed, not retried)"
            return _Failure(502, message, retryable=body.replayable)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _Failure(502, _describe(exc), retryable=False)
        self._served[rid] = self._served.get(rid, 0) + 1
        try:
            return await self._relay(request, rid, upstream)
        finally:
            # Returns the connection to the pool only if the body was read to the end;
            # otherwise aiohttp closes it, so a half-read response never gets reused.
            upstream.release()

    async def _relay(
        self, request: web.BaseRequest, rid: int, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Stream the replica's response to the client chunk by chunk, flushing each one."""
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
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # Headers are out, a 5xx is impossible: cut the client connection so it sees
                # a truncated response rather than one that looks complete.
                self._aborted += 1
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

    async def _proxy_websocket(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        """Relay a WebSocket: handshake with a replica first (retrying unreachable ones),
        then accept the client and pump messages both ways until either side closes."""
        session = self._session
        if session is None:
            return self._error(503, "balancer is stopped")
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
        failures: list[str] = []
        while len(tried) < self._max_attempts:
            rid = await self._pick(tried)
            if rid is None:
                break
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
                except _UNREACHABLE as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    failures.append(f"replica {rid}: {_describe(exc)}")
                    continue
                except aiohttp.WSServerHandshakeError as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    return self._error(
                        502, f"replica {rid} refused the WebSocket upgrade (HTTP {exc.status})"
                    )
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self._failed[rid] = self._failed.get(rid, 0) + 1
                    return self._error(502, f"replica {rid}: {_describe(exc)}")
                self._served[rid] = self._served.get(rid, 0) + 1
                try:
                    client = web.WebSocketResponse(
                        protocols=(upstream.protocol,) if upstream.protocol else (),
                        max_msg_size=self.WS_MAX_MESSAGE,
                    )
                    await client.prepare(request)
                    await _pump_websockets(client, upstream)
                    return client
                finally:
                    await upstream.close()
            finally:
                self._release(rid)
        if not tried:
            return self._no_ready()
        return self._error(502, f"{len(failures)} attempt(s) failed: {'; '.join(failures)}")


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


def _describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
