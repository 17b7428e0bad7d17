"""Readiness probing of one replica endpoint.

Probes are plain HTTP requests made concurrently from the daemon's event loop (one shared
aiohttp session), so probing 100 replicas costs 100 small requests, not 100 threads. The probe
mirrors SkyServe's: GET, or POST with a JSON body when ``post_data`` is set, a per-probe timeout,
and extra headers (only their names are ever logged: they often carry credentials).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    status: int | None
    error: str | None
    seconds: float


async def probe(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    path: str = "/",
    post_data: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 15.0,
) -> ProbeResult:
    """One probe: ready means an HTTP 2xx answer within ``timeout`` seconds."""
    started = time.monotonic()
    url = base_url.rstrip("/") + path
    try:
        async with asyncio.timeout(timeout):
            if post_data is not None:
                request = session.post(url, json=dict(post_data), headers=headers)
            else:
                request = session.get(url, headers=headers)
            async with request as response:
                await response.read()
                ok = 200 <= response.status < 300
                return ProbeResult(
                    ok,
                    response.status,
                    None if ok else f"HTTP {response.status}",
                    time.monotonic() - started,
                )
    except TimeoutError:
        return ProbeResult(
            False, None, f"no answer within {timeout:g}s", time.monotonic() - started
        )
    except (aiohttp.ClientError, OSError) as exc:
        return ProbeResult(False, None, _describe(exc), time.monotonic() - started)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
