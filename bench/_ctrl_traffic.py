"""Traffic helpers for the failure-detection scenario of ``bench/controller.py``.

Why a listener on the dead replica's port: once a replica is killed, a request the balancer still
routes to it fails on connect and is retried on another replica, so the client sees a success and
cannot tell it was ever misrouted. To *see* those requests, the benchmark binds the dead
replica's port right after the kill and records every request that arrives there, then closes the
connection without an answer. For the balancer that is the same kind of failure as a refused
connection (both are "unreachable", both retried), so the measurement does not change what it
measures. Blind spots, stated so the numbers are read right: requests in the ~millisecond between
the kill and the bind are refused and not seen, and a request sent on a pooled keep-alive
connection the kill just reset fails without reaching the listener.

One more thing the listener shows: each misrouted GET arrives *twice*. aiohttp (3.14, the
balancer's client) retries an idempotent request once on the same connection target after
``ServerDisconnectedError``/``ClientOSError``, before the balancer's own retry moves on to another
replica. So the benchmark reports both the attempts and the distinct requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Reply:
    """One request of the stream as the client saw it."""

    sent: float  # perf_counter
    seconds: float
    status: int | None  # None: no HTTP answer at all
    pid: int | None  # the replica that answered (examples/app.py puts its pid in the body)
    error: str | None


class RequestStream:
    """GET ``/bench/<seq>`` through the balancer at a steady total rate.

    ``connections`` keep-alive connections, each sequential and paced at ``rate/connections``,
    their schedules interleaved: one sequential connection cannot reach ~200 req/s on a loaded
    2-core machine (each exchange costs several ms of CPU on both sides), a few can, and with
    least_load the balancer still rotates every replica through the stream. Each worker is
    bounded by ``max_seconds`` whatever happens to the caller.
    """

    def __init__(
        self, url: str, rate: float = 200.0, max_seconds: float = 10.0, connections: int = 4
    ) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.rate = rate
        self.connections = connections
        self.max_seconds = max_seconds
        self.replies: list[Reply] = []  # appended from every worker (list.append is atomic)
        self.started: float | None = None
        self.stopped: float | None = None
        self._halt = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), name=f"bench-stream-{i}", daemon=True)
            for i in range(connections)
        ]

    def start(self) -> None:
        self.started = time.perf_counter()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._halt.set()
        for t in self._threads:
            t.join(timeout=5.0)
        self.stopped = time.perf_counter()

    def achieved_rate(self) -> float:
        if self.started is None or self.stopped is None or self.stopped <= self.started:
            return 0.0
        return len(self.replies) / (self.stopped - self.started)

    def _worker(self, index: int) -> None:
        assert self.started is not None
        interval = self.connections / self.rate
        conn = http.client.HTTPConnection(self.host, self.port, timeout=2.0)
        end = self.started + self.max_seconds
        next_at = self.started + index * interval / self.connections
        seq = index
        try:
            while not self._halt.is_set():
                now = time.perf_counter()
                if now >= end:
                    break
                if next_at > now:
                    time.sleep(next_at - now)
                sent = time.perf_counter()
                status: int | None = None
                pid: int | None = None
                error: str | None = None
                try:
                    conn.request("GET", f"/bench/{seq}")
                    response = conn.getresponse()
                    body = response.read()
                    status = response.status
                    if status == 200:
                        pid = int(json.loads(body)["pid"])
                    else:
                        error = body[:200].decode(errors="replace")
                except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                    error = repr(exc)
                    conn.close()
                    conn = http.client.HTTPConnection(self.host, self.port, timeout=2.0)
                self.replies.append(Reply(sent, time.perf_counter() - sent, status, pid, error))
                seq += self.connections
                next_at += interval
                # Late (a slow request): carry on from now rather than bursting to catch up.
                next_at = max(next_at, time.perf_counter() - interval)
        finally:
            conn.close()


class DeadPortListener(threading.Thread):
    """Takes over a just-killed replica's port and records the requests that still arrive.

    Start it right before the kill: it retries ``bind`` every millisecond (for at most
    ``bind_timeout`` seconds) until the dead process's socket is gone.
    """

    def __init__(self, port: int, max_seconds: float = 12.0, bind_timeout: float = 1.0) -> None:
        super().__init__(name=f"bench-dead-port-{port}", daemon=True)
        self.port = port
        self.max_seconds = max_seconds
        self.bind_timeout = bind_timeout
        self.bound_at: float | None = None  # perf_counter
        self.hits: list[tuple[float, str]] = []  # (perf_counter, request line)
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.perf_counter()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            while not self._halt.is_set() and time.perf_counter() - start < self.bind_timeout:
                try:
                    sock.bind(("127.0.0.1", self.port))
                    sock.listen(128)
                    self.bound_at = time.perf_counter()
                    break
                except OSError:
                    time.sleep(0.001)
            if self.bound_at is None:
                return
            sock.settimeout(0.02)
            end = start + self.max_seconds
            while not self._halt.is_set() and time.perf_counter() < end:
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                arrived = time.perf_counter()
                self.hits.append((arrived, _request_line(conn)))
                conn.close()
        finally:
            sock.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5.0)

    def bench_hits(self) -> list[float]:
        """Arrival times of the stream's requests (the balancer's), not of readiness probes."""
        return [t for t, line in self.hits if " /bench/" in line]

    def bench_requests(self) -> set[str]:
        """The distinct stream requests that arrived (one may arrive more than once if anything
        on the way retries it against the same replica)."""
        return {line for _, line in self.hits if " /bench/" in line}


def _request_line(conn: socket.socket) -> str:
    """The first line of what the peer sent, read for at most 0.2 s."""
    conn.settimeout(0.2)
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data and len(data) < 8192:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0].decode("latin-1")
