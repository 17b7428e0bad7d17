"""What an LLM operator watches, per service and per replica, as the API shows it.

Time to first token (measured by the balancer workers on every streamed answer), requests held
in the balancer, and what each replica's engine reports of itself (its queue, its batch, its
KV-cache use, its prefix-cache hit rate): the figures `corral status --json` and the daemon's
``/metrics`` carry, computed when asked from the workers' latest reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.balancer.metrics import quantile as bucket_quantile


def quantile(histogram: Mapping[str, Any] | None, q: float) -> float | None:
    """Quantile ``q`` of a per-bucket histogram (``{"buckets": [...]}``), interpolated inside
    its bucket as Prometheus' ``histogram_quantile`` does, to the microsecond; None when it
    counted nothing. (A bucket's upper bound alone overstated TTFT up to 2.5x.)"""
    value = bucket_quantile(q, list((histogram or {}).get("buckets") or ()))
    return None if value is None else round(value, 6)


def _hit_rate(signals: Mapping[str, Any]) -> float | None:
    queries = signals.get("prefix_queries")
    if queries:
        return round(float(signals.get("prefix_hits", 0.0)) / float(queries), 4)
    rate = signals.get("cache_hit_rate")  # SGLang reports the rate itself
    return None if rate is None else round(float(rate), 4)


def replica_llm(stats: Mapping[str, Any] | None, engine: Mapping[str, Any] | None) -> Any:
    """One replica's figures, or None when it has neither streamed nor reported anything."""
    ttft = ((stats or {}).get("ttft")) or {}
    if not ttft.get("count") and not engine:
        return None
    engine = engine or {}
    return {
        "ttft_p50_seconds": quantile(ttft, 0.5),
        "ttft_p99_seconds": quantile(ttft, 0.99),
        "streams": int(ttft.get("count") or 0),
        "streaming": int((stats or {}).get("streaming") or 0),  # under way now
        "waiting": engine.get("waiting"),
        "running": engine.get("running"),
        "kv_cache_usage": engine.get("kv_usage"),
        "tokens_per_second": engine.get("tokens_per_second"),
        "prefix_hit_rate": _hit_rate(engine),
    }


def service_llm(stats: Mapping[str, Any] | None) -> Any:
    """The service's figures (its engines summed), or None when there are none."""
    stats = stats or {}
    ttft = stats.get("ttft") or {}
    engines: Mapping[str, Mapping[str, Any]] = stats.get("engines") or {}
    if not ttft.get("count") and not engines and not stats.get("held_total"):
        return None
    summed: dict[str, float] = {}
    for signals in engines.values():
        for key in ("waiting", "running", "prefix_hits", "prefix_queries", "tokens_per_second"):
            if key in signals:
                summed[key] = summed.get(key, 0.0) + float(signals[key])
    rates = [r for s in engines.values() if (r := _hit_rate(s)) is not None]
    return {
        "ttft_p50_seconds": quantile(ttft, 0.5),
        "ttft_p99_seconds": quantile(ttft, 0.99),
        "streams": int(ttft.get("count") or 0),
        "streaming": int(stats.get("streaming") or 0),
        "held": int(stats.get("held") or 0),
        "held_expired": int(stats.get("held_expired") or 0),
        "queue": summed.get("waiting"),
        "running": summed.get("running"),
        "tokens_per_second": summed.get("tokens_per_second"),
        "prefix_hit_rate": _hit_rate(summed)
        if "prefix_queries" in summed
        else (round(sum(rates) / len(rates), 4) if rates else None),
    }
