"""A balancer worker reads each engine's metrics on one kept connection
(corral.dataplane.engines.fetch).

Against real HTTP servers on 127.0.0.1 that count the connections they accept and the requests
they answer: readings reuse one connection while the engine keeps it; an engine that closes it
between readings (or answers ``Connection: close``, or frames its answer by closing) is read
on a new one with no reading lost; a chunked answer is read to its last chunk and the
connection kept; a silent engine's connection is dropped, not kept; an unused connection is
closed once idle; an event loop never uses another loop's connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from corral.dataplane import engines

HOST = "127.0.0.1"
BODY = b"vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n"


class Engine:
    """Answers each ``GET /metrics`` on a connection as ``mode`` says, counting connections
    and answers: ``keep`` (Content-Length, kept open), ``chunked`` (kept open), ``close``
    (``Connection: close``, then closed), ``eof`` (no length: the end of the connection ends
    the body), ``once`` (one answer per connection, then closed without saying so), ``silent``
    (never answers)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.answers = 0
        self.open = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Engine:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.url = f"http://{HOST}:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if self.mode == "silent":
                    await asyncio.sleep(engines.TIMEOUT * 3)
                    return
                self.answers += 1
                writer.write(self._answer())
                await writer.drain()
                if self.mode in ("close", "eof", "once"):
                    return
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()

    def _answer(self) -> bytes:
        if self.mode == "chunked":
            half = len(BODY) // 2
            chunks = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (
                half,
                BODY[:half],
                len(BODY) - half,
                BODY[half:],
            )
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
        if self.mode == "close":
            head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY)
            return head + BODY
        if self.mode == "eof":
            return b"HTTP/1.1 200 OK\r\n\r\n" + BODY
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY)


def read_three(mode: str) -> tuple[list[Any], Engine]:
    """Three readings of one engine in ``mode``, a little apart, in one event loop."""

    async def go() -> tuple[list[Any], Engine]:
        async with Engine(mode) as engine:
            got = []
            for _ in range(3):
                got.append(await engines.fetch(engine.url, "/metrics"))
                await asyncio.sleep(0.05)
            return got, engine

    return asyncio.run(go())


def test_readings_share_one_kept_connection() -> None:
    got, engine = read_three("keep")
    assert got == [{"waiting": 3.0, "running": 2.0}] * 3
    assert (engine.connections, engine.answers) == (1, 3)


def test_a_chunked_answer_is_read_whole_and_its_connection_kept() -> None:
    got, engine = read_three("chunked")
    assert got == [{"waiting": 3.0, "running": 2.0}] * 3
    assert (engine.connections, engine.answers) == (1, 3)


def test_engines_that_close_are_read_anew_each_time_with_no_reading_lost() -> None:
    for mode in ("close", "eof", "once"):
        got, engine = read_three(mode)
        assert got == [{"waiting": 3.0, "running": 2.0}] * 3, mode
        assert (engine.connections, engine.answers) == (3, 3), mode


def test_a_silent_engine_is_not_kept_and_costs_one_timeout() -> None:
    async def go() -> None:
        async with Engine("silent") as engine:
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert await engines.fetch(engine.url, "/metrics") is None
            assert loop.time() - start < engines.TIMEOUT + 0.5
            assert not engines._kept()
            for _ in range(100):  # the engine sees its connection closed
                if engine.open == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.open == 0

    asyncio.run(go())


def test_an_unused_connection_is_closed_once_idle() -> None:
    async def go() -> None:
        async with Engine("keep") as first, Engine("keep") as second:
            assert await engines.read_all({1: first.url, 2: second.url}, "/metrics")
            assert first.open == second.open == 1
            kept = engines._kept()
            key = (HOST, int(second.url.rsplit(":", 1)[1]), False)
            kept[key] = kept[key]._replace(used=kept[key].used - engines.KEEP_IDLE - 1)
            await engines.read_all({1: first.url}, "/metrics")  # 2 left the ready set
            for _ in range(100):
                if second.open == 0:
                    break
                await asyncio.sleep(0.02)
            assert (first.open, second.open) == (1, 0)
            assert (first.connections, first.answers) == (1, 2)

    asyncio.run(go())


def test_kept_connections_belong_to_their_event_loop() -> None:
    async def one(url: str) -> Any:
        return await engines.fetch(url, "/metrics")

    async def go() -> None:
        async with Engine("keep") as engine:
            # Another loop in another thread reads the same engine: its own connection.
            other = await asyncio.to_thread(asyncio.run, one(engine.url))
            assert other == {"waiting": 3.0, "running": 2.0}
            assert await one(engine.url) == other
            assert await one(engine.url) == other
            assert (engine.connections, engine.answers) == (2, 3)

    asyncio.run(go())
