"""The local backend: every replica is a process group on this machine.

A replica is ``setup`` (run to completion, output in the launch log) followed by ``run`` (left
running, output appended to the replica's own log), each as ``bash -c`` (``sh -c`` without bash),
in the replica's working directory and in a session of its own, so that one ``killpg`` reaches
the app and everything it forked.

How a process is recognised, and why not by pid alone: a pid is recycled once its process is gone,
so a handle also carries the process start time, and nothing is signalled unless the pid's start
time still matches. ``create_time`` (psutil, wall clock) is the portable form. On Linux it is
``boot time + ticks since boot`` where the boot time is re-derived from the current wall clock,
so it moves when the clock is stepped or slewed by NTP (by a second or more over days); a daemon
restarted after that would see its replicas as "gone" and leak them. So on Linux the handle also
keeps the raw start ticks and the kernel boot id, which never change, and they decide when
present; ``create_time`` (with a 1 ms tolerance) is the fallback.

Why the table of children is per process and not per :class:`LocalInfra`: reaping is a property
of the OS process (any ``waitpid`` in the process can take a child's exit status, and only the
parent can reap it). Keeping every ``Popen`` this process started in one table means any instance
reaps, reports exit codes and spares in-flight launches from ``sweep`` correctly, while a process
started by an earlier daemon (not our child: after the restart init reaps it) is handled through
psutil alone, with no exit code.

POSIX only (sessions, process groups, ``/proc`` when there is one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from corral import jobs, procfs
from corral.infra import cgroups, confine
from corral.infra.base import LaunchRequest, Liveness, ReplicaHandle
from corral.ports import free_port
from corral.procfs import running as _running
from corral.procfs import terminate_all

__all__ = ["BACKEND", "ENV_HOME_MARKER", "ENV_REPLICA_KEY", "LocalInfra", "replica_key"]

BACKEND = "local"
ENV_HOME_MARKER = "CORRAL_HOME_MARKER"
ENV_REPLICA_KEY = "CORRAL_REPLICA_KEY"

# Two readings of the same process's create_time differ by float rounding at most; two different
# processes on one pid are at least one clock tick (10 ms at HZ=100) apart, in practice far more.
_CREATE_TIME_TOLERANCE = 1e-3

# Exited children kept for exit_code(); older ones are forgotten first. Bounded so a daemon that
# restarts crash-looping replicas for months does not grow without limit.
_MAX_EXITED_CHILDREN = 4096

# How many characters of a swept process's command line go into the sweep report.
_CMDLINE_SHOWN = 200

_Leader = Literal["running", "zombie", "gone"]


def replica_key(home_marker: str, service: str, replica_id: int) -> str:
    """The value of ``CORRAL_REPLICA_KEY`` in a replica's environment (and in its handle).

    Every process the replica forks inherits it, which is how ``sweep`` tells which replica a
    stray process belongs to and how ``terminate`` checks that survivors of a group whose leader
    is gone really are this replica's. It assumes replica ids are not reused within a service.
    """
    return f"{home_marker}/{service}/{replica_id}"


# -- process identity -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ident:
    """What identifies one process across pid reuse (read from a handle or from a live process)."""

    pid: int
    create_time: float
    start_ticks: int | None = None
    boot_id: str | None = None

    def same_process(self, other: _Ident) -> bool:
        if self.pid != other.pid:
            return False
        if self.boot_id is not None and other.boot_id is not None:
            if self.boot_id != other.boot_id:
                return False  # a process from before a reboot cannot be running now
            if self.start_ticks is not None and other.start_ticks is not None:
                return self.start_ticks == other.start_ticks
        return abs(self.create_time - other.create_time) <= _CREATE_TIME_TOLERANCE


def _ident_of(proc: psutil.Process) -> _Ident:
    """Identity of a live process (raises psutil errors when it is gone)."""
    return _Ident(proc.pid, proc.create_time(), procfs.start_ticks(proc.pid), procfs.boot_id())


@dataclass(frozen=True)
class _HandleInfo:
    """The fields of a local handle's ``data``, validated once."""

    ident: _Ident
    pgid: int
    key: str | None


def _handle_info(handle: ReplicaHandle) -> _HandleInfo:
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
    ident = _Ident(
        pid,
        create_time,
        ticks if isinstance(ticks, int) else None,
        boot if isinstance(boot, str) else None,
    )
    return _HandleInfo(ident, pgid, key if isinstance(key, str) else None)


def _leader_state(ident: _Ident) -> _Leader:
    """Whether the process a handle names still exists: running, a zombie, or gone (which
    includes 'the pid now belongs to another process'). A process we may not inspect is not
    ours: every process corral starts runs as the daemon's own user."""
    try:
        proc = psutil.Process(ident.pid)
        if not _ident_of(proc).same_process(ident):
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
class _Child:
    popen: subprocess.Popen[bytes]
    ident: _Ident


class _Registry:
    """Every replica process this OS process started, plus the launches in flight.

    Keyed by pid; an entry matches a handle only when the identity matches too, so a recycled
    pid never picks up another process's Popen (or exit code).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: OrderedDict[int, _Child] = OrderedDict()
        self._inflight: dict[str, int] = {}

    def add(self, child: _Child) -> None:
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

    def find(self, ident: _Ident) -> _Child | None:
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


_REGISTRY = _Registry()


# -- helpers --------------------------------------------------------------------------------------


def _shell() -> str:
    """bash when there is one (what users write in ``run`` usually assumes it), else sh."""
    return shutil.which("bash") or shutil.which("sh") or "/bin/sh"


_CORRAL_SET = (
    "PORT",
    "CORRAL_REPLICA_ID",
    "CORRAL_SERVICE",
    "CORRAL_VERSION",
    ENV_HOME_MARKER,
    ENV_REPLICA_KEY,
)


# What a replica takes from the daemon's environment: what a program needs to find commands and
# speak the user's language, nothing else. The daemon is started by whatever shell first ran a
# corral command; its other variables (cloud keys, tokens, a virtualenv of the moment) are that
# shell's business, not the service's: a replica gets them only through envs or secrets.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR")
INHERITED_ENV_PREFIXES = ("LC_",)


def _inherited(name: str) -> bool:
    return name in INHERITED_ENV or name.startswith(INHERITED_ENV_PREFIXES)


def _replica_env(request: LaunchRequest, port: int, key: str) -> dict[str, str]:
    """The short list of the daemon's environment (:data:`INHERITED_ENV`, ``LC_*``; never a
    ``CORRAL_*`` variable: the token and home must not reach a replica), plus the version's
    envs and secrets, plus what corral tells every replica. corral's own variables win over
    the spec's: PORT must be the port the daemon probes, and the marker and key are what
    ``sweep`` and ``terminate`` trust."""
    env = {k: v for k, v in os.environ.items() if _inherited(k)}
    env.update({str(k): str(v) for k, v in request.envs.items()})
    env.update(
        {
            "PORT": str(port),
            "CORRAL_REPLICA_ID": str(request.display_id or request.replica_id),
            "CORRAL_SERVICE": request.service,
            "CORRAL_VERSION": str(request.version),
            ENV_HOME_MARKER: request.home_marker,
            ENV_REPLICA_KEY: key,
        }
    )
    return env


def _is_version_copy(path: Path, home: Path) -> bool:
    """Whether ``path`` is a version's copy of its workdir: ``HOME/services/S/versions/N/
    workdir`` or below (see corral.versionfiles), the one part of the home a replica sees."""
    parts = path.relative_to(home).parts
    return (
        len(parts) >= 5
        and parts[0] == "services"
        and parts[2] == "versions"
        and (parts[3].isdigit() and parts[4] == "workdir")
    )


def _private_parent(replica_dir: Path) -> None:
    """Make sure the per-user scratch directory above ``replica_dir`` (see
    :func:`corral.infra.base.scratch_root`) is a real directory of this user, mode 0700: in a
    shared /tmp another user could have created it first, or left a symlink there."""
    for parent in replica_dir.parents:
        if parent.name != f"corral-{os.getuid()}":
            continue
        with contextlib.suppress(FileExistsError):
            parent.mkdir(mode=0o700, parents=True)
        info = parent.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{parent} is not a directory of this user: refusing it")
        if stat.S_IMODE(info.st_mode) != 0o700:
            parent.chmod(0o700)
        return


def _chain(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    """One ``preexec_fn`` made of several (those not None), run in order."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


def _pin(cpu_ids: tuple[int, ...]) -> Callable[[], None] | None:
    """A ``preexec_fn`` step pinning the replica to its CPUs (inherited by all it starts)."""
    if not cpu_ids:
        return None
    wanted = set(cpu_ids)

    def pin() -> None:
        os.sched_setaffinity(0, wanted)

    return pin


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of group ``pgid`` (a full process scan: only for the rare slow paths)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _environ(proc: psutil.Process) -> dict[str, str] | None:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


_LOOPBACK = frozenset({"127.0.0.1", "::ffff:127.0.0.1"})
_WILDCARD = frozenset({"0.0.0.0", "::", "::ffff:0.0.0.0"})


def _listeners(port: int) -> list[tuple[str, int | None]]:
    """(address, pid) of every TCP socket listening on ``port``; the pid is None when the owner
    is not visible to this process (another user's)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return [
        (c.laddr.ip, c.pid)
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    ]


def _environ_key(proc: psutil.Process) -> str | None:
    env = _environ(proc)
    return None if env is None else env.get(ENV_REPLICA_KEY)


def _belongs_to(pid: int, pgid: int, key: str | None) -> bool:
    """``pid`` is part of the replica: in its process group, or carrying its key (a descendant
    that left the group). One that is gone cannot be shown to be ours: not ours (the next
    probe asks again)."""
    try:
        if os.getpgid(pid) == pgid:
            return True
        proc = psutil.Process(pid)
    except (OSError, psutil.Error):
        return False
    return key is not None and _environ_key(proc) == key


def _not_older(proc: psutil.Process, ident: _Ident) -> bool:
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


def _key_holders(
    key: str, leader: _Ident, *, outside_pgid: int | None = None
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
        env = _environ(proc)
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


def _stop_key_holders(
    key: str, leader: _Ident, termed: list[psutil.Process], grace: float
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
    holders = _key_holders(key, leader)
    while holders and time.monotonic() < deadline:
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for proc in holders:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
        settle = time.monotonic() + 1.0
        while any(_running(p) for p in holders) and time.monotonic() < settle:
            time.sleep(0.01)
        holders = _key_holders(key, leader)
    return [p.pid for p in holders]


def _describe(proc: psutil.Process, pgid: int, key: str | None) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        cmd = "?"
    if len(cmd) > _CMDLINE_SHOWN:
        cmd = cmd[: _CMDLINE_SHOWN - 3] + "..."
    return f"pid {proc.pid} (process group {pgid}, replica {key or '?'}): {cmd}"


def _stop(
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
            report.append("stopped " + _describe(proc, pgid, key))
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


def _marked_processes(
    home_marker: str,
) -> tuple[list[tuple[psutil.Process, str | None, int]], set[int]]:
    """Every live process (but this one) whose environment carries ``home_marker``, as
    (process, replica key, process group), and the set of their pids. One full process scan."""
    me = os.getpid()
    found: list[tuple[psutil.Process, str | None, int]] = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        env = _environ(proc)
        if env is None or env.get(ENV_HOME_MARKER) != home_marker:
            continue
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            continue
        found.append((proc, env.get(ENV_REPLICA_KEY), pgid))
    return found, {proc.pid for proc, _, _ in found}


# -- the backend ----------------------------------------------------------------------------------


class LocalInfra:
    """Replicas as local process groups. See the module docstring for how they are recognised.

    ``abort_grace`` is the TERM-to-KILL wait when a launch is abandoned after its process started
    (cancelled, or ``on_started`` failed); ``sweep_grace`` the same for leaked processes.
    """

    name = BACKEND

    def __init__(self, *, abort_grace: float = 5.0, sweep_grace: float = 5.0) -> None:
        self.abort_grace = abort_grace
        self.sweep_grace = sweep_grace
        self.confinement: confine.Confinement | None = None
        self.unconfined_reason = "not asked to (LocalInfra.confine was not called)"

    def confine(self, home: Path) -> str:
        """Confine every replica launched from now on away from ``home`` (see
        :mod:`corral.infra.confine`); return what that covers, or why it cannot be done here
        (then replicas run unconfined: the caller should say so loudly)."""
        self.confinement, text = confine.plan(home)
        if self.confinement is None:
            self.unconfined_reason = text
        return text

    # -- launch -------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        """Run ``setup`` to completion, start ``run`` and return its handle without waiting for
        readiness (the controller probes). Meant to run inside a JobPool job whose route is the
        launch log: prints and setup's output land there, and a cancel stops setup at once.

        Raises :class:`jobs.CommandFailed` when setup fails and :class:`jobs.Cancelled` when the
        job is cancelled; in both cases nothing is left running. Once ``run`` has started, its
        handle reaches ``request.on_started`` before anything else can fail.
        """
        key = replica_key(request.home_marker, request.service, request.replica_id)
        _REGISTRY.begin_launch(key)
        try:
            return self._launch(request, key)
        finally:
            _REGISTRY.end_launch(key)
            _REGISTRY.reap_all()

    def _launch(self, request: LaunchRequest, key: str) -> ReplicaHandle:
        port = request.port if request.port is not None else free_port()
        if request.workdir is not None:
            cwd = Path(request.workdir)
            if not cwd.is_dir():
                # Said plainly: Popen would only report "No such file or directory".
                raise FileNotFoundError(f"working directory {cwd} does not exist")
        else:
            cwd = Path(request.replica_dir)
            _private_parent(cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        sandbox = self.confinement
        bind: tuple[Path, Path] | None = None
        if sandbox is not None and cwd.resolve().is_relative_to(sandbox.hidden):
            if not _is_version_copy(cwd.resolve(), sandbox.hidden):
                raise ValueError(
                    f"working directory {cwd} is inside corral's home {sandbox.hidden}, which "
                    "replicas cannot see; put the service's files elsewhere"
                )
            # A version's copy of its workdir: shown to the replica, read-only, at its own
            # directory outside the home (the rest of the home stays covered).
            replica_dir = Path(request.replica_dir)
            _private_parent(replica_dir)
            replica_dir.mkdir(parents=True, exist_ok=True)
            bind, cwd = (cwd.resolve(), replica_dir), replica_dir
        # Where the replica's own writes to its working directory go (copy-on-write).
        scratch = Path(request.replica_dir).with_name(f"{request.replica_id}.writes")
        confined = _chain(
            _pin(request.cpu_ids),
            sandbox.preexec(bind, scratch if bind else None) if sandbox else None,
        )
        shell = _shell()
        env = _replica_env(request, port, key)
        log_path = Path(request.log_path)
        print(
            f"[corral] launching replica {request.service}/{request.replica_id} "
            f"(version {request.version}) locally: cwd {cwd}, port {port}, shell {shell}",
            flush=True,
        )
        # Keys only: values may be secrets, and this log is shown to anyone who asks for it.
        shown = sorted(set(request.envs) | set(_CORRAL_SET))
        print(
            f"[corral] environment: {', '.join(INHERITED_ENV)}, LC_* of the daemon's + "
            f"{', '.join(shown)}",
            flush=True,
        )
        if request.cpu_ids:
            print(f"[corral] pinned to CPUs {list(request.cpu_ids)}", flush=True)
        if bind is not None:
            print(
                f"[corral] files: {bind[0]} shown at {cwd}; the replica's writes there go to "
                f"{scratch} (a read-only view where the kernel has no overlay)",
                flush=True,
            )
        if sandbox is not None:
            print(f"[corral] confined: {sandbox.describe()}", flush=True)
        else:
            print(f"[corral] NOT confined: {self.unconfined_reason}", flush=True)

        if request.setup and request.setup.strip():
            print(f"[corral] setup: {request.setup}", flush=True)
            since = time.time()
            try:
                jobs.run_command(
                    [shell, "-c", request.setup],
                    shell=False,
                    cwd=cwd,
                    env=env,
                    timeout=request.setup_timeout,
                    preexec_fn=confined,
                )
            except subprocess.TimeoutExpired:
                for line in self._stop_strays(request.home_marker, key, since):
                    print(f"[corral] setup left a process behind: {line}", flush=True)
                raise RuntimeError(
                    f"setup did not finish within {request.setup_timeout:g}s "
                    "(service.setup_timeout_seconds); it was stopped"
                ) from None
            except BaseException:
                # run_command stops setup's own group; this catches what setup started in a
                # session of its own (``setsid``, daemonizing tools), so a failed or cancelled
                # launch really leaves nothing behind.
                for line in self._stop_strays(request.home_marker, key, since):
                    print(f"[corral] setup left a process behind: {line}", flush=True)
                raise
            print("[corral] setup done", flush=True)
        jobs.checkpoint()

        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[corral] run: {request.run}", flush=True)
        group = cgroups.replica_cgroup(request.home_marker, request.service, request.replica_id)
        join, join_fd = cgroups.enter(group) if group is not None else (None, -1)
        preexec = _chain(join, confined)
        try:
            with open(log_path, "ab") as log_file:
                popen = subprocess.Popen(
                    [shell, "-c", request.run],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    env=env,
                    # Into the replica's cgroup and sandbox before any of its code runs.
                    preexec_fn=preexec,
                )
        except BaseException:
            if group is not None:
                cgroups.kill(group)  # empty: nothing started; removes the directory
            raise
        finally:
            if join_fd >= 0:
                os.close(join_fd)
        pid = popen.pid
        pgid = pid  # start_new_session: the child leads a new session and group of its own
        try:
            ident = _ident_of(psutil.Process(pid))
        except BaseException:
            # Cannot happen short of a broken /proc: the unreaped child exists at least as a
            # zombie. Without an identity there is no safe handle, so do not leave it running.
            procfs.terminate_process_group(pgid, self.abort_grace, popen.poll)
            popen.poll()
            raise
        _REGISTRY.add(_Child(popen, ident))
        handle = ReplicaHandle(
            backend=BACKEND,
            endpoint=f"http://127.0.0.1:{port}",
            data={
                "pid": pid,
                "pgid": pgid,
                "create_time": ident.create_time,
                "start_ticks": ident.start_ticks,
                "boot_id": ident.boot_id,
                "port": port,
                "log": str(log_path),
                "key": key,
                "cgroup": str(group) if group is not None else None,
            },
        )
        try:
            request.on_started(handle)
        except BaseException:
            # Not recorded anywhere: nobody else could ever stop it.
            print(f"[corral] recording pid {pid} failed; stopping it", flush=True)
            self._abort(popen, pgid, group)
            raise
        print(
            f"[corral] started pid {pid} (process group {pgid}) in {cwd} on port {port}; "
            f"output -> {log_path}",
            flush=True,
        )
        try:
            jobs.checkpoint()
        except jobs.Cancelled:
            print(f"[corral] launch cancelled; stopping pid {pid}", flush=True)
            self._abort(popen, pgid, group)
            raise
        return handle

    def _stop_strays(self, home_marker: str, key: str, since: float) -> list[str]:
        """Stop processes of replica ``key`` started since ``since`` (wall clock, this launch).
        Never raises: it runs while another error is on its way out."""
        try:
            found, marked = _marked_processes(home_marker)
            victims: dict[int, list[tuple[psutil.Process, str | None]]] = {}
            for proc, proc_key, pgid in found:
                if proc_key != key:
                    continue
                try:
                    # On Linux create_time is ticks since boot + the boot time in WHOLE seconds,
                    # so it reads up to 1 s earlier than the wall clock at the actual start.
                    if proc.create_time() < since - 1.1:
                        continue
                except psutil.Error:
                    continue
                victims.setdefault(pgid, []).append((proc, proc_key))
            return _stop(victims, marked, self.abort_grace)
        except Exception as exc:
            return [f"looking for leftovers failed: {exc!r}"]

    def _abort(self, popen: subprocess.Popen[bytes], pgid: int, group: Path | None = None) -> None:
        """Stop a just-started replica whose launch is being abandoned. Never masks the error
        that caused the abort: a failure here is printed, and the caller re-raises its own."""
        try:
            if not procfs.terminate_process_group(pgid, self.abort_grace, popen.poll):
                print(f"[corral] process group {pgid} survived TERM and KILL", flush=True)
            if group is not None and cgroups.kill(group):
                print(f"[corral] processes in {group} survived SIGKILL", flush=True)
        except Exception as exc:
            print(f"[corral] stopping process group {pgid} failed: {exc!r}", flush=True)
        popen.poll()

    # -- terminate / check / exit_code ---------------------------------------------------------

    def terminate(self, handle: ReplicaHandle, grace: float) -> None:
        """Stop the replica's whole process group: TERM, then KILL after ``grace`` seconds.

        Idempotent: a replica already gone is success. Signals nothing unless the handle's
        process is still the same process (never a recycled pid). When the leader is gone but
        members of its group survived (a backgrounded child), they are stopped too, once their
        environment proves they are this replica's. So are processes that left the group
        (``setsid``) but carry the replica's key, found by a scan of the process table; a
        process that also scrubbed its environment is out of reach. A replica in a cgroup of
        its own is torn down through it instead (:meth:`_terminate_cgroup`): nothing escapes,
        and nothing is scanned. Raises RuntimeError when something of the replica is still
        alive afterwards.
        """
        info = _handle_info(handle)
        child = _REGISTRY.find(info.ident)
        group = handle.data.get("cgroup")
        if isinstance(group, str) and Path(group).is_dir():
            self._terminate_cgroup(Path(group), child, grace)
            return
        reap = child.popen.poll if child is not None else None
        if child is not None:
            # An unreaped child's pid cannot be reused, so Popen alone says whether it is ours.
            leader: _Leader = "running" if child.popen.poll() is None else "gone"
        else:
            leader = _leader_state(info.ident)
        group_alive = leader != "gone" or (info.key is not None and bool(self._survivors(info)))
        # Processes of this replica that left its group (``setsid``, a daemonizing child) are
        # out of reach of killpg: without this they outlived every teardown. The replica key in
        # their environment (inherited by every descendant) is what finds them.
        key, ident = info.key, info.ident
        escaped = [] if key is None else _key_holders(key, ident, outside_pgid=info.pgid)
        if not group_alive and not escaped:
            return
        if group_alive and not procfs.safe_group(info.pgid):
            raise RuntimeError(
                f"refusing to signal process group {info.pgid} of replica pid {info.ident.pid}: "
                "it is the daemon's own group"
            )
        for proc in escaped:  # TERM them now, so their grace runs alongside the group's
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        gone = True
        if group_alive:
            gone = procfs.terminate_process_group(info.pgid, grace, reap)
        if child is not None:
            child.popen.poll()
        left = [] if key is None else _stop_key_holders(key, ident, escaped, grace)
        problems = []
        if not gone:
            problems.append(
                f"replica process group {info.pgid} (pid {info.ident.pid}) is still alive "
                f"after SIGTERM, {grace:g} s and SIGKILL"
            )
        if left:
            problems.append(
                f"processes of replica pid {info.ident.pid} that left its process group are "
                f"still alive after SIGKILL: pids {left}"
            )
        if problems:
            raise RuntimeError("; ".join(problems))

    @staticmethod
    def _terminate_cgroup(cgroup: Path, child: _Child | None, grace: float) -> None:
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
        if child is not None:
            child.popen.poll()
        if left:
            raise RuntimeError(f"processes of the replica in {cgroup} survived SIGKILL: {left}")

    @staticmethod
    def _survivors(info: _HandleInfo) -> list[psutil.Process]:
        """Members of the handle's group still running after its leader is gone, and carrying
        this replica's key: the key is the proof the group id was not taken by someone else."""
        found = []
        for proc in _group_members(info.pgid):
            env = _environ(proc)
            if env is not None and env.get(ENV_REPLICA_KEY) == info.key:
                found.append(proc)
        return found

    def containment(self, home_marker: str) -> str | None:
        """Why teardown cannot catch everything here (no cgroup for replicas), or None."""
        return cgroups.unavailable_reason(home_marker)

    def release(self, home_marker: str) -> None:
        """The daemon stops: remove this home's empty replica cgroups."""
        cgroups.release_root(home_marker)

    def check(self, handle: ReplicaHandle) -> Liveness:
        """ALIVE while the handle's process runs; EXITED once it ended (reaping it if it is our
        child). A local replica cannot be LOST: its host is this machine. Cheap: a waitpid or a
        couple of /proc reads, no scans, no sleeps."""
        info = _handle_info(handle)
        child = _REGISTRY.find(info.ident)
        if child is not None:
            return Liveness.ALIVE if child.popen.poll() is None else Liveness.EXITED
        if _leader_state(info.ident) == "running":
            return Liveness.ALIVE
        return Liveness.EXITED

    def endpoint_conflict(self, handle: ReplicaHandle) -> str | None:
        """Whether the socket listening on the replica's port is the replica's own (see
        :class:`corral.infra.base.EndpointOwner`): None when it is, or when its owner cannot be
        seen (another user's process, e.g. a root ``docker-proxy`` publishing the app's port);
        otherwise who holds the port instead. The listener that gets connections to 127.0.0.1
        is judged: one bound to 127.0.0.1 itself, else a wildcard one."""
        info = _handle_info(handle)
        port = handle.data.get("port")
        if not isinstance(port, int):
            return None
        listeners = _listeners(port)
        chosen = [pid for ip, pid in listeners if ip in _LOOPBACK] or [
            pid for ip, pid in listeners if ip in _WILDCARD
        ]
        foreign = [
            pid for pid in chosen if pid is not None and not _belongs_to(pid, info.pgid, info.key)
        ]
        if not foreign:
            return None
        holders = []
        for pid in sorted(set(foreign)):
            try:
                proc = psutil.Process(pid)
                holders.append(_describe(proc, os.getpgid(pid), _environ_key(proc)))
            except (psutil.Error, ProcessLookupError):
                holders.append(f"pid {pid}")
        return (
            f"port {port} is held by a process that is not this replica's "
            f"({'; '.join(holders)}): the probe reached it, not the replica"
        )

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """The exit code of a replica this process started and that has exited (negative: killed
        by that signal, as in ``Popen.returncode``); None while it runs or when another daemon
        started it (only the parent learns an exit status)."""
        info = _handle_info(handle)
        child = _REGISTRY.find(info.ident)
        if child is None:
            return None
        return child.popen.poll()

    # -- sweep ----------------------------------------------------------------------------------

    def sweep(
        self,
        home_marker: str,
        known: Collection[ReplicaHandle],
        recorded: Collection[str] | None = None,
    ) -> list[str]:
        """Stop processes of this corral home that no known handle accounts for: what a launch
        left behind when the daemon died between starting ``run`` and recording its handle.

        ``recorded``: the replica keys of every row in the state file. When given, only a
        process whose key names a recorded replica is provably such a leftover (its row was
        written before its launch); one whose replica the file does not know at all (a state
        file restored from an older backup) is spared and reported, never killed on a guess.

        A process is spared when it is (or is in the group of) a known handle's process, carries
        a known replica's key (the app forked it, even into a session of its own), or belongs
        to a launch in flight in this process. Returns one line per process stopped (or that
        could not be stopped); does not raise for those, so one unkillable leftover cannot keep
        the daemon from starting.
        """
        known_pids: set[int] = set()
        known_pgids: set[int] = set()
        known_keys = _REGISTRY.inflight_keys()
        for handle in known:
            if handle.backend != BACKEND:
                continue
            try:
                info = _handle_info(handle)
            except ValueError:
                continue
            known_pids.add(info.ident.pid)
            known_pgids.add(info.pgid)
            if info.key is not None:
                known_keys.add(info.key)
        ours = _REGISTRY.live_pids()
        known_pids |= ours
        known_pgids |= ours

        found, marked = _marked_processes(home_marker)
        victims: dict[int, list[tuple[psutil.Process, str | None]]] = {}
        spared: list[str] = []
        for proc, key, pgid in found:
            if proc.pid in known_pids or pgid in known_pgids or key in known_keys:
                continue
            if recorded is not None and key not in recorded:
                spared.append(
                    f"spared pid {proc.pid} (replica key {key}): no replica of the state file "
                    "is its own, so it is not provably a leftover; stop it yourself if unwanted"
                )
                continue
            victims.setdefault(pgid, []).append((proc, key))
        return spared + _stop(victims, marked, self.sweep_grace)
