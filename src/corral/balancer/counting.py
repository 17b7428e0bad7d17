"""What one balancer counts (requests, codes, latency, failures) and its rate-limited logs.

Kept apart from :mod:`corral.balancer.proxy` so the serving and routing logic reads alone. The
counters stay plain attributes of the balancer (a mixin, not an object it calls): the
per-request path bumps them directly, with no extra call or attribute hop.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from corral.balancer.metrics import LATENCY_BUCKETS

logger = logging.getLogger("corral.balancer")


class Counters:
    """The counting half of :class:`~corral.balancer.proxy.LoadBalancer`."""

    # Accepted-request timestamps kept for the autoscaler: at most this many (memory stays
    # bounded, ~10 MB, at any rate) ...
    TIMESTAMP_CAPACITY: Final = 1 << 18
    # ... and only for this many seconds (10x the autoscaler's 60 s window).
    TIMESTAMP_HORIZON: Final = 600.0
    # A replica's failures are logged at most once per this many seconds.
    FAILURE_LOG_INTERVAL: Final = 5.0

    _name: str
    _policy_name: str
    _port: int
    _ready: Mapping[int, object]
    _ready_ids: tuple[int, ...]
    _in_flight: dict[int, int]
    _streaming: dict[int, int]
    _held_total: int
    _held_expired: int
    _awaiting: int

    if TYPE_CHECKING:  # the balancer's own, which stats() reads

        @property
        def url(self) -> str: ...

        def in_flight(self, replica_id: int | None = None) -> int: ...

        def held(self) -> int: ...

    def _init_counters(self) -> None:
        self._served: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._timestamps: deque[float] = deque(maxlen=self.TIMESTAMP_CAPACITY)
        self._requests = 0
        self._errors = 0
        self._error_reasons: dict[str, int] = {}
        self._codes: dict[int, int] = {}
        self._latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        # Time to first token of streamed answers (the request sent to the first body bytes),
        # for the service and per replica: what an LLM operator watches.
        self._ttft: dict[int | None, list[float]] = {}
        self._retries = 0
        self._bad_requests = 0
        self._aborted = 0
        self._client_gone = 0
        self._quiet_until: dict[int, float] = {}  # per replica: failures only counted until then
        self._suppressed: dict[int, int] = {}
        self._shown_ids: dict[int, int] = {}  # internal key -> the id users see (status, logs)
        self._parse_log_until = 0.0  # malformed-request log lines: at most one per interval
        self._parse_suppressed = 0

    def request_timestamps(self, window: float = 60.0) -> list[float]:
        """``time.monotonic()`` of the requests accepted in the last ``window`` seconds, oldest
        first (at most TIMESTAMP_HORIZON seconds are kept)."""
        start = bisect.bisect_left(self._timestamps, time.monotonic() - window)
        return list(itertools.islice(self._timestamps, start, None))

    def timestamps_since(self, seen: int) -> tuple[list[float], int]:
        """The accepted-request times after this balancer's first ``seen`` requests, oldest
        first, and the count to pass next time: what a worker reports since its last report
        (0: every time still kept). Taken from the deque's end, in time proportional to what
        is new: a bisect and a skip from the deque's start cost ~1 ms a report at 30k req/s,
        ~1% of a worker's CPU (docs/benchmarks.md)."""
        total = self._requests  # every request counted appends its time (fast.py too)
        new = min(total - seen, len(self._timestamps))
        if new <= 0:
            return [], total
        out = list(itertools.islice(reversed(self._timestamps), new))
        out.reverse()
        return out, total

    def qps(self, window: float = 60.0) -> float:
        """Accepted requests per second over the last ``window`` seconds."""
        if window <= 0:
            raise ValueError("window must be > 0")
        start = bisect.bisect_left(self._timestamps, time.monotonic() - window)
        return (len(self._timestamps) - start) / window

    def _count_request(self, t0: float) -> None:
        self._requests += 1
        self._timestamps.append(t0)  # trimmed to the horizon by the ticker, not per request

    def _record(self, status: int, seconds: float) -> None:
        """A response went out (its headers): by code, and its latency."""
        codes = self._codes
        codes[status] = codes.get(status, 0) + 1
        self._latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds

    def _observe_ttft(self, rid: int | None, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        for key in (None, rid):
            h = self._ttft.get(key)
            if h is None:
                h = self._ttft[key] = [0.0] * (len(LATENCY_BUCKETS) + 2)
            h[i] += 1
            h[-1] += seconds  # the last slot holds the sum

    def ttft(self, rid: int | None = None) -> dict[str, Any]:
        """The TTFT histogram (per-bucket counts, as ``latency``) of the service or a replica."""
        h = self._ttft.get(rid) or [0.0] * (len(LATENCY_BUCKETS) + 2)
        counts = [int(n) for n in h[:-1]]
        return {"buckets": counts, "sum": h[-1], "count": sum(counts)}

    def _count_code(self, status: int) -> None:
        self._codes[status] = self._codes.get(status, 0) + 1

    def _count_reason(self, reason: str) -> None:
        self._error_reasons[reason] = self._error_reasons.get(reason, 0) + 1

    def _rejected(self, peer: bytes, status: int, reason: str, detail: str) -> None:
        """Count and log (rate-limited) a request the parser or a limit rejected."""
        self._bad_requests += 1
        self._count_reason(reason)
        self._count_code(status)
        now = time.monotonic()
        if now < self._parse_log_until:
            self._parse_suppressed += 1
            return
        self._parse_log_until = now + self.FAILURE_LOG_INTERVAL
        skipped, self._parse_suppressed = self._parse_suppressed, 0
        more = f" ({skipped} more not logged)" if skipped else ""
        logger.info(
            "balancer %s: rejected malformed request from %s with %d: %s%s",
            self._name,
            peer.decode("latin-1") or "?",
            status,
            detail or reason,
            more,
        )

    def shown_id(self, rid: int) -> int:
        """The replica's id as `corral status` and its logs show it (its internal key where
        the route gave none: a balancer run without a daemon)."""
        return self._shown_ids.get(rid, rid)

    def _warn(self, rid: int, text: str) -> None:
        """Log a replica failure, at most once per FAILURE_LOG_INTERVAL per replica.

        A dead replica fails every request sent its way until the controller takes it out of the
        ready set; one line per request would flood the log at full load. The next line after a
        quiet period says how many were left out.
        """
        now = time.monotonic()
        if now < self._quiet_until.get(rid, 0.0):
            self._suppressed[rid] = self._suppressed.get(rid, 0) + 1
            return
        self._quiet_until[rid] = now + self.FAILURE_LOG_INTERVAL
        skipped = self._suppressed.pop(rid, 0)
        more = f" ({skipped} more failure(s) not logged)" if skipped else ""
        logger.warning("balancer %s: replica %s: %s%s", self._name, self.shown_id(rid), text, more)

    def stats(self) -> dict[str, Any]:
        """Counters for status output, metrics and tests; JSON-serialisable (string keys), a
        fresh dict safe to keep or mutate. See :mod:`corral.balancer.metrics`."""
        ids = sorted(set(self._ready) | set(self._in_flight) | set(self._served))
        return {
            "service": self._name,
            "policy": self._policy_name,
            "url": self.url if self._port else None,
            "ready": list(self._ready_ids),
            "requests": self._requests,
            "errors": self._errors,
            "errors_by_reason": dict(self._error_reasons),
            "codes": {str(code): n for code, n in self._codes.items()},
            "latency": {
                "buckets": list(self._latency),
                "sum": self._latency_sum,
                "count": sum(self._latency),
            },
            "retries": self._retries,
            "bad_requests": self._bad_requests,
            "aborted": self._aborted,
            "client_disconnects": self._client_gone,
            "in_flight": self.in_flight(),
            "streaming": sum(self._streaming.values()),
            "ttft": self.ttft(),
            "held": self.held(),
            "held_total": self._held_total,
            "held_expired": self._held_expired,
            "awaiting": self._awaiting,
            "replicas": {
                str(rid): {
                    "ready": rid in self._ready,
                    "in_flight": self._in_flight.get(rid, 0),
                    "streaming": self._streaming.get(rid, 0),
                    "served": self._served.get(rid, 0),
                    "failed": self._failed.get(rid, 0),
                    "ttft": self.ttft(rid),
                }
                for rid in ids
            },
        }
