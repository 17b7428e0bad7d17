"""The dashboard's chart points as the sampler takes them (corral.dashboard.feed.Feed.sample),
with a stand-in daemon: what a chart shows after a daemon restart and while nothing happens. A
point is the figures of its 5 s, or nothing: never the service's whole past."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.balancer.metrics import LATENCY_BUCKETS
from corral.dashboard.feed import Feed


class _Daemon:
    """What Feed.sample asks of the daemon: the balancers' summed counters and the services."""

    def __init__(self, llm: dict[str, Any] | None = None) -> None:
        self.home = Path("/nonexistent")
        self.controllers: dict[str, Any] = {"chat": object()}
        self.stats: dict[str, Any] = {}
        self.llm = llm

    def balancer_stats(self) -> dict[str, Any]:
        return self.stats

    def services(self) -> list[dict[str, Any]]:
        return [{"name": "chat", "replicas": [], "target": 1, "llm": self.llm}]

    def recent_events(self, name: str, limit: int) -> list[Any]:
        return []


def _points(daemon: _Daemon, stats: list[dict[str, Any]], key: str) -> list[Any]:
    """``key`` of each point charted from these successive reports, 5 s apart."""
    feed = Feed(daemon)  # type: ignore[arg-type]
    for i, each in enumerate(stats):
        daemon.stats = each
        feed.sample(1000.0 + 5 * i)
    return [p[key] for p in feed.history.series("chat")]


def _counted(answers: int) -> dict[str, Any]:
    """A service's counters after ``answers`` fast answers, as the workers report them."""
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    buckets[0] = answers
    return {
        "chat": {
            "codes": {"200": answers},
            "latency": {"buckets": buckets},
            "ttft": {"buckets": buckets},
        }
    }


def test_a_restarted_daemon_does_not_chart_the_services_whole_past_as_one_interval() -> None:
    """A new daemon samples at once, before its workers have reported: the service has no
    counters yet. Taken as zeros, the next sample (the counters since the service was created,
    carried across restarts) charted every request ever answered as the last 5 s: QPS 100 and
    the lifetime p99 on a chart of an idle service."""
    reports = [{}, _counted(500), _counted(510)]  # 500 answers since the service was created
    assert _points(_Daemon(), reports, "qps") == [0.0, 0.0, pytest.approx(2.0)]
    assert _points(_Daemon(), reports, "ttft_p50")[1] is None


def _engines(**signals: dict[str, float]) -> dict[str, Any]:
    return {"chat": {"codes": {"200": 10}, "engines": signals}}


def test_an_idle_interval_of_counting_engines_charts_no_hit_rate() -> None:
    """vLLM's engines count hits and lookups: an interval with no lookup has no rate. The
    service's rate since its engines started (0.93 here), charted in its place, drew a flat
    line through every idle minute, as if prompts still hit the cache."""
    busy = _engines(r1={"prefix_hits": 930.0, "prefix_queries": 1000.0})
    later = _engines(r1={"prefix_hits": 1020.0, "prefix_queries": 1100.0})
    rates = _points(_Daemon({"prefix_hit_rate": 0.93}), [busy, later, later, later], "hit_rate")
    assert rates[1] == pytest.approx(0.9)  # 90 of the interval's 100 lookups
    assert rates[2:] == [None, None]  # nothing looked up: no rate


def test_engines_that_report_only_a_rate_are_charted_with_it() -> None:
    """SGLang reports its hit rate, not counters: that rate is what the chart has."""
    rated = _engines(r1={"cache_hit_rate": 0.5})
    assert _points(_Daemon({"prefix_hit_rate": 0.5}), [rated, rated], "hit_rate") == [0.5, 0.5]
