"""One timer per balancer for every deadline of its clients, asleep until the nearest one.

Why one timer and not one per request: a timer per request is an allocation and a heap push
and pop on every request, where the deadlines live on the client connections already
(``client.deadline``, set by whichever side last moved it: a head, a first byte, an idle
stream). So the ticker scans the connections and fires what has passed.

Why it sleeps until the nearest deadline: a wake-up costs 0.1-0.3 ms of CPU on these VMs
whatever it does, and an LLM stream's deadlines (its idle timeout) are tens of seconds away.
A tick every 0.1 s was ten wake-ups a second per balancer worker for nothing. Now it sleeps
until the nearest deadline, but never less than ``_tick_interval`` (how late a deadline may
fire: a quarter of the shortest timeout, 0.1 s at most) and never more than ``_tick_cap``
(a second, or the shortest timeout if less). That cap is what keeps a deadline set after a
tick from being missed: every deadline is set to now plus one of the timeouts (or a closing
client's 2 s linger), so it is never earlier than the next tick. The one exception: a stream
the pump hands back to the loop is given its idle deadline from its last batch, which may
then fire up to ``_tick_cap`` late (a second, against an idle timeout of tens of seconds).
Requests held in the
balancer keep the short tick (their hold expires there), and with no client at all it ticks
once a second for the pool's housekeeping until one connects (:meth:`Ticker._tick_soon`).

A mixin of :class:`~corral.balancer.proxy.LoadBalancer`, like its counters and its gate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Set
from typing import TYPE_CHECKING, Final, Protocol

from corral.balancer.counting import Counters

if TYPE_CHECKING:
    from corral.balancer.pool import Pool
    from corral.balancer.roles import Held

logger = logging.getLogger("corral.balancer")


class _Timed(Protocol):
    """A client connection as the ticker sees it (corral.balancer.client)."""

    deadline: float  # 0.0: none

    def on_timeout(self) -> None: ...


class Ticker:
    """The deadline half of the balancer (see the module docstring)."""

    IDLE_TICK: Final = 1.0  # the ticker's period with no client connected (the pool's own)

    _name: str
    _clients: Set[_Timed]
    _held: deque[Held]
    _pool: Pool
    _timestamps: deque[float]
    _stopped: bool
    _tick_interval: float
    _tick_cap: float
    _tick_handle: asyncio.TimerHandle | None
    _tick_idle: bool
    _next_expire: float

    def _expire_held(self, now: float) -> None:
        raise NotImplementedError  # corral.balancer.gate.Gate's

    def _tick(self) -> None:
        """Fire passed deadlines; once a second, close expired pooled connections and drop
        request times older than the horizon; then sleep (see the module docstring)."""
        now = time.monotonic()
        nearest = now + self._tick_cap
        try:
            for client in list(self._clients):
                deadline = client.deadline
                if deadline and deadline <= now:
                    client.on_timeout()
                    deadline = client.deadline  # a stream the pump holds may move it on
                if deadline and deadline < nearest:
                    nearest = deadline
            if self._held:
                nearest = now
                self._expire_held(now)
            if now >= self._next_expire:
                self._next_expire = now + 1.0
                self._pool.expire(now)
                stamps = self._timestamps
                horizon = now - Counters.TIMESTAMP_HORIZON
                while stamps and stamps[0] < horizon:  # each timestamp leaves once
                    stamps.popleft()
        except Exception:
            logger.exception("balancer %s: error in the deadline ticker", self._name)
        finally:
            if not self._stopped:
                self._tick_idle = not self._clients
                delay = max(self._tick_interval, nearest - now)
                delay = self.IDLE_TICK if self._tick_idle else delay
                self._tick_handle = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick_soon(self) -> None:
        """A client connected while the ticker idled: back to the short tick."""
        if self._tick_handle is not None and not self._stopped:
            self._tick_handle.cancel()
            self._tick_idle = False
            loop = asyncio.get_running_loop()
            self._tick_handle = loop.call_later(self._tick_interval, self._tick)
