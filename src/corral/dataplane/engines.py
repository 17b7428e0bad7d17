"""What each replica's LLM engine says of its own load, read from its Prometheus metrics.

A balancer worker counts only the requests it sent; an engine knows its whole queue (every
worker's requests, and what it has not started yet) and how full its KV cache is. vLLM and
SGLang publish both at ``GET /metrics``. Each worker reads them every ``INTERVAL`` for the
services whose route names a metrics path (``load_balancer.engine_metrics_path``; by default
under ``prefix_affinity``), hands them to the service's balancer (a policy weighs the queue),
and reports them to the daemon for ``status``, ``/metrics`` and the autoscaler.

A small reader of the text format instead of prometheus_client's parser: the worker stays
lean (it is on every service's path), and only a dozen names matter here, each summed over its
label sets (several engines may share a port: vLLM's data-parallel ranks each publish theirs,
``engine="0"``, ``engine="1"``), except the fractions of an engine (KV-cache use, cache hit
rate), which are averaged over them: two ranks at 0.5 are one replica at 0.5, not at 1.0. A
sample that is not a finite number (``NaN``, ``+Inf``) says nothing of the load and is skipped.

Read over asyncio's streams, not aiohttp's client: the worker process never imports aiohttp
(0.1 s and about 10 MB of memory for one GET a second). What the reading needs of HTTP/1.1 is
small: one kept connection per engine, an answer framed by Content-Length or chunks (the
balancer's own decoder), and a new connection when the engine closed the kept one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
import weakref
from collections.abc import Mapping
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

from corral.balancer import LoadBalancer
from corral.balancer.http1 import BadRequest, ChunkedDecoder
from corral.balancer.policies import EngineLoad

INTERVAL: Final = 1.0
TIMEOUT: Final = 0.8
MAX_BYTES: Final = 4 << 20

# The engines' names for each signal, first found wins (vLLM, then its older name, SGLang,
# TGI, llama.cpp's server). llama.cpp's are there because corral itself starts
# `llama-server --metrics` for a model-first spec on CPUs (corral.model_engines): without
# them its queue (`requests_deferred`), batch, KV-cache use and token counter were unread,
# so status showed nothing of it and a queue, KV or tokens/s target never scaled it.
SIGNALS: Final = {
    "waiting": (
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "tgi_queue_size",
        "llamacpp:requests_deferred",
    ),
    "running": (
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "tgi_batch_current_size",
        "llamacpp:requests_processing",
    ),
    "kv_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "prefix_hits": ("vllm:prefix_cache_hits_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total",),
    "generation_tokens": ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "llamacpp:prompt_tokens_total"),
    "cache_hit_rate": ("sglang:cache_hit_rate",),
    "gen_throughput": ("sglang:gen_throughput",),
}
_WANTED: Final = frozenset(name for names in SIGNALS.values() for name in names)
# The signals that are a fraction of one engine: averaged over their label sets, not summed.
_MEANS: Final = frozenset({"kv_usage", "cache_hit_rate"})


def parse(text: str) -> dict[str, float]:
    """The signals found in Prometheus text, by the keys of SIGNALS."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
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
            number = float(value.split()[0])
            if math.isfinite(number):
                sums[name] = sums.get(name, 0.0) + number
                counts[name] = counts.get(name, 0) + 1
    out: dict[str, float] = {}
    for key, names in SIGNALS.items():
        for name in names:
            if name in sums:
                out[key] = sums[name] / counts[name] if key in _MEANS else sums[name]
                break
    return out


class _Kept(NamedTuple):
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used: float


# Per event loop, the connection last used to each engine, kept open between readings: a new
# TCP connection and its asyncio streams each second were a third of an idle worker's CPU
# (py-spy, docs/benchmarks.md). Closed after KEEP_IDLE unused (a replica that left), when the
# engine closes it, or on any error.
_KEPT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int, bool], _Kept]]
_KEPT = weakref.WeakKeyDictionary()
KEEP_IDLE: Final = 3 * INTERVAL


class _Stale(Exception):
    """A kept connection the engine had closed meanwhile: the reading is tried once anew."""


def _kept() -> dict[tuple[str, int, bool], _Kept]:
    loop = asyncio.get_running_loop()
    kept = _KEPT.get(loop)
    if kept is None:
        kept = _KEPT[loop] = {}
    return kept


async def fetch(base: str, path: str) -> dict[str, float] | None:
    """One replica's signals, or None (no answer in TIMEOUT, not 200, nothing known)."""
    url = urlsplit(base)
    host, secure = url.hostname or "127.0.0.1", url.scheme == "https"
    port = url.port or (443 if secure else 80)
    key = (host, port, secure)
    head = f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: text/plain\r\n\r\n"
    request = head.encode("latin-1")
    kept = _kept()
    old = kept.pop(key, None)
    conn = None if old is None else (old.reader, old.writer)
    answer: tuple[int, bytes, bool] | None = None
    try:
        async with asyncio.timeout(TIMEOUT):
            if conn is not None:
                with contextlib.suppress(_Stale):
                    answer = await _exchange(*conn, request, reused=True)
            if answer is None:
                if conn is not None:
                    conn[1].close()
                context = ssl.create_default_context() if secure else None
                conn = await asyncio.open_connection(host, port, ssl=context)
                answer = await _exchange(*conn, request, reused=False)
    except (OSError, TimeoutError, EOFError, ssl.SSLError, UnicodeError, ValueError, BadRequest):
        answer = None
    finally:
        # Kept only after a whole answer that leaves it usable; closed on anything else,
        # cancellation included.
        if conn is not None:
            if answer is not None and answer[2] and key not in kept:
                kept[key] = _Kept(conn[0], conn[1], time.monotonic())
            else:
                conn[1].close()
    if answer is None or answer[0] != 200:
        return None
    return parse(answer[1].decode("utf-8", "replace")) or None


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, reused: bool
) -> tuple[int, bytes, bool]:
    """Send the request, read one answer: its status, its body, and whether the connection
    can carry the next (HTTP/1.1, not closing, its body framed). ``reused``: the connection
    was kept, so an end before any byte of the answer is :class:`_Stale`."""
    writer.write(request)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if reused and not exc.partial:
            raise _Stale from exc
        raise ValueError("the engine closed the connection mid-answer") from exc
    except ConnectionError as exc:
        if reused:
            raise _Stale from exc
        raise
    except asyncio.LimitOverrunError as exc:
        raise ValueError("answer head too long") from exc
    lines = head.decode("latin-1").lower().split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("http/1.") or not parts[1].isdigit():
        raise ValueError("not an HTTP/1 answer")
    split = (line.partition(":") for line in lines[1:] if line)
    fields = {name.strip(): value.strip() for name, _, value in split}
    reusable = parts[0] == "http/1.1" and fields.get("connection") != "close"
    if "chunked" in fields.get("transfer-encoding", ""):
        return int(parts[1]), await _read_chunked(reader), reusable
    if "content-length" in fields:
        length = int(fields["content-length"])
        if not 0 <= length <= MAX_BYTES:
            raise ValueError("metrics too large")
        return int(parts[1]), await reader.readexactly(length), reusable
    data = await reader.read(MAX_BYTES)  # framed by the end of the connection
    while len(data) < MAX_BYTES and (more := await reader.read(MAX_BYTES - len(data))):
        data += more
    return int(parts[1]), data, False


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, to its last chunk (the balancer's own decoder), at most MAX_BYTES."""
    decoder = ChunkedDecoder()
    pieces: list[bytes] = []
    size = 0
    while True:
        data = await reader.read(65536)
        if not data:
            raise ValueError("the engine closed the connection mid-answer")
        got, used, done = decoder.feed(data)
        pieces += got
        size += sum(map(len, got))
        if size > MAX_BYTES:
            raise ValueError("metrics too large")
        if done:
            if used != len(data):
                raise ValueError("bytes after the answer")
            return b"".join(pieces)


async def read_all(ready: Mapping[int, str], path: str) -> dict[int, dict[str, float]]:
    """Every ready replica's signals at once (those that answered)."""
    ids = list(ready)
    got = await asyncio.gather(*(fetch(ready[rid], path) for rid in ids))
    _close_idle()
    return {rid: signals for rid, signals in zip(ids, got, strict=True) if signals}


def _close_idle() -> None:
    """Close the kept connections unused for KEEP_IDLE (their replica left, or another worker
    reads it now)."""
    kept = _kept()
    now = time.monotonic()
    for key, conn in list(kept.items()):
        if now - conn.used > KEEP_IDLE:
            conn.writer.close()
            del kept[key]


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
