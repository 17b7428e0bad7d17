"""Finding a local replica's processes beyond its leader, and stopping them.

A replica's processes are its process group, plus whatever carries its ``CORRAL_REPLICA_KEY``
(inherited by every descendant, even one that left the group with ``setsid``); a home's are
those carrying its ``CORRAL_HOME_MARKER``. These scans read the whole process table, so they
serve the rare paths (a leader gone with members left, a teardown without a cgroup, the sweep at
start) and never a probe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from corral import procfs
from corral.infra import cgroups
from corral.infra.local_ident import ENV_HOME_MARKER, ENV_REPLICA_KEY, Child, HandleInfo, Ident
from corral.procfs import running as _running
from corral.procfs import terminate_all

# How many characters of a swept process's command line go into the sweep report.
_CMDLINE_SHOWN = 200


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of group ``pgid`` (a full process scan: only for the rare slow paths)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def environ(proc: psutil.Process) -> dict[str, str] | None:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


LOOPBACK = frozenset({"127.0.0.1", "::ffff:127.0.0.1"})
WILDCARD = frozenset({"0.0.0.0", "::", "::ffff:0.0.0.0"})


def environ_key(proc: psutil.Process) -> str | None:
    env = environ(proc)
    return None if env is None else env.get(ENV_REPLICA_KEY)


def belongs_to(pid: int, pgid: int, key: str | None) -> bool:
    """``pid`` is part of the replica: in its process group, or carrying its key (a descendant
    that left the group). One that is gone cannot be shown to be ours: not ours (the next
    probe asks again)."""
    try:
        if os.getpgid(pid) == pgid:
            return True
        proc = psutil.Process(pid)
    except (OSError, psutil.Error):
        return False
    return key is not None and environ_key(proc) == key


def _not_older(proc: psutil.Process, ident: Ident) -> bool:
    """``proc`` started no earlier than the process ``ident`` names, by the clock-proof start
    ticks when both are known, else by ``create_time`` with its 1 s of slack (on Linux it reads
    up to 1 s early, see LocalInfra._stop_strays)."""
    if ident.start_ticks is not None:
        ticks = procfs.start_ticks(proc.pid)
        if ticks is not None:
            return ticks >= ident.start_ticks
    try:
        return proc.create_time() >= ident.create_time - 1.1
    except psutil.Error:
        return False


def key_holders(
    key: str, leader: Ident, *, outside_pgid: int | None = None
) -> list[psutil.Process]:
    """Running processes (but this one) whose environment carries replica key ``key``; with
    ``outside_pgid``, only those not in that process group. One scan of the process table;
    only processes not older than the replica's ``leader`` (its descendants all are younger)
    have their environment read."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me or not _not_older(proc, leader):
            continue
        env = environ(proc)
        if env is None or env.get(ENV_REPLICA_KEY) != key or not _running(proc):
            continue
        if outside_pgid is not None:
            try:
                if os.getpgid(proc.pid) == outside_pgid:
                    continue
            except ProcessLookupError:
                continue
        found.append(proc)
    return found


def stop_key_holders(
    key: str, leader: Ident, termed: list[psutil.Process], grace: float
) -> list[int]:
    """Make sure no process carrying replica key ``key`` runs any more; return survivors' pids.

    ``termed`` already got SIGTERM: they get what is left of ``grace``. Then every holder of the
    key is stopped (SIGSTOP, so a process that respawns its children cannot fork between our
    scan and our kill) and killed, and the table is scanned again, until none is left or 5 s
    have passed: a tree that forks while it is being killed is caught by the next scan.
    """
    deadline = time.monotonic() + grace
    while any(_running(p) for p in termed) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 5.0
    holders = key_holders(key, leader)
    while holders and time.monotonic() < deadline:
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for proc in holders:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
        settle = time.monotonic() + 1.0
        while any(_running(p) for p in holders) and time.monotonic() < settle:
            time.sleep(0.01)
        holders = key_holders(key, leader)
    return [p.pid for p in holders]


def describe(proc: psutil.Process, pgid: int, key: str | None) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        cmd = "?"
    if len(cmd) > _CMDLINE_SHOWN:
        cmd = cmd[: _CMDLINE_SHOWN - 3] + "..."
    return f"pid {proc.pid} (process group {pgid}, replica {key or '?'}): {cmd}"


def stop_groups(
    victims: dict[int, list[tuple[psutil.Process, str | None]]], marked: set[int], grace: float
) -> list[str]:
    """Stop ``victims`` (by process group) and describe what was stopped or could not be.

    A whole group is signalled only when it is one of ours: its leader carries the home marker
    (or is gone, so the group was left by one of ours) and it is not the daemon's own group;
    otherwise only the marked processes themselves are.
    """
    report: list[str] = []
    groups: list[int] = []
    singles: list[psutil.Process] = []
    for pgid, procs in victims.items():
        for proc, key in procs:
            report.append("stopped " + describe(proc, pgid, key))
        if procfs.safe_group(pgid) and (pgid in marked or not psutil.pid_exists(pgid)):
            groups.append(pgid)
        else:
            singles.extend(proc for proc, _ in procs)
    # TERM everything first so the graces run concurrently, then wait group by group.
    for pgid in groups:
        procfs.signal_group(pgid, signal.SIGTERM)
    for pgid in groups:
        if not procfs.terminate_process_group(pgid, grace):
            report.append(f"could not stop process group {pgid}: alive after SIGKILL")
    for proc in terminate_all(singles, grace):
        report.append(f"could not stop pid {proc.pid}: alive after SIGKILL")
    return report


def marked_processes(
    home_marker: str,
) -> tuple[list[tuple[psutil.Process, str | None, int]], set[int]]:
    """Every live process (but this one) whose environment carries ``home_marker``, as
    (process, replica key, process group), and the set of their pids. One full process scan."""
    me = os.getpid()
    found: list[tuple[psutil.Process, str | None, int]] = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        env = environ(proc)
        if env is None or env.get(ENV_HOME_MARKER) != home_marker:
            continue
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            continue
        found.append((proc, env.get(ENV_REPLICA_KEY), pgid))
    return found, {proc.pid for proc, _, _ in found}


def terminate_cgroup(cgroup: Path, child: Child | None, grace: float) -> None:
    """Teardown of a replica in a cgroup of its own: everything it started is a member,
    whatever it did (``setsid``, a cleared environment), so no scan of the process table
    is needed: TERM every member, give them ``grace``, then ``cgroup.kill`` the rest.

    Proportionate: two small reads per replica, where the key scan read the environment of
    every process on the machine (200 teardowns at once stalled the daemon for seconds).
    """
    for pid in cgroups.members(cgroup):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while cgroups.members(cgroup) and time.monotonic() < deadline:
        if child is not None:
            child.popen.poll()  # reap the leader as soon as it exits
        time.sleep(0.02)
    left = cgroups.kill(cgroup)
    if child is not None and not left:
        # Out of its cgroup is not yet reapable: the kernel takes an exiting task out of the
        # cgroup before its parent can wait for it, and a check() right after this teardown
        # saw the leader ALIVE (a fresh-clone CI run). It is exiting: wait for it, bounded.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=max(1.0, grace))
    elif child is not None:
        child.popen.poll()
    if left:
        raise RuntimeError(f"processes of the replica in {cgroup} survived SIGKILL: {left}")


def survivors(info: HandleInfo) -> list[psutil.Process]:
    """Members of the handle's group still running after its leader is gone, and carrying
    this replica's key: the key is the proof the group id was not taken by someone else."""
    found = []
    for proc in group_members(info.pgid):
        env = environ(proc)
        if env is not None and env.get(ENV_REPLICA_KEY) == info.key:
            found.append(proc)
    return found


def end_home(home_marker: str, grace: float) -> list[str]:
    """Stop every process of a home whose owner is gone (the home deleted): what a daemon, a
    balancer worker or ``corral doctor`` does when no daemon will ever tear these replicas
    down. As teardown does: TERM by process group, KILL after ``grace``, then each replica's
    cgroup emptied and removed (which also stops what left the group and cleared its
    environment). Returns one line per process stopped or left."""
    found, marked = marked_processes(home_marker)
    cgroup_dirs = {path for proc, _, _ in found if (path := _replica_cgroup_of(proc.pid))}
    victims: dict[int, list[tuple[psutil.Process, str | None]]] = {}
    for proc, key, pgid in found:
        victims.setdefault(pgid, []).append((proc, key))
    report = stop_groups(victims, marked, grace)
    for path in cgroup_dirs:
        if path.parent.name == f"corral-{home_marker}":
            left = cgroups.kill(path)
            if left:
                report.append(f"could not empty {path}: {left}")
    return report


def _replica_cgroup_of(pid: int) -> Path | None:
    """The cgroup v2 directory of ``pid`` when it is a corral replica's (``corral-<home id>/
    <service>.<id>``), else None."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    mount = cgroups.mount_point()
    for line in text.splitlines():
        if line.startswith("0::") and mount is not None:
            path = mount / line[3:].lstrip("/")
            if path.parent.name.startswith("corral-"):
                return path
    return None
