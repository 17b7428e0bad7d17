"""The code that runs on Ray nodes: one :class:`ReplicaActor` per replica, and a stray reaper.

This module imports nothing from corral and only the standard library at module level (Ray is
imported inside the methods that need it): :mod:`corral.infra.ray` registers it with
cloudpickle *by value*, so the nodes of a cluster need Ray and a Python, not corral.

Why the replica is a direct child that stays in the actor's process group: Ray (2.x with
per-worker process groups) gives every worker a process group of its own and kills that whole
group when the worker dies, whether by ``ray.kill``, a crash, SIGKILL or the node going away.
A child (and everything it forks) left in that group dies with the actor; a child in a session of
its own would take only itself along, and its own children would be orphaned (measured). So:

* with a group of its own (``getpgrp() == getpid()``), the actor leaves setup and run in it, and
  :meth:`ReplicaActor.stop` signals every *other* member of the group (TERM, then KILL);
* otherwise (an older Ray, or ``RAY_process_group_cleanup_enabled=0``: the worker shares its
  raylet's group, which must never be signalled) each command gets a session of its own and is
  stopped with ``killpg``; Ray still kills the direct child when the worker exits.

Either way, :meth:`stop` finishes with a scan for processes carrying the replica's
``CORRAL_REPLICA_KEY`` (what daemonized out of the group: ``setsid``, double forks), the same
proof the local backend uses. Output goes to files in a node-local directory; the daemon reads
them with :meth:`ReplicaActor.poll` / :meth:`ReplicaActor.read` and removes them with
:meth:`ReplicaActor.cleanup`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Not the local backend's CORRAL_HOME_MARKER: its leak sweep stops every process on the daemon's
# machine that carries that marker and no *local* handle's key, which would kill the Ray replicas
# on a node that shares the daemon's machine at every daemon restart.
ENV_HOME_MARKER = "CORRAL_RAY_HOME_MARKER"
ENV_REPLICA_KEY = "CORRAL_REPLICA_KEY"

_SETUP_LOG = "setup.log"
_RUN_LOG = "run.log"


def _shell() -> str:
    return shutil.which("bash") or shutil.which("sh") or "/bin/sh"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process from ``/proc/<pid>/stat``; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _live(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _kill_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _keyed(key_name: str, wanted: set[str] | None, marker: str | None) -> dict[int, str]:
    """Live processes (not this one) whose environment holds ``key_name``: pid -> value.

    With ``wanted``, only those values; with ``marker``, only processes of that corral home.
    """
    me = os.getpid()
    found = {}
    for pid in _pids():
        if pid == me or not _live(pid):
            continue
        env = _environ(pid)
        if env is None or key_name not in env:
            continue
        if marker is not None and env.get(ENV_HOME_MARKER) != marker:
            continue
        value = env[key_name]
        if wanted is None or value in wanted:
            found[pid] = value
    return found


def _stop_pids(find: Any, grace: float) -> list[int]:
    """TERM what ``find()`` returns (re-asked each round, so late forks are caught), KILL what is
    left after ``grace`` s; return the pids still alive 5 s after the KILL."""
    pids: set[int] = set(find())
    if not pids:
        return []
    _kill_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        pids = set(find())
        if not pids:
            return []
        _kill_all(pids, signal.SIGTERM)
        time.sleep(0.05)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = set(find())
        if not pids:
            return []
        _kill_all(pids, signal.SIGKILL)
        time.sleep(0.05)
    return sorted(find())


def replica_dir(marker: str, key: str) -> Path:
    """The node-local directory of the replica with ``key`` (``marker/service/id``)."""
    _, service, replica = key.split("/", 2)
    return Path(tempfile.gettempdir()) / f"corral-{marker}" / f"{service}-{replica}"


def reap_strays(marker: str, keep: list[str], only: str | None = None) -> list[str]:
    """Stop processes of corral home ``marker`` whose replica key is not in ``keep`` (or, with
    ``only``, just those of that key), and remove the node-local directories of those replicas.
    Run as a Ray task pinned to a node: the fallback for what outlived its actor (an actor
    killed abruptly never ran its cleanup). Returns one line per process stopped or left alive."""
    wanted = {only} if only is not None else None
    keep_set = set(keep)
    home = Path(tempfile.gettempdir()) / f"corral-{marker}"
    if only is not None:
        shutil.rmtree(replica_dir(marker, only), ignore_errors=True)
    elif home.is_dir():
        kept_dirs = {replica_dir(marker, k).name for k in keep_set if k.count("/") == 2}
        for entry in home.iterdir():
            if entry.name not in kept_dirs:
                shutil.rmtree(entry, ignore_errors=True)
    with contextlib.suppress(OSError):
        home.rmdir()  # only once no replica of this home uses it

    def find() -> list[int]:
        return [
            pid
            for pid, key in _keyed(ENV_REPLICA_KEY, wanted, marker).items()
            if key not in keep_set
        ]

    victims = {pid: _cmdline(pid) for pid in find()}
    left = set(_stop_pids(find, 2.0))
    return [
        f"pid {pid} ({cmd}){' still alive after SIGKILL' if pid in left else ''}"
        for pid, cmd in sorted(victims.items())
    ]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


class ReplicaActor:
    """One replica on one Ray node: runs its setup and run as children, reports and stops them.

    Meant to be created as a detached, named, threaded actor (``max_concurrency`` > 1) so that
    :meth:`poll` answers while :meth:`run_setup` blocks.
    """

    def __init__(self, key: str, home_marker: str) -> None:
        import ray

        self._key = key
        self._marker = home_marker
        self._lock = threading.Lock()
        self._dir = replica_dir(home_marker, key)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._setup: subprocess.Popen[bytes] | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._port: int | None = None
        # Our own group: children stay in it and die with us (see the module docstring).
        self._own_group = os.getpgrp() == os.getpid()
        self._node_id = str(ray.get_runtime_context().get_node_id())
        util: Any = ray.util  # untyped
        self._ip = str(util.get_node_ip_address())

    # -- facts ----------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        child = self._child
        return {
            "node_id": self._node_id,
            "ip": self._ip,
            "actor_pid": os.getpid(),
            "pid": child.pid if child is not None else None,
            "port": self._port,
            "dir": str(self._dir),
            "own_group": self._own_group,
        }

    def reserve_port(self, port: int | None) -> int:
        """The port the replica will serve on: the spec's, or one free on this node right now
        (another process may take it before the app binds it; the app then fails its probes and
        is replaced, cheaper than holding a reservation)."""
        if port is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = int(sock.getsockname()[1])
        self._port = port
        return port

    # -- commands -------------------------------------------------------------------------------

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        """The node's environment (the worker's: CUDA_VISIBLE_DEVICES and friends are right for
        this actor) without ``CORRAL_*``, plus what the daemon sends (spec envs and corral's)."""
        merged = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        merged.update(env)
        return merged

    def _cwd(self, workdir: str | None) -> Path:
        if workdir is None:
            cwd = self._dir / "work"
            cwd.mkdir(parents=True, exist_ok=True)
            return cwd
        cwd = Path(workdir)
        if not cwd.is_dir():
            raise FileNotFoundError(
                f"working directory {cwd} does not exist on Ray node {self._ip} "
                f"({self._node_id[:12]}): Ray nodes run replicas in the same path, so it must "
                "be on a shared filesystem or synced to every node"
            )
        return cwd

    def _spawn(self, command: str, env: dict[str, str], cwd: Path, log: str) -> Any:
        with open(self._dir / log, "ab") as out:
            return subprocess.Popen(
                [_shell(), "-c", command],
                start_new_session=not self._own_group,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=self._env(env),
            )

    def run_setup(self, command: str, env: dict[str, str], workdir: str | None) -> int:
        """Run setup to completion (its output in the node-local setup log); its exit code."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the replica is being stopped")
            self._setup = self._spawn(command, env, self._cwd(workdir), _SETUP_LOG)
            setup = self._setup
        return setup.wait()

    def start(self, command: str, env: dict[str, str], workdir: str | None) -> int:
        """Start ``run`` (left running, output in the node-local run log); its pid."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the replica is being stopped")
            if self._child is not None:
                return self._child.pid
            self._child = self._spawn(command, env, self._cwd(workdir), _RUN_LOG)
            return self._child.pid

    # -- watching -------------------------------------------------------------------------------

    def _read(self, name: str, offset: int, max_bytes: int) -> bytes:
        if max_bytes <= 0:
            return b""
        try:
            with open(self._dir / name, "rb") as f:
                f.seek(offset)
                return f.read(max_bytes)
        except OSError:
            return b""

    def read(self, which: str, offset: int, max_bytes: int) -> bytes:
        """Bytes of the setup or run log from ``offset``."""
        return self._read(_SETUP_LOG if which == "setup" else _RUN_LOG, offset, max_bytes)

    def poll(self, offset: int, max_bytes: int) -> dict[str, Any]:
        """The run log from ``offset`` and the child's state in one call: what the daemon's log
        pump asks every actor about twice a second."""
        child = self._child
        code = child.poll() if child is not None else None
        return {
            "offset": offset,
            "data": self._read(_RUN_LOG, offset, max_bytes),
            "started": child is not None,
            "code": code,
            "pid": child.pid if child is not None else None,
        }

    # -- stopping -------------------------------------------------------------------------------

    def _group_members(self) -> list[int]:
        me = os.getpid()
        group = os.getpgrp()
        found = []
        for pid in _pids():
            if pid == me:
                continue
            stat = _stat(pid)
            if stat is not None and stat[2] == group and stat[0] not in ("Z", "X"):
                found.append(pid)
        return found

    def _session_members(self) -> list[int]:
        found = []
        for popen in (self._setup, self._child):
            if popen is None:
                continue
            popen.poll()
            for pid in _pids():
                stat = _stat(pid)
                if stat is not None and stat[2] == popen.pid and stat[0] not in ("Z", "X"):
                    found.append(pid)
        return found

    def stop(self, grace: float) -> list[str]:
        """Stop setup, run and everything they started: TERM, KILL after ``grace`` s. Returns
        what could not be stopped (empty when all is gone). Idempotent."""
        with self._lock:
            self._stopping = True

        def find() -> list[int]:
            for popen in (self._setup, self._child):
                if popen is not None:
                    popen.poll()  # reap, so an exited leader is not counted
            members = self._group_members() if self._own_group else self._session_members()
            return members + [
                p for p in _keyed(ENV_REPLICA_KEY, {self._key}, self._marker) if p not in members
            ]

        left = _stop_pids(find, grace)
        for popen in (self._setup, self._child):
            if popen is not None:
                popen.poll()
        return [f"pid {pid} ({_cmdline(pid)}) alive after SIGKILL" for pid in left]

    def cleanup(self) -> None:
        """Remove the node-local directory (logs, default working directory)."""
        shutil.rmtree(self._dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self._dir.parent.rmdir()  # only when no other replica of this home uses it
