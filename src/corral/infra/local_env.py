"""What a local replica starts with: its shell, its environment, its working directory, the
``preexec_fn`` steps (CPU pinning, cgroup, sandbox) run in the child before its code, and the
start of ``run`` itself, said in the launch log."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from corral.infra import cgroups, confine
from corral.infra.base import LaunchRequest, drop_replica_scratch
from corral.infra.local_ident import ENV_HOME_MARKER, ENV_REPLICA_KEY


def replica_shell() -> str:
    """bash when there is one (what users write in ``run`` usually assumes it), else sh."""
    return shutil.which("bash") or shutil.which("sh") or "/bin/sh"


CORRAL_SET = (
    "PORT",
    "CORRAL_REPLICA_ID",
    "CORRAL_SERVICE",
    "CORRAL_VERSION",
    ENV_HOME_MARKER,
    ENV_REPLICA_KEY,
)

# SkyPilot's own variables a SkyServe replica of one node gets (see :func:`skypilot_env`).
SKYPILOT_SET = (
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NUM_GPUS_PER_NODE",
    "SKYPILOT_NUM_NODES",
    "SKYPILOT_SERVE_REPLICA_ID",
)


# What a replica takes from the daemon's environment: what a program needs to find commands and
# speak the user's language, nothing else. The daemon is started by whatever shell first ran a
# corral command; its other variables (cloud keys, tokens, a virtualenv of the moment) are that
# shell's business, not the service's: a replica gets them only through envs or secrets.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR")
INHERITED_ENV_PREFIXES = ("LC_",)


def _inherited(name: str) -> bool:
    return name in INHERITED_ENV or name.startswith(INHERITED_ENV_PREFIXES)


def skypilot_env(replica_id: int, env: Mapping[str, str]) -> dict[str, str]:
    """What SkyPilot tells a SkyServe replica about itself, for a replica of one node.

    Why: SkyServe specs read these in ``run`` (its quickstart starts vLLM with
    ``--tensor-parallel-size $SKYPILOT_NUM_GPUS_PER_NODE``); unset, they expand to nothing and
    the engine fails on its own arguments, far from the cause. The GPU count is that of the
    devices the replica was given (its ``CUDA_VISIBLE_DEVICES``), 0 without any, as SkyPilot
    sets it on a node without GPUs; one node, always (``num_nodes`` above 1 is refused)."""
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_GPUS_PER_NODE": str(len(devices)),
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_SERVE_REPLICA_ID": str(replica_id),
    }


def replica_env(request: LaunchRequest, port: int, key: str) -> dict[str, str]:
    """The short list of the daemon's environment (:data:`INHERITED_ENV`, ``LC_*``; never a
    ``CORRAL_*`` variable: the token and home must not reach a replica), plus the version's
    envs and secrets, plus what corral tells every replica. corral's own variables win over
    the spec's: PORT must be the port the daemon probes, and the marker and key are what
    ``sweep`` and ``terminate`` trust."""
    env = {k: v for k, v in os.environ.items() if _inherited(k)}
    env.update({str(k): str(v) for k, v in request.envs.items()})
    env.update(skypilot_env(request.shown_id, env))
    env.update(
        {
            "PORT": str(port),
            "CORRAL_REPLICA_ID": str(request.shown_id),
            "CORRAL_SERVICE": request.service,
            "CORRAL_VERSION": str(request.version),
            ENV_HOME_MARKER: request.home_marker,
            ENV_REPLICA_KEY: key,
        }
    )
    return env


def is_version_copy(path: Path, home: Path) -> bool:
    """Whether ``path`` is a version's copy of its workdir: ``HOME/services/S/versions/N/
    workdir`` or below (see corral.versionfiles), the one part of the home a replica sees."""
    parts = path.relative_to(home).parts
    return (
        len(parts) >= 5
        and parts[0] == "services"
        and parts[2] == "versions"
        and (parts[3].isdigit() and parts[4] == "workdir")
    )


def private_parent(replica_dir: Path) -> None:
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


def chain(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
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


def pin_cpus(cpu_ids: tuple[int, ...]) -> Callable[[], None] | None:
    """A ``preexec_fn`` step pinning the replica to its CPUs (inherited by all it starts)."""
    if not cpu_ids:
        return None
    wanted = set(cpu_ids)

    def pin() -> None:
        os.sched_setaffinity(0, wanted)

    return pin


def announce(
    request: LaunchRequest,
    cwd: Path,
    port: int,
    shell: str,
    bind: tuple[Path, Path] | None,
    scratch: Path,
    confinement: confine.Confinement | None,
    unconfined_reason: str,
) -> None:
    """Say in the launch log where and how the replica runs (never an env value: they may
    be secrets, and this log is shown to anyone who asks for it)."""
    print(
        f"[corral] launching replica {request.service}/{request.shown_id} "
        f"(version {request.version}) locally: cwd {cwd}, port {port}, shell {shell}",
        flush=True,
    )
    shown = sorted(set(request.envs) | set(CORRAL_SET) | set(SKYPILOT_SET))
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
    if confinement is not None:
        print(f"[corral] confined: {confinement.describe()}", flush=True)
    else:
        print(f"[corral] NOT confined: {unconfined_reason}", flush=True)


@contextlib.contextmanager
def replica_group(
    request: LaunchRequest, key: str
) -> Iterator[tuple[Path | None, Callable[[], None] | None]]:
    """The replica's cgroup (None without one) and a ``preexec_fn`` step into it, for its
    ``setup`` as for its ``run``: what setup leaves running (a sidecar, a daemonizing tool) is
    the replica's and goes with it at teardown, where outside the cgroup it outlived every
    ``down``. A launch that fails before ``run`` started kills what is in it and removes it,
    and the replica's scratch directories (``key``'s) with what setup wrote there: they were
    left until the service went down, one more (a partial download...) for every attempt."""
    group = cgroups.replica_cgroup(request.home_marker, request.service, request.replica_id)
    join, join_fd = cgroups.enter(group) if group is not None else (None, -1)
    try:
        yield group, join
    except BaseException:
        if group is not None:
            cgroups.kill(group)
        drop_replica_scratch(key)
        raise
    finally:
        if join_fd >= 0:
            os.close(join_fd)


def start_run(
    request: LaunchRequest,
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    preexec: Callable[[], None] | None,
) -> subprocess.Popen[bytes]:
    """Start ``run`` in a session of its own, output appended to the replica's log.
    ``preexec`` moves it into its cgroup and sandbox before any of its code runs."""
    log_path = Path(request.log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[corral] run: {request.run}", flush=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            preexec_fn=preexec,
        )
