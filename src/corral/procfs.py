"""What the kernel says about a process, and how a whole process group is stopped for good.

The job pool (a ``setup`` command cancelled mid-way), the local backend (a replica torn down
or swept) and the data plane (balancer workers) all start processes in groups of their own and
must be sure they are gone afterwards. They share this one module so they agree on the two
facts that are easy to get wrong: ``/proc/<pid>/stat`` is split after the *last* ``)`` (a
command name may hold spaces and parentheses), and a group that holds nothing but zombies is
gone (they are dead; only their reaping is late). Reads of ``/proc`` give None or False where
there is no procfs, so callers fall back to psutil's portable answers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil

__all__ = [
    "boot_id",
    "group_alive",
    "only_zombies",
    "running",
    "safe_group",
    "signal_group",
    "start_ticks",
    "state_and_group",
    "terminate_all",
    "terminate_process_group",
]

_DEAD_STATES = (b"Z", b"X")


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    return raw[raw.rfind(b")") + 2 :].split()


def state_and_group(pid: int | str) -> tuple[bytes, int] | None:
    """(state letter, process group) of a process; None when it is gone or unreadable."""
    fields = _stat_fields(pid)
    try:
        return (fields[0], int(fields[2])) if fields else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    """Clock ticks from boot to the start of ``pid`` (field 22 of the stat line): unlike
    psutil's ``create_time`` it does not move when the wall clock is stepped, so a process is
    recognised across a daemon restart. None where there is no procfs or the pid is gone."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


@functools.cache
def boot_id() -> str | None:
    """The kernel's id of this boot (Linux), None elsewhere: start ticks of another boot mean
    nothing now. Read once, since it cannot change while this process runs."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def running(proc: psutil.Process) -> bool:
    """Still running: not gone and not a zombie (a zombie is dead, whoever has to reap it)."""
    try:
        return proc.is_running() and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False


def terminate_all(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM every process, SIGKILL those still alive after ``grace`` seconds; return the
    ones alive 5 s after that (psutil checks each one's identity, so a recycled pid is never
    signalled)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return list(alive)


def safe_group(pgid: int) -> bool:
    """False for groups that must never be signalled as a whole: init's and our own."""
    return pgid > 1 and pgid != os.getpgrp()


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to group ``pgid``; False when there is no such group (or it is not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    """Some member of group ``pgid`` is still running (members that are only zombies are not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not only_zombies(pgid)


def only_zombies(pgid: int) -> bool:
    """True when every member of the group is a zombie (Linux; False where /proc is missing).

    ``killpg(pgid, 0)`` succeeds while a group holds nothing but zombies. A killed command's
    orphaned grandchildren are re-parented to PID 1, and when that does not reap them (corral as
    a container's PID 1, an init that reaps lazily) they stay zombies: dead, but the group would
    look alive until the grace period and the KILL wait had both run out.
    """
    leader = state_and_group(pgid)
    if leader is not None and leader[1] == pgid and leader[0] not in _DEAD_STATES:
        return False  # the usual case, without scanning every process
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    seen = False
    for entry in entries:
        if not entry.isdigit():
            continue
        member = state_and_group(entry)
        if member is None or member[1] != pgid:
            continue
        if member[0] not in _DEAD_STATES:
            return False
        seen = True
    return seen  # no member visible at all (hidden /proc): assume alive


def _wait_gone(pgid: int, seconds: float, reap: Callable[[], object] | None) -> bool:
    """Poll until group ``pgid`` is gone or ``seconds`` pass, backing off from 5 ms to 0.1 s
    (most groups leave within milliseconds of a TERM; a slow one should not cost a busy loop)."""
    deadline = time.monotonic() + seconds
    delay = 0.005
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        if not group_alive(pgid):
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return False


def terminate_process_group(
    pgid: int, grace: float = 5.0, reap: Callable[[], object] | None = None
) -> bool:
    """TERM the whole group, KILL whatever is left after ``grace`` seconds.

    ``reap`` (e.g. ``Popen.poll``) is called while waiting so an exited leader that is our own
    child does not linger as a zombie that keeps the group "alive". Returns True when the group
    is gone (a group of zombies only is gone: see :func:`only_zombies`).
    """
    if not signal_group(pgid, signal.SIGTERM):
        return True
    if _wait_gone(pgid, grace, reap):
        return True
    signal_group(pgid, signal.SIGKILL)
    if _wait_gone(pgid, 5.0, reap):
        return True
    return not group_alive(pgid)
