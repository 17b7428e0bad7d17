"""Reading logs by lines: the last N lines of a file, and one service's lines of the balancer
workers' logs.

The balancer is not a process per service here (SkyServe has one per service, with a log of its
own): every balancer worker serves every service and writes ``dataplane/worker-N.log``. What
`corral logs NAME --load-balancer` shows is therefore the lines of those logs that name the
service (``balancer NAME ...``, ``service NAME: ...``), from every worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import BinaryIO

from corral.logfiles import backup_of, backup_tmp_of, rotation_mark

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
            # Past the end there is nothing (a client's offset may be 2**62: seek itself would
            # fail with EINVAL, after the 200 went out).
            if start < os.fstat(f.fileno()).st_size:
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
    found shorter than its position was emptied or replaced: it is read again from 0, after
    what the size cap moved to its ``.1`` past that position (lines written since the last
    read, which were lost at each rotation)."""
    found: list[bytes] = []
    after = dict(positions)
    for path in worker_logs(home):
        start = positions.get(path, 0)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < start:
                    older = backup_of(path)  # the rest of the generation read up to start
                    found += _naming(read_at(older, start, file_size(older) - start), service)
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


# How many of the last bytes read a cursor keeps, to recognize its generation in ``.1``.
_SEEN = 256
# How long a rotation's copy (``<log>.1.tmp``) may take to be put in place as ``.1``.
_ROTATING_SECONDS = 10.0


class LogCursor:
    """One follower's place in a log that the size cap rotates (``corral.logfiles`` copies it
    to ``.1`` and empties it in place, and its writer goes on at 0).

    `corral logs -f` (the API) and the dashboard's log tabs both read through it, so both cross
    a rotation alike: first what they had not read of the old content, which is now ``.1``
    from their position on (only when ``.1`` holds, just before that position, the bytes they
    read last: another rotation since, or a log emptied some other way, leaves an unrelated
    ``.1``); a line the cap cut ended; then the new log from 0. A rotation is seen as a new
    ``.1`` (:func:`corral.logfiles.rotation_mark`) or the log shorter than what was read, so a
    log that grew back past the follower's place between two reads is not mistaken for more
    of the old one. Blocking file reads: async callers run :meth:`read` in a thread."""

    def __init__(self, path: Path, position: int) -> None:
        self.path = path
        self.position = position  # in the live log
        # Where reading got to in the live log: a log found shorter was emptied. Not a place
        # past the log's end (a client's offset), which would read as an emptied log at once.
        self._reached = position if position <= file_size(path) else 0
        self._seen = _bytes_before(path, position)  # the last bytes read, up to _SEEN
        self._mark = rotation_mark(path)
        self._backup: tuple[int, int] | None = None  # (position, end) in .1 while draining it
        self._fresh = False  # the next read of the live log is a new generation's first

    def moved(self) -> bool:
        """Whether :meth:`read` may have something: two ``stat`` calls, cheap enough for an
        event loop polling many logs."""
        if self._backup is not None or rotation_mark(self.path) != self._mark:
            return True
        try:
            return os.stat(self.path).st_size != self.position
        except OSError:
            return False

    def read(self, limit: int = _BLOCK) -> tuple[bytes, bool]:
        """The next bytes to show, at most ``limit`` (b"" when nothing new), and whether they
        are the first read of a new generation (the log was rotated: a reader decoding text
        starts its decoder again, a page says so)."""
        if self._backup is not None:
            chunk = self._drain(limit)
            if chunk:
                return chunk, False
        chunk = read_at(self.path, self.position, limit)
        now = rotation_mark(self.path)
        try:
            shorter = os.stat(self.path).st_size < self._reached
        except OSError:
            shorter = False
        if chunk and not shorter:
            # Emptied by something other than the cap (`: > log`, `truncate -s 0`) and written
            # past this place before this read: its size no longer tells, but what was read
            # last is no longer before this place. Read on, the start of the new content was lost.
            shorter = not _bytes_before(self.path, self.position).endswith(self._seen)
        if now == self._mark and shorter and _rotating(self.path):
            return b"", False  # emptied, its .1 not in place yet: the rest of it is read from there
        if now != self._mark or shorter:
            # A chunk read across the rotation may belong to either generation: dropped, and
            # read again from .1 when it was the old one. The mark is taken again: ``now`` may
            # predate the rename that ended this rotation (it runs in another thread), and a
            # stale mark would make the drain below take this .1 for a later rotation's.
            self._mark = rotation_mark(self.path)
            older = backup_of(self.path)
            held = bool(self._seen) and _bytes_before(older, self.position) == self._seen
            end = file_size(older) if held else 0  # a .1 replaced meanwhile is not read on
            self._backup = (self.position, end)
            return self.read(limit)
        if chunk:
            self.position += len(chunk)
            self._reached = self.position
            self._seen = (self._seen + chunk[-_SEEN:])[-_SEEN:]
        fresh, self._fresh = self._fresh, False
        return chunk, fresh

    def _drain(self, limit: int) -> bytes:
        """The next bytes of ``.1`` to send, then a line break if the old content ended mid-line;
        b"" once done, the cursor then at 0 of the new generation."""
        assert self._backup is not None
        start, end = self._backup
        chunk = (
            read_at(backup_of(self.path), start, min(limit, end - start)) if start < end else b""
        )
        if chunk and rotation_mark(self.path) != self._mark:
            chunk = b""  # rotated again: that .1 is a later generation, not the rest of this one
        if chunk:
            self._backup = (start + len(chunk), end)
            self._seen = (self._seen + chunk[-_SEEN:])[-_SEEN:]
            return chunk
        self._backup = None
        self._fresh = True
        cut = self._seen[-1:] not in (b"", b"\n")
        self.position = self._reached = 0
        self._seen = b""
        return b"\n" if cut else b""


def read_at(path: Path, position: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path`` from ``position``; b"" past its end or when it is gone
    (never a seek past what the file system allows: EINVAL, found by fuzzing the API)."""
    try:
        with open(path, "rb") as f:
            if position >= os.fstat(f.fileno()).st_size or limit <= 0:
                return b""
            f.seek(position)
            return f.read(limit)
    except FileNotFoundError:
        return b""


def _rotating(path: Path) -> bool:
    """Whether ``corral.logfiles`` is between emptying ``path`` and putting its copy in place
    as ``.1`` (a copy made in the last seconds: one left by a crash is not waited for)."""
    try:
        return time.time() - os.stat(backup_tmp_of(path)).st_mtime < _ROTATING_SECONDS
    except OSError:
        return False


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


def file_size(path: Path) -> int:
    """``path``'s size, 0 when it cannot be read (gone, not there yet)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
