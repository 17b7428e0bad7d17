"""What each replica's LLM engine says of its own load, read from its Prometheus metrics.

A balancer worker counts only the requests it sent; an engine knows its whole queue (every
worker's requests, and what it has not started yet) and how full its KV cache is. vLLM and
SGLang publish both at ``GET /metrics``. Each worker reads them every ``INTERVAL`` for the
services whose route names a metrics path (``load_balancer.engine_metrics_path``; by default
under ``prefix_affinity``), hands them to the service's balancer (a policy weighs the queue),
and reports them to the daemon for ``status``, ``/metrics`` and the autoscaler.

A small reader of the text format instead of prometheus_client's parser: the worker stays
lean (it is on every service's path), and only a dozen names matter here, each summed over its
label sets (several engines may share a port).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from corral.balancer import LoadBalancer
from corral.balancer.http1 import BadRequest, ChunkedDecoder
from corral.balancer.policies import EngineLoad

INTERVAL: Final = 1.0
TIMEOUT: Final = 0.8
MAX_BYTES: Final = 4 << 20

# The engines' names for each signal, first found wins (vLLM, then its older name, SGLang).
SIGNALS: Final = {
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_hits": ("vllm:prefix_cache_hits_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "cache_hit_rate": ("sglang:cache_hit_rate",),
    "gen_throughput": ("sglang:gen_throughput",),
}
_WANTED: Final = frozenset(name for names in SIGNALS.values() for name in names)


def parse(text: str) -> dict[str, float]:
    """The signals found in Prometheus text, by the keys of SIGNALS."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[: brace if 0 <= brace < space else space]
        if name not in _WANTED:
            continue
        value = line[line.rfind("}") + 1 :] if brace >= 0 else line[space:]
        with contextlib.suppress(ValueError, IndexError):
            sums[name] = sums.get(name, 0.0) + float(value.split()[0])
    out: dict[str, float] = {}
    for key, names in SIGNALS.items():
        for name in names:
            if name in sums:
                out[key] = sums[name]
                break
    return out


async def fetch(base: str, path: str) -> dict[str, float] | None:
    """One replica's signals, or None (no answer in TIMEOUT, not 200, nothing known)."""
    url = urlsplit(base)
    host, secure = url.hostname or "127.0.0.1", url.scheme == "https"
    port = url.port or (443 if secure else 80)
    context = ssl.create_default_context() if secure else None
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\nConnection: close\r\n"
                "Accept: text/plain\r\n\r\n".encode("latin-1")
            )
            data = await reader.read(MAX_BYTES)
            while len(data) < MAX_BYTES:
                more = await reader.read(MAX_BYTES - len(data))
                if not more:
                    break
                data += more
    except (OSError, TimeoutError, ssl.SSLError, UnicodeError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
        return None
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    return parse(body.decode("utf-8", "replace")) or None


def _unchunk(body: bytes) -> bytes:
    """A chunked body's data (the balancer's own decoder); empty when its framing is broken."""
    try:
        pieces, _, _ = ChunkedDecoder().feed(body)
    except BadRequest:
        return b""
    return b"".join(pieces)


async def read_all(ready: Mapping[int, str], path: str) -> dict[int, dict[str, float]]:
    """Every ready replica's signals at once (those that answered)."""
    ids = list(ready)
    got = await asyncio.gather(*(fetch(ready[rid], path) for rid in ids))
    return {rid: signals for rid, signals in zip(ids, got, strict=True) if signals}


def with_rate(
    signals: dict[str, float], before: Mapping[str, Any] | None, now: float
) -> dict[str, float]:
    """``signals`` stamped ``read_at`` (``time.monotonic()``, the same in every process) with
    ``tokens_per_second``: SGLang's ``gen_throughput`` as it says, else the growth of vLLM's
    generation-token counter since ``before`` (the previous reading of the same replica). A
    counter that went back (the engine restarted) gives no rate this time."""
    out = {**signals, "read_at": now}
    if "gen_throughput" in signals:
        out["tokens_per_second"] = signals["gen_throughput"]
        return out
    count = signals.get("generation_tokens")
    last, then = (before or {}).get("generation_tokens"), (before or {}).get("read_at")
    if count is None or last is None or then is None or now <= then or count < last:
        return out
    out["tokens_per_second"] = (count - float(last)) / (now - float(then))
    return out


async def refresh(
    lb: LoadBalancer,
    ready: Mapping[int, str],
    path: str,
    before: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[int, Any]:
    """Read the engines of ``ready``, give their load to ``lb``; return what was read, with
    each one's tokens per second since ``before`` (:func:`with_rate`)."""
    signals = await read_rated(ready, path, before)
    give(lb, signals)
    return signals


async def read_rated(
    ready: Mapping[int, str], path: str, before: Mapping[int, Mapping[str, Any]] | None
) -> dict[int, Any]:
    """:func:`read_all`, each reading :func:`with_rate` against ``before``."""
    read = await read_all(ready, path)
    now = time.monotonic()
    return {rid: with_rate(s, (before or {}).get(rid), now) for rid, s in read.items()}


def give(lb: LoadBalancer, signals: Mapping[int, Mapping[str, Any]]) -> None:
    """Hand ``lb`` the engines' load as its policies weigh it."""
    lb.set_engine_load(
        {
            rid: EngineLoad(s.get("waiting", 0.0), s.get("running", 0.0), s.get("kv_usage"))
            for rid, s in signals.items()
        }
    )
