"""The counters of balancers that are gone, kept in the sums of those that go on.

A service's counters are the sum of its balancers' (one per worker, plus those a route change
retired and that still finish their requests). When one of them ends (its worker killed,
replaced, or its retirement over), its part of the sum would vanish: the service's
``corral_lb_requests_total`` would go down part of the way, which Prometheus reads as a reset
to zero and ``rate()`` as a spike of every request since the start. So the worker keeps what
its retired balancers counted, and the daemon what its gone workers last reported, and each
adds it to the sums it makes (:func:`corral.balancer.metrics.counters_only`: the gauges at 0,
each replica's counts kept too). What a worker counted after its last report is lost with it.

The daemon's part outlives the daemon (``path``: a file in the home, written at each change):
a daemon restarted (a SIGKILL, `daemon stop`/`start`, an upgrade) sums its live workers'
reports with what its predecessors carried, rather than those reports alone, which would take
``corral_lb_requests_total`` down to what the live workers counted: not a reset to 0, that
Prometheus would take in its stride, but a drop to a value it would read as counted since 0.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from corral.balancer.metrics import counters_only, merge_stats

__all__ = ["Carried"]


class Carried:
    """Per service, the counters of its balancers that are gone, by where they came from
    (``source``: the worker process that reported them, to the daemon), so that a worker
    whose channel dropped and that reconnects, alive and still counting from where it was,
    takes its part back instead of being counted twice (:meth:`back`)."""

    def __init__(
        self, path: Path | None = None, alive: Callable[[list[Any]], bool] | None = None
    ) -> None:
        self._by: dict[str, dict[str, dict[str, Any]]] = {}
        # service -> replica -> live worker -> its last counts of the replica (see _left)
        self._last: dict[str, dict[str, dict[str, Mapping[str, Any]]]] = {}
        self._path = path
        self._alive = alive  # whether a worker ([pid, created]) still runs: _merge_the_dead
        self._batch: bool | None = None  # in gone(): None, else whether a save was put off
        if path is not None:
            try:
                self._by = _load(path)
                self._merge_the_dead()
            except (ValueError, TypeError, KeyError):  # not what corral wrote: start from none
                self._by = {}

    def _runs(self, source: Any) -> bool:
        """Whether the worker ``source`` (its ``[pid, created]``) still runs."""
        return isinstance(source, list) and self._alive is not None and self._alive(source)

    def _merge_the_dead(self) -> None:
        """One part per service for every worker that no longer runs: only a live worker can
        take its part back (:meth:`back`), so the dead need not be told apart, and what is kept
        (in memory and in the file) grows with the live workers, not with every worker ever
        replaced. Without ``alive`` (a worker's own retired balancers), nothing is merged."""
        if self._alive is None:
            return
        for parts in self._by.values():
            dead = [k for k in parts if k != _DEAD and not self._runs(json.loads(k))]
            if dead:
                parts[_DEAD] = merge_stats([parts.get(_DEAD, {}), *(parts.pop(k) for k in dead)])

    def add(self, name: str, stats: Mapping[str, Any], source: Hashable = None) -> None:
        parts = self._by.setdefault(name, {})
        key = _key(source)
        parts[key] = merge_stats([parts.get(key, {}), counters_only(stats)])
        self._save()

    def _save(self) -> None:
        """The whole of it to ``path`` (a new file, renamed over the old one), if any."""
        if self._path is None:
            return
        if self._batch is not None:  # once, at the end of gone(), not once per service
            self._batch = True
            return
        with contextlib.suppress(OSError):
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fresh = self._path.with_name(self._path.name + ".new")
            fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(self._by, out, separators=(",", ":"))
            os.replace(fresh, self._path)

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
        self._batch = False
        try:
            self.back(source)
            for name, report in reports.items():
                if name in keep and report.get("stats"):
                    self.add(name, report["stats"], source)
            self.keep_only(keep)
            self._merge_the_dead()
        finally:
            changed, self._batch = self._batch, None
        if changed:
            self._save()

    def back(self, source: Hashable) -> None:
        """``source`` reports again (a worker that reconnected): its counts are in its own
        reports from now on, not to be added a second time."""
        key = _key(source)
        if not any(key in parts for parts in self._by.values()):
            return
        for name in list(self._by):
            self._by[name].pop(key, None)
            if not self._by[name]:
                del self._by[name]
        self._save()

    def summed(
        self, name: str, live: Sequence[Mapping[str, Any]], left: Sequence[Mapping[str, Any]] = ()
    ) -> dict[str, Any]:
        """The ``live`` balancers' stats summed with what is carried of ``name`` (and ``left``,
        see :meth:`_left`). A replica none of them lists (it left and drained, and they forgot
        its counts) is not brought back by what was carried of it: its series ends, as it
        would have."""
        out = merge_stats([*live, *self.of(name), *left])
        listed = {str(rid) for one in live for rid in (one.get("replicas") or {})}
        out["replicas"] = {rid: rep for rid, rep in out["replicas"].items() if rid in listed}
        return out

    def of(self, name: str) -> list[Mapping[str, Any]]:
        """What to add to ``name``'s sum: nothing, or one stats dict."""
        parts = self._by.get(name)
        return [merge_stats(list(parts.values()))] if parts else []

    def drop(self, name: str) -> None:
        """The service was taken down: a later one of that name starts from 0."""
        self._last.pop(name, None)
        if self._by.pop(name, None) is not None:
            self._save()

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        gone = [n for n in self._by if n not in keep]
        for name in gone:
            del self._by[name]
        if gone:
            self._save()

    def gathered(
        self,
        reports: Mapping[Any, Mapping[str, Mapping[str, Any]]],
        names: Container[str],
        only: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """The services ``names`` (or ``only`` that one) as the daemon sums them: the workers'
        latest ``reports`` (by worker, a mapping of service to report) plus what is carried,
        with what the services' engines said last (to any worker)."""
        per: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        engines: dict[str, dict[str, Any]] = defaultdict(dict)
        for worker in reports.values():
            for name, report in worker.items():
                if only is not None and name != only:
                    continue
                if report.get("stats"):
                    per[name].append(report["stats"])
                engines[name].update(report.get("engines") or {})
        if only is None:
            self._last = {n: kept for n, kept in self._last.items() if n in per}
        out = {}
        for name, stats in per.items():
            if name in names:
                by_worker = {
                    _key(source): (worker.get(name) or {}).get("stats") or {}
                    for source, worker in reports.items()
                }
                left = self._left(name, by_worker)
                out[name] = {**self.summed(name, stats, left), "engines": engines[name]}
        return out

    def _left(self, name: str, by_worker: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The last counts of a replica that a live worker no longer lists (its balancer
        forgot the replica once it left and drained there) while another worker still does
        (a stream to it under way): without them its series would go down part of the way
        until the last worker forgets it too. Kept per worker while any lists the replica."""
        seen = self._last.setdefault(name, {})
        listed: set[str] = set()
        for source, stats in by_worker.items():
            for rid, counts in (stats.get("replicas") or {}).items():
                seen.setdefault(str(rid), {})[source] = counts
                listed.add(str(rid))
        left = []
        for rid in list(seen):
            if rid not in listed:
                del seen[rid]
                continue
            for source in list(seen[rid]):
                if source not in by_worker:  # a gone worker: its part is carried (gone())
                    del seen[rid][source]
                elif rid not in (by_worker[source].get("replicas") or {}):
                    left.append(counters_only({"replicas": {rid: seen[rid][source]}}))
        return left


# The key of what the workers that no longer run counted, merged (never a source's own key:
# sources are a worker's ``[pid, created]`` or None).
_DEAD: Final = json.dumps("gone")


def _key(source: Hashable) -> str:
    """A source as the file keeps it (a worker's ``(pid, created)``, or None): JSON text."""
    return json.dumps(source)


def _load(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """What a previous daemon carried; nothing when there is no such file or it is unreadable
    (the sums then start from the live workers' reports, as they did before it was kept)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(name): {str(k): dict(v) for k, v in parts.items() if isinstance(v, dict)}
        for name, parts in data.items()
        if isinstance(parts, dict)
    }
