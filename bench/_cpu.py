"""A process's CPU time as the scheduler counts it, for the benchmarks that charge it.

Why not psutil's ``cpu_times``: those come in 10 ms ticks, too coarse for an idle process's few
ms a second or a run of 100 requests at ~1 ms each. ``/proc/PID/task/TID/schedstat`` gives each
thread's time on a CPU in nanoseconds. A thread that has ended is no longer listed: its time
is only in its process's ticks, which the caller keeps for that case where it matters.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["schedstat_seconds", "thread_nanoseconds"]


def thread_nanoseconds(pid: int) -> dict[int, int]:
    """Each listed thread of ``pid``: its CPU time so far, in nanoseconds (a thread that ends
    while being read is left out; an ended process gives nothing)."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
    return out


def schedstat_seconds(pid: int) -> float:
    """The CPU time the scheduler charged to every thread of ``pid`` still running, in seconds."""
    return sum(thread_nanoseconds(pid).values()) / 1e9
