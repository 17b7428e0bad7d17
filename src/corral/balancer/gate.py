"""Holding requests in the balancer while every replica is at its limit.

An LLM engine takes every request it is sent and queues what its batch cannot run; a request
queued there waits behind that replica's work even when another replica frees up first. With a
per-replica limit (``max_in_flight``: the spec's ``load_balancing.max_in_flight_per_replica``,
this worker's share of it), a request that finds every replica at its limit waits here instead,
first in, first out, and goes out the moment any replica has room (SkyWalker's "selective
pushing"). The wait is bounded: past ``hold_timeout`` the client gets a 503 with Retry-After,
never a hang. Without a limit nothing here runs, and plain HTTP pays one attribute test.

A mixin of :class:`~corral.balancer.proxy.LoadBalancer`, like its counters: the state stays
plain attributes of the balancer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from corral.balancer.roles import Pending

# Retry-After on a 503 for a request held past its bound.
HELD_RETRY_AFTER: Final = 1


class Gate:
    """The holding half of the balancer (see the module docstring)."""

    _in_flight: dict[int, int]
    _ready_ids: tuple[int, ...]

    def _init_gate(self, max_in_flight: int | None, hold_timeout: float, workers: int) -> None:
        # This worker's share of the limit: each balancer worker counts only its own requests.
        self._limit = math.ceil(max_in_flight / max(1, workers)) if max_in_flight else 0
        self._hold_timeout = hold_timeout
        self._held: deque[tuple[float, Pending]] = deque()
        self._held_total = 0
        self._held_expired = 0
        self._wake_scheduled = False

    def _room(self, candidates: Sequence[int]) -> Sequence[int]:
        """Candidates below this worker's share of the limit (all of them without one)."""
        limit = self._limit
        if not limit:
            return candidates
        get = self._in_flight.get
        return [rid for rid in candidates if get(rid, 0) < limit]

    def _full(self, tried: Sequence[int]) -> bool:
        """Every untried ready replica is at its limit (and there is one)."""
        if not self._limit:
            return False
        untried = [rid for rid in self._ready_ids if rid not in tried]
        return bool(untried) and not self._room(untried)

    def _hold(self, ex: Pending) -> None:
        self._held.append((time.monotonic() + self._hold_timeout, ex))
        self._held_total += 1

    def _room_freed(self) -> None:
        """A request to some replica ended: send held requests soon (not from inside the
        callback that ended it)."""
        if self._held and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_held)

    def _send_held(self) -> None:
        self._wake_scheduled = False
        held = self._held
        while held:
            _, ex = held[0]
            if ex.done:
                held.popleft()
                continue
            if self._full(ex.tried):
                return
            held.popleft()
            ex.next_attempt()  # room now, so it goes out (and never comes back here)

    def _expire_held(self, now: float) -> None:
        """Answer 503 to what waited past its bound (called by the balancer's ticker)."""
        held = self._held
        while held and (held[0][0] <= now or held[0][1].done):
            _, ex = held.popleft()
            if ex.done:
                continue
            self._held_expired += 1
            ex.respond_error(
                503,
                f"every replica had {self._limit} request(s) in flight from this balancer "
                f"worker for {self._hold_timeout:g}s",
                "held_too_long",
                extra=b"Retry-After: %d\r\n" % HELD_RETRY_AFTER,
            )

    def held(self) -> int:
        """Requests waiting here now."""
        return sum(1 for _, ex in self._held if not ex.done)
