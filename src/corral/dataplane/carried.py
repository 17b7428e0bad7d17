"""The counters of balancers that are gone, kept in the sums of those that go on.

A service's counters are the sum of its balancers' (one per worker, plus those a route change
retired and that still finish their requests). When one of them ends (its worker killed,
replaced, or its retirement over), its part of the sum would vanish: the service's
``corral_lb_requests_total`` would go down part of the way, which Prometheus reads as a reset
to zero and ``rate()`` as a spike of every request since the start. So the worker keeps what
its retired balancers counted, and the daemon what its gone workers last reported, and each
adds it to the sums it makes (:func:`corral.balancer.metrics.counters_only`: the gauges at 0,
each replica's counts kept too). What a worker counted after its last report is lost with it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from typing import Any

from corral.balancer.metrics import counters_only, merge_stats

__all__ = ["Carried"]


class Carried:
    """Per service, the counters of its balancers that are gone, by where they came from
    (``source``: the worker process that reported them, to the daemon), so that a worker
    whose channel dropped and that reconnects, alive and still counting from where it was,
    takes its part back instead of being counted twice (:meth:`back`)."""

    def __init__(self) -> None:
        self._by: dict[str, dict[Hashable, dict[str, Any]]] = {}

    def add(self, name: str, stats: Mapping[str, Any], source: Hashable = None) -> None:
        parts = self._by.setdefault(name, {})
        parts[source] = merge_stats([parts.get(source, {}), counters_only(stats)])

    def gone(
        self,
        reports: Mapping[str, Mapping[str, Any]],
        names: Iterable[str],
        source: Hashable = None,
    ) -> None:
        """A worker is gone: its last ``reports`` of the services still ``names`` are kept
        (a service no longer among them drops what was kept of it). ``source`` replaces what
        was kept of that worker before (its reports are cumulative)."""
        keep = set(names)
        self.back(source)
        for name, report in reports.items():
            if name in keep and report.get("stats"):
                self.add(name, report["stats"], source)
        self.keep_only(keep)

    def back(self, source: Hashable) -> None:
        """``source`` reports again (a worker that reconnected): its counts are in its own
        reports from now on, not to be added a second time."""
        for name in list(self._by):
            self._by[name].pop(source, None)
            if not self._by[name]:
                del self._by[name]

    def summed(self, name: str, live: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The ``live`` balancers' stats summed with what is carried of ``name``. A replica
        none of them lists (it left and drained, and they forgot its counts) is not brought
        back by what was carried of it: its series ends, as it would have."""
        out = merge_stats([*live, *self.of(name)])
        listed = {str(rid) for one in live for rid in (one.get("replicas") or {})}
        out["replicas"] = {rid: rep for rid, rep in out["replicas"].items() if rid in listed}
        return out

    def of(self, name: str) -> list[Mapping[str, Any]]:
        """What to add to ``name``'s sum: nothing, or one stats dict."""
        parts = self._by.get(name)
        return [merge_stats(list(parts.values()))] if parts else []

    def drop(self, name: str) -> None:
        """The service was taken down: a later one of that name starts from 0."""
        self._by.pop(name, None)

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in [n for n in self._by if n not in keep]:
            del self._by[name]

    def gathered(
        self,
        reports: Iterable[Mapping[str, Mapping[str, Any]]],
        names: Container[str],
        only: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """The services ``names`` (or ``only`` that one) as the daemon sums them: the workers'
        latest ``reports`` (one mapping of service to report per worker) plus what is carried,
        with what the services' engines said last (to any worker)."""
        per: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        engines: dict[str, dict[str, Any]] = defaultdict(dict)
        for worker in reports:
            for name, report in worker.items():
                if only is not None and name != only:
                    continue
                if report.get("stats"):
                    per[name].append(report["stats"])
                engines[name].update(report.get("engines") or {})
        return {
            name: {**self.summed(name, stats), "engines": engines[name]}
            for name, stats in per.items()
            if name in names
        }
