"""A version's own files: the copy of its ``workdir`` that its replicas run from, the env and
secret values given at ``up``/``update``, and a copy of its TLS certificate and key.

Why a copy: SkyPilot copies the workdir to each replica at launch, so a version is what the
directory held when it was deployed. Running replicas in the live directory instead meant that
a replacement replica of version 1 served code edited after ``up``, next to replicas that did
not. Here the copy is taken once, at ``up``/``update``, into
``$CORRAL_HOME/services/NAME/versions/N/workdir``, and every replica of version N runs from it.

How it stays cheap: every regular file goes into a content-addressed store
(``$CORRAL_HOME/store/<sha256>``, one inode per distinct content and executable bit) and the
version's tree holds hard links to it, so 100 versions of a 1 GB directory that differ in one
file cost 1 GB plus one file, not 100 GB. The store is in the home, so the links never cross a
filesystem. A store file whose only link left is the store's own is garbage
(:func:`collect_garbage`).

Why shared inodes are safe: a write through any link would change the file for every version
that shares it, so stored files are read-only (0444, or 0555 for executables), which stops an
accidental in-place write by a replica of a non-root daemon; and a confined replica (the usual
case, :mod:`corral.infra.confine`) sees its version's tree only through an overlay whose writes
go copy-on-write to a scratch directory of its own (so it may write to its working directory,
as on a SkyPilot replica), or, where the kernel refuses an overlay, a read-only bind mount.
Either stops every writer, root included, and cannot be lifted from inside (Landlock forbids
mounts). Replacing or deleting a file (what editors and ``git checkout`` do) only ever touches
one version's directory entry.

What is left out, as SkyPilot does: with a ``.skyignore`` at the workdir's top, what it
matches; otherwise what the ``.gitignore`` files of the tree (and ``.git/info/exclude``) match,
read with gitignore's rules (``pathspec``), whether or not the directory is a git checkout.
Sockets, FIFOs and devices are skipped; symlinks are copied as links.

The values file (``values.json``, mode 0600, outside ``state.db``) holds the ``--env`` values
and every secret value. It is a separate file rather than encrypted rows because the daemon must
read secrets unattended: an encryption key would have to sit in the same 0700 home, so it would
protect nothing, while the state file (and its backups, which are copied around) stays free of
secrets, and removing a version's directory removes its secrets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets as random
import shutil
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pathspec

__all__ = [
    "SKYIGNORE",
    "VersionFiles",
    "clone_version",
    "collect_garbage",
    "fingerprint",
    "has_files",
    "held_dir",
    "prepare_version",
    "prune_versions",
    "read_values",
    "remove_service_files",
    "remove_unstored",
    "store_dir",
    "version_dir",
    "version_tls",
]

SKYIGNORE = ".skyignore"
GITIGNORE = ".gitignore"
VALUES_FILE = "values.json"
FINGERPRINT_FILE = "fingerprint"
WORKDIR = "workdir"
TLS_DIR = "tls"
TLS_CERT, TLS_KEY = "cert.pem", "key.pem"
_CHUNK = 1 << 20

# Snapshots and garbage collection never overlap: a store file is created before it is linked,
# and for that moment its link count says "garbage".
_STORE_LOCK = threading.Lock()


def store_dir(home: Path) -> Path:
    return home / "store"


def version_dir(home: Path, service: str, version: int) -> Path:
    return home / "services" / service / "versions" / str(version)


@dataclass(frozen=True)
class VersionFiles:
    """What :func:`prepare_version` made: where, and a fingerprint of everything in it (the
    files' contents and names, and the values), to tell whether a new version differs."""

    path: Path
    fingerprint: str
    files: int
    bytes: int


class _Ignored:
    """Which paths of a workdir are left out of its copy (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.skyignore: pathspec.GitIgnoreSpec | None = None
        self.git: dict[str, pathspec.GitIgnoreSpec] = {}
        sky = root / SKYIGNORE
        if sky.is_file():
            self.skyignore = _spec_of(sky)
            return
        exclude = root / ".git" / "info" / "exclude"
        if exclude.is_file():
            self.git["\0exclude"] = _spec_of(exclude)

    def enter(self, rel_dir: str) -> None:
        """Read the ``.gitignore`` of directory ``rel_dir`` (when .skyignore is not used)."""
        if self.skyignore is not None:
            return
        file = self.root / rel_dir / GITIGNORE if rel_dir else self.root / GITIGNORE
        if file.is_file():
            self.git[rel_dir] = _spec_of(file)

    def __call__(self, rel: str, is_dir: bool) -> bool:
        shown = rel + "/" if is_dir else rel
        if self.skyignore is not None:
            return self.skyignore.match_file(shown)
        for base, spec in self.git.items():
            if base == "\0exclude" or not base:
                if spec.match_file(shown):
                    return True
            elif shown.startswith(base + "/") and spec.match_file(shown[len(base) + 1 :]):
                return True
        return False


def _spec_of(file: Path) -> pathspec.GitIgnoreSpec:
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _stored(source: Path, info: os.stat_result, store: Path) -> Path:
    """``source``'s content in the store (copied there once), read-only; its path."""
    executable = bool(info.st_mode & stat.S_IXUSR)
    temp = store / f".tmp-{random.token_hex(8)}"
    digest = hashlib.sha256()
    try:
        with open(source, "rb") as reader, open(temp, "xb") as writer:
            while chunk := reader.read(_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
    except BaseException:
        temp.unlink(missing_ok=True)  # a full disk, an unreadable file: no half copy stays
        raise
    name = digest.hexdigest() + ("-x" if executable else "")
    final = store / name
    if final.exists():
        temp.unlink()
    else:
        temp.chmod(0o555 if executable else 0o444)
        os.replace(temp, final)
    return final


def _snapshot(source: Path, dest: Path, store: Path, home: Path) -> tuple[list[str], int, int]:
    """Copy ``source`` to ``dest`` through the store; the manifest lines, files and bytes.
    The corral home is never copied (a workdir may contain it: the token, the store itself)."""
    ignored = _Ignored(source)
    manifest: list[str] = []
    files = size = 0
    dest.mkdir()
    for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(source).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        ignored.enter(rel_dir)
        keep = []
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if ignored(rel, is_dir=True) or (here / name).resolve() == home:
                continue
            if (here / name).is_symlink():
                os.symlink(os.readlink(here / name), dest / rel)
                manifest.append(f"l {rel} {os.readlink(here / name)}")
                continue
            (dest / rel).mkdir()
            manifest.append(f"d {rel}")
            keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if ignored(rel, is_dir=False):
                continue
            info = os.lstat(here / name)
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(here / name)
                os.symlink(target, dest / rel)
                manifest.append(f"l {rel} {target}")
            elif stat.S_ISREG(info.st_mode):
                stored = _stored(here / name, info, store)
                os.link(stored, dest / rel)
                manifest.append(f"f {rel} {stored.name}")
                files += 1
                size += info.st_size
    return manifest, files, size


def _copy_all(
    workdir: Path | None, mounts: Mapping[str, Path], dest: Path, store: Path, home: Path
) -> tuple[list[str], int, int]:
    """The workdir, then each mount at its place inside it (replacing what was there, as a
    mount would hide it)."""
    manifest: list[str] = []
    files = size = 0
    if workdir is not None:
        manifest, files, size = _snapshot(workdir, dest, store, home.resolve())
    else:
        dest.mkdir()
    for target, source in sorted(mounts.items()):
        place = dest / target
        if place.is_dir() and not place.is_symlink():
            shutil.rmtree(place)
        elif place.exists() or place.is_symlink():
            place.unlink()
        place.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            lines, count, total = _snapshot(source, place, store, home.resolve())
            manifest += [f"m {target} {line}" for line in lines]
        else:
            stored = _stored(source, source.stat(), store)
            os.link(stored, place)
            manifest.append(f"m {target} {stored.name}")
            count, total = 1, source.stat().st_size
        files, size = files + count, size + total
    return manifest, files, size


def _write_values(directory: Path, envs: Mapping[str, str], secrets: Mapping[str, str]) -> None:
    data = json.dumps({"envs": dict(envs), "secrets": dict(secrets)}, sort_keys=True)
    fd = os.open(directory / VALUES_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(data)


def _copy_tls(directory: Path, cert: Path, key: Path) -> None:
    """The service's certificate and key, as they are now, into the version (0600, not in the
    store: a private key is linked from nowhere else)."""
    (directory / TLS_DIR).mkdir(mode=0o700)
    for source, name in ((cert, TLS_CERT), (key, TLS_KEY)):
        fd = os.open(directory / TLS_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())


def version_tls(home: Path, service: str, version: int) -> tuple[str, str] | None:
    """The copies of a version's certificate and key (see :func:`prepare_version`), or None for
    a version without TLS or made by a corral that read them from their paths."""
    tls = version_dir(home, service, version) / TLS_DIR
    cert, key = tls / TLS_CERT, tls / TLS_KEY
    return (str(cert), str(key)) if cert.is_file() and key.is_file() else None


def read_values(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The ``--env`` values and the secrets of a version (both empty when it has no file)."""
    try:
        data = json.loads((directory / VALUES_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, {}
    return dict(data.get("envs") or {}), dict(data.get("secrets") or {})


def version_envs(home: Path, service: str, version: int) -> dict[str, str]:
    """The ``--env`` values a version was given, for filling its spec again (after a daemon
    restart, or for a rollback that reuses them): empty where it has none or they cannot be
    read, as a spec parsed with none (a launch of that version then says what is wrong)."""
    try:
        return read_values(version_dir(home, service, version))[0]
    except (OSError, ValueError, AttributeError):
        return {}


def prepare_version(
    home: Path,
    service: str,
    version: int,
    *,
    workdir: Path | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
    mounts: Mapping[str, Path] | None = None,
    spec_file: str | None = None,
    tls: tuple[Path, Path] | None = None,
) -> VersionFiles:
    """Make version ``version``'s directory: a copy of ``workdir`` (if any) with ``mounts``
    (a relative destination -> a local file or directory) copied into it, and its values.

    ``tls``: the service's (certificate, key) files, copied too, so that what the balancer
    serves with is the version's: a daemon restart no longer fails the service when those
    files went bad or away since (a temp directory cleaned, a renewal half written), and a
    rollback serves its own certificate again. Left out of the fingerprint: a renewed
    certificate is the balancer's business and must not relaunch the replicas.

    ``spec_file``: where the spec itself lies in ``workdir`` (relative, ``/``-separated), if
    it does. It is copied, but left out of the fingerprint: an update that edits only the
    `service:` section of a spec kept in its workdir changes that file, and must still keep the
    running replicas (``corral.daemon``'s same-replicas rule) instead of relaunching them all.

    Built beside the final place and renamed into it, so the directory is whole or absent; a
    leftover of an earlier attempt at the same version (a daemon killed before it stored the
    version) is replaced. Blocking: run it off the event loop.
    """
    final = version_dir(home, service, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    store = store_dir(home)
    store.mkdir(mode=0o700, exist_ok=True)
    temp = final.parent / f".{version}.tmp-{random.token_hex(4)}"
    temp.mkdir(mode=0o700)
    try:
        manifest: list[str] = []
        files = size = 0
        if workdir is not None or mounts:
            with _STORE_LOCK:
                manifest, files, size = _copy_all(
                    workdir, mounts or {}, temp / WORKDIR, store, home
                )
        _write_values(temp, envs, secrets)
        if tls is not None:
            _copy_tls(temp, *tls)
        values = json.dumps([sorted(envs.items()), sorted(secrets.items())])
        kept = [m for m in manifest if spec_file is None or not m.startswith(f"f {spec_file} ")]
        digest = hashlib.sha256("\n".join([values, *kept]).encode("utf-8", "surrogateescape"))
        (temp / FINGERPRINT_FILE).write_text(digest.hexdigest(), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return VersionFiles(final, digest.hexdigest(), files, size)


def fingerprint(home: Path, service: str, version: int) -> str | None:
    """The fingerprint of a version's files, or None when it has none (made by an older
    corral, or pruned)."""
    try:
        return (version_dir(home, service, version) / FINGERPRINT_FILE).read_text().strip()
    except OSError:
        return None


def clone_version(home: Path, service: str, old: int, new: int) -> bool:
    """Make version ``new``'s directory the same as ``old``'s (a rollback), sharing every file;
    False when ``old`` has no directory."""
    source = version_dir(home, service, old)
    if not source.is_dir():
        return False
    final = version_dir(home, service, new)
    temp = final.parent / f".{new}.tmp-{random.token_hex(4)}"
    try:
        with _STORE_LOCK:
            shutil.copytree(source, temp, symlinks=True, copy_function=os.link)
        if final.exists():
            shutil.rmtree(final)
        os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return True


def has_files(home: Path, service: str) -> bool:
    """Whether any version of the service has a directory (none: made by an older corral)."""
    root = home / "services" / service / "versions"
    return root.is_dir() and any(entry.name.isdigit() for entry in root.iterdir())


def held_dir(home: Path, service: str) -> Path:
    """Where the files of versions past the rollback window wait while a replica launched
    from them still runs (see :func:`prune_versions`)."""
    return home / "services" / service / "held"


def prune_versions(
    home: Path, service: str, keep: set[int], running: frozenset[int] = frozenset()
) -> list[int]:
    """Remove the directories of the versions not in ``keep``; the versions removed.

    ``running``: versions whose files a live replica was launched from. An update of the
    service section only relabels a replica, which goes on running in the files of the
    version that launched it (its working directory, or the overlay over it, was set up
    then), so those files must outlive the version's place in the rollback window. They are
    moved out of ``versions/`` (to :func:`held_dir`) instead of being removed: a rename keeps
    the directory the replica has open, while the window, and what a rollback may reuse,
    stay the last versions only (a chain of service-only updates is still pruned). A held
    directory goes at the first prune after its last replica did.

    A version's directory being built (``.N.tmp-...``, see :func:`prepare_version`) that a
    killed daemon left goes too (its number is among those returned): its links kept their
    store files from :func:`collect_garbage` for as long as the service lived. The caller
    holds the service's deploy lock, so none is being built now."""
    root = home / "services" / service / "versions"
    held = held_dir(home, service)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in root.iterdir():
            if (number := _half_built(entry.name)) is not None:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(number)
            elif entry.name.isdigit() and int(entry.name) not in keep:
                if int(entry.name) in running:
                    held.mkdir(mode=0o700, exist_ok=True)
                    os.replace(entry, held / entry.name)
                else:
                    shutil.rmtree(entry, ignore_errors=True)
                removed.append(int(entry.name))
    with contextlib.suppress(FileNotFoundError):
        for entry in held.iterdir():
            if not (entry.name.isdigit() and int(entry.name) in running):
                shutil.rmtree(entry, ignore_errors=True)
                removed += [int(entry.name)] if entry.name.isdigit() else []
    return sorted(removed)


def _half_built(name: str) -> int | None:
    """The version number of a directory :func:`prepare_version` was still building
    (``.N.tmp-...``), else None."""
    number, _, rest = name[1:].partition(".tmp-")
    return int(number) if name.startswith(".") and number.isdigit() and rest else None


def remove_unstored(home: Path, service: str, latest: int | None) -> list[int]:
    """Remove the version directories of ``service`` that no stored version owns: every one
    (and the held ones) when ``latest`` is None (no service of that name), else those numbered
    past ``latest`` and those half built (``.N.tmp-...``). The numbers removed. For a daemon
    killed between making a version's files and storing it (``corral.deploy_files``)."""
    root = home / "services" / service / "versions"
    removed: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in root.iterdir():
            if (number := _half_built(entry.name)) is not None:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(number)
            elif entry.name.isdigit() and (latest is None or int(entry.name) > latest):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(int(entry.name))
    if latest is None:
        with contextlib.suppress(FileNotFoundError):
            for entry in held_dir(home, service).iterdir():
                shutil.rmtree(entry, ignore_errors=True)
                removed += [int(entry.name)] if entry.name.isdigit() else []
    return sorted(removed)


def remove_service_files(home: Path, service: str) -> None:
    """Every version's files of a service that is gone, then the store's garbage."""
    shutil.rmtree(home / "services" / service / "versions", ignore_errors=True)
    shutil.rmtree(held_dir(home, service), ignore_errors=True)
    collect_garbage(home)


def collect_garbage(home: Path) -> int:
    """Delete store files no version links to any more (and leftover temporaries); how many."""
    store = store_dir(home)
    removed = 0
    with _STORE_LOCK, contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(store):
            try:
                if (
                    entry.name.startswith(".tmp-")
                    or entry.stat(follow_symlinks=False).st_nlink <= 1
                ):
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
    return removed
