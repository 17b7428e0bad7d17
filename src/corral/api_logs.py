"""``GET /v1/services/{name}/logs``: a log file, or the balancers' lines, streamed to the client.

Why apart from the other routes: following a log is the one long-lived answer. Its status and
first bytes are sent before the end is known, so it must survive what the writer does meanwhile
(a rotation, a truncation, the state file busy) and end when the writer is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

from aiohttp import web

from corral import logfiles, loglines
from corral.api_errors import RequestError
from corral.api_input import flag, int_param
from corral.daemon import Daemon
from corral.state import StateError

LOG_CHUNK = 1 << 16
TEXT = {"Content-Type": "text/plain; charset=utf-8"}


async def logs(request: web.Request, daemon: Daemon) -> web.StreamResponse:
    name = request.match_info["name"]
    kind = request.query.get("kind", "replica")
    follow = flag(request, "follow")
    tail = int_param(request, "tail", 0) if "tail" in request.query else None
    if kind == "load_balancer":
        daemon.controller(name)
        return await _balancer_log(request, daemon, name, follow=follow, tail=tail)
    replica_id = None
    if request.query.get("replica") is not None:
        replica_id = int_param(request, "replica", 0)  # the id users see, which names its files
    path = daemon.log_path(name, kind, replica_id)
    offset = int_param(request, "offset", 0)
    earlier: list[tuple[Path, int]] = []  # the rotated generation's last lines, sent first
    if tail is not None:
        *earlier, (_, offset) = await asyncio.to_thread(loglines.tail_spans, path, tail)
    if not path.exists() and not follow:
        launch = kind == "replica" and replica_id is not None
        raise RequestError(
            404,
            f"no {kind} log yet for service {name!r}"
            + (f" replica {replica_id}" if replica_id is not None else "")
            # A replica that failed in setup (or before) never had a log of its own.
            + (f"; its launch log: `corral logs {name} {replica_id} --launch`" if launch else ""),
        )
    response = web.StreamResponse(headers=TEXT)
    await response.prepare(request)
    try:
        if follow:
            await _send(response, loglines.span_chunks(earlier, last_as_is=False))
            await _follow(response, daemon, path, offset, name, replica_id)
        else:
            await _send(response, loglines.span_chunks([*earlier, (path, offset)]))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the reader left (Ctrl-C on `corral logs`): nothing to answer, nothing to log
    return response


async def _send(response: web.StreamResponse, chunks: Generator[bytes, None, None]) -> None:
    """Send what a file-reading generator yields, each read in a thread (off the loop)."""
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            await response.write(chunk)
    finally:
        with contextlib.suppress(ValueError):  # "generator already executing": a thread holds it
            chunks.close()


async def _follow(
    response: web.StreamResponse,
    daemon: Daemon,
    path: Path,
    position: int,
    name: str,
    replica_id: int | None,
) -> None:
    reached = 0  # where this follower got to by reading (0: nowhere yet)
    seen = await asyncio.to_thread(_bytes_before, path, position)  # the last bytes sent
    mark = await asyncio.to_thread(logfiles.rotation_mark, path)
    while True:
        # Decided before reading: what the writer wrote before it finished is still sent.
        try:
            # A stopping daemon ends its followers too: the API waits for every answer before
            # it stops, so one follower would otherwise hold the whole stop up (and stream on).
            done = daemon.stop_requested.is_set() or daemon.log_finished(name, replica_id)
        except StateError:
            done = False  # the state file is busy: keep following, ask again next time
        chunk = await asyncio.to_thread(_read_from, path, position)
        rotated, mark = await asyncio.to_thread(_rotated, path, mark, reached)
        if rotated:
            # The log was emptied (corral.logfiles moved it to .1) and its writer goes on at
            # 0: so does the follower, after the rest of the old content, which is in .1 (a
            # chunk read across the rotation may belong to either generation: dropped, and
            # read again from .1 if it was old). A line still cut short is ended, so the next
            # one starts on a line of its own.
            seen = await _send_rest_of_backup(response, path, position, seen)
            if seen[-1:] not in (b"", b"\n"):
                await response.write(b"\n")
            position = reached = 0
            seen = b""
            continue
        if chunk:
            position += len(chunk)
            reached, seen = position, (seen + chunk[-_SEEN:])[-_SEEN:]
            await response.write(chunk)
            continue
        if done:
            return
        await asyncio.sleep(0.2)


# How many of the last bytes sent a follower keeps, to recognize its generation in ``.1``.
_SEEN = 256


async def _send_rest_of_backup(
    response: web.StreamResponse, path: Path, position: int, seen: bytes
) -> bytes:
    """After a rotation, send what the follower had not read of the log's old content, now
    ``.1`` from ``position`` on; returns the last bytes sent (``seen`` if none). Only when
    ``.1`` holds, just before ``position``, the bytes the follower sent last: another
    rotation since, or a log emptied some other way, leaves an unrelated ``.1``."""
    backup = logfiles.backup_of(path)
    if not seen or await asyncio.to_thread(_bytes_before, backup, position) != seen:
        return seen
    end = await asyncio.to_thread(_size, backup)  # a .1 replaced meanwhile is not read on
    while position < end and (chunk := await asyncio.to_thread(_read_from, backup, position)):
        chunk = chunk[: end - position]
        position += len(chunk)
        seen = (seen + chunk[-_SEEN:])[-_SEEN:]
        await response.write(chunk)
    return seen


def _bytes_before(path: Path, position: int) -> bytes:
    """The (up to) _SEEN bytes of ``path`` before ``position``; b"" when it has fewer."""
    start = max(0, position - _SEEN)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(position - start)
    except OSError:
        return b""
    return data if len(data) == position - start else b""


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


async def _balancer_log(
    request: web.Request, daemon: Daemon, name: str, *, follow: bool, tail: int | None
) -> web.StreamResponse:
    """The lines of the balancer workers' logs about service ``name`` (see corral.loglines),
    the last ``tail`` of them first, then, with ``follow``, new ones until the service goes."""
    response = web.StreamResponse(headers=TEXT)
    await response.prepare(request)
    positions: dict[Any, int] = {}
    first = True
    try:
        while True:
            if first and tail is not None:  # read from the end: a worker's log may be huge
                lines, positions = await asyncio.to_thread(
                    loglines.balancer_tail, daemon.home, name, tail
                )
            else:
                lines, positions = await asyncio.to_thread(
                    loglines.balancer_lines, daemon.home, name, positions
                )
            first = False
            if lines:
                await response.write(b"".join(lines))
            if not follow or not daemon.has_service(name) or daemon.stop_requested.is_set():
                break
            await asyncio.sleep(0.5)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the reader left
    return response


def _read_from(path: Any, position: int) -> bytes:
    try:
        with open(path, "rb") as f:
            # Past the end there is nothing yet; seek itself fails on offsets beyond what the
            # file system allows (EINVAL), after the 200 went out (found by fuzzing).
            if position >= os.fstat(f.fileno()).st_size:
                return b""
            f.seek(position)
            return f.read(LOG_CHUNK)
    except FileNotFoundError:
        return b""


def _rotated(
    path: Any, mark: logfiles.RotationMark, reached: int
) -> tuple[bool, logfiles.RotationMark]:
    """Was the followed log rotated since ``mark`` (a new ``.1``), or emptied some other way
    (now shorter than what the follower read)? And the mark to compare with next time."""
    now = logfiles.rotation_mark(path)
    if now != mark:
        return True, now
    try:
        return os.stat(path).st_size < reached, now
    except OSError:
        return False, now
