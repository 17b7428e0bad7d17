"""How a balancer worker starts the daemon again after it crashed (corral.dataplane.worker says
when: no daemon for a while, not stopped on purpose, the home still there, no other worker
starting one).

Apart from the worker so that its module keeps to deciding; this one only runs the command.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("corral.worker")


def start_daemon(home: Path, command: Mapping[str, Any]) -> subprocess.Popen[bytes] | None:
    """Start the daemon's own command line again, its output appended to the home's
    ``daemon.log``. ``command`` is what the daemon said it was started with (``argv``,
    ``env``, ``cwd``), over the home's 0600 socket. None, logged, when it is not a command or
    does not start."""
    try:
        argv = [str(a) for a in command["argv"]]
        env = {str(k): str(v) for k, v in dict(command.get("env") or {}).items()}
        cwd = str(command.get("cwd") or "/")
    except (KeyError, TypeError, ValueError) as exc:
        log.error("cannot restart the daemon: bad command from it: %s", exc)
        return None
    return _spawn(home, argv, env or dict(os.environ), cwd)


def _spawn(
    home: Path, argv: list[str], env: dict[str, str], cwd: str
) -> subprocess.Popen[bytes] | None:
    """``argv`` run as it is, never through a shell, in a session of its own."""
    try:
        with open(home / "daemon.log", "ab") as out:
            return subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
    except (OSError, ValueError) as exc:
        log.error("could not restart the daemon: %s", exc)
        return None
