"""The counters of balancers that are gone, kept in the sums of those that go on.

A service's counters are the sum of its balancers' (one per worker, plus those a route change
retired and that still finish their requests). When one of them ends (its worker killed,
replaced, or its retirement over), its part of the sum would vanish: the service's
``corral_lb_requests_total`` would go down part of the way, which Prometheus reads as a reset
to zero and ``rate()`` as a spike of every request since the start. So the worker keeps what
its retired balancers counted, and the daemon what its gone workers last reported, and each
adds it to the sums it makes (:func:`corral.balancer.metrics.counters_only`: the gauges at 0,
no per-replica counts). What a worker counted after its last report is lost with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from corral.balancer.metrics import counters_only, merge_stats

__all__ = ["Carried"]


class Carried:
    """Per service, the counters of its balancers that are gone."""

    def __init__(self) -> None:
        self._by: dict[str, dict[str, Any]] = {}

    def add(self, name: str, stats: Mapping[str, Any]) -> None:
        self._by[name] = merge_stats([self._by.get(name, {}), counters_only(stats)])

    def gone(self, reports: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> None:
        """A worker is gone: its last ``reports`` of the services still ``names`` are kept
        (a service no longer among them drops what was kept of it)."""
        keep = set(names)
        for name, report in reports.items():
            if name in keep and report.get("stats"):
                self.add(name, report["stats"])
        self.keep_only(keep)

    def of(self, name: str) -> list[Mapping[str, Any]]:
        """What to add to ``name``'s sum: nothing, or one stats dict."""
        return [self._by[name]] if name in self._by else []

    def drop(self, name: str) -> None:
        """The service was taken down: a later one of that name starts from 0."""
        self._by.pop(name, None)

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in [n for n in self._by if n not in keep]:
            del self._by[name]
