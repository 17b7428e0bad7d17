"""State that refuses to be lost: a guard at start, a rolling backup, a restore.

``state.db`` is the only record of which replicas a home runs. A daemon that took an empty,
truncated or foreign file for "no services" would come up with nothing and its leak sweep
would kill every running replica (reproduced with ``: > state.db``). So before the daemon
opens the file, :func:`check_state_file` compares it with what the home shows it had: service
directories with logs (kept after `down`) or a backup. A home with that evidence and a
state file that is missing, empty, unreadable or not corral's is refused with an error that
says what was found and how to restore; nothing is changed, nothing is killed.

The daemon keeps a rolling backup (SQLite's online backup API, consistent while in use):
``state.db.backup`` (latest) and ``state.db.backup.1`` (the one before), taken at start once the
file passed the guard, every ``BACKUP_INTERVAL`` seconds when something changed, and at a clean
stop. ``corral daemon restore`` puts one back, with no daemon running, keeping the file it
replaces as ``state.db.broken-<time>``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Final

__all__ = [
    "BACKUP_INTERVAL",
    "StateFileRefused",
    "backup_path",
    "check_state_file",
    "restore",
    "take_backup",
]

BACKUP_INTERVAL: Final = 60.0
BACKUP_NAME: Final = "state.db.backup"


class StateFileRefused(RuntimeError):
    """The state file does not match the home (see the module docstring); nothing changed."""


def backup_path(home: Path) -> Path:
    return home / BACKUP_NAME


def _evidence(home: Path) -> list[str]:
    found = []
    services = home / "services"
    if services.is_dir():
        # A service that ran has logs (controller.log at least); an empty directory, e.g. a
        # mount point made ready before the first start, is no evidence.
        names = sorted(
            p.name for p in services.iterdir() if p.is_dir() and any((p / "logs").glob("*.log"))
        )
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            found.append(f"service directories ({shown})")
    backup = backup_path(home)
    if backup.exists():
        taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(backup.stat().st_mtime))
        found.append(f"a backup ({backup.name}, taken {taken})")
    return found


def _problem(db: Path) -> str | None:
    """Why ``db`` is not a usable corral state file, or None when it is."""
    if not db.exists():
        return "is missing"
    if db.stat().st_size == 0:
        return "is empty (0 bytes)"
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return f"cannot be read as a database ({exc}): truncated or corrupt"
    except sqlite3.Error as exc:
        return f"cannot be opened ({exc})"
    if version == 0 and not tables:
        return "holds no tables (an empty database)"
    if "services" not in tables or "replicas" not in tables:
        return f"is not a corral state file (tables: {', '.join(sorted(tables)) or 'none'})"
    return None


def check_state_file(home: Path) -> None:
    """Refuse a state file that lost what the home shows it had; a new home passes."""
    db = home / "state.db"
    evidence = _evidence(home)
    if not evidence:
        return
    problem = _problem(db)
    if problem is None:
        return
    # A deleted file is the home's end to its daemon and workers (corral.ownership): they
    # ended its replicas then, and saying "no replica was stopped" would be false.
    replicas = (
        " (its replicas were ended when it was deleted: a home without its state file is gone)"
        if problem == "is missing"
        else " and no replica was stopped"
    )
    raise StateFileRefused(
        f"refusing to start: {db} {problem}, but this home had services: "
        f"{'; '.join(evidence)}. Nothing was changed{replicas}. Restore the "
        f"last backup with `corral daemon restore` (or `--from FILE`), or, to start afresh, "
        f"move {home} aside."
    )


def take_backup(db: sqlite3.Connection, home: Path) -> Path:
    """Copy the open database to ``state.db.backup`` (the previous one becomes ``.1``).

    The copy is written to a temporary file and renamed, so a crash mid-way never leaves a
    half backup in place of a whole one.
    """
    dest = backup_path(home)
    tmp = dest.with_name(dest.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    out = sqlite3.connect(tmp)
    try:
        db.backup(out)
    finally:
        out.close()
    os.chmod(tmp, 0o600)
    if dest.exists():
        dest.replace(dest.with_name(dest.name + ".1"))
    tmp.replace(dest)
    return dest


def restore(home: Path, source: Path | None = None) -> str:
    """Put a backup back as ``state.db`` (no daemon may run: the caller holds the lock).

    Returns a line saying what was restored. Raises StateFileRefused when the source itself
    is not a usable state file.
    """
    src = source or backup_path(home)
    problem = _problem(src)
    if problem is not None:
        raise StateFileRefused(f"cannot restore from {src}: it {problem}")
    db = home / "state.db"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = []
    for suffix in ("", "-wal", "-shm"):
        old = db.with_name(db.name + suffix)
        if old.exists():
            moved = old.with_name(f"{old.name}.broken-{stamp}")
            old.replace(moved)
            kept.append(moved.name)
    conn_src = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    conn_dst = sqlite3.connect(db)
    try:
        conn_src.backup(conn_dst)
        services = conn_dst.execute("SELECT COUNT(*) FROM services").fetchone()[0]
    finally:
        conn_src.close()
        conn_dst.close()
    os.chmod(db, 0o600)
    note = f"; the file it replaces kept as {', '.join(kept)}" if kept else ""
    return f"restored {db} from {src} ({services} service(s)){note}"
