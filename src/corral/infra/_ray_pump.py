"""The log pump of the Ray backend: one thread follows every replica's output and state.

Split from :mod:`corral.infra.ray`: the backend starts and stops actors, the pump only reads from
them (new output appended to the daemon-side log, the child's state for ``check``), so each can
be read alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray

from corral.infra._ray_calls import _ACTOR_DIED, _TRANSIENT

log = logging.getLogger("corral.infra.ray")

# Bytes of a replica's output moved per actor per pump round: bounds one round's memory and the
# size of one RPC, while 2 MB/s per replica is more than any log worth following.
_READ_CHUNK = 1 << 20
# A pump result older than this is stale: check() then asks the actor itself.
_FRESH = 3.0
# A replica whose output is quiet is polled less and less often, down to once per this many
# seconds (measured: polling 32 quiet actors twice a second doubled the daemon's idle CPU). Any
# new output brings it back to the pump's interval. Below _FRESH, so check() stays answered.
_QUIET_MAX = 2.0


@dataclasses.dataclass
class _Followed:
    """One replica the pump follows, and the latest it learned about it."""

    name: str
    actor: Any
    log_path: Path
    offset: int  # bytes of the node-local run log already appended to log_path
    inflight: Any = None  # the ObjectRef of the poll in progress
    started: bool = False
    code: int | None = None
    pid: int | None = None
    dead: str | None = None  # why the actor is gone, once it is
    updated: float = 0.0  # monotonic time of the last answer
    every: float = 0.0  # current polling period (grows while the replica is quiet)
    due: float = 0.0  # monotonic time of the next poll
    io: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class _Pump:
    """One thread for every followed replica: each round sends a ``poll`` to every actor that is
    due and whose previous poll has answered, then applies the answers (new output to the
    daemon-side log, the child's state to the record). A slow actor skips rounds; it never holds
    up the others. A quiet replica is polled less often (up to ``_QUIET_MAX`` apart)."""

    def __init__(self, interval: float, call_timeout: float) -> None:
        self.interval = interval
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._followed: dict[str, _Followed] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def follow(self, name: str, actor: Any, log_path: Path, offset: int) -> _Followed:
        with self._lock:
            entry = self._followed.get(name)
            if entry is None:
                entry = _Followed(name, actor, Path(log_path), max(0, offset))
                self._followed[name] = entry
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="corral-ray-pump")
                self._thread.daemon = True
                self._thread.start()
        self._wake.set()
        return entry

    def get(self, name: str) -> _Followed | None:
        with self._lock:
            return self._followed.get(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._followed.pop(name, None)

    def names(self) -> set[str]:
        with self._lock:
            return set(self._followed)

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.round()
            except Exception:
                log.exception("ray log pump round failed")

    def round(self) -> None:
        now = time.monotonic()
        with self._lock:
            entries = [e for e in self._followed.values() if e.dead is None]
        for entry in entries:
            if entry.inflight is None and now >= entry.due:
                entry.inflight = (entry.offset, entry.actor.poll.remote(entry.offset, _READ_CHUNK))
        pending = {e.inflight[1]: e for e in entries if e.inflight is not None}
        if not pending:
            return
        # Wait one interval at most: an actor that answers later is applied next round.
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.interval)
        for ref in ready:
            entry = pending[ref]
            offset, _ = entry.inflight
            entry.inflight = None
            self._apply(entry, offset, ref)

    def _apply(self, entry: _Followed, offset: int, ref: Any) -> None:
        try:
            answer = ray.get(ref, timeout=0)
        except _TRANSIENT:
            return  # asked again next round
        except _ACTOR_DIED as exc:
            self.mark_dead(entry, exc)
            return
        except Exception as exc:  # one broken actor must not stop the round for the others
            log.warning("ray log pump: polling %s failed: %r", entry.name, exc)
            return
        with entry.io:
            if offset != entry.offset:
                return  # a drain read the same bytes first
            data: bytes = answer["data"]
            if data:
                with open(entry.log_path, "ab") as out:
                    out.write(data)
                entry.offset += len(data)
            entry.started = bool(answer["started"])
            entry.code = answer["code"]
            entry.pid = answer["pid"]
            entry.updated = time.monotonic()
            quiet = not data and entry.started and entry.code is None
            if quiet:
                entry.every = min(_QUIET_MAX, max(self.interval, entry.every * 2))
            else:
                entry.every = self.interval
            entry.due = entry.updated + entry.every - self.interval / 2
        if len(data) >= _READ_CHUNK:
            self._wake.set()  # more waiting: read it without sleeping

    def mark_dead(self, entry: _Followed, exc: BaseException) -> None:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        with entry.io:
            if entry.dead is None:
                entry.dead = reason
                entry.updated = time.monotonic()
                with contextlib.suppress(OSError), open(entry.log_path, "ab") as out:
                    out.write(f"\n[corral] the replica's Ray actor is gone: {reason}\n".encode())

    def drain(self, name: str, timeout: float) -> None:
        """Copy what is left of a replica's output (its app has stopped) before it is deleted."""
        entry = self.get(name)
        if entry is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and entry.dead is None:
            with entry.io:
                offset = entry.offset
                try:
                    answer = ray.get(
                        entry.actor.poll.remote(offset, _READ_CHUNK),
                        timeout=max(0.1, deadline - time.monotonic()),
                    )
                except Exception:
                    return
                data: bytes = answer["data"]
                if data:
                    try:
                        with open(entry.log_path, "ab") as out:
                            out.write(data)
                    except OSError:
                        return  # the log cannot take it (gone, full): never stop a teardown
                    entry.offset += len(data)
                entry.code = answer["code"]
            if len(data) < _READ_CHUNK:
                return
