"""The local backend: every replica is a process group on this machine.

A replica is ``setup`` (run to completion, output in the launch log) followed by ``run`` (left
running, output appended to the replica's own log), each as ``bash -c`` (``sh -c`` without bash),
in the replica's working directory and in a session of its own, so that one ``killpg`` reaches
the app and everything it forked.

Which process a handle names (identity across pid reuse, the table of our children) is
:mod:`corral.infra.local_ident`; a replica's environment, working directory and ``preexec_fn``
steps are :mod:`corral.infra.local_env`; scans for its processes beyond the leader, and
stopping them, are :mod:`corral.infra.local_scan`.

POSIX only (sessions, process groups, ``/proc`` when there is one).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Collection
from pathlib import Path

import psutil

from corral import jobs, procfs
from corral.infra import cgroups, confine
from corral.infra.base import LaunchRequest, Liveness, ReplicaHandle, drop_replica_scratch
from corral.infra.local_env import (
    announce,
    chain,
    is_version_copy,
    pin_cpus,
    private_parent,
    replica_env,
    replica_group,
    replica_shell,
    start_run,
)
from corral.infra.local_ident import (
    BACKEND,
    ENV_HOME_MARKER,
    ENV_REPLICA_KEY,
    REGISTRY,
    Child,
    HandleInfo,
    Leader,
    handle_info,
    ident_of,
    launch_floor,
    leader_state,
)
from corral.infra.local_scan import (
    LOOPBACK,
    WILDCARD,
    belongs_to,
    describe,
    environ_key,
    key_holders,
    marked_processes,
    stop_groups,
    stop_key_holders,
    survivors,
    terminate_cgroup,
)
from corral.ports import PortTaken, fixed_port_taken, free_port, listeners

__all__ = ["BACKEND", "ENV_HOME_MARKER", "ENV_REPLICA_KEY", "LocalInfra", "replica_key"]


def replica_key(home_marker: str, service: str, replica_id: int) -> str:
    """The value of ``CORRAL_REPLICA_KEY`` in a replica's environment (and in its handle).

    Every process the replica forks inherits it, which is how ``sweep`` tells which replica a
    stray process belongs to and how ``terminate`` checks that survivors of a group whose leader
    is gone really are this replica's. It assumes replica ids are not reused within a service.
    """
    return f"{home_marker}/{service}/{replica_id}"


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
        REGISTRY.begin_launch(key)
        try:
            return self._launch(request, key)
        finally:
            REGISTRY.end_launch(key)
            REGISTRY.reap_all()

    def _launch(self, request: LaunchRequest, key: str) -> ReplicaHandle:
        port = request.port if request.port is not None else free_port()
        cwd, bind = self._working_dir(request)
        # Where the replica's own writes to its working directory go (copy-on-write).
        scratch = Path(request.replica_dir).with_name(f"{request.replica_id}.writes")
        sandbox = self.confinement
        confined = chain(
            pin_cpus(request.cpu_ids),
            sandbox.preexec(bind, scratch if bind else None) if sandbox else None,
        )
        shell = replica_shell()
        env = replica_env(request, port, key)
        announce(request, cwd, port, shell, bind, scratch, self.confinement, self.unconfined_reason)
        since = time.time()  # what setup leaves running is no older (see launch_floor)
        with replica_group(request, key) as (group, join):
            if request.setup and request.setup.strip():
                argv = [shell, "-c", request.setup]
                self._setup(request, key, argv, cwd, env, chain(join, confined))
            jobs.checkpoint()
            if request.port is not None:
                taken = fixed_port_taken(request.port, request.home_marker)
                if taken is not None:
                    raise PortTaken(taken)
            popen = start_run(request, [shell, "-c", request.run], cwd, env, chain(join, confined))
        handle = self._handle(popen, group, port, key, Path(request.log_path), since)
        pid = pgid = popen.pid
        try:
            request.on_started(handle)
        except BaseException:
            # Not recorded anywhere: nobody else could ever stop it.
            print(f"[corral] recording pid {pid} failed; stopping it", flush=True)
            self._abort(popen, pgid, group)
            raise
        print(
            f"[corral] started pid {pid} (process group {pgid}) in {cwd} on port {port}; "
            f"output -> {request.log_path}",
            flush=True,
        )
        try:
            jobs.checkpoint()
        except jobs.Cancelled:
            print(f"[corral] launch cancelled; stopping pid {pid}", flush=True)
            self._abort(popen, pgid, group)
            raise
        return handle

    def _working_dir(self, request: LaunchRequest) -> tuple[Path, tuple[Path, Path] | None]:
        """The replica's working directory, and what the sandbox must show there: a version's
        copy of its workdir inside the hidden home is bound read-only at the replica's own
        directory (the rest of the home stays covered)."""
        if request.workdir is not None:
            cwd = Path(request.workdir)
            if not cwd.is_dir():
                # Said plainly: Popen would only report "No such file or directory".
                raise FileNotFoundError(f"working directory {cwd} does not exist")
        else:
            cwd = Path(request.replica_dir)
            private_parent(cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        sandbox = self.confinement
        if sandbox is None or not cwd.resolve().is_relative_to(sandbox.hidden):
            return cwd, None
        if not is_version_copy(cwd.resolve(), sandbox.hidden):
            raise ValueError(
                f"working directory {cwd} is inside corral's home {sandbox.hidden}, which "
                "replicas cannot see; put the service's files elsewhere"
            )
        replica_dir = Path(request.replica_dir)
        private_parent(replica_dir)
        replica_dir.mkdir(parents=True, exist_ok=True)
        return replica_dir, (cwd.resolve(), replica_dir)

    def _setup(
        self,
        request: LaunchRequest,
        key: str,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        preexec: Callable[[], None] | None,
    ) -> None:
        """Run ``setup`` to completion as a job command (cancel and timeout stop its group),
        then stop whatever it left in sessions of its own when it did not succeed."""
        print(f"[corral] setup: {request.setup}", flush=True)
        since = time.time()
        try:
            jobs.run_command(
                argv,
                shell=False,
                cwd=cwd,
                env=env,
                timeout=request.setup_timeout,
                preexec_fn=preexec,
            )
        except jobs.CommandFailed as exc:
            for line in self._stop_strays(request.home_marker, key, since):
                print(f"[corral] setup left a process behind: {line}", flush=True)
            raise jobs.SetupFailed(exc.returncode) from None
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

    def _handle(
        self,
        popen: subprocess.Popen[bytes],
        group: Path | None,
        port: int,
        key: str,
        log_path: Path,
        launched: float,
    ) -> ReplicaHandle:
        """The handle of a just-started ``run``, its identity recorded in the table of children."""
        pid = pgid = popen.pid  # start_new_session: the child leads a group of its own
        try:
            ident = ident_of(psutil.Process(pid))
        except BaseException:
            # Cannot happen short of a broken /proc: the unreaped child exists at least as a
            # zombie. Without an identity there is no safe handle, so do not leave it running.
            procfs.terminate_process_group(pgid, self.abort_grace, popen.poll)
            popen.poll()
            raise
        REGISTRY.add(Child(popen, ident))
        return ReplicaHandle(
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
                "launched": launched,
            },
        )

    def _stop_strays(self, home_marker: str, key: str, since: float) -> list[str]:
        """Stop processes of replica ``key`` started since ``since`` (wall clock, this launch).
        Never raises: it runs while another error is on its way out."""
        try:
            found, marked = marked_processes(home_marker)
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
            return stop_groups(victims, marked, self.abort_grace)
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
        its own is torn down through it instead
        (:func:`~corral.infra.local_scan.terminate_cgroup`): nothing escapes, and nothing is
        scanned. Raises RuntimeError when something of the replica is still alive afterwards.
        Once nothing of it runs, its scratch directory goes too (:func:`drop_replica_scratch`).
        """
        self._stop(handle, grace)
        drop_replica_scratch(handle.data.get("key"))

    def _stop(self, handle: ReplicaHandle, grace: float) -> None:
        """:meth:`terminate`'s signals and scans: every process of the replica stopped."""
        info = handle_info(handle)
        child = REGISTRY.find(info.ident)
        group = handle.data.get("cgroup")
        if isinstance(group, str) and Path(group).is_dir():
            terminate_cgroup(Path(group), child, grace)
            return
        reap = child.popen.poll if child is not None else None
        if child is not None:
            # An unreaped child's pid cannot be reused, so Popen alone says whether it is ours.
            leader: Leader = "running" if child.popen.poll() is None else "gone"
        else:
            leader = leader_state(info.ident)
        group_alive = leader != "gone" or (info.key is not None and bool(survivors(info)))
        # Processes of this replica that left its group (``setsid``, a daemonizing child) are
        # out of reach of killpg: without this they outlived every teardown. The replica key in
        # their environment (inherited by every descendant) is what finds them.
        key, ident = info.key, launch_floor(handle, info.ident)
        escaped = [] if key is None else key_holders(key, ident, outside_pgid=info.pgid)
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
        left = [] if key is None else stop_key_holders(key, ident, escaped, grace)
        if not gone or left:
            raise RuntimeError(_still_alive(info, gone, left, grace))

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
        info = handle_info(handle)
        child = REGISTRY.find(info.ident)
        if child is not None:
            return Liveness.ALIVE if child.popen.poll() is None else Liveness.EXITED
        if leader_state(info.ident) == "running":
            return Liveness.ALIVE
        return Liveness.EXITED

    def endpoint_conflict(self, handle: ReplicaHandle) -> str | None:
        """Whether the socket listening on the replica's port is the replica's own (see
        :class:`corral.infra.base.EndpointOwner`): None when it is, or when its owner cannot be
        seen (another user's process, e.g. a root ``docker-proxy`` publishing the app's port);
        otherwise who holds the port instead. The listener that gets connections to 127.0.0.1
        is judged: one bound to 127.0.0.1 itself, else a wildcard one."""
        info = handle_info(handle)
        port = handle.data.get("port")
        if not isinstance(port, int):
            return None
        held = listeners(port)
        chosen = [pid for ip, pid in held if ip in LOOPBACK] or [
            pid for ip, pid in held if ip in WILDCARD
        ]
        foreign = [
            pid for pid in chosen if pid is not None and not belongs_to(pid, info.pgid, info.key)
        ]
        if not foreign:
            return None
        holders = []
        for pid in sorted(set(foreign)):
            try:
                proc = psutil.Process(pid)
                holders.append(describe(proc, os.getpgid(pid), environ_key(proc)))
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
        info = handle_info(handle)
        child = REGISTRY.find(info.ident)
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
        known_keys = REGISTRY.inflight_keys()
        for handle in known:
            if handle.backend != BACKEND:
                continue
            try:
                info = handle_info(handle)
            except ValueError:
                continue
            known_pids.add(info.ident.pid)
            known_pgids.add(info.pgid)
            if info.key is not None:
                known_keys.add(info.key)
        ours = REGISTRY.live_pids()
        known_pids |= ours
        known_pgids |= ours

        found, marked = marked_processes(home_marker)
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
        return spared + stop_groups(victims, marked, self.sweep_grace)


def _still_alive(info: HandleInfo, gone: bool, left: list[int], grace: float) -> str:
    """What of a replica outlived its teardown, as the error the controller records."""
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
    return "; ".join(problems)
