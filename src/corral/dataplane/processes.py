"""The balancer worker processes as the operating system sees them: started, found, stopped.

Kept apart from :mod:`corral.dataplane.plane` (the daemon's bookkeeping of its workers) because
``corral daemon stop --all`` stops recorded workers with no daemon and no data plane running.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Final

import psutil

from corral.dataplane.protocol import Route
from corral.home import read_state
from corral.ownership import HOME_ID_FLAG, read_home_id
from corral.procfs import running as _running
from corral.procfs import terminate_all

log = logging.getLogger("corral.dataplane")

# `stop(workers=True)`: how long workers get to finish in-flight requests before SIGKILL.
WORKER_STOP_TIMEOUT: Final = 10.0
# restart-workers: how long an old worker gets to drain after its successor took over.
OLD_WORKER_GRACE: Final = WORKER_STOP_TIMEOUT
MAX_OLD_WORKER_GRACE: Final = 60.0  # restart-workers waits for each slot in turn


def old_worker_grace(routes: Iterable[Route]) -> float:
    """A replaced worker's time for its requests under way: the longest drain_timeout of the
    services it serves (``routes``), and a second for its end."""
    drains = [float(route.config.get("drain_timeout") or 0) for route in routes]
    return max(OLD_WORKER_GRACE, min(max(drains, default=0.0), MAX_OLD_WORKER_GRACE) + 1.0)


def start_worker(
    home: Path, slot: int, env: Mapping[str, str], *, successor: bool = False
) -> subprocess.Popen[bytes] | None:
    """A new worker process for ``slot``, its output in the home's worker log; None (logged)
    when it cannot be started. ``successor``: it serves beside the slot's current worker until
    that one exits (restart-workers); any other second worker for a slot exits at once."""
    logfile = home / "dataplane" / f"worker-{slot}.log"
    try:
        out: IO[bytes] | int = open(logfile, "ab")  # noqa: SIM115 - closed below
    except OSError as exc:
        # A full or read-only disk must not cost the traffic: run it without its log.
        log.error("balancer worker %d runs without its log %s: %s", slot, logfile, exc)
        out = subprocess.DEVNULL
    try:
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "corral.dataplane.worker",
                "--slot",
                str(slot),
                # Not the home's path (command lines are readable by everyone): its id, which
                # is how `corral doctor` finds the owner of a worker whose home is gone.
                *([HOME_ID_FLAG, home_id] if (home_id := read_home_id(home)) else []),
                *(["--successor"] if successor else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            # The home by environment: a command line is readable by every process.
            env={**env, "CORRAL_HOME": str(home)},
            cwd="/",
            start_new_session=True,
        )
    except OSError as exc:
        log.error("cannot start balancer worker %d: %s", slot, exc)
        return None
    finally:
        if not isinstance(out, int):
            out.close()
    return child


def find_process(pid: int, created: float) -> psutil.Process | None:
    """The live process with this pid and creation time, or None (gone, recycled pid, zombie)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.05 or not _running(proc):
            return None
        return proc
    except psutil.Error:
        return None


def stop_recorded_workers(home: Path, timeout: float = WORKER_STOP_TIMEOUT) -> list[int]:
    """Stop the balancer workers recorded in the home's state file, with no daemon running
    (``corral daemon stop --all``): SIGTERM (they finish in-flight requests), then SIGKILL.
    Only processes whose pid and creation time match a record are touched."""
    rows = read_state(home, "SELECT pid, created FROM balancer_workers") or []
    procs = [
        p for pid, created in rows if (p := find_process(int(pid), float(created))) is not None
    ]
    terminate_all(procs, timeout)
    return [p.pid for p in procs]
