"""What the CLI does when no daemon answers, before it tells anyone to start one.

Two cases are not the user's to fix:

* The daemon crashed (SIGKILL, OOM) and the balancer workers are about to start it again (they
  do ~1 s + 0.5 s per slot after losing it, unless it stopped on purpose, see
  corral.dataplane.worker): telling the user to run `corral daemon start` would race that
  restart. Live workers hold their slot locks and an on-purpose stop leaves ``daemon.stopped``,
  so the CLI can tell, and waits a few seconds for the new daemon instead.
* The home has no services at all (or was never used): as with `sky serve status`, that is
  "no services", not an error, and no daemon is started only to say so.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.client import Client

# How long a command waits for the workers to bring a crashed daemon back (seconds). Workers
# respawn after ~1 s + 0.5 s per slot; a daemon answers well under a second after it starts.
RESPAWN_WAIT = 5.0
RESPAWN_NOTE = "the daemon stopped unexpectedly; corral is restarting it..."


def _holders(locks: list[Path]) -> set[int] | None:
    """The pids holding a flock on any of ``locks``, from /proc/locks (None: not readable,
    not Linux). A pid that waits for a lock (``->``) holds none."""
    inodes = set()
    for lock in locks:
        try:
            inodes.add(lock.stat().st_ino)
        except OSError:
            continue
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    pids = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK":
            with contextlib.suppress(ValueError):
                if int(fields[5].rsplit(":", 1)[-1]) in inodes:
                    pids.add(int(fields[4]))
    return pids


def respawn_expected(home: Path) -> bool:
    """The balancer workers of ``home`` will start its daemon again: one of them runs (it
    holds its slot's lock), the last daemon told them to (no ``dataplane/no-respawn``), and it
    did not stop on purpose (no ``daemon.stopped``)."""
    from corral.dataplane.locks import slot_lock_paths
    from corral.dataplane.protocol import NO_RESPAWN_MARKER, STOPPED_MARKER

    if (home / STOPPED_MARKER).exists() or (home / NO_RESPAWN_MARKER).exists():
        return False
    # No /proc/locks (not Linux): no telling, so no waiting (the message says what to do).
    return bool(_holders(slot_lock_paths(home)))


def await_respawn(client: Client, say: Callable[[str], None], wait: float = RESPAWN_WAIT) -> bool:
    """Whether the home's daemon answers, after waiting up to ``wait`` s for the workers to
    restart it when it crashed (``say`` tells the user). A remote API ($CORRAL_API_URL) has
    no workers here: it is asked once."""
    from corral.client import ENV_API_URL

    if client.health():
        return True
    if os.environ.get(ENV_API_URL) or not respawn_expected(client.home):
        return False
    say(RESPAWN_NOTE)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if client.health():
            return True
    return False


def home_services(home: Path) -> list[str] | None:
    """The names of the services ``home``'s state file holds (read only, without a daemon);
    [] for a home never used; None when the file cannot be read (then assume some)."""
    from corral.home import read_state

    rows = read_state(home, "SELECT name FROM services ORDER BY name")
    if rows is None:
        return None
    return [str(name) for (name,) in rows]


def log_on_disk(
    home: Path, service: str, kind: str, replica: int | None, tail: int | None
) -> Iterator[bytes] | None:
    """A service's log as its files hold it, for `corral logs` when no daemon answers (after
    `corral daemon stop` the replicas still run and write): the last ``tail`` lines, or all of
    it, in chunks; None when there is no such file."""
    from corral import logfiles, loglines

    if kind == "load_balancer":
        if not loglines.worker_logs(home):
            return None
        if tail is not None:
            return iter(loglines.balancer_tail(home, service, tail)[0])
        return iter(loglines.balancer_lines(home, service, {})[0])
    path = logfiles.log_file(logfiles.service_logs(home, service), kind, replica)
    try:
        open(path, "rb").close()  # there and readable: else "no such log", not a traceback
    except OSError:
        return None
    return loglines.span_chunks(
        loglines.tail_spans(path, tail) if tail is not None else [(path, 0)]
    )
