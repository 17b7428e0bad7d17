"""Each local replica's CPU and memory, read from /proc when a service page asks for them.

A replica is its process and every descendant (``sh -c`` and the app, workers it forks). Its
CPU use is the growth of their CPU time (user + system) between two readings divided by the
wall time between them, in percent of one core (200% is two cores busy); its memory is their
resident set sizes summed (pages shared between them are counted once per process, as ``ps``
does). A replica never read before is read twice, :data:`FIRST_GAP` apart, so the first
answer has a CPU figure too (over that short gap; later ones span the time between readings).

Cost: one scan of the process table per replica and a ``stat`` of each of its processes, done
on a thread, at most once per :data:`MIN_INTERVAL` per service however many tabs ask (a
reading younger than that is answered again). Nothing is read while no service page is open.
Replicas of other backends (Ray) have no pid here: their figures are None.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import psutil

MIN_INTERVAL: Final = 1.0
FIRST_GAP: Final = 0.25


def _group(pid: int) -> list[psutil.Process] | None:
    """The replica's process and its descendants, or None when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return None


def _totals(procs: Iterable[psutil.Process]) -> tuple[float, int, int]:
    """(CPU seconds, resident bytes, processes counted) of ``procs``, skipping those gone."""
    cpu = 0.0
    rss = 0
    count = 0
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                memory = proc.memory_info()
        except psutil.Error:
            continue
        cpu += times.user + times.system
        rss += memory.rss
        count += 1
    return cpu, rss, count


class Usage:
    """The last reading of each replica (for CPU deltas) and of each service (to answer again
    within :data:`MIN_INTERVAL`)."""

    def __init__(self) -> None:
        # replica key -> (wall time, CPU seconds, root's creation time)
        self._cpu: dict[str, tuple[float, float, float | None]] = {}
        self._answers: dict[str, tuple[float, dict[str, Any]]] = {}
        # Two tabs may miss the cache at once: their reads run one after the other, and the
        # second is answered from the first's reading.
        self._lock = threading.Lock()

    def cached(self, service: str, now: float) -> dict[str, Any] | None:
        found = self._answers.get(service)
        return found[1] if found and now - found[0] < MIN_INTERVAL else None

    def read(
        self, service: str, replicas: Iterable[Mapping[str, Any]], keep: Iterable[str]
    ) -> dict[str, Any]:
        """Per replica id (as the page shows it): cpu_percent (None if its process changed
        between two readings), rss_bytes, processes; or None for a replica with no local
        process. What is kept for services not in ``keep`` is dropped. Blocking: call on a
        thread."""
        with self._lock:
            self._forget(keep)
            return self.cached(service, time.time()) or self._read(service, list(replicas))

    def _read(self, service: str, replicas: list[Mapping[str, Any]]) -> dict[str, Any]:
        if self._prime(service, replicas):
            time.sleep(FIRST_GAP)  # a first figure now, not at the page's next reading
        now = time.time()
        out: dict[str, Any] = {}
        seen = set()
        for replica in replicas:
            key = f"{service}/{replica.get('uid', replica['id'])}"
            pid = replica.get("pid")
            group = _group(int(pid)) if isinstance(pid, int) and pid > 0 else None
            if not group:
                out[str(replica["id"])] = None
                continue
            seen.add(key)
            created = _created(group[0])
            cpu, rss, count = _totals(group)
            before = self._cpu.get(key)
            percent = None
            if before is not None and before[2] == created and now > before[0]:
                percent = round(max(0.0, cpu - before[1]) / (now - before[0]) * 100, 1)
            self._cpu[key] = (now, cpu, created)
            out[str(replica["id"])] = {"cpu_percent": percent, "rss_bytes": rss, "processes": count}
        for key in [k for k in self._cpu if k.startswith(service + "/") and k not in seen]:
            del self._cpu[key]
        answer = {"t": now, "replicas": out}
        self._answers[service] = (now, answer)
        return answer

    def _prime(self, service: str, replicas: list[Mapping[str, Any]]) -> bool:
        """Take a first CPU reading of each replica never read; whether there was one."""
        primed = False
        for replica in replicas:
            key = f"{service}/{replica.get('uid', replica['id'])}"
            pid = replica.get("pid")
            if key in self._cpu or not isinstance(pid, int) or pid <= 0:
                continue
            group = _group(pid)
            if group:
                self._cpu[key] = (time.time(), _totals(group)[0], _created(group[0]))
                primed = True
        return primed

    def _forget(self, keep: Iterable[str]) -> None:
        """Drop what is kept for services that are gone."""
        names = set(keep)
        for service in [s for s in self._answers if s not in names]:
            del self._answers[service]
        for key in [k for k in self._cpu if k.split("/", 1)[0] not in names]:
            del self._cpu[key]


def _created(proc: psutil.Process) -> float | None:
    try:
        return float(proc.create_time())
    except psutil.Error:
        return None
