"""Replica selection policies for the load balancer.

A policy only chooses; it never owns state the balancer depends on. The balancer passes the
candidate replica ids (already minus the replicas a retry has tried), its live in-flight counts
and, only to a policy whose ``reads_request`` is true, a :class:`RequestView` (the target, the
body it holds, the header lines); the policy returns one of the candidates. The balancer tells
every policy when the ready set or the engines' own load changes (:meth:`Policy.update`), so
one that keeps state per replica (a prefix index) forgets a replica that left.

Policies run on the event loop thread for every request, so the load policies' ``select`` is a
single linear pass with no sorting and no allocation beyond a couple of locals: the ready set
of one service is small (tens of replicas), and a pass over it costs less than building any
index would. Plain HTTP pays nothing for the request view: it is built only for a policy that
reads it (``corral.balancer.prefix_policy``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple, Protocol

from corral.balancer import speedups

__all__ = [
    "STREAM_WEIGHT",
    "EngineLoad",
    "InstanceAwareLeastLoad",
    "LeastLoad",
    "Policy",
    "PowerOfTwo",
    "RequestView",
    "RoundRobin",
    "weigh_streams",
]


# How far over the mean load a replica may be before a request goes past it (prefix_affinity,
# session affinity): consistent hashing with bounded loads.
DEFAULT_BALANCE: Final = 1.25
# What a request whose streamed answer has begun weighs in a choice by load, against one still
# waiting for its first bytes (corral.balancer.gate, "What a load is"). A power of two, so
# every load is an exact float.
STREAM_WEIGHT: Final = 1 / 16


def weigh_streams(
    candidates: Sequence[int], in_flight: Mapping[int, float], streams: Mapping[int, float]
) -> dict[int, float]:
    """Each candidate's load with its streams under way weighing ``STREAM_WEIGHT``. A stream
    is a request in flight, but counts read from shared boards may say more streams than
    requests (a row read mid-update, or written by a worker and its successor in one slot
    during restart-workers): never a negative load, which least_loaded cannot pick from."""
    get, streaming = in_flight.get, streams.get
    less = 1.0 - STREAM_WEIGHT
    return {rid: (n := get(rid, 0)) - less * min(streaming(rid, 0), n) for rid in candidates}


class RequestView(NamedTuple):
    """What a policy that reads requests sees of one: its target (path and query), its body
    when the balancer holds it whole (None while it streams: too big, or chunked and still
    arriving), and its header lines as sent (``Name: value\r\n`` each)."""

    target: bytes
    body: bytes | None
    headers: bytes


class EngineLoad(NamedTuple):
    """A replica's own view of its load, read from its Prometheus metrics (vLLM, SGLang):
    requests queued in the engine and running in its batch, and its KV-cache use (0..1)."""

    waiting: float
    running: float
    kv_usage: float | None = None


class Policy(Protocol):
    """Chooses the replica that gets the next request."""

    # True only for a policy that reads the request (the balancer then passes a RequestView).
    reads_request: bool
    # Whether the loads passed to ``select`` weigh a streamed answer under way at
    # STREAM_WEIGHT (True), or are plain counts (False: a policy that ignores load, or one
    # that weighs streams itself where it wants: corral.balancer.prefix_policy).
    weighs_streams: bool
    # Whether the last choice was for that request in particular (its prefix is cached there,
    # its session lives there): worth a held request's wait (corral.balancer.gate). False for
    # a choice by load, which any replica with room serves as well.
    preferred: bool
    # Set by the balancer for a policy that keeps what it sent where (prefix_affinity): the
    # last ``select`` then leaves that record in ``pending`` instead of keeping it, and the
    # balancer hands it to ``commit`` with the replica the request really went to (its
    # choice may be full and the request go elsewhere, or wait first). False: kept at once.
    defer: bool
    pending: object | None

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        """Return one id out of ``candidates`` (never empty).

        ``in_flight`` maps replica id to its load: the requests currently sent to it (under
        ``weighs_streams``, one whose streamed answer has begun counts ``STREAM_WEIGHT``); a
        missing id means 0.
        """
        ...

    def commit(self, rid: int, record: object | None) -> None:
        """The request ``select`` left ``record`` for (None: none) went to ``rid``."""
        ...

    def update(self, ready: Sequence[int], engines: Mapping[int, EngineLoad]) -> None:
        """The ready set, or what the engines report, changed."""
        ...

    def weigh(self, weights: Mapping[int, float]) -> None:
        """What each replica serves relative to the others (its accelerator's target QPS,
        from the route); a replica missing from it weighs 1. Only
        :class:`InstanceAwareLeastLoad` reads it."""
        ...


class _Blind:
    """The load policies' side of :class:`Policy`: they read no request and keep nothing per
    replica."""

    reads_request = False
    weighs_streams = True
    preferred = False
    defer = False
    pending: object | None = None

    def commit(self, rid: int, record: object | None) -> None:
        return None

    def update(self, ready: Sequence[int], engines: Mapping[int, EngineLoad]) -> None:
        return None

    def weigh(self, weights: Mapping[int, float]) -> None:
        return None


def _next_after(
    candidates: Sequence[int], last: int | None, loads: Mapping[int, float] | None, target: int
) -> int:
    """Smallest candidate id greater than ``last``, wrapping to the smallest id.

    Rotating by id rather than by list position keeps the rotation fair when the ready set
    changes between calls (a replica added or removed does not make the next one be skipped or
    served twice), and needs no sorted copy. When ``loads`` is given only candidates whose load
    equals ``target`` are considered.
    """
    after: int | None = None
    smallest: int | None = None
    for rid in candidates:
        if loads is not None and loads.get(rid, 0) != target:
            continue
        if smallest is None or rid < smallest:
            smallest = rid
        if last is not None and rid > last and (after is None or rid < after):
            after = rid
    chosen = after if after is not None else smallest
    if chosen is None:  # pragma: no cover - callers guarantee a non-empty match
        raise ValueError("no candidate replica")
    return chosen


class RoundRobin(_Blind):
    """Each replica in turn, by ascending id; ignores load.

    With a stable ready set of N replicas, N consecutive requests hit each replica exactly once.
    """

    weighs_streams = False  # it reads no load

    def __init__(self) -> None:
        self._last: int | None = None
        # The successor of each id in the last candidates tuple seen (the balancer passes the
        # same ready-set tuple until it changes): one dict lookup per pick instead of a pass.
        self._seen: tuple[int, ...] | None = None
        self._succ: dict[int | None, int] = {}

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        if candidates is self._seen:
            chosen = self._succ.get(self._last)
            if chosen is not None:
                self._last = chosen
                return chosen
        chosen = _next_after(candidates, self._last, None, 0)
        self._last = chosen
        if type(candidates) is tuple and candidates is not self._seen:
            order = sorted(set(candidates))
            self._succ = dict(zip(order, order[1:] + order[:1], strict=True))
            self._seen = candidates  # held, so its identity cannot be reused
        return chosen

    def __repr__(self) -> str:
        return "RoundRobin()"


class LeastLoad(_Blind):
    """The replica with the fewest in-flight requests; ties rotate like round robin.

    Rotating among ties (instead of always taking the first) matters at low concurrency: with
    sequential requests every replica is idle at every pick, and a fixed tie-break would send
    all traffic to one replica and leave the others cold.
    """

    def __init__(self) -> None:
        self._last: int | None = None

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        chosen: int = _least_loaded(candidates, in_flight, self._last)
        self._last = chosen
        return chosen

    def __repr__(self) -> str:
        return "LeastLoad()"


def least_loaded(
    candidates: Sequence[int], in_flight: Mapping[int, float], last: int | None
) -> int:
    """:class:`LeastLoad`'s pick: in one pass, the least load so far, the smallest id with it,
    and the smallest id with it after ``last`` (what :func:`_next_after` would find among the
    least loaded). The reference; ``_speedups`` has its compiled twin, which the compiled build
    runs (the loop is the largest piece of Python left per request on the fast path)."""
    get = in_flight.get
    least: float = -1
    smallest = after = 0
    found_after = False
    for rid in candidates:
        load = get(rid, 0)
        if least < 0 or load < least:
            least = load
            smallest = rid
            found_after = last is not None and rid > last
            after = rid
        elif load == least:
            if rid < smallest:
                smallest = rid
            if last is not None and rid > last and (not found_after or rid < after):
                found_after = True
                after = rid
    if least < 0:
        raise ValueError("no candidate replica")
    return after if found_after else smallest


_least_loaded = speedups.twin("least_loaded") or least_loaded


class PowerOfTwo(_Blind):
    """Two replicas at random; the one with fewer in-flight requests wins.

    Nearly as good as least-load at spreading load but needs no full scan, and its randomness
    avoids the herding least-load shows when many requests arrive between count updates.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        n = len(candidates)
        if n == 0:
            raise ValueError("no candidate replica")
        if n == 1:
            return candidates[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:  # two distinct indexes without building a sample list
            j += 1
        a, b = candidates[i], candidates[j]
        return b if in_flight.get(b, 0) < in_flight.get(a, 0) else a

    def __repr__(self) -> str:
        return "PowerOfTwo()"


class InstanceAwareLeastLoad(_Blind):
    """SkyServe's ``instance_aware_least_load``, for fleets of mixed accelerators: the replica
    with the least in-flight requests per unit of what it serves (its accelerator's target QPS,
    :meth:`weigh`), so an H100 replica worth 10 QPS takes twice the requests of an A100 worth
    5 before either is preferred to the other. Ties rotate as in :class:`LeastLoad`."""

    def __init__(self) -> None:
        self._last: int | None = None
        self._weights: dict[int, float] = {}

    def weigh(self, weights: Mapping[int, float]) -> None:
        self._weights = {int(rid): float(w) for rid, w in weights.items() if w > 0}

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        weights, last = self._weights, self._last
        best: float | None = None
        smallest = after = 0
        found_after = False
        for rid in candidates:
            load = in_flight.get(rid, 0) / weights.get(rid, 1.0)
            if best is None or load < best - 1e-12:
                best, smallest, after = load, rid, rid
                found_after = last is not None and rid > last
            elif load <= best + 1e-12:
                smallest = min(smallest, rid)
                if last is not None and rid > last and (not found_after or rid < after):
                    found_after, after = True, rid
        if best is None:
            raise ValueError("no candidate replica")
        self._last = chosen = after if found_after else smallest
        return chosen

    def __repr__(self) -> str:
        return f"InstanceAwareLeastLoad(weights={self._weights})"
