"""A balancer worker reports each request's time to the daemon once (the autoscaler's input):
also the last ones of a balancer a route change retired (they were dropped with its cursor),
and also to a restarted daemon that asks for history (a report sent before its hello held
times the history holds again, and they were counted twice)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from corral.dataplane.protocol import decode, encode, socket_path
from corral.dataplane.worker import Worker
from corral.ports import free_port

pytestmark = pytest.mark.timeout(60)


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


@contextlib.asynccontextmanager
async def _replica() -> AsyncIterator[str]:
    """A replica on 127.0.0.1 answering every request with a 200: its URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def test_a_retired_balancers_last_requests_are_reported(tmp_path: Path) -> None:
    async def main() -> None:
        async with _replica() as url:
            (tmp_path / "dataplane").mkdir()
            worker = Worker(tmp_path, 0)
            sent: list[Mapping[str, Any]] = []

            async def send(message: Mapping[str, Any]) -> None:
                sent.append(message)

            worker._send = send  # type: ignore[method-assign]
            worker._writer = object()  # type: ignore[assignment]
            port = free_port()
            route = {"port": port, "config": {"connect_timeout": 5.0}, "ready": {"1": {"url": url}}}
            try:
                await worker._handle({"t": "table", "seq": 1, "services": {"svc": route}})
                for _ in range(3):
                    assert (await _get(port)).startswith(b"HTTP/1.1 200")
                # Another setting: a new listener; the one that served the 3 requests retires.
                changed = {**route, "config": {"connect_timeout": 6.0}}
                await worker._handle({"t": "table", "seq": 2, "services": {"svc": changed}})
                deadline = time.monotonic() + 10
                while worker.retiring and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert not worker.retiring
                await worker._report()
                await worker._report()
                times = [m["services"].get("svc", {}).get("times", []) for m in sent]
                assert sum(n for report in times for _, n in report) == 3
            finally:
                for svc in worker.services.values():
                    await svc.lb.stop()

    asyncio.run(main())


def test_no_report_goes_out_before_a_restarted_daemons_hello(tmp_path: Path) -> None:
    async def main() -> None:
        async with _replica() as url:
            (tmp_path / "dataplane").mkdir()
            port = free_port()
            route: Mapping[str, Any] = {"port": port, "ready": {"1": {"url": url}}}
            worker = Worker(tmp_path, 0)
            await worker._apply({"svc": route})  # serving the table it had: no daemon now
            for _ in range(3):
                assert (await _get(port)).startswith(b"HTTP/1.1 200")
            counted: list[int] = []
            reports = 0

            async def daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                nonlocal reports
                await reader.readuntil(b"\n")  # the worker's hello
                await asyncio.sleep(0.6)  # a restarted daemon, busy starting its controllers
                writer.write(encode({"t": "hello", "history": True, "respawn": None}))
                writer.write(encode({"t": "table", "seq": 1, "services": {"svc": route}}))
                with contextlib.suppress(asyncio.IncompleteReadError, OSError):
                    while True:
                        message = decode(await reader.readuntil(b"\n"))
                        report = (message.get("services") or {}).get("svc") or {}
                        counted.extend(n for _, n in report.get("times") or ())
                        reports += message.get("t") == "report"

            plane = await asyncio.start_unix_server(daemon, path=socket_path(tmp_path))
            tasks = [
                asyncio.create_task(worker._connect_loop()),
                asyncio.create_task(worker._report_loop()),
            ]
            try:
                deadline = time.monotonic() + 20
                while (sum(counted) < 3 or reports < 4) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert sum(counted) == 3 and reports >= 4, (counted, reports)
            finally:
                for task in tasks:
                    task.cancel()
                for svc in worker.services.values():
                    await svc.lb.stop()
                plane.close()

    asyncio.run(main())
