"""The keep-alive pool of replica connections: the idle ones of every replica, newest used first.

Why LIFO: the connection taken is the one used last, the least likely to have been closed by
the replica, and under light load the older ones expire (``KEEPALIVE_SECONDS``) instead of
being kept warm. The idle connections live on their :class:`~corral.balancer.upstream.Target`
(where the compiled fast path takes and puts them); this holds which targets have any.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from corral.balancer.upstream import Target, UpstreamConnection

__all__ = ["KEEPALIVE_SECONDS", "Pool"]

# Pooled connections are closed after this many idle seconds: below the idle timeout of common
# Python servers (uvicorn closes after 5 s), so the balancer rarely picks a pooled connection
# the replica is closing at that moment.
KEEPALIVE_SECONDS: Final = 4.0


class Pool:
    """Idle keep-alive connections of every replica (kept on their :class:`Target`)."""

    __slots__ = ("_targets",)

    def __init__(self) -> None:
        self._targets: set[Target] = set()

    def take(self, target: Target, max_idle: float) -> UpstreamConnection | None:
        """The most recently used idle connection, if it has been idle at most ``max_idle``
        seconds; connections known closed are dropped on the way."""
        idle = target.idle
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if time.monotonic() - conn.idle_since > max_idle:
                idle.append(conn)  # older ones may still serve an idempotent request
                return None
            return conn
        return None

    def put(self, conn: UpstreamConnection) -> None:
        """Keep a connection whose exchange ended cleanly; close it otherwise."""
        conn.sink = None
        if not conn.reusable or conn.closed or conn.target.retired:
            conn.close()
            return
        conn.pause_reading(False)
        conn.idle_since = time.monotonic()
        conn.target.idle.append(conn)
        self._targets.add(conn.target)

    def expire(self, now: float) -> None:
        """Close connections idle for KEEPALIVE_SECONDS (oldest are at the left)."""
        for target in list(self._targets):
            idle = target.idle
            while idle and (idle[0].closed or now - idle[0].idle_since > KEEPALIVE_SECONDS):
                idle.popleft().close()
            if not idle:
                self._targets.discard(target)

    def close_target(self, target: Target) -> None:
        while target.idle:
            target.idle.pop().close()
        self._targets.discard(target)

    def close_all(self) -> None:
        for target in list(self._targets):
            self.close_target(target)
