"""Which process a local replica handle names: identity across pid reuse, and the table of
the children this OS process started.

How a process is recognised, and why not by pid alone: a pid is recycled once its process is gone,
so a handle also carries the process start time, and nothing is signalled unless the pid's start
time still matches. ``create_time`` (psutil, wall clock) is the portable form. On Linux it is
``boot time + ticks since boot`` where the boot time is re-derived from the current wall clock,
so it moves when the clock is stepped or slewed by NTP (by a second or more over days); a daemon
restarted after that would see its replicas as "gone" and leak them. So on Linux the handle also
keeps the raw start ticks and the kernel boot id, which never change, and they decide when
present; ``create_time`` (with a 1 ms tolerance) is the fallback.

Why the table of children is per process and not per :class:`~corral.infra.local.LocalInfra`:
reaping is a property of the OS process (any ``waitpid`` in the process can take a child's exit
status, and only the parent can reap it). Keeping every ``Popen`` this process started in one
table means any instance reaps, reports exit codes and spares in-flight launches from ``sweep``
correctly, while a process started by an earlier daemon (not our child: after the restart init
reaps it) is handled through psutil alone, with no exit code.
"""

from __future__ import annotations

import subprocess
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import psutil

from corral import procfs
from corral.infra.base import ReplicaHandle

BACKEND = "local"
ENV_HOME_MARKER = "CORRAL_HOME_MARKER"
ENV_REPLICA_KEY = "CORRAL_REPLICA_KEY"

# Two readings of the same process's create_time differ by float rounding at most; two different
# processes on one pid are at least one clock tick (10 ms at HZ=100) apart, in practice far more.
_CREATE_TIME_TOLERANCE = 1e-3

# Exited children kept for exit_code(); older ones are forgotten first. Bounded so a daemon that
# restarts crash-looping replicas for months does not grow without limit.
_MAX_EXITED_CHILDREN = 4096


Leader = Literal["running", "zombie", "gone"]


@dataclass(frozen=True)
class Ident:
    """What identifies one process across pid reuse (read from a handle or from a live process)."""

    pid: int
    create_time: float
    start_ticks: int | None = None
    boot_id: str | None = None

    def same_process(self, other: Ident) -> bool:
        if self.pid != other.pid:
            return False
        if self.boot_id is not None and other.boot_id is not None:
            if self.boot_id != other.boot_id:
                return False  # a process from before a reboot cannot be running now
            if self.start_ticks is not None and other.start_ticks is not None:
                return self.start_ticks == other.start_ticks
        return abs(self.create_time - other.create_time) <= _CREATE_TIME_TOLERANCE


def ident_of(proc: psutil.Process) -> Ident:
    """Identity of a live process (raises psutil errors when it is gone)."""
    return Ident(proc.pid, proc.create_time(), procfs.start_ticks(proc.pid), procfs.boot_id())


@dataclass(frozen=True)
class HandleInfo:
    """The fields of a local handle's ``data``, validated once."""

    ident: Ident
    pgid: int
    key: str | None


def handle_info(handle: ReplicaHandle) -> HandleInfo:
    if handle.backend != BACKEND:
        raise ValueError(f"not a {BACKEND} replica handle: backend={handle.backend!r}")
    data = handle.data
    try:
        pid = int(data["pid"])
        pgid = int(data.get("pgid", pid))
        create_time = float(data["create_time"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {BACKEND} replica handle {dict(data)!r}: {exc!r}") from None
    if pid <= 1 or pgid <= 1:
        # killpg(0) is our own group and pid 1 is init: never signal those from a bad handle.
        raise ValueError(f"malformed {BACKEND} replica handle: pid={pid} pgid={pgid}")
    ticks = data.get("start_ticks")
    boot = data.get("boot_id")
    key = data.get("key")
    ident = Ident(
        pid,
        create_time,
        ticks if isinstance(ticks, int) else None,
        boot if isinstance(boot, str) else None,
    )
    return HandleInfo(ident, pgid, key if isinstance(key, str) else None)


def launch_floor(handle: ReplicaHandle, leader: Ident) -> Ident:
    """The oldest a process of this replica can be: its launch's start, since what ``setup``
    left running (older than ``run``'s ``leader``) is the replica's too. A handle recorded
    before launches kept their start has the leader's own time."""
    launched = handle.data.get("launched")
    if isinstance(launched, int | float) and not isinstance(launched, bool):
        return Ident(leader.pid, float(launched))
    return leader


def leader_state(ident: Ident) -> Leader:
    """Whether the process a handle names still exists: running, a zombie, or gone (which
    includes 'the pid now belongs to another process'). A process we may not inspect is not
    ours: every process corral starts runs as the daemon's own user."""
    try:
        proc = psutil.Process(ident.pid)
        if not ident_of(proc).same_process(ident):
            return "gone"
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # includes ZombieProcess: unverified
        return "gone"
    try:
        status = proc.status()
        return "zombie" if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "running"
    except psutil.ZombieProcess:
        return "zombie"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"


# -- the per-process table of children ------------------------------------------------------------


@dataclass
class Child:
    popen: subprocess.Popen[bytes]
    ident: Ident


class _Registry:
    """Every replica process this OS process started, plus the launches in flight.

    Keyed by pid; an entry matches a handle only when the identity matches too, so a recycled
    pid never picks up another process's Popen (or exit code).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: OrderedDict[int, Child] = OrderedDict()
        self._inflight: dict[str, int] = {}

    def add(self, child: Child) -> None:
        with self._lock:
            self._children.pop(child.ident.pid, None)
            self._children[child.ident.pid] = child
            excess = len(self._children) - _MAX_EXITED_CHILDREN
            if excess > 0:
                for pid in [p for p, c in self._children.items() if c.popen.returncode is not None]:
                    if excess <= 0:
                        break
                    del self._children[pid]
                    excess -= 1

    def find(self, ident: Ident) -> Child | None:
        with self._lock:
            child = self._children.get(ident.pid)
        if child is not None and child.ident.same_process(ident):
            return child
        return None

    def reap_all(self) -> None:
        """Collect every exited child, so none lingers as a zombie between probes."""
        with self._lock:
            children = list(self._children.values())
        for child in children:
            if child.popen.returncode is None:
                child.popen.poll()

    def live_pids(self) -> set[int]:
        with self._lock:
            children = list(self._children.values())
        return {c.ident.pid for c in children if c.popen.poll() is None}

    def begin_launch(self, key: str) -> None:
        with self._lock:
            self._inflight[key] = self._inflight.get(key, 0) + 1

    def end_launch(self, key: str) -> None:
        with self._lock:
            left = self._inflight.get(key, 0) - 1
            if left > 0:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)

    def inflight_keys(self) -> set[str]:
        with self._lock:
            return set(self._inflight)


REGISTRY = _Registry()
