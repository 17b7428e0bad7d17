"""One sampler for every open dashboard tab, and the server-sent events stream that shares it.

Why one: a tab that asked the daemon for everything on its own timer would multiply the
control plane's work by the tabs open. Here a single task reads the counters and the services
once per :data:`TICK_SECONDS` while any tab listens, encodes that state once, and hands the very
same bytes to every listener; a listener that falls behind skips to the newest state instead of
queueing old ones. With no tab open it only takes the charts' sample every
:data:`~corral.dashboard.history.SAMPLE_SECONDS`, so the history is there when a tab opens.

What a state holds per service is the API's own snapshot (``GET /v1/services/NAME``) plus the
traffic figures of :mod:`corral.dashboard.history`, each replica's share from the balancers'
counters, and the last events: the page needs nothing else to draw a services list or a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from corral import __version__
from corral.daemon_env import DaemonError, env_seconds
from corral.dashboard.history import (
    LIVE_WINDOW,
    SAMPLE_SECONDS,
    History,
    Point,
    Reading,
    Readings,
)
from corral.state import StateError

if TYPE_CHECKING:
    from corral.daemon import Daemon

log = logging.getLogger("corral.dashboard")

TICK_SECONDS: Final = 1.0
EVENTS_SHOWN: Final = 25
MAX_LISTENERS: Final = 64
SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-store",
}


def sse(event: str, data: Any) -> bytes:
    """One server-sent event; JSON never holds a raw newline, so it fits one ``data:`` line."""
    body = json.dumps(data, separators=(",", ":"), default=str)
    return f"event: {event}\ndata: {body}\n\n".encode()


def _replica_traffic(stats: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return dict((stats or {}).get("replicas") or {})


class Feed:
    """The sampler task, the charts' history it fills, and its listeners."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.readings = Readings()
        self.history = History()
        self.listeners = 0
        self.closed = False
        self._frame = b""
        self._frame_at = 0.0
        self._seq = 0
        self._published = asyncio.Event()
        self._wake = asyncio.Event()
        self._last_point: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        # The autoscaler's QPS window (its sentence quotes a QPS over it): read as the daemon
        # read it at start, so the page can say which window each QPS figure is over.
        try:
            self.qps_window = env_seconds("CORRAL_QPS_WINDOW", 60.0)
        except DaemonError:
            self.qps_window = 60.0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="corral-dashboard-feed")

    async def stop(self) -> None:
        """End every stream now (a daemon stopping must not wait for open tabs)."""
        self.closed = True
        self._published.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while not self.closed:
            try:
                self.sample(time.time())
            except StateError as exc:  # the state file is busy: skip this tick
                log.warning("dashboard sample skipped: %s", exc)
            except Exception:
                log.exception("dashboard sample failed")
            interval = TICK_SECONDS if self.listeners else SAMPLE_SECONDS
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    # -- sampling -----------------------------------------------------------------------------

    def sample(self, now: float) -> None:
        """Read the counters; add chart points that are due; encode a state if anyone listens."""
        stats = self.daemon.balancer_stats()
        names = list(self.daemon.controllers)
        for name in names:
            # No counters yet (a new daemon before its workers' first reports) is no reading:
            # taken as zeros, the next one charted the service's whole past as one interval.
            if name in stats:
                self.readings.add(name, Reading.of(now, stats[name]))
        self.readings.keep_only(names)
        self.history.keep_only(names)
        due = [n for n in names if now - self._last_point.get(n, 0.0) >= SAMPLE_SECONDS - 0.5]
        if not due and not self.listeners:
            return
        services = self.daemon.services()
        for service in services:
            name = service["name"]
            if name in due:
                self._add_point(name, now, service)
        if self.listeners:
            self._publish(now, services, stats)

    def _add_point(self, name: str, now: float, service: dict[str, Any]) -> None:
        figures = self.readings.since(name, SAMPLE_SECONDS)
        ready = sum(1 for r in service["replicas"] if r["status"] == "READY")
        llm = service.get("llm") or {}
        hit_rate = figures.hit_rate if figures else None
        reading = self.readings.latest(name)
        if hit_rate is None and not (reading and reading.lookups):
            # SGLang reports its hit rate itself (no counters to take a difference of). Engines
            # that count lookups (vLLM) and looked up nothing in these 5 s have no rate for
            # them: their rate since they started, in its place, was charted as this interval's.
            hit_rate = llm.get("prefix_hit_rate")
        self.history.add(
            name,
            Point(
                t=round(now, 3),
                qps=round(figures.qps, 3) if figures else 0.0,
                p50=figures.p50 if figures else None,
                p99=figures.p99 if figures else None,
                error_rate=figures.error_rate if figures else None,
                ready=ready,
                target=service.get("target"),
                ttft_p50=figures.ttft_p50 if figures else None,
                ttft_p99=figures.ttft_p99 if figures else None,
                hit_rate=hit_rate,
                waiting=llm.get("queue"),
                running=llm.get("running"),
                held=llm.get("held"),
                tps=llm.get("tokens_per_second"),
            ),
        )
        self._last_point[name] = now

    def state(self, now: float, services: list[dict[str, Any]], stats: dict[str, Any]) -> Any:
        """What every tab is sent: the services as the API shows them, and more."""
        out = []
        for service in services:
            name = service["name"]
            figures = self.readings.since(name, LIVE_WINDOW)
            traffic = _replica_traffic(stats.get(name))
            held = service.get("traffic_held_for_version")
            for replica in service["replicas"]:
                # The balancers count by the internal id; a replica they never counted served 0.
                counted = traffic.get(str(replica.get("uid", replica["id"])))
                replica["traffic"] = counted or {"in_flight": 0, "served": 0}
            ready = [r for r in service["replicas"] if r["status"] == "READY"]
            events = self.daemon.recent_events(name, EVENTS_SHOWN)
            point = self.history.latest(name)
            out.append(
                {
                    **service,
                    "ready": len(ready),
                    "serving_versions": sorted({r["version"] for r in ready} - {held}),
                    "live": figures.as_dict() if figures else None,
                    "point": asdict(point) if point else None,
                    "events": [e.__dict__ for e in events],
                }
            )
        return {
            "t": now,
            "daemon": {"pid": os.getpid(), "version": __version__, "home": str(self.daemon.home)},
            "live_window": LIVE_WINDOW,
            "qps_window": self.qps_window,
            "sample_seconds": SAMPLE_SECONDS,
            "services": out,
        }

    def _publish(self, now: float, services: list[dict[str, Any]], stats: dict[str, Any]) -> None:
        self._frame = sse("state", self.state(now, services, stats))
        self._frame_at = time.monotonic()
        self._seq += 1
        published, self._published = self._published, asyncio.Event()
        published.set()

    # -- listeners ----------------------------------------------------------------------------

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """The state stream of one tab: the newest state at once, then each new one."""
        if self.listeners >= MAX_LISTENERS:
            return web.json_response(
                {"error": f"too many dashboard streams open (at most {MAX_LISTENERS})"},
                status=503,
            )
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        self.listeners += 1
        self._wake.set()  # a state made for this tab now, not at the next slow tick
        seq = self._seq if time.monotonic() - self._frame_at > 2 * TICK_SECONDS else -1
        try:
            await response.write(b"retry: 2000\n\n")
            while not self.closed:
                published = self._published
                if seq != self._seq and self._frame:
                    seq = self._seq
                    await response.write(self._frame)
                    continue
                await published.wait()
        except ConnectionError:
            return response  # the tab went away
        finally:
            self.listeners -= 1
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
