"""Which process holds each balancer worker slot, as the daemon knows it.

The daemon's memory is the truth while it runs; the state file (``balancer_workers``) is where
the next daemon finds the workers to adopt, written best effort. Before this book, the state
file was the only record: on a busy machine a write that met a locked file was lost (the slot
still named a dead worker, so the next check started another one), and a read that met it
looked like "no worker at all" and started a whole new set; one daemon started six workers for
one slot in nine minutes. Now a failed write is retried on the next check, and a slot is never
judged empty on a read that failed.

What makes a worker dead is its process: gone, or a zombie, by pid and creation time (never by
a late report). A worker whose process is stopped (SIGSTOP, a debugger: state T) and has not
reported for ``FROZEN_AFTER`` seconds is ended with SIGKILL, since its share of the port's new
connections would wait on it for as long as it stays stopped; only then is its slot filled
again. A worker that is running but slow (a loaded machine) is never replaced.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

import psutil

from corral.dataplane.processes import find_process
from corral.state import StateError, Store, WorkerRow

log = logging.getLogger("corral.dataplane")

FROZEN_AFTER: Final = 10.0
# A worker dying sooner than this after its start is a crash loop: restarts back off.
CRASH_WINDOW: Final = 5.0
SPAWN_BACKOFF_CAP: Final = 30.0
_STOPPED: Final = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


class SlotBook:
    """The slot -> worker record: memory first, the state file behind it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._rows: dict[int, WorkerRow] = {}
        self._loaded = False
        self._behind: set[int] = set()  # slots whose state-file row is not written yet
        self._silent_since: dict[int, float] = {}
        self._spawned_at: dict[int, float] = {}  # slot -> monotonic time of the last start
        self._next_spawn: dict[int, float] = {}
        self._delay: dict[int, float] = {}

    def may_start(self, slot: int, said_hello: bool, now: float) -> bool:
        """Whether a worker may be started for the empty ``slot`` now (and, if so, noted as
        started). A worker that died within CRASH_WINDOW of its start without ever saying
        hello doubles the wait before the next one (up to SPAWN_BACKOFF_CAP); one that served
        (or lived longer) is replaced at once."""
        if now < self._next_spawn.get(slot, 0.0):
            return False
        started = self._spawned_at.get(slot)
        quick = started is not None and now - started < CRASH_WINDOW and not said_hello
        delay = min(SPAWN_BACKOFF_CAP, self._delay.get(slot, 0.5) * 2) if quick else 0.0
        self._delay[slot] = delay or 0.5
        self._next_spawn[slot] = now + delay
        self._spawned_at[slot] = now
        return True

    def rows(self) -> dict[int, WorkerRow] | None:
        """Every slot's worker, or None when not known yet (the state file could not be read
        the first time): a caller must then not conclude that any slot is empty."""
        if not self._loaded:
            try:
                self._rows = {row.slot: row for row in self.store.workers()}
            except StateError as exc:
                log.warning("balancer workers not checked: %s", exc)
                return None
            self._loaded = True
        self._write_behind()
        return dict(self._rows)

    def set(self, slot: int, pid: int, created: float) -> None:
        self._rows[slot] = WorkerRow(slot=slot, pid=pid, created=created, started_at=time.time())
        self._behind.add(slot)
        self._write_behind()

    def delete(self, slot: int) -> None:
        self._rows.pop(slot, None)
        self._behind.add(slot)
        self._write_behind()

    def _write_behind(self) -> None:
        for slot in sorted(self._behind):
            row = self._rows.get(slot)
            try:
                if row is None:
                    self.store.delete_worker(slot)
                else:
                    self.store.set_worker(slot, row.pid, row.created)
            except StateError as exc:
                log.warning("balancer worker %d not recorded yet: %s", slot, exc)
                return
            self._behind.discard(slot)

    def end_frozen(self, heard: dict[int, float], now: float) -> None:
        """SIGKILL each worker that is stopped and has been silent for FROZEN_AFTER seconds.
        ``heard``: pid -> monotonic time of its last report (connected workers only)."""
        for slot, row in self._rows.items():
            last = heard.get(row.pid)
            if last is not None and now - last < FROZEN_AFTER:
                self._silent_since.pop(slot, None)
                continue
            since = self._silent_since.setdefault(slot, last if last is not None else now)
            if now - since < FROZEN_AFTER:
                continue
            proc = find_process(row.pid, row.created)
            try:
                stopped = proc is not None and proc.status() in _STOPPED
            except psutil.Error:
                stopped = False
            if proc is not None and stopped:
                log.warning(
                    "balancer worker %d (pid %d) is stopped and silent for %.0fs: ending it",
                    slot,
                    row.pid,
                    now - since,
                )
                try:
                    proc.kill()
                except psutil.Error:
                    continue
                self._silent_since.pop(slot, None)

    def view(self, connected: dict[int, tuple[int, str]]) -> list[dict[str, Any]]:
        """Each slot's worker for ``corral daemon status``; ``connected``: pid -> the table
        seq it applied and its fast path's build ("compiled", "pure")."""
        out = []
        for slot, row in sorted((self.rows() or {}).items()):
            proc = find_process(row.pid, row.created)
            try:
                state = proc.status() if proc is not None else "gone"
            except psutil.Error:
                state = "gone"
            seq, accelerated = connected.get(row.pid, (None, None))
            out.append(
                {
                    "slot": slot,
                    "pid": row.pid,
                    "alive": proc is not None,
                    "state": state,
                    "connected": row.pid in connected,
                    "table_seq": seq,
                    "accelerated": accelerated,
                    "started_at": row.started_at,
                }
            )
        return out
