"""Each replica's share of the recent requests, to keep a cached replica from becoming a hot spot.

Why requests and not only requests in flight: a replica that holds a hot prompt family in its
cache answers it faster, so the same number in flight there means more requests per second. A
load bound on requests in flight alone let a replica holding one long document serve a third
of a 4-replica fleet's requests near saturation (bench/llm_routing.py, RAG). Bounding its
share of the recent requests as well caps what it serves, and what goes past the cap warms a
second replica with that family, after which both serve it from cache.

Each balancer worker counts its own requests only. Connections reach the workers at random
(SO_REUSEPORT), so each worker's requests are a sample of the service's and their shares agree
without any shared state; a worker that just started has no history and bounds nothing until it
has some.

The count decays per request (an exponential window of ``window`` requests), kept in O(1) per
request: rather than shrinking every count, each new request weighs ``1 / decay`` times the
previous one, and the weights are rescaled before they overflow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["DEFAULT_WINDOW", "RecentShare"]

# About this many of the latest requests make up a share (the exponential window's mean age).
DEFAULT_WINDOW: Final = 128
# Rescale the weights once the next one would pass this (far from float's limit).
_RESCALE_AT: Final = 1e200


class RecentShare:
    """Each replica's share of this worker's recent requests (exponentially decayed)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, not {window}")
        self.window = window
        self._growth = 1.0 / (1.0 - 1.0 / (window + 1))
        self._weight = 1.0
        self._total = 0.0
        self._count = 0
        self._by_replica: dict[int, float] = {}

    def add(self, rid: int) -> None:
        """Count one request sent to ``rid``."""
        self._weight *= self._growth
        if self._weight > _RESCALE_AT:
            scale = 1.0 / self._weight
            self._by_replica = {r: w * scale for r, w in self._by_replica.items()}
            self._total *= scale
            self._weight = 1.0
        self._by_replica[rid] = self._by_replica.get(rid, 0.0) + self._weight
        self._total += self._weight
        self._count += 1

    def forget(self, rid: int) -> None:
        """Drop a replica that left: the shares of those that remain are among themselves."""
        self._total -= self._by_replica.pop(rid, 0.0)

    def share(self, rid: int) -> float:
        """``rid``'s share of the recent requests, 0.0 with none counted."""
        total = self._total
        return self._by_replica.get(rid, 0.0) / total if total > 0.0 else 0.0

    def over(self, candidates: Iterable[int], factor: float) -> frozenset[int]:
        """Those of ``candidates`` whose share is above ``factor`` times an even one among
        them. None until a window's worth of requests is counted: a few early requests prove
        no hot spot."""
        pool = list(candidates)
        if self._count < self.window or len(pool) < 2:
            return frozenset()
        total = sum(self._by_replica.get(rid, 0.0) for rid in pool)
        if total <= 0.0:
            return frozenset()
        limit = factor * total / len(pool)
        return frozenset(rid for rid in pool if self._by_replica.get(rid, 0.0) > limit)
