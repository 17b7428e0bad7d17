"""Per-replica cgroups (v2): teardown finds every process a replica started, whatever it did.

A process group misses a child that calls ``setsid``; the replica key in the environment
misses one that also clears its environment. A cgroup misses nothing: every process forked
from a member is a member, and no unprivileged call leaves it. So where the cgroup v2
hierarchy is writable (root, or a delegated subtree), each local replica runs in a cgroup of
its own, ``<daemon's cgroup>/corral-<home id>/<service>.<replica id>``, which teardown empties
with ``cgroup.kill`` (SIGKILL to every member at once, no race with forks) and removes.

The process joins its cgroup before it runs any of the replica's code: ``subprocess.Popen``'s
``preexec_fn`` writes "0" into a ``cgroup.procs`` descriptor opened by the parent. (The child
only makes one ``write`` system call there, so the usual warning about ``preexec_fn`` in
threaded programs, locks held across the fork, does not apply.)

Where no writable cgroup v2 exists, :func:`replica_root` is None and teardown falls back on
process groups and replica keys; the daemon says so at start.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "enter",
    "kill",
    "members",
    "mount_point",
    "release_root",
    "replica_cgroup",
    "replica_root",
    "unavailable_reason",
]


def mount_point() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, or None."""
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return Path(fields[1])
    except OSError:
        pass
    return None


def _own_cgroup() -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None


_reason: list[str] = []


@functools.cache
def replica_root(home_marker: str) -> Path | None:
    """The directory under which this home's replica cgroups go, or None (see
    :func:`unavailable_reason`). Checked once per process: made, and a child made and
    removed in it."""
    mount, own = mount_point(), _own_cgroup()
    if mount is None or own is None:
        _reason.append("no cgroup v2 hierarchy is mounted")
        return None
    root = mount / own.lstrip("/") / f"corral-{home_marker}"
    probe = root / f"probe-{os.getpid()}"
    try:
        root.mkdir(exist_ok=True)
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as exc:
        _reason.append(f"cgroup v2 at {mount} is not writable here ({exc.strerror})")
        return None
    return root


def unavailable_reason(home_marker: str) -> str | None:
    """Why replicas get no cgroup of their own, or None when they do."""
    if replica_root(home_marker) is not None:
        return None
    return _reason[-1] if _reason else "no usable cgroup v2"


def replica_cgroup(home_marker: str, service: str, replica_id: int) -> Path | None:
    """Make the cgroup of one replica (empty; removed by :func:`kill`); None if unavailable."""
    root = replica_root(home_marker)
    if root is None:
        return None
    path = root / f"{service}.{replica_id}"
    for _ in range(3):  # the root goes when its last replica does (see kill): make it again
        try:
            root.mkdir(exist_ok=True)
            path.mkdir(exist_ok=True)
            return path
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def enter(path: Path) -> tuple[Callable[[], None], int]:
    """A ``preexec_fn`` that moves the new process into ``path``, and the descriptor it writes
    to (the caller closes it once the child started; it is close-on-exec in the child)."""
    fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def join() -> None:
        os.write(fd, b"0")

    return join, fd


def members(path: Path) -> list[int]:
    """Pids in the cgroup (empty when it is gone)."""
    try:
        text = (path / "cgroup.procs").read_text()
    except OSError:
        return []
    return [int(pid) for pid in text.split()]


def kill(path: Path, timeout: float = 5.0) -> list[int]:
    """SIGKILL everything in the cgroup and remove it; return the pids still in it after
    ``timeout`` (empty on success). A cgroup already gone is success."""
    if not path.exists():
        return []
    killer = path / "cgroup.kill"
    deadline = time.monotonic() + timeout
    while True:
        pids = members(path)
        if not pids:
            break
        if killer.exists():
            with contextlib.suppress(OSError):
                killer.write_text("1")
        else:  # kernels before 5.14: one by one, again until none is left
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return members(path)
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        path.rmdir()
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the home's directory, once its last replica is gone
    return []


def release_root(home_marker: str) -> None:
    """Remove this home's cgroup directory if nothing is left in it (a clean daemon stop with
    no replica running); a replica still running keeps it, for the next daemon."""
    root = replica_root(home_marker)
    if root is None:
        return
    for child in root.iterdir() if root.is_dir() else ():
        if child.is_dir() and not members(child):
            with contextlib.suppress(OSError):
                child.rmdir()
    with contextlib.suppress(OSError):
        root.rmdir()
