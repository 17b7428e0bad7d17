"""``GET /v1/services/{name}/logs``: a log file, or the balancers' lines, streamed to the client.

Why apart from the other routes: following a log is the one long-lived answer. Its status and
first bytes are sent before the end is known, so it must survive what the writer does meanwhile
(a rotation, a truncation, the state file busy) and end when the writer is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator
from pathlib import Path
from typing import Any

from aiohttp import web

from corral import loglines
from corral.api_errors import RequestError
from corral.api_input import flag, int_param
from corral.daemon import Daemon
from corral.state import StateError

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
            + _why_no_log(daemon, name, replica_id)
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


def _why_no_log(daemon: Daemon, name: str, replica_id: int | None) -> str:
    """The replica's state where it explains the missing log: one PENDING (a port, a GPU, a
    CPU it waits for) has started nothing, and the two "no log yet" answers pointed from one
    missing log to the other without saying so."""
    if replica_id is None:
        return ""
    try:
        replicas = daemon.service(name).get("replicas") or ()
    except Exception:  # a hint only: the 404 stands without it
        return ""
    for replica in replicas:
        if replica.get("id") == replica_id and replica.get("status"):
            waits = f": it waits: {replica['waiting']}" if replica.get("waiting") else ""
            return f" (it is {replica['status']}{waits})"
    return ""


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
    """Send the log from ``position`` as it grows, across the size cap's rotations
    (:class:`corral.loglines.LogCursor`), until its replica's output is finished."""
    cursor = await asyncio.to_thread(loglines.LogCursor, path, position)
    while True:
        # Decided before reading: what the writer wrote before it finished is still sent.
        try:
            # A stopping daemon ends its followers too: the API waits for every answer before
            # it stops, so one follower would otherwise hold the whole stop up (and stream on).
            done = daemon.stop_requested.is_set() or daemon.log_finished(name, replica_id)
        except StateError:
            done = False  # the state file is busy: keep following, ask again next time
        chunk, fresh = await asyncio.to_thread(cursor.read)
        if chunk:
            await response.write(chunk)
        if chunk or fresh:
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
