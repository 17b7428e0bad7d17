"""Reading logs by lines: the last N lines of a file, and one service's lines of the balancer
workers' logs.

The balancer is not a process per service here (SkyServe has one per service, with a log of its
own): every balancer worker serves every service and writes ``dataplane/worker-N.log``. What
`corral logs NAME --load-balancer` shows is therefore the lines of those logs that name the
service (``balancer NAME ...``, ``service NAME: ...``), from every worker.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import BinaryIO

from corral.logfiles import backup_of

_BLOCK = 1 << 16
_READ_BLOCK = 1 << 20


def tail_offset(path: Path, lines: int) -> int:
    """Where the last ``lines`` lines of ``path`` start (0 for a shorter file, the end for 0).

    Read backwards in blocks, so a 64 MiB log costs what its tail costs. A last line without a
    newline counts as a line."""
    return _tail(path, lines)[0]


def tail_spans(path: Path, lines: int) -> list[tuple[Path, int]]:
    """The last ``lines`` lines of a log as (file, offset) spans to read to their ends, in
    order: the log's own, and before it the last lines of its rotated generation (``.1``)
    when the log holds fewer. Right after the size cap emptied a log, `--tail 20` printed
    nothing while the lines asked for were all in ``.1``."""
    offset, found = _tail(path, lines)
    older = backup_of(path)
    if found >= lines or not older.exists():
        return [(path, offset)]
    return [(older, _tail(older, lines - found)[0]), (path, 0)]


def span_chunks(
    spans: Sequence[tuple[Path, int]], last_as_is: bool = True
) -> Generator[bytes, None, None]:
    """The bytes of ``spans`` (:func:`tail_spans`) in order, in chunks of at most 64 KiB.

    A span other than the last ends on a line break: a rotated ``.1`` stops where the size cap
    cut it, often mid-line, and the log's own lines must not run on from it. The last span is
    the log being written, sent as it is, unless ``last_as_is`` is false (a follower reads the
    live log itself, after these). A file gone meanwhile is skipped. The same rule for the
    API's `logs --tail` and for reading a home's logs without a daemon."""
    for n, (path, start) in enumerate(spans):
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            continue
        last = b"\n"
        with f:
            f.seek(start)
            while chunk := f.read(_BLOCK):
                last = chunk[-1:]
                yield chunk
        if last != b"\n" and (n < len(spans) - 1 or not last_as_is):
            yield b"\n"


def _tail(path: Path, lines: int) -> tuple[int, int]:
    """:func:`tail_offset`, and how many lines it found there (fewer than ``lines`` when the
    file holds fewer)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0, 0
    with f:
        end = os.fstat(f.fileno()).st_size
        if lines <= 0:
            return end, 0
        position = end
        seen = 0
        # A newline ending the file closes the last line; it does not start another one.
        skip_last = True
        while position > 0:
            start = max(0, position - _BLOCK)
            f.seek(start)
            block = f.read(position - start)
            index = len(block)
            while True:
                index = block.rfind(b"\n", 0, index)
                if index < 0:
                    break
                if skip_last and start + index == end - 1:
                    skip_last = False
                    continue
                skip_last = False
                seen += 1
                if seen == lines:
                    return start + index + 1, lines
            skip_last = False
            position = start
        return 0, seen + 1 if end > 0 else 0


def worker_logs(home: Path) -> list[Path]:
    return sorted((home / "dataplane").glob("worker-*.log"))


def names_service(line: bytes, service: str) -> bool:
    """A balancer worker's log line about ``service`` (how the balancer and the worker name
    a service in what they log)."""
    name = service.encode()
    return (
        b" balancer " + name + b" " in line
        or b" balancer " + name + b":" in line
        or b" service " + name + b":" in line
    )


def balancer_lines(
    home: Path, service: str, positions: dict[Path, int]
) -> tuple[list[bytes], dict[Path, int]]:
    """The complete lines naming ``service`` written to the workers' logs since ``positions``
    (file -> offset; empty: from the start), and the positions to ask from next time. A log
    found shorter than its position was emptied or replaced: it is read again from 0."""
    found: list[bytes] = []
    after = dict(positions)
    for path in worker_logs(home):
        start = positions.get(path, 0)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < start:
                    start = 0
                f.seek(start)
                # In blocks, keeping only this service's lines: a worker's log holds every
                # service's, and may be far larger than what is asked of it.
                rest = b""
                while block := f.read(_READ_BLOCK):
                    data = rest + block
                    complete = data.rfind(b"\n") + 1
                    found += _naming(data[:complete], service)
                    rest = data[complete:]
                    start += complete  # a line still being written waits for next time
        except OSError:
            continue
        after[path] = start
    return _in_time_order(found), after


def balancer_tail(home: Path, service: str, count: int) -> tuple[list[bytes], dict[Path, int]]:
    """The last ``count`` complete lines naming ``service`` in the workers' logs, and the
    positions to follow from (:func:`balancer_lines`). Each log is read backwards in blocks
    until it gave ``count`` of them: what it costs is the tail's, not the log's."""
    found: list[bytes] = []
    after: dict[Path, int] = {}
    for path in worker_logs(home):
        try:
            with open(path, "rb") as f:
                # A last line without its newline is still being written: followed later.
                position = end = _complete_end(f, os.fstat(f.fileno()).st_size)
                head = b""  # a line's end cut off by a block's start: its start comes next
                mine: list[bytes] = []
                while position > 0 and len(mine) < count:
                    start = max(0, position - _BLOCK)
                    f.seek(start)
                    data = f.read(position - start) + head
                    head = b""
                    if start > 0:
                        newline = data.find(b"\n")
                        cut = newline + 1 if newline >= 0 else len(data)
                        head, data = data[:cut], data[cut:]
                    mine = _naming(data, service) + mine
                    position = start
        except OSError:
            continue
        after[path] = end
        found += mine[-count:] if count else []
    return _in_time_order(found)[-count:] if count else [], after


def _complete_end(f: BinaryIO, size: int) -> int:
    """Where the last complete line of ``f`` (``size`` bytes) ends: after its last newline."""
    position = size
    while position > 0:
        start = max(0, position - _BLOCK)
        f.seek(start)
        newline = f.read(position - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0


def _naming(data: bytes, service: str) -> list[bytes]:
    """The complete lines of ``data`` that name ``service``, each with its newline."""
    return [line + b"\n" for line in data.splitlines() if names_service(line, service)]


def _in_time_order(lines: list[bytes]) -> list[bytes]:
    """Each line starts with its time (the workers' logging format): merged in time order."""
    return sorted(lines, key=lambda line: line[:23])


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of ``path`` (at most ``limit`` characters), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(tail_offset(path, 3))
            lines = [line.strip() for line in f.read(64 * 1024).splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].decode("utf-8", "replace")[:limit] if lines else ""
