"""What the local backend asks of a spec beyond the spec's own rules, and makes of its mounts.

These rules live with the backend, not in :mod:`corral.spec`: they follow from how local replicas
run (many on one machine, each given a free port in ``$PORT``; ``file_mounts`` copied into each
version, so only relative destinations), and another backend that gives each replica its own
host or pod has no such rule. The CLI checks them before posting a spec and
the daemon again when it accepts one, both importing from here; the spec never imports a backend.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from corral.spec import SpecIssue, key_text

if TYPE_CHECKING:
    from corral.spec import ServiceSpec

__all__ = [
    "claim_resources",
    "fixed_port",
    "local_mount_issues",
    "local_mounts",
    "local_port_problem",
    "reads_port",
]

# $PORT or ${PORT...}: anything that hands the assigned port to the command.
_PORT_REF_RE = re.compile(r"\$\{?PORT(?![A-Za-z0-9_])")


def reads_port(run: str) -> bool:
    """Whether ``run`` hands the assigned port to the command (``$PORT``, ``${PORT}``). One
    rule for the check and the launch: the launch once took any "PORT" in the text
    (``$APP_PORT``) for it, gave such a fixed-port app a free port, and probed that port."""
    return _PORT_REF_RE.search(run) is not None


def local_port_problem(spec: ServiceSpec) -> str | None:
    """Why this spec cannot run several replicas on one machine, or None if it can.

    Each local replica is given a free port in ``$PORT``. A ``run`` that binds a fixed port
    works for one replica and fails for the second (address in use), which otherwise shows up
    only later as a crash loop. A ``run`` that mentions ``$PORT`` is taken as using it. Only the
    local infra is checked: other infra give each replica its own host or pod.
    """
    port = fixed_port(spec)
    policy = spec.service.replica_policy
    most = policy.max_replicas + policy.num_overprovision
    if port is None or most <= 1:
        return None
    return (
        f"the replicas serve on port {port} and this service may run up to {most} replicas on "
        f"this machine, but `run` never uses $PORT, so every replica would try to bind port "
        f"{port}. corral gives each local replica a free port in $PORT: start the server on it "
        "(e.g. `--port $PORT`). If the program already reads the PORT environment variable, "
        "say so in run (e.g. `PORT=$PORT python3 server.py`)."
    )


def fixed_port(spec: ServiceSpec) -> int | None:
    """The port a local replica's ``run`` binds itself (it never uses ``$PORT``), or None.
    One process at a time can bind it, so it is claimed like a device
    (:func:`claim_resources`): a rolling update retires the old replica before its successor
    starts, and a blue-green one, which needs both at once, is refused."""
    port = spec.replica_port()
    if spec.infra != "local" or port is None or reads_port(spec.run or ""):
        return None
    if spec.model and not spec.run:
        return None  # the engine corral starts listens on $PORT (corral.model_engines)
    return port


def claim_resources(spec: ServiceSpec) -> dict[str, object]:
    """What a local replica of ``spec`` claims of the machine (:mod:`corral.capacity`): its
    ``resources``, and its fixed port when ``run`` binds one."""
    resources: dict[str, object] = spec.resources.model_dump(exclude_none=True)
    port = fixed_port(spec)
    if port is not None:
        resources["fixed_port"] = port
    return resources


def local_mounts(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``file_mounts`` as the local backend honours them: a destination relative to the
    replica's working directory -> an absolute local path (copied with the version)."""
    mounts = spec.file_mounts if isinstance(spec.file_mounts, dict) else {}
    return {
        str(dest): Path(base_dir, Path(str(src)).expanduser()).resolve()
        for dest, src in mounts.items()
    }


def local_mount_issues(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> list[SpecIssue]:
    """``file_mounts`` the local backend cannot honour: a bucket, an absolute destination (one
    path of this machine for every replica and version), a source that does not exist.
    Relative paths are taken from ``base_dir``, as ``workdir`` is. Other infra: no issue."""
    if not spec.file_mounts or spec.infra != "local":
        return []
    line = spec.line_of("file_mounts")
    if not isinstance(spec.file_mounts, dict):
        return [SpecIssue("file_mounts", "expected a mapping of destination: source", line)]
    issues = []
    for dest, src in spec.file_mounts.items():
        field = f"file_mounts.{key_text(dest)}"
        dest_text = str(dest)
        if not isinstance(src, str) or "://" in src:
            issues.append(
                SpecIssue(
                    field,
                    "only a local path can be mounted on infra local (not a bucket or a "
                    "storage mapping)",
                    line,
                    "download it in `setup` instead",
                )
            )
        elif dest_text.startswith(("/", "~")) or ".." in Path(dest_text).parts:
            issues.append(
                SpecIssue(
                    field,
                    f"cannot be honoured on infra local: {dest_text} would be one path of this "
                    "machine for every replica and version",
                    line,
                    "give a relative destination (placed in the replica's working directory, "
                    "copied with each version), or put the files in workdir",
                )
            )
        elif not Path(dest_text).parts:
            # "", "." or "./": the working directory itself. Accepted, the mount's copy
            # replaced the whole workdir of the version (its code gone, no word said).
            issues.append(
                SpecIssue(
                    field,
                    f"{dest_text!r} is the replica's working directory itself: the mount would "
                    "replace the whole workdir",
                    line,
                    "give a directory under it (data: ./data), or put the files in workdir",
                )
            )
        elif not Path(base_dir, Path(src).expanduser()).exists():
            issues.append(
                SpecIssue(
                    field,
                    f"{Path(base_dir, src)} does not exist (relative paths are taken from the "
                    "directory corral is run in)",
                    line,
                )
            )
    return issues
