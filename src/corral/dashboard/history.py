"""Traffic figures for the dashboard, from the counters ``/metrics`` renders, and their history.

The balancer workers report cumulative counters (answers by status code, latency buckets; see
:mod:`corral.balancer.metrics`). A figure such as QPS or p99 is the difference between two
readings of those counters divided by the time between them, so this module keeps:

* a short ring of readings per service (:class:`Readings`, the last :data:`RECENT_SECONDS`),
  from which the dashboard's "now" figures are taken over the last :data:`LIVE_WINDOW` seconds;
* a bounded history of one point per :data:`SAMPLE_SECONDS` per service (:class:`History`), the
  charts' data: :data:`KEEP_SECONDS` (six hours) of it, so at most :data:`POINTS` points each
  (slotted objects of fourteen numbers, seven of them None but for an LLM service: 1.1 MB per
  service when full, 1.7 MB for an LLM service, measured with tracemalloc).

Why memory and not SQLite: six hours of 5-second points is 4320 small tuples per service,
written every 5 s; persisting them would add a write per service every 5 s to the state file
that the control plane depends on, for charts nobody may open. The price: a daemon restart
starts its history empty (an open tab keeps what it drew and goes on from there), and its
counters at 0; a worker that ended leaves what it last reported in them
(:mod:`corral.dataplane.carried`). A reading may still go down (a daemon restart): a
difference below zero counts as zero (less traffic than there was, never negative traffic).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

from corral.balancer.metrics import quantile

SAMPLE_SECONDS: Final = 5.0
KEEP_SECONDS: Final = 6 * 3600.0
POINTS: Final = int(KEEP_SECONDS / SAMPLE_SECONDS)
LIVE_WINDOW: Final = 10.0
RECENT_SECONDS: Final = 15.0


@dataclass(frozen=True)
class Reading:
    """One service's cumulative counters at time ``t`` (summed over the balancer workers)."""

    t: float
    answered: int  # every answer, by any status: corral_lb_requests_total summed over codes
    server_errors: int  # answers with a 5xx status (the balancer's own 502/503/504 included)
    buckets: tuple[int, ...]  # latency, per bucket (not cumulative), last one +Inf
    ttft: tuple[int, ...] = ()  # time to first token of streamed answers, the same way
    # Each engine's prefix-cache hits and the prompt tokens it looked up (vLLM's counters),
    # by replica: kept apart, since the ready set the sum is over changes between readings.
    lookups: tuple[tuple[str, float, float], ...] = ()

    @classmethod
    def of(cls, t: float, stats: Mapping[str, Any] | None) -> Reading:
        stats = stats or {}
        codes = stats.get("codes") or {}
        answered = server_errors = 0
        for code, n in codes.items():
            answered += int(n)
            if str(code).startswith("5"):
                server_errors += int(n)
        lookups = tuple(
            (str(key), float(signals.get("prefix_hits") or 0.0), float(signals["prefix_queries"]))
            for key, signals in sorted((stats.get("engines") or {}).items())
            if signals.get("prefix_queries") is not None
        )
        latency, ttft = _buckets(stats, "latency"), _buckets(stats, "ttft")
        return cls(t, answered, server_errors, latency, ttft, lookups)


def _buckets(stats: Mapping[str, Any], key: str) -> tuple[int, ...]:
    return tuple(int(n) for n in (stats.get(key) or {}).get("buckets") or ())


def _hit_rate(old: Reading, new: Reading) -> float | None:
    """The engines' hit rate over the lookups between two readings, of the engines read in
    both whose counters did not go back. A sum over the whole ready set would count as this
    interval's a replica's every lookup since it started when it joins (a probe that passed
    again), and take them away when it leaves (a scale-down): 2.25 once for a true 0.9."""
    before = {key: (hits, queries) for key, hits, queries in old.lookups}
    hits = queries = 0.0
    for key, now_hits, now_queries in new.lookups:
        then = before.get(key)
        if then is None or now_hits < then[0] or now_queries < then[1]:
            continue  # new to the ready set, or its engine restarted: its past is not this
        hits += now_hits - then[0]
        queries += now_queries - then[1]
    return round(hits / queries, 4) if queries > 0 else None


def _growth(old: tuple[int, ...], new: tuple[int, ...]) -> list[int]:
    """Per-bucket counts between two readings (a bucket that went down, a restarted worker's,
    grew by none)."""
    width = max(len(old), len(new))
    then = (*old, *([0] * (width - len(old))))
    now = (*new, *([0] * (width - len(new))))
    return [max(0, b - a) for a, b in zip(then, now, strict=True)]


@dataclass(frozen=True)
class Figures:
    """Traffic over an interval: answers per second, latency quantiles (seconds, None when
    nothing was answered), the share of 5xx answers, and the counters' totals at its end; for
    an LLM service also the time to first token of the answers streamed in it and the engines'
    prefix-cache hit rate over it (None when none was streamed or looked up)."""

    qps: float
    p50: float | None
    p99: float | None
    error_rate: float | None
    answered_total: int
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    hit_rate: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def figures(old: Reading | None, new: Reading) -> Figures:
    """Figures between two readings of one service (``old`` None: no traffic known yet)."""
    if old is None or new.t <= old.t:
        return Figures(0.0, None, None, None, new.answered)
    seconds = new.t - old.t
    answered = max(0, new.answered - old.answered)
    errors = max(0, new.server_errors - old.server_errors)
    delta = _growth(old.buckets, new.buckets)
    ttft = _growth(old.ttft, new.ttft)
    return Figures(
        qps=answered / seconds,
        p50=quantile(0.5, delta),
        p99=quantile(0.99, delta),
        error_rate=errors / answered if answered else None,
        answered_total=new.answered,
        ttft_p50=quantile(0.5, ttft),
        ttft_p99=quantile(0.99, ttft),
        hit_rate=_hit_rate(old, new),
    )


class Readings:
    """The last :data:`RECENT_SECONDS` of readings per service, to take differences from."""

    def __init__(self) -> None:
        self._recent: dict[str, deque[Reading]] = {}

    def add(self, name: str, reading: Reading) -> None:
        ring = self._recent.setdefault(name, deque())
        ring.append(reading)
        while len(ring) > 1 and reading.t - ring[0].t > RECENT_SECONDS:
            ring.popleft()

    def since(self, name: str, seconds: float) -> Figures | None:
        """Figures over about the last ``seconds`` (the oldest reading at least that old, or
        the oldest kept), or None for a service never read."""
        ring = self._recent.get(name)
        if not ring:
            return None
        newest = ring[-1]
        old = ring[0]
        for reading in ring:
            # A sampler tick comes a little late at times: a reading 0.25 s short still counts.
            if newest.t - reading.t < seconds - 0.25:
                break
            old = reading
        return figures(old if old is not newest else None, newest)

    def latest(self, name: str) -> Reading | None:
        ring = self._recent.get(name)
        return ring[-1] if ring else None

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in list(self._recent):
            if name not in keep:
                del self._recent[name]


@dataclass(frozen=True, slots=True)
class Point:
    """One chart point: figures over the :data:`SAMPLE_SECONDS` before ``t``, and the
    replica counts then; for an LLM service (else None) the time to first token and the
    prefix-cache hit rate over those seconds, and the engines' queue (waiting, running), the
    requests held in the balancer and the tokens per second at ``t``."""

    t: float
    qps: float
    p50: float | None
    p99: float | None
    error_rate: float | None
    ready: int
    target: int | None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    hit_rate: float | None = None
    waiting: float | None = None
    running: float | None = None
    held: int | None = None
    tps: float | None = None


class History:
    """At most ``points`` chart points per service, oldest dropped first."""

    def __init__(self, points: int = POINTS) -> None:
        self.points = points
        self._series: dict[str, deque[Point]] = {}

    def add(self, name: str, point: Point) -> None:
        self._series.setdefault(name, deque(maxlen=self.points)).append(point)

    def series(self, name: str) -> list[dict[str, Any]]:
        return [asdict(p) for p in self._series.get(name, ())]

    def latest(self, name: str) -> Point | None:
        ring = self._series.get(name)
        return ring[-1] if ring else None

    def keep_only(self, names: Iterable[str]) -> None:
        """Forget services that are gone (taken down): their points would never be read."""
        keep = set(names)
        for name in list(self._series):
            if name not in keep:
                del self._series[name]

    def __len__(self) -> int:
        return sum(len(s) for s in self._series.values())
