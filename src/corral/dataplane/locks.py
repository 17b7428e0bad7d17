"""The locks that keep one daemon per home and one balancer worker per slot.

Both are ``flock`` locks on files in the home, held for the owner's life: the kernel drops
them when the process dies however it dies, so a lock never outlives its holder and a check
never has to guess from a pid or a heartbeat whether the holder is still there.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import IO, Final

DAEMON_LOCK: Final = "daemon.lock"


def take_daemon_lock(home: Path) -> IO[str] | None:
    """The home's daemon lock, held until the returned file is closed (the daemon keeps it
    for its life; `corral daemon restore` while it puts a state file back), or None while
    another process holds it."""
    f = open(home / DAEMON_LOCK, "a+")  # noqa: SIM115 - held for as long as the caller needs
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def daemon_holds_lock(home: Path) -> bool:
    """True while a daemon holds the home's lock (a live daemon, or one starting)."""
    try:
        with open(home / DAEMON_LOCK, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return False
    except OSError:
        return True  # cannot tell: do not start a second daemon on a guess


def slot_lock_path(home: Path, slot: int) -> Path:
    return home / "dataplane" / f"slot-{slot}.lock"


def slot_lock_paths(home: Path) -> list[Path]:
    """Every slot's lock file of ``home`` (held or not), in slot order."""
    return sorted((home / "dataplane").glob("slot-*.lock"))


def take_slot(home: Path, slot: int) -> IO[str] | None:
    """The slot's lock, held for the worker's life (closed with the process), or None while
    another process holds it."""
    try:
        f = open(slot_lock_path(home, slot), "a+")  # noqa: SIM115 - held for life
    except OSError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def claim_respawn(home: Path, within: float) -> bool:
    """Whether this worker may start a daemon now: no other worker of the home started one in
    the last ``within`` seconds. Every worker of a home sees a crashed daemon, and a daemon
    takes a second to take the home's lock; without this, a second worker started a second
    daemon in that second, which took the lock once the first was stopped on purpose."""
    path = home / "dataplane" / "respawn.lock"
    try:
        with open(path, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another worker is deciding right now
            f.seek(0)
            try:
                last = float(f.read().strip() or 0.0)
            except ValueError:
                last = 0.0
            now = time.time()
            if 0 <= now - last < within:
                return False
            f.seek(0)
            f.truncate()
            f.write(f"{now}\n")
            f.flush()
            return True
    except OSError:
        return False  # cannot tell: never a second daemon on a guess
