"""Memory sampler for bench/jobs_vs_processes.py, run as a separate process.

Why a process and not a sampler thread in the benchmark: (1) the fork variant must fork from a
parent with no other thread alive (forking a threaded process is unsafe and warns on 3.12+), and
(2) walking /proc for 256 children every 10 ms holds the GIL for milliseconds, which would be
charged to the JobPool's own latency. Out here it only competes for the cores, like the other
load on this shared machine.

Protocol on stdin/stdout, one line each: ``start`` -> ``ok`` (after a first sample), ``stop`` ->
one JSON object with the peaks since ``start``, ``quit`` -> exit. The tree is the target pid and
all its descendants, minus this sampler. RSS is summed every tick (~10 ms, stretched so sampling
uses at most about half a core; the member list is refreshed every 50 ms). PSS/USS come from
/proc/PID/smaps_rollup, which costs ~0.4 ms per process here, so they are swept at most every
100 ms by default (and at most a third of the time). A vfork()ed child that has not exec'd yet is
left out: it shares its parent's memory, and counting it doubled the JobPool's numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import select
import sys
import time

import psutil

PSS_MIN_INTERVAL = 0.1  # default; argv[3] overrides
# Finding the tree means reading /proc/*/stat for every pid on the machine (2-7 ms here), so the
# member list is refreshed every 50 ms and only their RSS is read every tick. A job process lives
# at least the simulated I/O (200 ms), so none is missed while it is part of the peak.
TREE_REFRESH = 0.05


def _tree(root: psutil.Process, me: int) -> list[tuple[psutil.Process, int]]:
    """The root and its descendants (minus this sampler), each with its parent's pid."""
    try:
        procs = root.children(recursive=True)
    except psutil.Error:
        return []
    out = [(root, 0)]
    for p in procs:
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            out.append((p, p.ppid()))
    return out


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_KCMP = 312 if platform.machine() == "x86_64" else -1
_KCMP_VM = 1


def _shares_parent_vm(pid: int, ppid: int) -> bool:
    """True for a vfork()ed child that has not exec'd yet: it runs in its parent's memory.

    subprocess uses vfork on Linux, so for a few microseconds every command started by a job is
    a second view of the job's (or the daemon's) whole address space. Counting it would add the
    parent's RSS and PSS a second time; kcmp(KCMP_VM) tells whether two pids share one mm.
    """
    if ppid <= 0 or _SYS_KCMP < 0:
        return False
    return int(_libc.syscall(_SYS_KCMP, ppid, pid, _KCMP_VM, 0, 0)) == 0


def _rollup(pid: int) -> tuple[int, int]:
    """(PSS, USS) in bytes from smaps_rollup; (0, 0) if the process is gone."""
    pss = uss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    uss += int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return pss, uss


class Peaks:
    """Running peaks of the tree's summed memory between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.rss = self.pss = self.uss = 0
        self.procs = 0
        self.vfork_skips = 0
        self.ticks = self.pss_sweeps = 0
        self.baseline_rss = self.baseline_pss = 0
        self.tick_seconds = 0.0
        self.pss_seconds = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "peak_rss": self.rss,
            "peak_pss": self.pss,
            "peak_uss": self.uss,
            "peak_procs": self.procs,
            "vfork_skips": self.vfork_skips,
            "baseline_rss": self.baseline_rss,
            "baseline_pss": self.baseline_pss,
            "ticks": self.ticks,
            "pss_sweeps": self.pss_sweeps,
            "sampler_wall_s": self.tick_seconds + self.pss_seconds,
        }


def main() -> None:
    root = psutil.Process(int(sys.argv[1]))
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    pss_interval = float(sys.argv[3]) if len(sys.argv) > 3 else PSS_MIN_INTERVAL
    me = os.getpid()
    peaks: Peaks | None = None
    last_pss = 0.0
    pss_cost = 0.0
    last_tree = 0.0
    members: list[tuple[psutil.Process, int]] = []
    wait = interval
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], wait if peaks is not None else None)
        if ready:
            cmd = sys.stdin.readline().strip()
            if cmd in ("quit", ""):
                return
            if cmd == "start":
                peaks = Peaks()
                last_pss = last_tree = 0.0
            elif cmd == "stop" and peaks is not None:
                sys.stdout.write(json.dumps(peaks.as_dict()) + "\n")
                sys.stdout.flush()
                peaks = None
                continue
        if peaks is None:
            continue
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        if t0 - last_tree >= TREE_REFRESH:
            members = _tree(root, me)
            last_tree = t0
        procs = [p for p, ppid in members if not _shares_parent_vm(p.pid, ppid)]
        peaks.vfork_skips += len(members) - len(procs)
        rss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
        tick = time.perf_counter() - t0
        peaks.tick_seconds += tick
        peaks.rss = max(peaks.rss, rss)
        peaks.procs = max(peaks.procs, len(procs))
        peaks.ticks += 1
        now = time.perf_counter()
        if now - last_pss >= max(pss_interval, 3 * pss_cost) or peaks.pss_sweeps == 0:
            pss = uss = 0
            for p in procs:
                a, b = _rollup(p.pid)
                pss += a
                uss += b
            pss_cost = time.perf_counter() - now
            peaks.pss_seconds += pss_cost
            last_pss = time.perf_counter()
            peaks.pss = max(peaks.pss, pss)
            peaks.uss = max(peaks.uss, uss)
            peaks.pss_sweeps += 1
        if peaks.ticks == 1:
            peaks.baseline_rss = rss
            peaks.baseline_pss = peaks.pss
            sys.stdout.write("ok\n")
            sys.stdout.flush()
        # Stretch the interval so sampling never takes more than about half a core. CPU time, not
        # wall time: when 64 children starve this process, it must sample as soon as it runs.
        wait = max(interval, time.process_time() - cpu0)


if __name__ == "__main__":
    main()
