"""Which home a corral process belongs to, and whether that home still exists.

Every daemon, balancer worker and local replica is owned by one home. When the home is deleted,
replaced (another directory at the same path) or loses its state file, nothing of it may keep
running: a worker with no home serves a table nobody can change, a replica of a deleted home
is memory and a port held for no one, and a daemon respawned for a missing home would make a
new, empty one. Kubernetes garbage-collects what no owner holds; this module gives corral's
processes the facts to do the same:

* :class:`HomeWatch` remembers what the home was when a process started (the directory's
  device and inode, its ``home_id``, whether ``state.db`` existed) and says when that is no
  longer true. It is a few ``stat`` calls, cheap enough to run every second.
* A registry outside the home (``$TMPDIR/corral-<uid>/homes/<home id>.json``, or
  ``$CORRAL_RUNTIME_DIR``) maps each home id to its path and its daemon's pid, so that
  ``corral doctor`` can still name the home of a process after the home itself is gone. The
  home's path never goes on a command line (see docs/architecture.md, "Security"); the id
  does: a balancer worker runs with ``--home-id`` and a replica carries it in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

STATE_FILE = "state.db"
HOME_ID_FILE = "home_id"
# The command line of a balancer worker carries its home's id after this flag.
WORKER_MODULE = "corral.dataplane.worker"
HOME_ID_FLAG = "--home-id"
# How often a daemon or a worker looks at its home (a few stat calls).
CHECK_INTERVAL: Final = 1.0


def read_home_id(home: Path) -> str | None:
    try:
        return (home / HOME_ID_FILE).read_text().strip() or None
    except OSError:
        return None


class HomeWatch:
    """Whether the home a process was started for is still there, and the same one."""

    def __init__(self, home: Path) -> None:
        self.home = home
        st = os.stat(home)
        self._dir = (st.st_dev, st.st_ino)
        self.home_id = read_home_id(home)
        self._had_state = (home / STATE_FILE).exists()
        self._state_missing = False

    def gone(self) -> str | None:
        """Why the home is no longer this process's, or None while it is."""
        try:
            st = os.stat(self.home)
        except FileNotFoundError:
            return f"the home {self.home} was deleted"
        except OSError:
            return None  # cannot tell (a permission hiccup): never act on a guess
        if (st.st_dev, st.st_ino) != self._dir:
            return f"the home {self.home} was replaced by another directory"
        if self.home_id is not None and self._other_home_id():
            return f"the home {self.home} has another home_id now"
        if self._had_state and not (self.home / STATE_FILE).exists():
            # Twice in a row: `corral daemon restore` moves the old file aside a moment
            # before it writes the new one.
            if self._state_missing:
                return f"the state file of {self.home} was deleted"
            self._state_missing = True
            return None
        self._state_missing = False
        return None

    def _other_home_id(self) -> bool:
        """Whether the home's id file names another home or is gone: a read that fails for
        another reason (out of descriptors on a loaded machine) tells nothing, and nothing is
        ended on it."""
        try:
            found = (self.home / HOME_ID_FILE).read_text().strip()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return bool(found) and found != self.home_id


async def watch(home: HomeWatch, on_gone: Callable[[str], None]) -> None:
    """Call ``on_gone(reason)`` once, when the home is seen gone (checked every
    CHECK_INTERVAL seconds), then return."""
    while True:
        await asyncio.sleep(CHECK_INTERVAL)
        reason = home.gone()
        if reason is not None:
            on_gone(reason)
            return


def own(home: Path, home_id: str) -> HomeWatch:
    """A daemon takes ``home``: what the home is now (so its deletion is noticed), and the
    machine-wide record of it that `corral doctor` reads once the home itself is gone."""
    register(home, home_id, os.getpid(), psutil.Process().create_time())
    return HomeWatch(home)


def registry_dir() -> Path:
    base = os.environ.get("CORRAL_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"corral-{os.getuid()}" / "homes"


@dataclass(frozen=True)
class Registration:
    home_id: str
    home: Path
    daemon_pid: int | None
    daemon_created: float | None
    updated: float

    def home_exists(self) -> bool:
        """The registered path is still a home with this id (not deleted, not replaced)."""
        return read_home_id(self.home) == self.home_id


def register(home: Path, home_id: str, pid: int, created: float) -> None:
    """Record (best effort) that ``home`` has id ``home_id`` and its daemon is ``pid``."""
    data = {
        "home_id": home_id,
        "home": str(home),
        "daemon_pid": pid,
        "daemon_created": created,
        "updated": time.time(),
    }
    directory = registry_dir()
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = directory / f".{home_id}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(directory / f"{home_id}.json")


def unregister(home_id: str) -> None:
    with contextlib.suppress(OSError):
        (registry_dir() / f"{home_id}.json").unlink()


def registrations() -> dict[str, Registration]:
    """Every home this user's corral daemons registered, by home id."""
    found: dict[str, Registration] = {}
    directory = registry_dir()
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return found
    for path in paths:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            reg = Registration(
                home_id=str(data["home_id"]),
                home=Path(str(data["home"])),
                daemon_pid=int(data["daemon_pid"]) if data.get("daemon_pid") else None,
                daemon_created=float(data["daemon_created"])
                if data.get("daemon_created")
                else None,
                updated=float(data.get("updated") or 0.0),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[reg.home_id] = reg
    return found


def worker_home_id(cmdline: list[str]) -> tuple[str, int] | None:
    """(home id, slot) of a balancer worker's command line, or None if it is not one."""
    if WORKER_MODULE not in cmdline or HOME_ID_FLAG not in cmdline:
        return None
    try:
        home_id = cmdline[cmdline.index(HOME_ID_FLAG) + 1]
        slot = int(cmdline[cmdline.index("--slot") + 1])
    except (ValueError, IndexError):
        return None
    return home_id, slot
