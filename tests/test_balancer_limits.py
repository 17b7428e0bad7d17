"""Timeouts, size limits and malformed HTTP at the load balancer.

Same rules as tests/test_balancer.py (whose replica and helpers these tests reuse): real sockets
on 127.0.0.1, every test bounded by ``run``'s deadline, waits on events rather than sleeps except
where the thing under test is a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from test_balancer import HOST, cluster, header_values, raw_exchange, run

from corral.balancer import LoadBalancer

# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A base URL whose TCP connects hang: a listener with a full accept queue (backlog 0 and
    one connection never accepted), so Linux drops further SYNs instead of refusing them."""
    listener = socket.socket()
    filler = socket.socket()
    try:
        listener.bind((HOST, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        filler.connect((HOST, port))
        yield f"http://{HOST}:{port}"
    finally:
        filler.close()
        listener.close()


async def raw_response(port: int, data: bytes, *, pause: float = 0.0, tail: bytes = b"") -> bytes:
    """Send ``data`` (then ``tail`` after ``pause`` seconds, as a separate packet) and return
    the first response: its head and Content-Length bytes of body.

    It does not wait for the connection to close: after an early error the server may keep
    reading (aiohttp's lingering close) for a body the client never sends."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        await writer.drain()
        if tail:
            await asyncio.sleep(pause)
            writer.write(tail)
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        _, headers, _ = parse(head)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
        return head + body
    finally:
        writer.close()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None, f"traceback logged: {record.getMessage()}"
        assert "Traceback" not in record.getMessage()


# ---------------------------------------------------------------------------- configuration


def test_timeout_parameters_and_request_timeout_alias() -> None:
    lb = LoadBalancer(name="s")
    assert (lb._first_byte_timeout, lb._idle_timeout) == (120.0, 120.0)
    lb = LoadBalancer(name="s", request_timeout=7)  # the old single timeout sets both
    assert (lb._first_byte_timeout, lb._idle_timeout) == (7, 7)
    lb = LoadBalancer(name="s", request_timeout=7, first_byte_timeout=2)
    assert (lb._first_byte_timeout, lb._idle_timeout) == (2, 7)
    lb = LoadBalancer(name="s", idle_timeout=3)
    assert (lb._first_byte_timeout, lb._idle_timeout) == (120.0, 3)
    for bad in (
        {"connect_timeout": 0},
        {"first_byte_timeout": 0},
        {"idle_timeout": -1},
        {"request_timeout": 0},
        {"max_body_bytes": -1},
        {"max_header_bytes": 10},
    ):
        with pytest.raises(ValueError):
            LoadBalancer(name="s", **bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- timeouts


def test_connect_timeout_retries_on_another_replica_then_504() -> None:
    async def main() -> None:
        with black_hole() as hole:
            async with (
                cluster(1, policy="round_robin", connect_timeout=0.3) as (lb, reps, ready),
                aiohttp.ClientSession() as s,
            ):
                lb.set_ready({**ready, 0: hole})  # id 0: round robin tries it first
                start = time.monotonic()
                async with s.get(lb.url + "/") as resp:
                    assert resp.status == 200  # the request never reached the hole: retried
                    assert (await resp.json())["replica"] == 1
                assert time.monotonic() - start < 3
                assert lb.stats()["replicas"]["0"]["failed"] == 1

                lb.set_ready({0: hole})
                start = time.monotonic()
                async with s.post(lb.url + "/", data=b"body") as resp:
                    assert resp.status == 504
                    assert "could not connect within 0.3s" in (await resp.json())["error"]
                assert time.monotonic() - start < 3
                assert lb.stats()["errors_by_reason"]["connect_timeout"] == 1
                assert len(reps[0].requests) == 1

    run(main())


def test_first_byte_timeout_is_504_and_independent_of_idle_timeout() -> None:
    async def main() -> None:
        async with (
            cluster(2, first_byte_timeout=0.3, idle_timeout=10) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            start = time.monotonic()
            async with s.get(lb.url + "/delay?s=3") as resp:
                assert resp.status == 504
                assert "no response within 0.3s" in (await resp.json())["error"]
            assert time.monotonic() - start < 2.5
            assert sum(len(r.requests) for r in reps) == 1  # not retried: may be running
            assert lb.stats()["errors_by_reason"] == {"first_byte_timeout": 1}
            # once the headers are out, silence up to idle_timeout is fine
            async with s.get(lb.url + "/gap?s=0.8") as resp:
                assert resp.status == 200
                assert await resp.read() == b"first;second"
            assert lb.stats()["aborted"] == 0

    run(main())


def test_idle_timeout_cuts_a_stalled_stream_but_not_a_slow_first_byte() -> None:
    async def main() -> None:
        async with (
            cluster(1, first_byte_timeout=10, idle_timeout=0.3) as (lb, _, _),
            aiohttp.ClientSession() as s,
        ):
            # a replica thinking for longer than idle_timeout before its headers is fine
            async with s.get(lb.url + "/delay?s=0.8") as resp:
                assert (resp.status, await resp.text()) == (200, "delayed")
            start = time.monotonic()
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.get(lb.url + "/gap?s=3") as resp:
                    assert resp.status == 200
                    await resp.read()
            assert time.monotonic() - start < 2.5
            stats = lb.stats()
            assert stats["aborted"] == 1
            assert stats["errors_by_reason"] == {"idle_timeout": 1}
            assert await lb.wait_drained(1, 5)

    run(main())


def test_a_client_of_an_idle_balancer_has_its_deadlines_kept() -> None:
    """With no client connected the ticker wakes once a second (an idle service costs a
    worker next to nothing); a client that connects just after such a tick has its first-byte
    deadline fired at the short tick, not at the next idle one a second later."""

    async def main() -> None:
        async with (
            cluster(1, first_byte_timeout=0.3, idle_timeout=10) as (lb, _, _),
            aiohttp.ClientSession() as s,
        ):
            deadline = time.monotonic() + 5
            while not lb._tick_idle:  # set by a tick that found no client
                assert time.monotonic() < deadline, "the ticker never idled"
                await asyncio.sleep(0.01)
            start = time.monotonic()
            async with s.get(lb.url + "/delay?s=3") as resp:
                assert resp.status == 504
            assert time.monotonic() - start < 0.8  # the idle tick would come at ~1 s

    run(main())


def test_the_ticker_sleeps_until_the_nearest_deadline() -> None:
    """A client whose deadline is far (a keep-alive connection between requests: the header
    timeout) costs the worker a tick a second, not ten (corral.balancer.ticker); a client with
    a near deadline still has it fired at the short tick."""

    async def main() -> None:
        async with (
            cluster(1, first_byte_timeout=1.0, idle_timeout=10) as (lb, _, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.get(lb.url + "/") as resp:  # its connection stays, its deadline far
                assert resp.status == 200
                await resp.read()
            calls: list[float] = []
            tick = lb._tick

            def counted() -> None:
                calls.append(time.monotonic())
                tick()

            lb._tick = counted  # type: ignore[method-assign]
            await asyncio.sleep(2.5)
            assert 1 <= len(calls) <= 4, calls  # at 0.1 s it was 25
            start = time.monotonic()
            async with s.get(lb.url + "/delay?s=3") as resp:  # a first byte due in 1 s
                assert resp.status == 504
            assert 0.9 < time.monotonic() - start < 1.6

    run(main())


def test_idle_timer_is_not_left_running_on_pooled_connections() -> None:
    async def main() -> None:
        # idle != first byte, so every response switches aiohttp's read timer; a timer left
        # armed on a pooled connection would break the next request sent on it
        async with (
            cluster(1, first_byte_timeout=0.5, idle_timeout=0.2) as (lb, _, _),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(3):
                for _ in range(5):
                    async with s.get(lb.url + "/") as resp:
                        assert resp.status == 200
                        await resp.read()
                    async with s.get(lb.url + "/chunks") as resp:
                        assert await resp.read() == b"abc"
                await asyncio.sleep(0.7)  # longer than both timeouts, shorter than keep-alive
            stats = lb.stats()
            assert stats["aborted"] == 0 and stats["errors"] == 0
            assert stats["replicas"]["1"]["failed"] == 0

    run(main())


# ---------------------------------------------------------------------------- header limits


def test_max_header_bytes_rejects_with_431() -> None:
    async def main() -> None:
        async with (
            cluster(1, max_header_bytes=1024) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.get(lb.url + "/", headers={"X-Big": "a" * 900}) as resp:
                assert resp.status == 200
            async with s.get(lb.url + "/", headers={"X-Big": "a" * 2000}) as resp:
                assert resp.status == 431
                assert "header too large" in (await resp.json())["error"]
            async with s.get(lb.url + "/" + "p" * 2000) as resp:
                assert resp.status == 431
            assert len(reps[0].requests) == 1
            assert lb.stats()["bad_requests"] == 2
        # the default (aiohttp's 8190) still takes an 8000-byte header
        async with (
            cluster(1) as (lb, _, _),
            aiohttp.ClientSession() as s,
            s.get(lb.url + "/", headers={"X-Big": "a" * 8000}) as resp,
        ):
            assert resp.status == 200

    run(main())


# ---------------------------------------------------------------------------- body limits


def test_max_body_bytes_by_content_length() -> None:
    async def main() -> None:
        async with (
            cluster(1, max_body_bytes=1000) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(lb.url + "/", data=b"x" * 1000) as resp:
                assert resp.status == 200
                assert (await resp.json())["body_len"] == 1000
            async with s.post(lb.url + "/", data=b"x" * 1001) as resp:
                assert resp.status == 413
                assert resp.headers["Content-Type"].startswith("application/json")
                assert "too large" in (await resp.json())["error"]
            assert len(reps[0].requests) == 1  # the replica never saw it
            status, headers, body = await raw_exchange(
                lb.port,
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"y" * 5000,
            )
            assert status == 413 and json.loads(body)["service"] == "svc"
            assert header_values(headers, "Connection") == ["close"]
            assert lb.stats()["errors_by_reason"] == {"body_too_large": 2}

    run(main())


def test_max_body_bytes_answers_expect_100_continue_with_413() -> None:
    async def main() -> None:
        async with cluster(1, max_body_bytes=1000) as (lb, reps, _):
            raw = await raw_response(
                lb.port,
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
                b"Expect: 100-continue\r\n\r\n",
            )
            status, _, body = parse(raw)
            assert status == 413 and b"100 Continue" not in raw
            assert "too large" in json.loads(body)["error"]
            assert reps[0].requests == []

    run(main())


async def chunked(total: int, piece: int = 4096) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        sent += n
        yield b"z" * n


def test_max_body_bytes_on_chunked_bodies_buffered_and_streamed() -> None:
    async def main() -> None:
        # buffered phase: the limit is below max_buffered_body
        async with (
            cluster(1, max_body_bytes=10_000) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(lb.url + "/", data=chunked(10_000)) as resp:
                assert resp.status == 200
                assert (await resp.json())["body_len"] == 10_000
            async with s.post(lb.url + "/", data=chunked(50_000)) as resp:
                assert resp.status == 413
            assert len(reps[0].requests) == 1
        # streamed phase: the body is already flowing to the replica when it crosses the limit
        async with (
            cluster(1, max_buffered_body=1024, max_body_bytes=64 * 1024) as (lb, reps, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(lb.url + "/", data=chunked(60 * 1024)) as resp:
                assert resp.status == 200
                assert (await resp.json())["body_len"] == 60 * 1024
            async with s.post(lb.url + "/", data=chunked(256 * 1024)) as resp:
                assert resp.status == 413
                assert "too large" in (await resp.json())["error"]
            stats = lb.stats()
            assert stats["errors_by_reason"] == {"body_too_large": 1}
            assert stats["replicas"]["1"]["failed"] == 0  # the client's fault, not the replica's
            assert await lb.wait_drained(1, 5)

    run(main())


def test_gzip_request_body_is_forwarded_still_compressed() -> None:
    async def main() -> None:
        plain = b"hello " * 1000
        packed = gzip.compress(plain)
        async with cluster(1) as (lb, _, _), aiohttp.ClientSession() as s:
            async with s.post(
                lb.url + "/", data=packed, headers={"Content-Encoding": "gzip"}
            ) as resp:
                assert resp.status == 200
                echo = await resp.json()
            # the replica inflated it itself: it got the gzip bytes with their header
            assert echo["body_len"] == len(plain)
            assert echo["body_sha"] == hashlib.sha256(plain).hexdigest()

    run(main())


# ---------------------------------------------------------------------------- malformed HTTP


def test_malformed_http_is_a_json_4xx_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with cluster(1) as (lb, reps, _):
            cases = [
                b"garbage\r\n\r\n",
                b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS hello on the plain port
                b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
                b"GET / HTTP/9.9\r\n\r\n",
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                b"\x00\xff\xfe\r\n\r\n",
            ]
            for data in cases:
                status, headers, body = parse(await raw_response(lb.port, data))
                assert status == 400, data
                assert headers["content-type"].startswith("application/json")
                error = json.loads(body)["error"]
                assert error.startswith("malformed HTTP request") and "Traceback" not in error
            # broken chunked framing that arrives after the handler started: still a 400
            raw = await raw_response(
                lb.port,
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                pause=0.2,
                tail=b"zz\r\nnot a chunk\r\n",
            )
            status, headers, body = parse(raw)
            assert status == 400 and "Traceback" not in body.decode()
            assert reps[0].requests == []
            assert lb.stats()["bad_requests"] == len(cases)  # the parser's; the last was ours
            assert lb.stats()["errors_by_reason"] == {"bad_request": len(cases) + 1}
            # the balancer still works
            async with aiohttp.ClientSession() as s, s.get(lb.url + "/") as resp:
                assert resp.status == 200
        # the same once the body is already streaming to the replica
        async with cluster(1, max_buffered_body=16) as (lb, reps, _):
            raw = await raw_response(
                lb.port,
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"40\r\n" + b"a" * 64 + b"\r\n",
                pause=0.2,
                tail=b"zz\r\nnot a chunk\r\n",
            )
            status, headers, body = parse(raw)
            assert status == 400
            assert "malformed request body" in json.loads(body)["error"]
            assert lb.stats()["replicas"]["1"]["failed"] == 0
            assert await lb.wait_drained(1, 5)

    run(main())
    no_tracebacks(caplog)
    rejected = [r for r in caplog.records if "rejected malformed request" in r.getMessage()]
    assert len(rejected) == 1  # rate-limited: one line per FAILURE_LOG_INTERVAL
