"""An open-loop HTTP load generator for the tests (balancer churn, data plane survival).

Open loop: requests leave on a fixed schedule whatever the answers do, so a stall shows up as
latency, not as fewer requests. Bounded in every way: at most ``rate * duration`` requests, each
with a total deadline of REQUEST_DEADLINE, and the thread is joined with a deadline. Every
``post_every``-th request is a POST with a small body (examples/app.py echoes it), to check that
non-idempotent requests get through too.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REQUEST_DEADLINE = 10.0  # s, total per request (connect + answer)
MAX_CONCURRENT = 128  # open requests at most; a stall beyond this delays sends (seen as latency)
SLOW = 0.5  # s: answers slower than this are listed (when they were sent), never asserted


@dataclass
class LoadResult:
    """What the client saw: one entry per request sent."""

    sent: int = 0
    ok: int = 0
    latencies: list[float] = field(default_factory=list)  # s, of every answered request
    errors: Counter[str] = field(default_factory=Counter)  # failure kind -> count
    examples: list[str] = field(default_factory=list)  # the first few failures, verbatim
    pids: Counter[int] = field(default_factory=Counter)  # replica pid -> answers
    slow: list[tuple[float, float]] = field(default_factory=list)  # (sent at, took) > SLOW
    elapsed: float = 0.0

    @property
    def failed(self) -> int:
        return self.sent - self.ok

    def quantile_ms(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.sent,
            "failed": self.failed,
            "achieved_rps": round(self.sent / self.elapsed, 1) if self.elapsed else 0.0,
            "p50_ms": round(self.quantile_ms(0.50), 1),
            "p99_ms": round(self.quantile_ms(0.99), 1),
            "max_ms": round(1000.0 * max(self.latencies, default=0.0), 1),
            "replicas_answering": len(self.pids),
            "slow": [f"{at:.1f}s:{took * 1000:.0f}ms" for at, took in self.slow[:10]],
        }


class PacedLoad:
    """GET (and POST) ``url/churn/<n>`` at ``rate`` req/s for ``duration`` s on a thread of its own.

    Bounded in every way: at most ``rate * duration`` requests, each with a total deadline of
    REQUEST_DEADLINE, and the thread is joined with a deadline by :meth:`join`.
    """

    def __init__(self, url: str, rate: float, duration: float, *, post_every: int = 0) -> None:
        assert url.startswith("http://127.0.0.1:"), url
        self.url = url
        self.post_every = post_every
        self.rate = rate
        self.duration = duration
        self.result = LoadResult()
        self._thread = threading.Thread(target=self._main, name="paced-load", daemon=True)
        self._crash: BaseException | None = None
        self._halt = threading.Event()
        self.started = 0.0  # loop time of the first request

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Send no more requests (those in flight still finish, within their deadline)."""
        self._halt.set()

    def join(self) -> LoadResult:
        self._thread.join(self.duration + REQUEST_DEADLINE + 30.0)
        assert not self._thread.is_alive(), "the load generator overran its own deadline"
        if self._crash is not None:
            raise self._crash
        return self.result

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by join(), on the test's thread
            self._crash = exc

    async def _run(self) -> None:
        total = int(self.rate * self.duration)
        limit = asyncio.Semaphore(MAX_CONCURRENT)
        connector = aiohttp.TCPConnector(limit=MAX_CONCURRENT, force_close=False)
        timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            loop = asyncio.get_running_loop()
            start = self.started = loop.time()
            tasks = []
            for n in range(total):
                if self._halt.is_set():
                    break
                delay = start + n / self.rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await limit.acquire()
                tasks.append(asyncio.create_task(self._one(session, n, limit)))
            await asyncio.gather(*tasks)
            self.result.elapsed = loop.time() - start

    async def _one(self, session: aiohttp.ClientSession, n: int, limit: asyncio.Semaphore) -> None:
        result = self.result
        result.sent += 1
        t0 = time.monotonic()
        try:
            if self.post_every and n % self.post_every == 0:
                request = session.post(f"{self.url}/churn/{n}", data=b"x" * 100)
            else:
                request = session.get(f"{self.url}/churn/{n}")
            async with request as response:
                body = await response.read()
                took = time.monotonic() - t0
                if took > SLOW and len(result.slow) < 50:
                    result.slow.append((t0 - self.started, took))
                if 200 <= response.status < 300:
                    result.ok += 1
                    result.latencies.append(took)
                    result.pids[int(json.loads(body)["pid"])] += 1
                    return
                kind = f"HTTP {response.status}"
                detail = body[:300].decode(errors="replace")
                result.latencies.append(took)
        except TimeoutError:
            kind, detail = "deadline", f"no answer within {REQUEST_DEADLINE:g}s"
        except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
            kind, detail = type(exc).__name__, str(exc)
        finally:
            limit.release()
        result.errors[kind] += 1
        if len(result.examples) < 10:
            result.examples.append(f"t={t0 - self.started:.2f}s #{n} {kind}: {detail}")
