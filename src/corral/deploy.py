"""From a checked spec and the values given with it (``--env``, ``--secret``) to a version's
files, and back from those files to what a replica is launched with.

The daemon calls :func:`check` before it stores anything (every problem at once, as a
:class:`SpecError`), :func:`prepare` to make the version's directory (a copy of the workdir and
the values file, see :mod:`corral.versionfiles`), and :func:`launch_inputs` when a replica of
that version starts. A version stored by an older corral has no directory: its replicas run as
they did then (the workdir in place, the spec's envs).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from corral.infra.local_rules import local_mount_issues, local_mounts, reads_port
from corral.model_engines import ModelUnavailable, engine_command
from corral.spec import (
    ServiceSpec,
    SpecError,
    SpecIssue,
    missing_values,
    path_issues,
    tls_paths,
)
from corral.versionfiles import (
    VersionFiles,
    fingerprint,
    has_files,
    prepare_version,
    read_values,
    version_dir,
)

__all__ = [
    "KEEP_VERSIONS",
    "check",
    "launch_inputs",
    "launch_port",
    "prepare",
    "probes_alike",
    "workdir_of",
]

# Versions whose files are kept for `corral update --to-version N` besides those with replicas.
KEEP_VERSIONS = 10

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def workdir_of(spec: ServiceSpec, base_dir: str | None) -> Path | None:
    """The spec's workdir as an absolute path (relative ones from ``base_dir``)."""
    if not spec.workdir:
        return None
    path = Path(spec.workdir).expanduser()
    if not path.is_absolute() and base_dir:
        path = Path(base_dir) / path
    return path.resolve()


def check(
    spec: ServiceSpec,
    *,
    source: str,
    base_dir: str | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
) -> None:
    """Every problem of the spec together with the given values, raised as one SpecError:
    keys left without a value, names given twice, a workdir that is not there."""
    issues: list[SpecIssue] = []
    for flag, given in (("--env", envs), ("--secret", secrets)):
        for key in given:
            if not _ENV_NAME.fullmatch(key):
                issues.append(SpecIssue(flag, f"{key!r} is not an environment variable name", None))
    for key in sorted(set(envs) & set(secrets)):
        issues.append(SpecIssue("--secret", f"{key} is given with both --env and --secret", None))
    for key in sorted(set(envs) & set(spec.secrets)):
        issues.append(
            SpecIssue("--env", f"{key} is a secret in the spec: give it with --secret", None)
        )
    for key in sorted(set(secrets) & set(spec.envs)):
        issues.append(
            SpecIssue("--secret", f"{key} is in the spec's envs: give it with --env", None)
        )
    issues += missing_values(spec, envs, secrets)
    if spec.workdir and base_dir is None and not Path(spec.workdir).expanduser().is_absolute():
        issues.append(
            SpecIssue(
                "workdir",
                "is relative, but the request did not say which directory it is relative to",
                spec.line_of("workdir"),
                "send base_dir (the CLI sends its current directory) or an absolute workdir",
            )
        )
    else:
        issues += path_issues(spec, base_dir or "/")
        issues += local_mount_issues(spec, base_dir or "/")
    if issues:
        raise SpecError(issues, source)


def prepare(
    home: Path,
    name: str,
    version: int,
    spec: ServiceSpec,
    *,
    base_dir: str | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
    source: str | None = None,
) -> VersionFiles:
    """Make version ``version``'s directory (blocking: run it off the event loop). The
    secrets stored are the spec's own values and the given ones (the given win); ``source``,
    the spec file's path, is left out of the fingerprint when it lies in the workdir."""
    mounts = local_mounts(spec, base_dir or "/") if spec.infra == "local" else {}
    workdir = workdir_of(spec, base_dir)
    return prepare_version(
        home,
        name,
        version,
        workdir=workdir,
        envs=dict(envs),
        secrets={**spec.secrets, **secrets},
        mounts=mounts,
        spec_file=_inside(Path(base_dir or "/", source), workdir) if source else None,
        tls=tls_paths(spec, base_dir),
    )


def _inside(file: Path, workdir: Path | None) -> str | None:
    """``file``'s path relative to ``workdir`` when it lies there (as the copy names it)."""
    if workdir is None:
        return None
    try:
        return file.resolve().relative_to(workdir.resolve()).as_posix()
    except (OSError, ValueError):
        return None


def launch_inputs(
    home: Path, name: str, version: int, spec: ServiceSpec, base_dir: str | None
) -> tuple[Path | None, dict[str, str]]:
    """Where a replica of ``version`` runs and its environment from the spec and the values."""
    directory = version_dir(home, name, version)
    if not directory.is_dir():
        if has_files(home, name):
            # Its files are gone (a state file restored from before they were pruned): never
            # fall back to the live directory; the launch fails saying this path is missing.
            return (directory / "workdir" if spec.workdir else None), dict(spec.envs)
        # Stored before versions had files (or by a client writing state directly).
        return workdir_of(spec, base_dir), dict(spec.envs)
    envs, secrets = read_values(directory)
    workdir = directory / "workdir" if (directory / "workdir").is_dir() else None
    return workdir, {**spec.envs, **envs, **secrets}


def replica_command(spec: ServiceSpec, base_dir: str | None = None) -> str:
    """What a replica runs: the spec's ``run``, or for a model-first spec the engine this
    machine has for it (corral.model_engines; a relative model path taken from ``base_dir``,
    the directory the spec was sent from). Admission refuses a model nothing here can run,
    so the fallback (a replica that fails at once with the reason in its log) only meets a
    machine that lost its engine since."""
    if spec.run:
        return spec.run
    try:
        return engine_command(spec, base_dir)
    except ModelUnavailable as exc:
        return f"echo {shlex.quote(str(exc))} >&2; exit 78"


def launch_port(spec: ServiceSpec, run: str) -> int | None:
    """The port a replica running ``run`` is launched on: None (a free one, in ``$PORT``) when
    ``run`` reads ``$PORT``, else the spec's own, which the app binds itself and the probe and
    the balancer must reach (:func:`corral.infra.local_rules.fixed_port` reads it the same)."""
    return None if reads_port(run) else spec.replica_port()


# What decides whether a readiness probe passes: a version that changes one of them must prove
# it on new replicas, as a rolling update does, before the old ones leave (its timing does not).
PROBE_ASKS = frozenset({"path", "post_data", "headers"})


def probes_alike(new: ServiceSpec, current: ServiceSpec) -> bool:
    """Whether the running replicas, kept for ``new`` (relabelled: only its `service:` section
    changed), would answer its probe as they answer ``current``'s. A new path they answered
    404 was promoted at once, and every replica fell out of the balancer together: a rolling
    update took the whole service down, with nothing left to fall back on."""
    asks = set(PROBE_ASKS)
    before = current.service.readiness_probe.model_dump(include=asks)
    return new.service.readiness_probe.model_dump(include=asks) == before


def same_replicas(
    home: Path,
    name: str,
    old: tuple[int, str | None, ServiceSpec],
    new: tuple[int, str | None, ServiceSpec],
) -> bool:
    """Whether version ``new`` (its number, base_dir and spec) differs from ``old`` only in
    the `service:` section (policy, probe timing; not what the probe asks): then ``old``'s
    running replicas are kept, relabelled. The same files (workdir copy, env and secret
    values) are part of it. The directory each was sent from counts only where the replicas
    still read it: a version without files, or the engine command a relative model path
    resolves to (an update sent from another shell relaunched every engine for a knob)."""
    (old_version, old_base, old_spec), (new_version, new_base, new_spec) = old, new
    files = fingerprint(home, name, old_version)
    return (
        files == fingerprint(home, name, new_version)
        and new_spec.model_dump(exclude={"service"}) == old_spec.model_dump(exclude={"service"})
        and probes_alike(new_spec, old_spec)
        and (
            old_base == new_base
            or (
                files is not None
                and replica_command(old_spec, old_base) == replica_command(new_spec, new_base)
            )
        )
    )
