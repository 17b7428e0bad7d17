"""``GET /v1/services/{name}/logs`` followed (corral.api_logs): when a follower ends.

`daemon stop` with followers runs a real daemon. A reader that leaves, and a log rotated under
its follower, run the route in a real aiohttp server over a stand-in daemon that has only what
the route reads (``controller``, ``log_path``, ``log_finished``, ``has_service``,
``stop_requested``, ``home``): to count the errors logged in this process, and to rotate the
log at the moments that lose lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import CorralHome, pid_alive, spec_text, wait_for, write_spec

from corral import api_logs, loglines
from corral.dashboard.logs import Tail
from corral.logfiles import rotate_if_over

pytestmark = pytest.mark.timeout(60)


class FakeDaemon:
    """What the logs route reads of the daemon, and nothing else."""

    def __init__(self, home: Path, log: Path) -> None:
        self.home = home
        self.log = log
        self.finished = False  # the replica still runs
        self.stop_requested = asyncio.Event()

    def controller(self, name: str) -> None:
        return None

    def log_path(self, name: str, kind: str, replica: int | None) -> Path:
        return self.log

    def log_finished(self, name: str, replica: int | None) -> bool:
        return self.finished

    def has_service(self, name: str) -> bool:
        return True


class Served:
    """The route in an aiohttp runner as the daemon's API runs it (no handler cancellation:
    a test server cancels a handler whose client left, which the daemon's runner does not)."""

    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self.runner = runner
        self.host = "127.0.0.1"
        self.port = port

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def _serve(daemon: FakeDaemon) -> Served:
    async def logs(request: web.Request) -> web.StreamResponse:
        return await api_logs.logs(request, daemon)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_get("/v1/services/{name}/logs", logs)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return Served(runner, port)


def test_daemon_stop_ends_the_followers_of_logs_at_once(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral daemon stop` must not wait for (nor keep feeding) `corral logs` followers: the
    API's shutdown waits for every answer in progress, so a follower that never ended held the
    whole stop up for aiohttp's shutdown timeout, twice (two minutes), while `status` said no
    daemon ran and `daemon start` failed. A real daemon, a replica's log and the balancer's
    followed; each follower ends with a message, not a traceback."""
    corral_home.run("up", str(write_spec(tmp_path / "svc.yaml", spec_text("tailed", 1))))
    daemon = corral_home.daemon_pid()
    followers = [
        corral_home.popen("logs", "tailed", "1"),
        corral_home.popen("logs", "tailed", "--load-balancer"),
    ]
    for follower in followers:  # following now: a replica's first line, or still running
        assert follower.stdout is not None
    wait_for(lambda: all(f.poll() is None for f in followers), 5, "the followers to run")
    corral_home.run("daemon", "stop", timeout=60)
    wait_for(lambda: not pid_alive(daemon), 30, "the daemon to exit after `daemon stop`")
    for follower in followers:
        follower.wait(30)
        assert follower.stdout is not None
        said = follower.stdout.read().decode()
        assert "Traceback" not in said, said


def test_a_reader_that_leaves_is_not_an_error_in_the_daemon_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C on `corral logs` is how a follower normally ends: the daemon's log must not get
    an ERROR with a traceback each time."""
    log = tmp_path / "replica_1.log"
    log.write_text("x" * 100 + "\n")
    daemon = FakeDaemon(tmp_path, log)

    async def main() -> None:
        server = await _serve(daemon)
        try:
            for _ in range(3):
                reader, writer = await asyncio.open_connection(server.host, server.port)
                writer.write(
                    b"GET /v1/services/web/logs?follow=true&replica=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                await reader.readuntil(b"x\n")
                writer.close()  # the reader leaves
                with log.open("a") as f:  # the replica writes on
                    for _ in range(50):
                        f.write("more\n")
                        f.flush()
                        await asyncio.sleep(0.02)
        finally:
            await server.close()

    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_a_log_answer_leaves_no_warning(tmp_path: Path) -> None:
    """The route marked its request as streaming with a str key, and aiohttp warned of that
    (NotAppKeyWarning) into the daemon's log at every `corral logs`."""
    log = tmp_path / "replica_1.log"
    log.write_text("one\ntwo\n")
    daemon = FakeDaemon(tmp_path, log)

    async def main() -> str:
        server = await _serve(daemon)
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(server.url("/v1/services/web/logs?replica=1")) as answer,
            ):
                assert answer.status == 200
                return await answer.text()
        finally:
            await server.close()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert asyncio.run(main()) == "one\ntwo\n"
    assert not [w for w in seen if issubclass(w.category, web.NotAppKeyWarning)], seen


def test_a_tail_right_after_a_rotation_reads_the_rotated_lines(tmp_path: Path) -> None:
    """The size cap moves a log to ``.1`` and empties it: `--tail 3` then printed the one line
    written since, where the user asked for three that are all on disk. The ``.1`` part ends
    on a line break even where the cap cut a line."""
    log = tmp_path / "replica_1.log"
    log.write_text("new\n")
    (tmp_path / "replica_1.log.1").write_text("old1\nold2\nold3\ncut sho")
    daemon = FakeDaemon(tmp_path, log)

    async def main(query: str) -> str:
        server = await _serve(daemon)
        try:
            url = server.url(f"/v1/services/web/logs?replica=1&{query}")
            async with aiohttp.ClientSession() as session, session.get(url) as answer:
                assert answer.status == 200
                return await answer.text()
        finally:
            await server.close()

    assert asyncio.run(main("tail=3")) == "old3\ncut sho\nnew\n"
    assert asyncio.run(main("tail=1")) == "new\n"  # the log alone holds it
    assert asyncio.run(main("tail=9")) == "old1\nold2\nold3\ncut sho\nnew\n"


def test_an_error_after_the_answer_started_drops_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the API's own app and guard: a route that fails once its 200 and part of its
    body went out must not have an error answer written into that body; the connection is
    dropped. The guard learns that the answer started from aiohttp's on_response_prepare, for
    every streaming route (logs, the dashboard's feeds), not from each route saying so."""
    from unittest import mock

    from corral import api

    log = tmp_path / "replica_1.log"
    log.write_text("one\n")
    fake = FakeDaemon(tmp_path, log)
    daemon = mock.MagicMock(home=tmp_path)  # the dashboard's feed reads more than the route
    for name in ("controller", "log_path", "log_finished", "has_service"):
        setattr(daemon, name, getattr(fake, name))
    reads = 0
    read_at = loglines.read_at

    def fails_second(path: Path, position: int, limit: int) -> bytes:
        nonlocal reads
        reads += 1
        if reads > 1:
            raise RuntimeError("the disk went away")
        return read_at(path, position, limit)

    monkeypatch.setattr(loglines, "read_at", fails_second)

    async def main() -> tuple[int, bytes, str]:
        runner = web.AppRunner(api.make_app(daemon, "tok"), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/v1/services/web/logs?replica=1&follow=true"
        got = b""
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(url, headers={"Authorization": "Bearer tok"}) as answer,
            ):
                try:
                    async for chunk in answer.content.iter_any():
                        got += chunk
                except aiohttp.ClientPayloadError as exc:
                    return answer.status, got, type(exc).__name__
                return answer.status, got, "ended"
        finally:
            await runner.cleanup()

    status, body, end = asyncio.run(asyncio.wait_for(main(), 20))  # before: it never ended
    assert status == 200 and body == b"one\n", (status, body)
    assert end == "ClientPayloadError", end  # cut, no '{"error": ...}' inside the log's text


def test_an_answer_cut_short_is_a_client_error_not_a_traceback(tmp_path: Path) -> None:
    """A stream the daemon drops midway (it stopped) ends `corral logs` with a message."""
    import socket
    import threading

    from corral.client import Client, ClientError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: text/plain\r\n\r\n6\r\nline1\n\r\n"
        )
        conn.close()  # midway: no last chunk

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = Client(tmp_path)
    client._connection = lambda _t: _plain_connection(port)  # type: ignore[method-assign]
    got: list[bytes] = []
    with pytest.raises(ClientError, match="midway"):
        for chunk in client.stream("/v1/services/web/logs", {"follow": "true"}):
            got.append(chunk)
    assert b"".join(got) == b"line1\n"
    thread.join(5)
    listener.close()


def _plain_connection(port: int) -> tuple[Any, str, Any]:
    import http.client

    class Ep:
        url = f"http://127.0.0.1:{port}"
        remote = False
        ca = None

    return http.client.HTTPConnection("127.0.0.1", port, timeout=10), "token", Ep()


def _append(log: Path, first: int, count: int) -> None:
    with log.open("a") as f:
        f.writelines(f"line {n:06d} {'x' * 60}\n" for n in range(first, first + count))


def test_lines_written_just_before_a_rotation_reach_the_follower(tmp_path: Path) -> None:
    """corral.logfiles moves a log over its cap to ``.1`` and empties it in place; the follower
    then starts over at 0. What the app wrote after the follower's last read and before the
    rotation is in ``.1``: it must reach the follower too, or every rotation silently drops up
    to a poll's worth (0.2 s) of lines from `corral logs`."""
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"")
    daemon = FakeDaemon(tmp_path, log)
    rounds, per_write = 6, 100

    async def follow() -> bytes:
        server = await _serve(daemon)
        got = b""
        try:
            async with aiohttp.ClientSession() as session:
                params = {"follow": "true", "replica": "1"}
                url = server.url("/v1/services/web/logs")
                async with session.get(url, params=params) as answer:
                    n = 0
                    for _ in range(rounds):
                        _append(log, n, per_write)  # the follower reads these...
                        n += per_write
                        while f"line {n - 1:06d} ".encode() not in got:
                            got += await asyncio.wait_for(answer.content.readany(), 10)
                        # ...and these are written right before a rotation: a follower polling
                        # every 0.2 s almost never reads them from the log itself.
                        _append(log, n, per_write)
                        n += per_write
                        assert rotate_if_over(log, 1) is not None
                    _append(log, n, per_write)
                    daemon.finished = True
                    got += await asyncio.wait_for(answer.content.read(), 10)
        finally:
            await server.close()
        return got

    got = asyncio.run(follow())
    numbers = [int(n) for n in re.findall(rb"^line (\d+) x+$", got, re.M)]
    total = (2 * rounds + 1) * per_write
    missing = sorted(set(range(total)) - set(numbers))
    assert not missing, f"{len(missing)} lines never reached the follower, from {missing[0]}"
    assert numbers == list(range(total)), "lines repeated or out of order"


def test_the_dashboard_crosses_a_rotation_as_logs_follow_does(tmp_path: Path) -> None:
    """The dashboard's log tab noticed a rotation only by the log being shorter than its place:
    it dropped what was written just before the rotation (that is in ``.1``), and a log that
    grew back past its place between two polls was read on from there, as if nothing had
    happened. It now crosses a rotation through the same cursor as `corral logs -f`."""
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"")

    async def follow() -> tuple[str, list[str]]:
        closed = asyncio.Event()
        tail = Tail(log, closed)
        queue, _ = tail.join()
        text, events = "", []

        async def until(number: int) -> None:
            nonlocal text
            while f"line {number:06d} " not in text:
                frame = await asyncio.wait_for(queue.get(), 10)
                assert frame is not None
                event, data = re.match(rb"event: (\w+)\ndata: (.*)\n\n", frame).groups()  # type: ignore[union-attr]
                events.append(event.decode())
                text += json.loads(data) or ""

        try:
            _append(log, 0, 100)
            await until(99)
            _append(log, 100, 100)  # written just before the rotation: read from .1
            assert rotate_if_over(log, 1) is not None
            _append(log, 200, 300)  # and the log grew back past where the tab was
            await until(499)
        finally:
            closed.set()
            tail.leave(queue)
        return text, events

    text, events = asyncio.run(follow())
    numbers = [int(n) for n in re.findall(r"^line (\d+) x+$", text, re.M)]
    assert numbers == list(range(500)), "lines lost, repeated or out of order"
    assert events.count("rotated") == 1, events


def test_a_tab_sees_a_log_emptied_before_its_tail_task_first_ran(tmp_path: Path) -> None:
    """The dashboard's tail made its cursor when its task first ran: a log emptied between a
    tab's join and that moment looked like a log that had always been that short, and the tab
    never heard of the rotation nor of anything written after it (seen once in CI)."""
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"before\n" * 10)

    async def follow() -> list[bytes]:
        closed = asyncio.Event()
        tail = Tail(log, closed)
        queue, _ = tail.join()  # its task is created, not yet run
        log.write_bytes(b"")  # emptied in place, as the size cap does
        log.write_bytes(b"after\n")
        frames = []
        try:
            while not any(b"after" in frame for frame in frames):
                frame = await asyncio.wait_for(queue.get(), 5)
                assert frame is not None
                frames.append(frame)
        finally:
            closed.set()
            tail.leave(queue)
        return frames

    frames = asyncio.run(follow())
    assert frames[0].startswith(b"event: rotated"), frames
