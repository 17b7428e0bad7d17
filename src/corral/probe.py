"""Readiness probing of one replica endpoint.

Probes are plain HTTP requests made concurrently from the daemon's event loop (one shared
aiohttp session), so probing 100 replicas costs 100 small requests, not 100 threads. The probe
mirrors SkyServe's: GET, or POST with a JSON body when ``post_data`` is set, a per-probe timeout,
and extra headers (only their names are ever logged: they often carry credentials).

Only the status decides, so a probe reads at most ``READ_LIMIT`` bytes of the answer: a
`/health` that answers with a huge (or endless) body must neither cost the daemon its size in
memory nor keep the probe waiting for a body nobody looks at.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

# A framed answer up to this size is read whole (the connection can then be reused); anything
# else is not read at all: the connection is closed once the status line and headers are in.
READ_LIMIT = 64 * 1024


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
                length = response.content_length
                if length is not None and length <= READ_LIMIT:
                    await response.read()
                else:
                    response.close()
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
    """Why a probe failed, in words: this text is what `corral status` shows for a replica
    that never became ready, and aiohttp's own ("ClientConnectorError: Cannot connect to host
    ... ssl:default [Connect call failed ...]") is its internals, not the reason."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        where = f"{exc.host}:{exc.port}"
        if isinstance(exc.os_error, ConnectionRefusedError):
            return f"connection refused: nothing listens on {where} (yet)"
        return f"cannot connect to {where}: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the replica closed the connection without answering"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut short"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"not an HTTP answer corral can read ({exc.message})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
