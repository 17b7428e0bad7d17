"""``GET /v1/services/{name}/logs``: a log file, or the balancers' lines, streamed to the client.

Why apart from the other routes: following a log is the one long-lived answer. Its status and
first bytes are sent before the end is known, so it must survive what the writer does meanwhile
(a rotation, a truncation, the state file busy) and end when the writer is gone.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from corral import logfiles, loglines
from corral.api_errors import STREAMING, RequestError
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
    if tail is not None:
        offset = await asyncio.to_thread(loglines.tail_offset, path, tail)
    if not path.exists() and not follow:
        raise RequestError(
            404,
            f"no {kind} log yet for service {name!r}"
            + (f" replica {replica_id}" if replica_id is not None else ""),
        )
    response = web.StreamResponse(headers=TEXT)
    request[STREAMING] = True
    await response.prepare(request)
    if follow:
        await _follow(response, daemon, path, offset, name, replica_id)
    else:
        await _send_from(response, path, offset)
    await response.write_eof()
    return response


async def _send_from(response: web.StreamResponse, path: Path, position: int) -> None:
    while chunk := await asyncio.to_thread(_read_from, path, position):
        position += len(chunk)
        await response.write(chunk)


async def _follow(
    response: web.StreamResponse,
    daemon: Daemon,
    path: Path,
    position: int,
    name: str,
    replica_id: int | None,
) -> None:
    reached = 0  # where this follower got to by reading (0: nowhere yet)
    last = b""  # the last byte sent
    mark = await asyncio.to_thread(logfiles.rotation_mark, path)
    while True:
        # Decided before reading: what the writer wrote before it finished is still sent.
        try:
            done = daemon.log_finished(name, replica_id)
        except StateError:
            done = False  # the state file is busy: keep following, ask again next time
        chunk = await asyncio.to_thread(_read_from, path, position)
        rotated, mark = await asyncio.to_thread(_rotated, path, mark, reached)
        if rotated:
            # The log was emptied (corral.logfiles moved it to .1) and its writer goes on at
            # 0: so does the follower. A chunk read across that may belong to either
            # generation, so it is dropped (it is in .1 if it was old). A line cut short by
            # that is ended, so the next one starts on a line of its own.
            if last not in (b"", b"\n"):
                await response.write(b"\n")
                last = b"\n"
            position = reached = 0
            continue
        if chunk:
            position += len(chunk)
            reached, last = position, chunk[-1:]
            await response.write(chunk)
            continue
        if done:
            return
        await asyncio.sleep(0.2)


async def _balancer_log(
    request: web.Request, daemon: Daemon, name: str, *, follow: bool, tail: int | None
) -> web.StreamResponse:
    """The lines of the balancer workers' logs about service ``name`` (see corral.loglines),
    the last ``tail`` of them first, then, with ``follow``, new ones until the service goes."""
    response = web.StreamResponse(headers=TEXT)
    request[STREAMING] = True
    await response.prepare(request)
    positions: dict[Any, int] = {}
    first = True
    while True:
        lines, positions = await asyncio.to_thread(
            loglines.balancer_lines, daemon.home, name, positions
        )
        if first and tail is not None:
            lines = lines[-tail:] if tail else []
        first = False
        if lines:
            await response.write(b"".join(lines))
        if not follow or not daemon.has_service(name):
            break
        await asyncio.sleep(0.5)
    await response.write_eof()
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
