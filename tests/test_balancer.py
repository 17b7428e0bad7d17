"""Tests of corral.balancer against real aiohttp replicas and real HTTP clients on 127.0.0.1.

Every test runs its own event loop through ``run`` with an overall deadline, so a proxy bug that
hangs shows up as a failed test instead of a stuck run. Waits are on events set by the replicas
or the balancer, not on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import hashlib
import logging
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from conftest import make_cert, needs_openssl

from corral.balancer import LoadBalancer, make_policy
from corral.balancer.failures import refused
from corral.balancer.policies import LeastLoad, PowerOfTwo, RoundRobin

T = TypeVar("T")

HOST = "127.0.0.1"


def run(coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
    """Run one test coroutine on a fresh loop, failing it if it takes longer than ``timeout``."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


class Replica:
    """A test replica: an aiohttp server whose behaviour is chosen by the request path."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.requests: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()  # a /hold or /hang request reached the replica
        self.gate = asyncio.Event()  # releases /hold requests
        self.cancelled = asyncio.Event()  # a /hang request was cancelled
        self.sse_ack = asyncio.Event()  # the test got the first SSE event
        self.sse_times: dict[str, float] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> Replica:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path_qs": request.raw_path,
                "headers": list(request.headers.items()),
                "body": body,
            }
        )
        path = request.path
        if path == "/sse":
            return await self._sse(request)
        if path == "/hold":
            self.arrived.set()
            await self.gate.wait()
            return web.Response(text=f"held {self.rid}")
        if path == "/hang":
            self.arrived.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return web.Response(text="too late")
        if path == "/slow":
            await asyncio.sleep(3)
            return web.Response(text="slow")
        if path == "/500":
            return web.Response(status=500, text="replica error")
        if path == "/delay":  # headers after ?s= seconds
            await asyncio.sleep(float(request.query.get("s", "1")))
            return web.Response(text="delayed")
        if path == "/gap":  # headers and a first chunk at once, the rest after ?s= seconds
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            await resp.write(b"first;")
            await asyncio.sleep(float(request.query.get("s", "1")))
            await resp.write(b"second")
            await resp.write_eof()
            return resp
        if path == "/cut-small" and self.rid == 1:  # replica 1 dies mid-answer; others answer
            resp = web.StreamResponse(headers={"Content-Length": "100"})
            await resp.prepare(request)
            await resp.write(b"x" * 10)
            assert request.transport is not None
            request.transport.close()
            return resp
        if path == "/cut-small":
            return web.Response(body=b"y" * 100)
        if path == "/cut":  # larger than the balancer buffers: relayed as it comes, then cut
            resp = web.StreamResponse(headers={"Content-Length": str(1 << 20)})
            await resp.prepare(request)
            await resp.write(b"x" * 10)
            assert request.transport is not None
            request.transport.close()
            return resp
        if path == "/stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            for i in range(100):  # bounded: at most ~5 s
                await resp.write(f"chunk {i}\n".encode())
                await asyncio.sleep(0.05)
            await resp.write_eof()
            return resp
        if path == "/chunks":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for part in (b"a", b"b", b"c"):
                await resp.write(part)
            await resp.write_eof()
            return resp
        if path == "/big":
            return web.Response(body=bytes(range(256)) * 4096)  # 1 MiB
        if path == "/gzip":
            return web.Response(
                body=gzip.compress(b"hello " * 100),
                headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"},
            )
        if path == "/headers":
            return web.Response(
                text="ok",
                headers=[
                    ("X-Resp", "1"),
                    ("Set-Cookie", "a=1"),
                    ("Set-Cookie", "b=2"),
                    ("Connection", "X-Secret"),
                    ("X-Secret", "hidden"),
                    ("Keep-Alive", "timeout=5"),
                ],
            )
        if path == "/ws":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    await ws.send_str(f"{self.rid}:{msg.data}")
            return ws
        return web.json_response(
            {
                "replica": self.rid,
                "method": request.method,
                "path_qs": request.raw_path,
                "body_len": len(body),
                "body_sha": hashlib.sha256(body).hexdigest(),
            }
        )

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        self.sse_times["one"] = time.monotonic()
        # The replica goes on only once the client has the first event. A proxy that buffers
        # never delivers it, so this times out and the stream carries the failure marker.
        try:
            await asyncio.wait_for(self.sse_ack.wait(), 5)
        except TimeoutError:
            await resp.write(b"data: NOT-STREAMED\n\n")
        await asyncio.sleep(0.3)
        await resp.write(b"data: two\n\n")
        self.sse_times["two"] = time.monotonic()
        await asyncio.sleep(0.3)
        await resp.write(b"data: three\n\n")
        self.sse_times["done"] = time.monotonic()
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def cluster(
    n: int, dead: int = 0, **lb_kwargs: Any
) -> AsyncIterator[tuple[LoadBalancer, list[Replica], dict[int, str]]]:
    """``n`` live replicas (ids 1..n), ``dead`` ids pointing at closed ports (ids n+1..), and a
    started balancer with all of them ready."""
    replicas = [await Replica(i + 1).start() for i in range(n)]
    ready = {r.rid: r.url for r in replicas}
    for j in range(dead):
        ready[n + 1 + j] = f"http://{HOST}:{closed_port()}"
    lb = LoadBalancer(name="svc", **lb_kwargs)
    try:
        await lb.start()
        lb.set_ready(ready)
        yield lb, replicas, ready
    finally:
        await lb.stop()
        for r in replicas:
            await r.stop()


async def get_json(
    session: aiohttp.ClientSession, url: str, method: str = "GET", **kw: Any
) -> tuple[int, Any]:
    async with session.request(method, url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def raw_exchange(port: int, request: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send exact request bytes (must say Connection: close) and parse the whole response."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = [(k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:])]
    if any(k.lower() == "transfer-encoding" and "chunked" in v for k, v in headers):
        out = b""
        while True:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out += body[:size]
            body = body[size + 2 :]
        body = out
    return status, headers, body


def header_values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name.lower()]


# ---------------------------------------------------------------------------- policies


def test_make_policy_names() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_load"), LeastLoad)
    assert isinstance(make_policy("power_of_two"), PowerOfTwo)
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")
    with pytest.raises(ValueError):
        LoadBalancer(name="x", policy="nope")


def test_round_robin_rotates_by_id_across_set_changes() -> None:
    rr = RoundRobin()
    assert [rr.select([3, 1, 2], {}) for _ in range(6)] == [1, 2, 3, 1, 2, 3]
    # replica 2 leaves, 5 joins: rotation continues after the last chosen id (3)
    assert [rr.select([1, 3, 5], {}) for _ in range(4)] == [5, 1, 3, 5]


def test_least_load_picks_least_and_rotates_ties() -> None:
    ll = LeastLoad()
    assert ll.select([1, 2, 3], {1: 2, 2: 0, 3: 1}) == 2
    assert [ll.select([1, 2, 3], {}) for _ in range(4)] == [3, 1, 2, 3]
    assert [ll.select([1, 2, 3], {2: 5}) for _ in range(3)] == [1, 3, 1]


def test_power_of_two_prefers_the_less_loaded_of_two() -> None:
    p2 = PowerOfTwo(random.Random(7))
    loads = {1: 10, 2: 0}
    assert all(p2.select([1, 2], loads) == 2 for _ in range(50))
    assert p2.select([4], {}) == 4
    picks = {p2.select([1, 2, 3], {}) for _ in range(200)}
    assert picks == {1, 2, 3}


# ---------------------------------------------------------------------------- spreading


def test_round_robin_alternates_exactly() -> None:
    async def main() -> None:
        async with cluster(3, policy="round_robin") as (lb, _, _), aiohttp.ClientSession() as s:
            seen = [(await get_json(s, lb.url + "/"))[1]["replica"] for _ in range(9)]
            assert seen == [1, 2, 3] * 3
            stats = lb.stats()
            assert stats["requests"] == 9
            # stats() is JSON-serialisable: replica ids are string keys
            assert {rid: st["served"] for rid, st in stats["replicas"].items()} == {
                "1": 3,
                "2": 3,
                "3": 3,
            }

    run(main())


def test_least_load_prefers_idle_replica() -> None:
    async def main() -> None:
        async with cluster(2, policy="least_load") as (lb, reps, _), aiohttp.ClientSession() as s:
            held = asyncio.ensure_future(s.get(lb.url + "/hold"))
            await asyncio.wait_for(reps[0].arrived.wait(), 5)  # ties go to id 1 first
            assert lb.in_flight(1) == 1 and lb.in_flight() == 1
            seen = [(await get_json(s, lb.url + "/"))[1]["replica"] for _ in range(5)]
            assert seen == [2] * 5
            reps[0].gate.set()
            resp = await held
            assert resp.status == 200 and await resp.text() == "held 1"
            resp.release()
            # both idle again: ties rotate, so both get traffic
            seen = [(await get_json(s, lb.url + "/"))[1]["replica"] for _ in range(4)]
            assert set(seen) == {1, 2}

    run(main())


def test_power_of_two_serves_everything() -> None:
    async def main() -> None:
        async with cluster(3, policy="power_of_two") as (lb, reps, _), aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(get_json(s, lb.url + "/") for _ in range(30)))
            assert all(status == 200 for status, _ in results)
            assert sum(len(r.requests) for r in reps) == 30

    run(main())


# ---------------------------------------------------------------------------- proxying


def test_post_body_and_query_string_pass_through() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _reps, _), aiohttp.ClientSession() as s:
            payload = random.Random(1).randbytes(200_000)
            status, echo = await get_json(
                s, lb.url + "/a/b%2Fc?x=1&y=%20z&x=2", method="POST", data=payload
            )
            assert status == 200
            assert echo["method"] == "POST"
            assert echo["path_qs"] == "/a/b%2Fc?x=1&y=%20z&x=2"
            assert echo["body_len"] == len(payload)
            assert echo["body_sha"] == hashlib.sha256(payload).hexdigest()
            # Expect: 100-continue is answered, then the body is proxied
            status, echo = await get_json(
                s, lb.url + "/e", method="POST", data=payload, expect100=True
            )
            assert (status, echo["body_len"]) == (200, len(payload))
            for method in ("PUT", "PATCH", "DELETE", "OPTIONS"):
                status, echo = await get_json(s, lb.url + "/m", method=method, data=b"abc")
                assert (status, echo["method"], echo["body_len"]) == (200, method, 3)
            async with s.head(lb.url + "/big") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Length"] == str(1 << 20)
            async with s.get(lb.url + "/big") as resp:
                assert await resp.read() == bytes(range(256)) * 4096

    run(main())


def test_headers_forwarded_and_hop_by_hop_stripped() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, reps, _ready):
            request = (
                "GET /echo?q=1 HTTP/1.1\r\n"
                f"Host: {HOST}:{lb.port}\r\n"
                "X-Custom: kept\r\n"
                "X-Forwarded-For: 10.0.0.1\r\n"
                "X-Forwarded-Proto: https\r\n"
                "X-Private: per-hop\r\n"
                "Keep-Alive: timeout=5\r\n"
                "TE: trailers\r\n"
                "Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
                "Connection: close, X-Private\r\n"
                "\r\n"
            ).encode()
            status, resp_headers, body = await raw_exchange(lb.port, request)
            assert status == 200, body
            seen = {k.lower(): v for k, v in reps[0].requests[-1]["headers"]}
            assert seen["x-custom"] == "kept"
            assert seen["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
            assert seen["x-forwarded-proto"] == "http"
            assert seen["x-forwarded-host"] == f"{HOST}:{lb.port}"
            assert seen["host"] == f"{HOST}:{reps[0].port}"
            for hop in ("x-private", "keep-alive", "te", "proxy-authorization"):
                assert hop not in seen, hop
            # nothing invented on the client's behalf
            for invented in ("accept-encoding", "user-agent", "accept", "content-type"):
                assert invented not in seen, invented
            assert seen.get("connection", "keep-alive").lower() != "close"

            status, resp_headers, body = await raw_exchange(
                lb.port,
                f"GET /headers HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode(),
            )
            assert status == 200 and body == b"ok"
            assert header_values(resp_headers, "X-Resp") == ["1"]
            assert sorted(header_values(resp_headers, "Set-Cookie")) == ["a=1", "b=2"]
            assert header_values(resp_headers, "X-Secret") == []
            assert header_values(resp_headers, "Keep-Alive") == []

    run(main())


def test_http10_client() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _):
            status, headers, body = await raw_exchange(lb.port, b"GET /big HTTP/1.0\r\n\r\n")
            assert status == 200 and body == bytes(range(256)) * 4096
            # a chunked upstream response reaches an HTTP/1.0 client unchunked, ended by close
            status, headers, body = await raw_exchange(lb.port, b"GET /chunks HTTP/1.0\r\n\r\n")
            assert status == 200 and body == b"abc"
            assert header_values(headers, "Transfer-Encoding") == []

    run(main())


@needs_openssl
def test_https_listener(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "127.0.0.1", "IP:127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def main() -> None:
        async with cluster(1, ssl_context=context) as (lb, reps, _), aiohttp.ClientSession() as s:
            assert lb.url.startswith("https://")
            status, echo = await get_json(s, lb.url + "/tls", ssl=False)
            assert (status, echo["replica"]) == (200, 1)
            seen = {k.lower(): v for k, v in reps[0].requests[-1]["headers"]}
            assert seen["x-forwarded-proto"] == "https"

    run(main())


def test_encoded_bodies_pass_through_unchanged() -> None:
    async def main() -> None:
        async with (
            cluster(1) as (lb, _, _),
            aiohttp.ClientSession(auto_decompress=False) as s,
            s.get(lb.url + "/gzip", headers={"Accept-Encoding": "gzip"}) as resp,
        ):
            raw = await resp.read()
            assert resp.headers["Content-Encoding"] == "gzip"
            assert int(resp.headers["Content-Length"]) == len(raw)
            assert gzip.decompress(raw) == b"hello " * 100

    run(main())


def test_sse_events_arrive_while_replica_still_streaming() -> None:
    async def main() -> None:
        async with (
            cluster(1) as (lb, reps, _),
            aiohttp.ClientSession() as s,
            s.get(lb.url + "/sse") as resp,
        ):
            assert resp.headers["Content-Type"] == "text/event-stream"
            arrivals: dict[str, float] = {}
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                for name in ("one", "two", "three", "NOT-STREAMED"):
                    if f"data: {name}\n\n".encode() in buffer and name not in arrivals:
                        arrivals[name] = time.monotonic()
                        if name == "one":
                            reps[0].sse_ack.set()
        times = reps[0].sse_times
        assert "NOT-STREAMED" not in arrivals, "first event was held back by the proxy"
        assert set(arrivals) == {"one", "two", "three"}
        # the first event came before the replica had even written the second one
        assert arrivals["one"] < times["two"]
        assert arrivals["one"] <= times["done"] - 0.5
        # the second arrived well before the replica finished (0.3 s later)
        assert arrivals["two"] < times["done"] - 0.1

    run(main())


# ---------------------------------------------------------------------------- ready set


def test_set_ready_takes_effect_on_next_request() -> None:
    async def main() -> None:
        async with (
            cluster(2, policy="round_robin") as (lb, reps, ready),
            aiohttp.ClientSession() as s,
        ):
            lb.set_ready({1: ready[1]})
            assert [(await get_json(s, lb.url + "/"))[1]["replica"] for _ in range(3)] == [1] * 3
            lb.set_ready({2: ready[2]})
            before = len(reps[0].requests)
            assert [(await get_json(s, lb.url + "/"))[1]["replica"] for _ in range(3)] == [2] * 3
            assert len(reps[0].requests) == before
            with pytest.raises(ValueError):
                lb.set_ready({3: "ftp://example"})

    run(main())


def test_no_ready_replica_is_503_json() -> None:
    async def main() -> None:
        async with cluster(0) as (lb, _, _), aiohttp.ClientSession() as s:
            async with s.post(lb.url + "/x", data=b"body") as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"]
                assert await resp.json() == {"error": "no ready replicas", "service": "svc"}
            assert lb.stats()["errors"] == 1

    run(main())


def test_no_replica_wait_holds_request_until_a_replica_is_ready() -> None:
    async def main() -> None:
        replica = await Replica(1).start()
        lb = LoadBalancer(name="svc", no_replica_wait=5.0)
        try:
            await lb.start()
            async with aiohttp.ClientSession() as s:
                loop = asyncio.get_running_loop()
                start = loop.time()
                loop.call_later(0.3, lb.set_ready, {1: replica.url})
                status, echo = await get_json(s, lb.url + "/late", method="POST", data=b"payload")
                elapsed = loop.time() - start
                assert status == 200 and echo["replica"] == 1 and echo["body_len"] == 7
                assert 0.25 <= elapsed < 4.0
        finally:
            await lb.stop()
            await replica.stop()

        short = LoadBalancer(name="svc", no_replica_wait=0.2)
        try:
            await short.start()
            async with aiohttp.ClientSession() as s, s.get(short.url + "/") as resp:
                assert resp.status == 503
        finally:
            await short.stop()

    run(main())


# ---------------------------------------------------------------------------- retries


def test_dead_replica_is_retried_elsewhere_once_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="corral.balancer")

    async def main() -> None:
        # replica 2 points at a closed port; round robin picks it first on every request
        async with (
            cluster(1, dead=1, policy="round_robin") as (lb, _reps, _),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(10):
                status, echo = await get_json(s, lb.url + "/")
                assert (status, echo["replica"]) == (200, 1)
            stats = lb.stats()["replicas"]
            # after its first refused connection it is passed over (EJECT_SECONDS), so it
            # fails once, not once per request (9) and never twice per request (18)
            assert stats["2"]["failed"] == 1
            assert stats["1"]["served"] == 10
            # the dead replica's failures are logged once, not once per request
            assert len([r for r in caplog.records if "replica 2" in r.getMessage()]) == 1

        async with cluster(0, dead=2, max_attempts=3) as (lb, _, _), aiohttp.ClientSession() as s:
            async with s.get(lb.url + "/") as resp:
                assert resp.status == 502
                err = await resp.json()
            # two replicas, three attempts allowed: each tried once, then give up
            assert err["error"].startswith("2 attempt(s) failed")
            assert "replica 1" in err["error"] and "replica 2" in err["error"]
            assert "Connect" in err["error"]
            assert {st["failed"] for st in lb.stats()["replicas"].values()} == {1}

    run(main())


def test_post_body_is_resent_on_retry() -> None:
    async def main() -> None:
        payload = b"resend-me " * 5000
        # small buffer limit: the 50 kB body is streamed, yet the dead port fails before a byte
        # was read from the client, so it is still retried
        for limit in (1 << 20, 1024):
            async with (
                cluster(1, dead=2, policy="round_robin", max_buffered_body=limit) as (lb, _reps, _),
                aiohttp.ClientSession() as s,
            ):
                for _ in range(3):
                    status, echo = await get_json(s, lb.url + "/up", method="POST", data=payload)
                    assert status == 200, echo
                    assert echo["body_sha"] == hashlib.sha256(payload).hexdigest()
                assert lb.in_flight() == 0

    run(main())


def test_retry_after_replica_drops_the_connection() -> None:
    async def main() -> None:
        accepted = 0

        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # The replica "crashes" once the request started and, for a big body, once more
            # of it arrived than the balancer could have buffered.
            nonlocal accepted
            accepted += 1
            received = b""
            while b"\r\n\r\n" not in received or len(received) < 20_000:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
                if b"\r\n\r\n" in received and b"Content-Length: 4" in received:
                    break
            writer.transport.abort()

        dropper = await asyncio.start_server(drop, HOST, 0)
        drop_port = dropper.sockets[0].getsockname()[1]
        try:
            async with cluster(1, policy="round_robin") as (lb, reps, ready):
                lb.set_ready({1: ready[1], 0: f"http://{HOST}:{drop_port}"})
                async with aiohttp.ClientSession() as s:
                    # a POST the replica read and dropped may have taken effect: never resent
                    async with s.post(lb.url + "/p", data=b"once") as resp:
                        assert resp.status == 502
                        assert "not retried" in (await resp.json())["error"]
                    assert accepted == 1 and reps[0].requests == []
                    # the same for a PUT (idempotent) goes on to the other replica
                    status, echo = await get_json(s, lb.url + "/p", method="PUT", data=b"once")
                    assert (status, echo["replica"]) == (200, 1)
                    status, echo = await get_json(s, lb.url + "/p", method="PUT", data=b"once")
                    assert (status, echo["replica"], echo["body_len"]) == (200, 1, 4)
                    assert accepted == 2  # not retried on the replica that dropped it
            # a body too big to buffer, already partly streamed to the replica that dropped it,
            # cannot be sent again: 502 instead of a retry with a truncated body
            async with cluster(1, policy="round_robin", max_buffered_body=1024) as (
                lb,
                reps,
                ready,
            ):
                lb.set_ready({1: ready[1], 0: f"http://{HOST}:{drop_port}"})
                async with aiohttp.ClientSession() as s:
                    async with s.post(lb.url + "/p", data=b"z" * 100_000) as resp:
                        assert resp.status == 502
                        assert "not retried" in (await resp.json())["error"]
                    assert accepted == 3 and reps[0].requests == []
                    assert lb.in_flight() == 0
        finally:
            dropper.close()
            await dropper.wait_closed()

    run(main())


def test_timeout_before_headers_is_504_and_not_retried() -> None:
    async def main() -> None:
        async with (
            cluster(2, policy="round_robin", request_timeout=0.3) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.get(lb.url + "/slow") as resp:
                assert resp.status == 504
                assert "timed out" in (await resp.json())["error"]
            assert sum(len(r.requests) for r in reps) == 1
            async with s.get(lb.url + "/500") as resp:
                # a replica's own 5xx is passed through, not retried
                assert (resp.status, await resp.text()) == (500, "replica error")
            assert sum(len(r.requests) for r in reps) == 2

    run(main())


def test_small_answer_cut_mid_body_is_retried_on_another_replica() -> None:
    """A replica killed between its headers and its body: for an idempotent request with a
    small answer nothing was sent yet, so the client gets the whole answer of another replica;
    a POST (not idempotent) is never repeated and gets a 502 instead."""

    async def main() -> None:
        async with (
            cluster(2, policy="round_robin") as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            first = next(r for r in reps if r.rid == 1)

            def hits(rep: Any, method: str) -> int:
                return sum(
                    1
                    for q in rep.requests
                    if q["path_qs"] == "/cut-small" and q["method"] == method
                )

            for _ in range(4):  # round robin: replica 1 gets its turn at least twice
                async with s.get(lb.url + "/cut-small") as resp:
                    assert (resp.status, await resp.read()) == (200, b"y" * 100)
            assert hits(first, "GET") >= 2
            truncated = 0
            for _ in range(2):  # one POST meets replica 1: cut for the client, never repeated
                try:
                    async with s.post(lb.url + "/cut-small", data=b"z") as resp:
                        await resp.read()
                except aiohttp.ClientPayloadError:
                    truncated += 1
            assert truncated == 1
            assert [hits(r, "POST") for r in reps] == [1, 1]
            assert await lb.wait_drained(1, 5) and await lb.wait_drained(2, 5)

    run(main())


def test_failure_mid_response_truncates_client_response() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.get(lb.url + "/cut") as resp:
                    assert resp.status == 200
                    await resp.read()
            assert lb.stats()["aborted"] == 1
            assert await lb.wait_drained(1, 5)

    run(main())


# ---------------------------------------------------------------------------- counters


def test_client_disconnect_cancels_upstream_request() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, reps, _):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with s.get(lb.url + "/hang") as resp:
                        await resp.read()
            await asyncio.wait_for(reps[0].cancelled.wait(), 5)
            assert await lb.wait_drained(1, 5)
            assert lb.in_flight() == 0

    run(main())


def test_in_flight_counters_return_to_zero_after_churn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="corral.balancer")

    async def main() -> dict[str, int]:
        outcomes: dict[str, int] = {}

        async def one(s: aiohttp.ClientSession, kind: str) -> None:
            try:
                if kind == "ok":
                    status, _ = await get_json(s, lb.url + "/")
                    result = str(status)
                elif kind == "post":
                    status, _ = await get_json(s, lb.url + "/", method="POST", data=b"x" * 3000)
                    result = str(status)
                elif kind == "stream_disconnect":
                    async with s.get(lb.url + "/stream") as resp:
                        await resp.content.readline()
                        resp.close()  # drop the connection mid-stream
                    result = "dropped"
                elif kind == "hang":
                    async with s.get(
                        lb.url + "/hang", timeout=aiohttp.ClientTimeout(total=0.2)
                    ) as resp:
                        await resp.read()
                    result = "unexpected"
                else:
                    async with s.get(lb.url + "/" + kind) as resp:
                        await resp.read()
                        result = str(resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                result = type(exc).__name__
            key = f"{kind}:{result}"
            outcomes[key] = outcomes.get(key, 0) + 1

        kinds = ["ok", "post", "500", "cut", "slow", "stream_disconnect", "hang"]
        async with (
            cluster(3, dead=1, request_timeout=0.5, policy="least_load") as (lb, _, ready),
            aiohttp.ClientSession() as s,
        ):
            for round_ in range(3):
                await asyncio.gather(*(one(s, kinds[i % len(kinds)]) for i in range(35)))
                if round_ == 1:  # churn the ready set between rounds
                    lb.set_ready({rid: url for rid, url in ready.items() if rid != 1})
            for rid in ready:
                assert await lb.wait_drained(rid, 5), rid
            assert lb.in_flight() == 0
            stats = lb.stats()
            assert all(st["in_flight"] == 0 for st in stats["replicas"].values())
            assert stats["requests"] == 105
            assert stats["errors"] == outcomes["slow:504"]
            assert stats["aborted"] == outcomes.get("cut:ClientPayloadError", 0)
        return outcomes

    outcomes = run(main())
    assert outcomes["ok:200"] == 15 and outcomes["post:200"] == 15
    assert outcomes["500:500"] == 15 and outcomes["slow:504"] == 15
    assert outcomes["cut:ClientPayloadError"] == 15
    assert outcomes["stream_disconnect:dropped"] == 15
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_wait_drained_waits_for_slow_request() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, reps, _), aiohttp.ClientSession() as s:
            assert await lb.wait_drained(1, 0.1)  # idle: at once
            held = asyncio.ensure_future(s.get(lb.url + "/hold"))
            await asyncio.wait_for(reps[0].arrived.wait(), 5)
            assert lb.in_flight(1) == 1
            assert await lb.wait_drained(1, 0.2) is False
            lb.set_ready({})  # leaving the ready set keeps the count until the request ends
            assert lb.in_flight(1) == 1
            waiter = asyncio.ensure_future(lb.wait_drained(1, 5))
            await asyncio.sleep(0)
            assert not waiter.done()
            reps[0].gate.set()
            assert await waiter is True
            resp = await held
            assert resp.status == 200
            resp.release()
            assert lb.in_flight(1) == 0 and lb.in_flight() == 0
            assert "1" not in lb.stats()["replicas"]  # drained and gone: counters forgotten

    run(main())


def test_request_timestamps_window() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            before = time.monotonic()
            for _ in range(5):
                await get_json(s, lb.url + "/")
            stamps = lb.request_timestamps(60)
            assert len(stamps) == 5 and stamps == sorted(stamps)
            assert all(ts >= before for ts in stamps)
            assert lb.request_timestamps(0) == []

    run(main())


# ---------------------------------------------------------------------------- misc


def test_websocket_is_proxied() -> None:
    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            async with s.ws_connect(lb.url + "/ws") as ws:
                assert lb.in_flight(1) == 1
                await ws.send_str("hi")
                msg = await ws.receive(timeout=5)
                assert msg.data == "1:hi"
            assert await lb.wait_drained(1, 5)

    run(main())


def test_lifecycle_and_url() -> None:
    async def main() -> None:
        lb = LoadBalancer(name="svc")
        await lb.stop()  # before start: no-op
        lb2 = LoadBalancer(name="svc")
        port = await lb2.start()
        assert port == lb2.port > 0 and lb2.url == f"http://127.0.0.1:{port}"
        with pytest.raises(RuntimeError):
            await lb2.start()
        await lb2.stop()
        await lb2.stop()  # idempotent

    run(main())


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One whole response with a Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def test_stop_answers_connections_still_in_the_accept_queue() -> None:
    """Connections the kernel completed before stop() but the loop had not accepted yet: a
    closing listener resets them, so stop() takes them first and they are answered."""
    request = b"GET /queued HTTP/1.1\r\nHost: x\r\n\r\n"

    def exchange(sock: socket.socket) -> bytes:
        with sock:
            sock.settimeout(10)
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    async def main() -> None:
        async with cluster(1) as (lb, _, _):
            # Blocking connects: the handshakes complete in the kernel while the loop is not
            # running, so all of these wait in the accept queue when stop() begins.
            socks = [socket.create_connection((HOST, lb.port)) for _ in range(4)]
            stopping = asyncio.create_task(lb.stop())
            answers = await asyncio.gather(*(asyncio.to_thread(exchange, s) for s in socks))
            await stopping
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert b"connection: close" in answer.lower()

    run(main())


def test_stop_with_idle_grace_answers_the_next_request_on_an_idle_connection() -> None:
    """A worker handing over its port: a keep-alive client idle when the stop began sends
    its next request there (it cannot know); it is answered, with Connection: close."""
    request = b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n"

    async def main() -> None:
        async with cluster(1) as (lb, _, _):
            reader, writer = await asyncio.open_connection(HOST, lb.port)
            writer.write(request)
            first = await read_answer(reader)
            assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower()
            stopping = asyncio.create_task(lb.stop(idle_grace=3.0))
            while lb._server is not None:  # stop() has begun
                await asyncio.sleep(0.01)
            with pytest.raises(OSError):  # the listener is closed already
                await asyncio.open_connection(HOST, lb.port)
            writer.write(request)
            second = await reader.read()  # to EOF: the balancer closes after this answer
            writer.close()
            await asyncio.wait_for(stopping, 5)
        assert second.startswith(b"HTTP/1.1 200"), second
        assert b"connection: close" in second.lower()

    run(main())


def test_unreachable_replica_is_passed_over_by_least_load() -> None:
    """A dead replica has nothing in flight, so least_load would keep choosing it until the
    controller notices; after one refused connection it is passed over for a while."""

    async def main() -> None:
        async with (
            cluster(2, dead=1, policy="least_load") as (lb, _reps, _),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(30):
                status, _echo = await get_json(s, lb.url + "/")
                assert status == 200
            stats = lb.stats()["replicas"]
            assert stats["3"]["failed"] == 1, stats
            assert stats["1"]["served"] + stats["2"]["served"] == 30

    run(main())


def test_only_a_refused_connection_is_free_of_the_attempt_budget() -> None:
    """ECONNREFUSED answers at once and reached no app: it costs no attempt. A host that is
    unreachable (or a name that does not resolve) is also a connector error but may take
    seconds each: it must count, or one request could wait on every replica of a dead host."""

    def connect_error(code: int) -> OSError:
        return OSError(code, "x")

    assert refused(ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"))
    assert refused(connect_error(errno.ECONNREFUSED))
    assert not refused(connect_error(errno.EHOSTUNREACH))
    assert not refused(connect_error(errno.ENETUNREACH))
    assert not refused(socket.gaierror(socket.EAI_NONAME, "name unknown"))
    assert not refused(ConnectionResetError(errno.ECONNRESET, "reset"))


# ---------------------------------------------------------------------------- new engine


@contextlib.asynccontextmanager
async def swallowing_replica() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A replica that reads each request whole (head and Content-Length body), then closes the
    connection without answering; yields its base URL and the request lines it read."""
    seen: list[bytes] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            seen.append(head.split(b"\r\n", 1)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, HOST, 0)
    try:
        yield f"http://{HOST}:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()
        await server.wait_closed()


def test_non_idempotent_request_read_then_dropped_is_never_resent() -> None:
    """The replica read the whole POST and closed without answering: it may have acted on it,
    so the client gets a 502 and the second replica never sees the request (nginx does the
    same). A GET in the same situation is retried on the other replica."""

    async def main() -> None:
        async with swallowing_replica() as (hole, seen):
            for method, data in ((b"POST", b"charge-card"), (b"PATCH", b"x")):
                async with cluster(1, policy="round_robin") as (lb, reps, ready):
                    lb.set_ready({0: hole, 1: ready[1]})  # round robin tries id 0 first
                    async with aiohttp.ClientSession() as s:
                        async with s.request(method.decode(), lb.url + "/pay", data=data) as r:
                            assert r.status == 502
                            error = (await r.json())["error"]
                        assert "not retried" in error and "may have reached" in error
                    assert reps[0].requests == []  # never sent twice
                    assert seen[-1] == method + b" /pay HTTP/1.1"
                    assert lb.stats()["retries"] == 0
                    assert lb.in_flight() == 0
            async with cluster(1, policy="round_robin") as (lb, reps, ready):
                lb.set_ready({0: hole, 1: ready[1]})
                async with aiohttp.ClientSession() as s:
                    status, echo = await get_json(s, lb.url + "/read")
                    assert (status, echo["replica"]) == (200, 1)
                assert seen[-1] == b"GET /read HTTP/1.1"
                assert [q["path_qs"] for q in reps[0].requests] == ["/read"]
                assert lb.stats()["retries"] == 1

    run(main())


def test_post_gets_a_fresh_connection_when_the_pooled_one_is_idle() -> None:
    """A pooled connection idle for a while may be closing at the replica just as a request is
    written; a POST must not take that risk (it could not be resent), a GET may."""
    from corral.balancer.exchange import NONIDEMPOTENT_MAX_IDLE

    async def main() -> None:
        async with cluster(1) as (lb, reps, _), aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            original = loop.create_connection
            opened: list[int] = []  # connections the balancer opens to the replica

            async def counting(*args: Any, **kw: Any) -> Any:
                if args[2:3] == (reps[0].port,):
                    opened.append(1)
                return await original(*args, **kw)

            loop.create_connection = counting  # type: ignore[method-assign]
            try:
                for _ in range(3):
                    assert (await get_json(s, lb.url + "/", method="POST", data=b"a"))[0] == 200
                assert len(opened) == 1  # back to back: the pooled connection is reused
                await asyncio.sleep(NONIDEMPOTENT_MAX_IDLE + 0.2)
                assert (await get_json(s, lb.url + "/", method="POST", data=b"a"))[0] == 200
                assert len(opened) == 2  # idle too long for a POST: a fresh one
                await asyncio.sleep(NONIDEMPOTENT_MAX_IDLE + 0.2)
                assert (await get_json(s, lb.url + "/"))[0] == 200
                assert len(opened) == 2  # a GET takes the idle one
            finally:
                del loop.create_connection

    run(main())


def test_on_drained_is_called_when_a_removed_replica_drains() -> None:
    async def main() -> None:
        drained: list[int] = []
        async with (
            cluster(2, policy="round_robin", on_drained=drained.append) as (lb, reps, ready),
            aiohttp.ClientSession() as s,
        ):
            held = asyncio.ensure_future(s.get(lb.url + "/hold"))
            await asyncio.wait_for(reps[0].arrived.wait(), 5)
            lb.set_ready({2: ready[2]})
            (await get_json(s, lb.url + "/"))  # replica 2 (ready) finishing: no call
            assert drained == []
            reps[0].gate.set()
            resp = await held
            assert resp.status == 200
            resp.release()
            assert await lb.wait_drained(1, 5)
            assert drained == [1]

    run(main())


def test_timestamps_since_is_incremental() -> None:
    """What a worker reports: each request's time once, from a count of those reported."""

    async def main() -> None:
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            for _ in range(3):
                await get_json(s, lb.url + "/")
            first, seen = lb.timestamps_since(0)
            assert len(first) == 3 and first == sorted(first) and seen == 3
            assert lb.timestamps_since(seen) == ([], 3)
            await get_json(s, lb.url + "/")
            later, seen = lb.timestamps_since(seen)
            assert len(later) == 1 and later[0] >= first[-1] and seen == 4
            assert first + later == lb.request_timestamps(60)
            # Fewer kept than asked for (the deque's cap or horizon): all it keeps.
            lb._timestamps.popleft()
            assert lb.timestamps_since(0) == (lb.request_timestamps(60), 4)

    run(main())


def test_reuse_port_lets_two_balancers_share_a_port() -> None:
    async def main() -> None:
        replica = await Replica(1).start()
        a = LoadBalancer(name="svc", reuse_port=True)
        try:
            port = await a.start()
            b = LoadBalancer(name="svc", port=port, reuse_port=True)
            try:
                assert await b.start() == port
                for lb in (a, b):
                    lb.set_ready({1: replica.url})
                async with aiohttp.ClientSession() as s:
                    for _ in range(4):
                        assert (await get_json(s, a.url + "/"))[0] == 200
                assert a.stats()["requests"] + b.stats()["requests"] == 4
            finally:
                await b.stop()
            with pytest.raises(OSError):
                await LoadBalancer(name="svc", port=port).start()  # without: the port is taken
        finally:
            await a.stop()
            await replica.stop()

    run(main())


def test_runs_on_uvloop() -> None:
    """Production hosts the balancer on uvloop: the same exchanges, streams and WebSocket."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        async with cluster(2, policy="round_robin", dead=1, max_buffered_body=1 << 16) as (
            lb,
            _,
            _,
        ):
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    assert (await get_json(s, lb.url + "/"))[0] == 200
                payload = random.Random(2).randbytes(512 << 10)  # streamed, above the buffer
                status, echo = await get_json(s, lb.url + "/up", method="POST", data=payload)
                assert (status, echo["body_len"]) == (200, len(payload))
                async with s.get(lb.url + "/big") as resp:
                    assert await resp.read() == bytes(range(256)) * 4096
                async with s.get(lb.url + "/chunks") as resp:
                    assert await resp.read() == b"abc"
                async with s.ws_connect(lb.url + "/ws") as ws:
                    await ws.send_str("hi")
                    assert (await ws.receive(timeout=5)).data in ("1:hi", "2:hi")
            assert await lb.wait_drained(1, 5) and await lb.wait_drained(2, 5)

    async def bounded() -> None:
        await asyncio.wait_for(main(), 20)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(bounded())
