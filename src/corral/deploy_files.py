"""The files of the versions a daemon deploys: made for a new version, shared for a rollback,
pruned past the rollback window, and swept where a killed daemon left them.

Why apart from :mod:`corral.daemon`: the daemon decides what is deployed and stores it; this is
what goes on disk around that, and what a crash between the two leaves. A version's directory
(its workdir copy and ``values.json``, the secrets, 0600) is made before its row is stored, so
that a replica never finds it missing; a daemon killed in between left it behind: under a
service that was never created (an ``up`` cut), or numbered past the service's last stored
version (an ``update`` cut). :func:`sweep_leftovers` removes those at the daemon's start,
before the API takes any request, so no create or update is under way, and it removes nothing
of a stored version.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from corral import deploy, versionfiles
from corral.deploy import KEEP_VERSIONS
from corral.errors import HomeUnwritable, Unrunnable, VersionFilesGone
from corral.spec import ServiceSpec
from corral.state import StateError, Store

log = logging.getLogger("corral.daemon")


async def prepare(
    home: Path,
    name: str,
    version: int,
    spec: ServiceSpec,
    *,
    base_dir: str | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
    source: str | None,
) -> None:
    """Make version ``version``'s files off the loop (:func:`corral.deploy.prepare`); what
    stops it is the daemon's trouble or the request's, said as a domain error."""
    try:
        files = await asyncio.to_thread(
            deploy.prepare,
            home,
            name,
            version,
            spec,
            base_dir=base_dir,
            envs=envs,
            secrets=secrets,
            source=source,
        )
    except OSError as exc:
        # The home's disk full or read-only is the daemon's trouble (retry later); anything
        # else (an unreadable file of the workdir) is the request's.
        home_trouble = {errno.ENOSPC: "disk is full", errno.EDQUOT: "disk is full"}
        home_trouble[errno.EROFS] = "home is read-only"
        trouble = home_trouble.get(exc.errno or 0)
        if trouble is not None:
            raise HomeUnwritable(
                f"service {name}: the version's files cannot be written: the {trouble} "
                f"({exc}); nothing was changed, retry",
            ) from None
        raise Unrunnable(
            f"service {name}: cannot copy the workdir of version {version}: {exc}"
        ) from None
    if spec.workdir:
        copied = f"{files.files} files, {files.bytes} bytes"
        log.info("service %s: version %d: workdir copied (%s)", name, version, copied)


@contextlib.asynccontextmanager
async def storing(home: Path, name: str, version: int) -> AsyncIterator[None]:
    """Around the storing of version ``version``, whose files were just made: when the state
    file refuses it (a :class:`StateError`: locked, full; the API answers "nothing was changed,
    retry"), its files go too, secrets included, instead of waiting for the next daemon's
    sweep. Only a version nobody stored: the caller holds the service's deploy lock and saw
    no row of it."""
    try:
        yield
    except StateError:
        directory = versionfiles.version_dir(home, name, version)
        await asyncio.to_thread(shutil.rmtree, directory, ignore_errors=True)
        await asyncio.to_thread(versionfiles.collect_garbage, home)
        raise


async def reuse(home: Path, name: str, old: int, new: int) -> None:
    """A rollback's files: version ``old``'s, shared."""
    cloned = await asyncio.to_thread(versionfiles.clone_version, home, name, old, new)
    if not cloned and versionfiles.has_files(home, name):
        raise VersionFilesGone(
            f"the files of version {old} were removed (the last {KEEP_VERSIONS} versions "
            "are kept): deploy it from its spec file with `corral update`",
        )


def prune(home: Path, store: Store, name: str) -> None:
    """Drop the files of versions no replica runs and past the rollback window; hold
    aside those a live replica runs in (``versionfiles.prune_versions``), keep those a
    launch enters. Blocking: run it off the loop, under the service's deploy lock."""
    versions, rows = [v.version for v in store.versions(name)], store.replicas(name)
    keep = set(versions[-KEEP_VERSIONS:]) | {r.version for r in rows}
    keep |= {r.launched_from for r in rows if r.launch_state in ("pending", "running")}
    running = frozenset(r.launched_from for r in rows)
    if versionfiles.prune_versions(home, name, keep, running):
        versionfiles.collect_garbage(home)


def sweep_leftovers(home: Path, store: Store) -> list[str]:
    """Remove the version files a killed daemon made but never stored (see the module): of a
    service with no row, every version's (its logs stay, as a removed service's do); of one
    with rows, those past its last stored version and those half built. What was removed, as
    ``NAME/N``. Blocking, and only before the API serves: a create or update under way has
    made files it has not stored yet."""
    removed: list[str] = []
    try:
        entries = sorted((home / "services").iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        latest = None
        if store.service(entry.name) is not None:
            latest = max((v.version for v in store.versions(entry.name)), default=0)
        gone = versionfiles.remove_unstored(home, entry.name, latest)
        removed += [f"{entry.name}/{number}" for number in gone]
    if removed:
        versionfiles.collect_garbage(home)
    return removed
