"""The files of a corral home, shared by the daemon and its clients.

Kept apart from :mod:`corral.daemon` so the CLI can find and talk to a daemon without importing
the daemon's machinery (aiohttp, the controller, the balancer): every ``corral`` command pays
that import time, and most never need it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The exit code of `corral daemon run` when another daemon already holds the home's lock.
EXIT_DAEMON_RUNNING = 75


def default_home() -> Path:
    return Path(os.environ.get("CORRAL_HOME") or Path.home() / ".corral").expanduser()


def read_token(home: Path) -> str:
    return (home / "token").read_text().strip()


def read_info(home: Path) -> dict[str, Any] | None:
    """The running daemon's ``daemon.json`` (pid, host, port), or None."""
    try:
        return dict(json.loads((home / "daemon.json").read_text()))
    except (OSError, ValueError):
        return None
