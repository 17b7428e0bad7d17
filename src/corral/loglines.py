"""Reading logs by lines: the last N lines of a file, and one service's lines of the balancer
workers' logs.

The balancer is not a process per service here (SkyServe has one per service, with a log of its
own): every balancer worker serves every service and writes ``dataplane/worker-N.log``. What
`corral logs NAME --load-balancer` shows is therefore the lines of those logs that name the
service (``balancer NAME ...``, ``service NAME: ...``), from every worker.
"""

from __future__ import annotations

import os
from pathlib import Path

_BLOCK = 1 << 16


def tail_offset(path: Path, lines: int) -> int:
    """Where the last ``lines`` lines of ``path`` start (0 for a shorter file, the end for 0).

    Read backwards in blocks, so a 64 MiB log costs what its tail costs. A last line without a
    newline counts as a line."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0
    with f:
        end = os.fstat(f.fileno()).st_size
        if lines <= 0:
            return end
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
                    return start + index + 1
            skip_last = False
            position = start
        return 0


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
                data = f.read()
        except OSError:
            continue
        complete = data.rfind(b"\n") + 1  # a line still being written waits for next time
        after[path] = start + complete
        lines = data[:complete].splitlines()
        found += [line + b"\n" for line in lines if names_service(line, service)]
    # Each line starts with its time (the workers' logging format): merged in time order.
    found.sort(key=lambda line: line[:23])
    return found, after


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of ``path`` (at most ``limit`` characters), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(tail_offset(path, 3))
            lines = [line.strip() for line in f.read(64 * 1024).splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].decode("utf-8", "replace")[:limit] if lines else ""
