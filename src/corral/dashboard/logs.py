"""Replica logs (output and launch log) followed live for the dashboard, as server-sent events.

Each followed file is one task (a :class:`Tail`) shared by every tab that shows it: it looks at
the file's size every :data:`POLL_SECONDS`, reads what was appended, encodes it once and hands
the same bytes to each of those tabs. A line a replica prints reaches the pages within about
that long, pushed by the daemon: the browser never asks again. Why polling the size rather
than inotify: one ``stat`` per followed file every quarter second, it works on every file
system (inotify misses writes over NFS and in some containers), and it needs no dependency.

Bounds: a tab's first event carries at most the last :data:`TAIL_BYTES` of the file, each later
one at most :data:`CHUNK_BYTES`; at most :data:`MAX_FOLLOWERS` streams are open at once; a tab
that falls :data:`BACKLOG` events behind is cut off (its browser reconnects by itself and starts
again from the tail) rather than queued without end; the page keeps a bounded number of lines.

A log emptied under the followers (``corral.logfiles`` moved it to ``.1``) is crossed as
`corral logs -f` crosses it (:class:`corral.loglines.LogCursor`): the rest of the old content
from ``.1``, then the new log from 0, the pages told in between (a ``rotated`` event).

The load balancer's log of a service is not one file: it is the lines naming the service in
every balancer worker's log (:mod:`corral.loglines`, as ``corral logs NAME --load-balancer``
shows them). :meth:`Followers.balancer` reads those per tab, from the last
:data:`BALANCER_TAIL_LINES` lines of each worker's log on, every :data:`BALANCER_POLL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

from aiohttp import web

from corral import loglines
from corral.dashboard.feed import SSE_HEADERS, sse

POLL_SECONDS: Final = 0.25
TAIL_BYTES: Final = 64 * 1024
CHUNK_BYTES: Final = 64 * 1024
MAX_FOLLOWERS: Final = 64
BACKLOG: Final = 256
# How often a waiting stream checks that its tab is still there (a quiet log writes nothing).
IDLE_CHECK_SECONDS: Final = 1.0
BALANCER_TAIL_LINES: Final = 2000
BALANCER_POLL_SECONDS: Final = 0.5


def _balancer_start(home: Path) -> dict[Path, int]:
    """Where a new tab starts in each worker's log: its last BALANCER_TAIL_LINES lines."""
    return {p: loglines.tail_offset(p, BALANCER_TAIL_LINES) for p in loglines.worker_logs(home)}


def _before(path: Path, end: int) -> bytes:
    """The last TAIL_BYTES before ``end``, from the start of a line."""
    start = max(0, end - TAIL_BYTES)
    try:
        data = loglines.read_at(path, start, end - start)
    except OSError:
        return b""
    if start > 0:
        data = data[data.find(b"\n") + 1 :]
    return data


class Tail:
    """One followed file and the tabs that show it."""

    def __init__(self, path: Path, closed: asyncio.Event) -> None:
        self.path = path
        self.closed = closed
        self.position = loglines.file_size(path)
        # Made now, not when the task first runs: a log emptied in between would otherwise
        # look like a log that was always this short, and the rotation would go unseen.
        self._cursor = loglines.LogCursor(path, self.position)
        self.listeners: set[asyncio.Queue[bytes | None]] = set()
        self.task: asyncio.Task[None] | None = None

    def join(self) -> tuple[asyncio.Queue[bytes | None], int]:
        """A queue of this file's events from ``position`` on, and that position: what was
        there before it is the new tab's to read (see :meth:`Followers.follow`)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=BACKLOG)
        self.listeners.add(queue)
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name=f"corral-log-tail {self.path.name}")
        return queue, self.position

    def leave(self, queue: asyncio.Queue[bytes | None]) -> bool:
        """Drop a tab; True when it was the last (the task is then stopped)."""
        self.listeners.discard(queue)
        if self.listeners or self.task is None:
            return not self.listeners
        self.task.cancel()
        return True

    def _send(self, frame: bytes | None) -> None:
        for queue in list(self.listeners):
            try:
                queue.put_nowait(frame)
            except asyncio.QueueFull:  # a tab this far behind starts again from the tail
                self.listeners.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)

    async def _run(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        cursor = self._cursor
        while not self.closed.is_set():
            if cursor.moved():  # two stats on the loop; a read only when there is news
                chunk, fresh = await asyncio.to_thread(cursor.read, CHUNK_BYTES)
                if fresh:  # rotated: what was left of the old log was sent before this
                    decoder.reset()
                    self._send(sse("rotated", None))
                self.position = cursor.position
                text = decoder.decode(chunk)
                if text:
                    self._send(sse("log", text))
                if chunk or fresh:
                    continue  # more may be waiting: no pause
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), POLL_SECONDS)
        self._send(None)


class Followers:
    """Every followed file; ``closed`` ends them all (the daemon is stopping)."""

    def __init__(self) -> None:
        self.count = 0
        self.closed = asyncio.Event()
        self.tails: dict[Path, Tail] = {}

    async def follow(self, request: web.Request, path: Path) -> web.StreamResponse:
        if self.count >= MAX_FOLLOWERS:
            return web.json_response(
                {"error": f"too many logs followed at once (at most {MAX_FOLLOWERS})"}, status=503
            )
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        tail = self.tails.get(path)
        if tail is None:
            tail = self.tails[path] = Tail(path, self.closed)
        queue, position = tail.join()
        self.count += 1
        try:
            first = await asyncio.to_thread(_before, path, position)
            text = first.decode("utf-8", errors="replace")
            await response.write(b"retry: 2000\n\n" + sse("log", text))
            await self._pump(request, response, queue)
        except ConnectionError:
            return response  # the tab closed the log
        finally:
            self.count -= 1
            if tail.leave(queue) and self.tails.get(path) is tail:
                del self.tails[path]
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def _pump(
        self, request: web.Request, response: web.StreamResponse, queue: asyncio.Queue[bytes | None]
    ) -> None:
        while not self.closed.is_set():
            try:
                frame = await asyncio.wait_for(queue.get(), IDLE_CHECK_SECONDS)
            except TimeoutError:
                transport = request.transport
                if transport is None or transport.is_closing():
                    return  # the tab went away: a quiet log would never find out by writing
                continue
            if frame is None:
                return
            await response.write(frame)

    async def balancer(
        self, request: web.Request, home: Path, name: str, alive: Callable[[], bool]
    ) -> web.StreamResponse:
        """The balancer workers' lines about service ``name``, followed until it is gone."""
        if self.count >= MAX_FOLLOWERS:
            return web.json_response(
                {"error": f"too many logs followed at once (at most {MAX_FOLLOWERS})"}, status=503
            )
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        self.count += 1
        try:
            positions = await asyncio.to_thread(_balancer_start, home)
            await response.write(b"retry: 2000\n\n")
            while not self.closed.is_set() and alive():
                lines, positions = await asyncio.to_thread(
                    loglines.balancer_lines, home, name, positions
                )
                text = b"".join(lines)[-TAIL_BYTES:].decode("utf-8", errors="replace")
                if text:
                    await response.write(sse("log", text))
                elif request.transport is None or request.transport.is_closing():
                    return response
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.closed.wait(), BALANCER_POLL_SECONDS)
        except ConnectionError:
            return response
        finally:
            self.count -= 1
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
