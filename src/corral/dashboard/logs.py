"""A replica's log (or launch log) followed live for the dashboard, as server-sent events.

Each open log is one task (the request's handler) that looks at the file's size every
:data:`POLL_SECONDS` and sends what was appended, so a line a replica prints reaches the page
within about that long: the browser never asks again, the daemon pushes. Why polling the size
rather than inotify: it is one ``stat`` per open log every quarter second, it works on every
file system (inotify misses writes over NFS and in some containers), and it needs no
dependency. Bounds: the first event carries at most the last :data:`TAIL_BYTES` of the file,
each later one at most :data:`CHUNK_BYTES`; at most :data:`MAX_FOLLOWERS` logs are followed at
once; the page keeps a bounded number of lines.

A log emptied under the follower (``corral.logfiles`` moved it to ``.1``) starts again at 0,
and the page is told (a ``rotated`` event).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
from pathlib import Path
from typing import Final

from aiohttp import web

from corral.dashboard.feed import SSE_HEADERS, sse

POLL_SECONDS: Final = 0.25
TAIL_BYTES: Final = 64 * 1024
CHUNK_BYTES: Final = 64 * 1024
MAX_FOLLOWERS: Final = 32


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: Path, position: int, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(position)
            return f.read(limit)
    except OSError:
        return b""


def _start(path: Path) -> tuple[int, bytes]:
    """Where to start following: the last TAIL_BYTES, from the start of a line."""
    size = _size(path)
    if size <= TAIL_BYTES:
        return 0, _read(path, 0, TAIL_BYTES)
    data = _read(path, size - TAIL_BYTES, TAIL_BYTES)
    cut = data.find(b"\n")
    return size - TAIL_BYTES + cut + 1, data[cut + 1 :]


class Followers:
    """The logs followed now; ``closed`` ends them all (the daemon is stopping)."""

    def __init__(self) -> None:
        self.count = 0
        self.closed = asyncio.Event()

    async def follow(self, request: web.Request, path: Path) -> web.StreamResponse:
        if self.count >= MAX_FOLLOWERS:
            return web.json_response(
                {"error": f"too many logs followed at once (at most {MAX_FOLLOWERS})"}, status=503
            )
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        self.count += 1
        try:
            await self._pump(request, response, path)
        except ConnectionError:
            return response  # the tab closed the log
        finally:
            self.count -= 1
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def _pump(self, request: web.Request, response: web.StreamResponse, path: Path) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        position, first = await asyncio.to_thread(_start, path)
        position += len(first)
        await response.write(b"retry: 2000\n\n" + sse("log", decoder.decode(first)))
        while not self.closed.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return  # the tab went away: a quiet log would never find out by writing
            size = _size(path)
            if size < position:  # emptied in place (rotated): its writer went on at 0
                position = 0
                decoder.reset()
                await response.write(sse("rotated", None))
            if size > position:
                chunk = await asyncio.to_thread(_read, path, position, CHUNK_BYTES)
                position += len(chunk)
                text = decoder.decode(chunk)
                if text:
                    await response.write(sse("log", text))
                if size > position:
                    continue  # more is waiting: no pause
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), POLL_SECONDS)
