"""A size cap for log files that another process keeps open: "copytruncate" with one generation.

A replica writes its own log (the local backend hands the child a descriptor opened with
O_APPEND; the Ray backend's pump appends on the daemon's side), and corral cannot make the app
reopen it. So a log over the cap is copied to ``<log>.1`` (replacing the previous ``.1``) and
then truncated to 0 in place: because every writer appends (O_APPEND), its next write lands at
the new end, offset 0 onward, with no hole and no reopening.

What this costs, and why it is still the right trade:

* Bytes the app writes between the end of the copy and the truncation are lost (in neither
  file). The copy reads until it meets the end and truncates right after, through the same
  descriptor, so the window is one ``read`` + ``ftruncate`` long (microseconds). A writer
  faster than the copy could keep it from ever meeting the end: the copy stops after
  ``size at start + max_bytes`` bytes and what came after is lost too. A read is not atomic
  against a write in progress, so ``.1`` may end with part of a line whose rest was lost.
* The cap is checked by the caller periodically (the controller: every ~2 s), so a log can pass
  it by what the app writes in one period; on disk there is at most ~2x the cap plus that.
* When the copy cannot be written (disk full, read-only directory), the log is truncated
  anyway and its old content dropped: the cap is there so a flooding app cannot fill the disk.

Also here, the names of a service's log files (``services/NAME/logs/``): ``controller.log``,
and ``replica_N.log`` / ``replica_N_launch.log`` where N is the replica's id within its service
(what `corral status` shows). A new service of a name starts with a directory of its own
(:func:`fresh`); a home from before files were named that way is renamed once (:func:`by_seq`).

stdlib only: it sits below everything in corral.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_COPY_CHUNK = 1 << 20
_MiB = 1 << 20
DEFAULT_MAX_BYTES = 64 * _MiB


@dataclass(frozen=True)
class Rotation:
    """What one rotation did: ``kept`` bytes now in ``backup``; ``error`` when the copy failed
    and the old content was dropped instead."""

    path: Path
    backup: Path
    kept: int
    error: str | None = None


def service_logs(home: Path, service: str) -> Path:
    """A service's logs directory in its home."""
    return home / "services" / service / "logs"


def log_file(logs: Path, kind: str, seq: int | None = None) -> Path:
    """A service's log of ``kind`` (``controller``, ``replica``, ``launch``) in ``logs``, for
    replica ``seq`` (its id within the service): the one place their names are made."""
    if kind == "controller":
        return logs / "controller.log"
    return logs / f"replica_{seq}{'_launch' if kind == 'launch' else ''}.log"


def backup_of(path: Path) -> Path:
    """The one rotated generation of ``path``: ``<name>.1`` beside it."""
    return path.with_name(path.name + ".1")


def backup_tmp_of(path: Path) -> Path:
    """Where :func:`rotate_if_over` copies ``path`` before it becomes :func:`backup_of`."""
    return path.with_name(path.name + ".1.tmp")


def rotate_if_over(path: Path, max_bytes: int) -> Rotation | None:
    """Copy ``path`` to ``<path>.1`` and truncate it to 0 when it is larger than ``max_bytes``.

    ``max_bytes <= 0`` disables the cap. A missing file is not an error (a replica that has not
    started, or whose log was removed). Returns what was done, or None when nothing was.
    Raises OSError only when the log itself cannot be opened or truncated.
    """
    if max_bytes <= 0:
        return None
    try:
        if os.stat(path).st_size <= max_bytes:
            return None
        src = open(path, "r+b", buffering=0)  # noqa: SIM115 - closed below, after truncating
    except FileNotFoundError:
        return None
    backup = backup_of(path)
    tmp = backup_tmp_of(path)
    with src:
        limit = os.fstat(src.fileno()).st_size + max_bytes
        kept = 0
        error: str | None = None
        try:
            with open(tmp, "wb") as dst:
                while kept < limit:
                    chunk = src.read(min(_COPY_CHUNK, limit - kept))
                    if not chunk:
                        break
                    dst.write(chunk)
                    kept += len(chunk)
                dst.flush()
        except OSError as exc:
            error = f"{tmp}: {exc}"
        # The window where the app's writes are lost: from the last read above to here.
        os.ftruncate(src.fileno(), 0)
    if error is not None:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return Rotation(path, backup, 0, error)
    try:
        # After the truncation, so the loss window above does not include a rename; a reader
        # (the API's follower) sees a new ``.1`` once the log was emptied (see rotation_mark).
        os.replace(tmp, backup)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return Rotation(path, backup, 0, f"{backup}: {exc}")
    return Rotation(path, backup, kept)


def rotate_all(paths: list[Path], max_bytes: int) -> list[Rotation | str]:
    """:func:`rotate_if_over` for each path (meant for a worker thread): what was rotated, and a
    one-line error per log that could not be opened or truncated (the others still are)."""
    done: list[Rotation | str] = []
    for path in paths:
        try:
            rotation = rotate_if_over(path, max_bytes)
        except OSError as exc:
            done.append(f"{path}: {exc}")
            continue
        if rotation is not None:
            done.append(rotation)
    return done


RotationMark = tuple[int, int, int, int] | None


def rotation_mark(path: Path) -> RotationMark:
    """Identifies the last rotation of ``path``: its ``.1`` file (a new inode each time, put in
    place right after the log was emptied), or None when there was none. A follower that saw
    one mark and now sees another knows the log was emptied in between and starts over at 0."""
    try:
        st = os.stat(backup_of(path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def parse_max_bytes(value: str | None, default: int = DEFAULT_MAX_BYTES) -> int:
    """A byte count from the environment: an integer, optionally with a K/M/G suffix (binary),
    ``0`` to disable the cap; empty or None means ``default``. Raises ValueError."""
    if value is None or not value.strip():
        return default
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if text and text[-1] in "KMG":
        scale = 1 << (10 * ("KMG".index(text[-1]) + 1))
        text = text[:-1]
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"not a byte count: {value!r} (use e.g. 1048576, 64M or 0)")
    return int(text) * scale


# In a service's logs directory: its replica files are named by the id within the service.
MARKER = ".replica-ids"
_MARKER_TEXT = "replica files here are named by the replica's id within its service\n"
_REPLICA_FILE = re.compile(r"replica_(\d+)(_launch)?\.log(\.1)?")


def fresh(logs: Path) -> None:
    """The logs directory of a service about to be created: what an earlier service of the
    same name left there moves to ``logs.previous`` (replacing an older one), so the new
    service's controller log and replica files start empty. A directory with nothing written
    in it yet (an `up` that was then refused, or cut by the daemon's death) stays: setting it
    aside would put an empty one over the earlier service's logs."""
    if logs.exists() and {entry.name for entry in logs.iterdir()} - {MARKER}:
        previous = logs.with_name(logs.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(logs, previous)
    logs.mkdir(parents=True, exist_ok=True)
    (logs / MARKER).write_text(_MARKER_TEXT)


def by_seq(logs: Path, seqs: Mapping[int, int]) -> bool:
    """Once per logs directory, before anything writes to it: files named by the replicas'
    internal ids (``seqs`` maps each known replica's to its id within the service) take their
    new names; files of replicas no longer known move to ``old-ids/`` as they were. The whole
    directory is set aside first (one rename), so a crash midway resumes from there. Returns
    whether anything was renamed. A replica writing its log meanwhile keeps writing to it:
    its descriptor follows the file."""
    if (logs / MARKER).exists():
        return False
    aside = logs.with_name(logs.name + ".old-ids")
    if not aside.exists():
        logs.mkdir(parents=True, exist_ok=True)
        os.replace(logs, aside)
    logs.mkdir(parents=True, exist_ok=True)
    renamed = False
    for entry in sorted(os.listdir(aside)):
        match = _REPLICA_FILE.fullmatch(entry)
        if match is None:
            os.replace(aside / entry, logs / entry)  # controller.log and the like
        elif int(match[1]) in seqs:
            seq = seqs[int(match[1])]
            os.replace(aside / entry, logs / f"replica_{seq}{match[2] or ''}.log{match[3] or ''}")
            renamed = True
    (logs / MARKER).write_text(_MARKER_TEXT)
    if any(aside.iterdir()):
        os.replace(aside, logs / "old-ids")
    else:
        aside.rmdir()
    return renamed
