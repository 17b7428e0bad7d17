"""How `corral status` draws services for a person (the JSON is the API's answer as it is).

Kept apart from the commands so what a row says (which version takes traffic, how long a
replica has been starting, which failed replicas are folded) is one small, testable place.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from corral.figures import gib

# Failed replicas shown per service without -v (newest first); older ones are counted.
SHOWN_FAILED = 3
FAILED_PREFIX = ("FAILED", "PREEMPTED")


def age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def traffic_versions(service: dict[str, Any]) -> list[int]:
    """The versions whose READY replicas take traffic now (the balancer's ready set)."""
    versions = service.get("traffic_versions")
    if versions is None:  # an older daemon: every READY replica takes traffic
        versions = sorted({r["version"] for r in service["replicas"] if r["status"] == "READY"})
    return [int(v) for v in versions]


def serving_text(service: dict[str, Any]) -> str:
    """``traffic stays on version 2``: the versions that serve after a failed update (what
    the balancer's ready set holds now, never a guess from the version numbers)."""
    serving = traffic_versions(service)
    if not serving:
        return "no version serves"
    listed = ", ".join(str(v) for v in serving)
    return f"traffic stays on version{'s' if len(serving) > 1 else ''} {listed}"


def version_text(service: dict[str, Any]) -> str:
    """The version that serves, and beside it a version that does not yet (or failed)."""
    serving = traffic_versions(service)
    current = int(service["version"])
    if not serving:
        return str(current)
    text = ",".join(str(v) for v in serving)
    if current not in serving:
        failed = service.get("last_update_failure")
        text += f" (v{current} failed)" if failed else f" (v{current} starting)"
    return text


def ready_text(service: dict[str, Any]) -> str:
    """READY replicas that take traffic, out of the target."""
    serving = set(traffic_versions(service))
    ready = sum(
        1 for r in service["replicas"] if r["status"] == "READY" and r["version"] in serving
    )
    target = service.get("target")
    return f"{ready}/{'-' if target is None else target}"


def status_text(replica: dict[str, Any]) -> str:
    """A replica's status; a STARTING one says for how long, out of its initial delay, and
    what its last probe got (an app answering 500 is told apart from one not listening)."""
    status = str(replica["status"])
    started = replica.get("starting_seconds")
    last = replica.get("last_probe")
    seen = f"; last probe: {last}" if last else ""
    if status == "STARTING" and started is not None:
        delay = replica.get("initial_delay_seconds")
        limit = f" of {age(float(delay))} initial delay" if delay is not None else ""
        return f"STARTING ({age(float(started))}{limit}{seen})"
    if status == "NOT_READY" and last:
        return f"NOT_READY (last probe: {last})"
    retry = replica.get("teardown_retry_in_seconds")
    if status == "FAILED_CLEANUP" and retry is not None:
        attempt = int(replica.get("teardown_attempts") or 0) + 1
        when = f"in {age(float(retry))}" if float(retry) >= 0.5 else "now"
        return f"FAILED_CLEANUP (teardown attempt {attempt} {when})"
    return status


def is_failed(replica: dict[str, Any]) -> bool:
    return str(replica["status"]).startswith(FAILED_PREFIX)


def shown_replicas(service: dict[str, Any], verbose: bool) -> tuple[list[dict[str, Any]], int]:
    """The replicas to list and how many failed ones were folded: every live one, and the
    newest SHOWN_FAILED failed ones (all of them with ``verbose``)."""
    replicas = list(service["replicas"])
    if verbose:
        return replicas, 0
    failed = sorted((r for r in replicas if is_failed(r)), key=lambda r: r["id"])
    folded = {id(r) for r in failed[: max(0, len(failed) - SHOWN_FAILED)]}
    return [r for r in replicas if id(r) not in folded], len(folded)


def _width(values: list[str]) -> int:
    return max((len(v) for v in values), default=1)


def services_table(services: list[dict[str, Any]]) -> Table:
    table = Table(box=None)
    endpoints = [s["endpoint"] or "-" for s in services]
    table.add_column("SERVICE", overflow="fold")
    table.add_column("STATUS", no_wrap=True)
    # Never cut: an endpoint is what users copy from here.
    table.add_column("ENDPOINT", no_wrap=True, min_width=_width(endpoints))
    table.add_column("VERSION", overflow="fold")
    table.add_column("READY", no_wrap=True)
    for s, endpoint in zip(services, endpoints, strict=True):
        table.add_row(s["name"], s["status"], endpoint, version_text(s), ready_text(s))
    return table


def devices_text(held: dict[str, Any] | None) -> str:
    """``GPU-5f3c..,GPU-9a1d.. CPU 0-1``: what a replica holds (see corral.capacity). A GPU is
    named as its ``CUDA_VISIBLE_DEVICES`` names it (the UUID; ``GPU 2`` without one), so the
    two can be compared; shared CPUs say so, and what the machine's replicas ask beyond it."""
    if not held:
        return "-"
    parts = []
    if held["gpus"]:
        shares = [
            (g["uuid"] or f"GPU {g['index']}") + (f"({g['share']:g})" if g["share"] < 1 else "")
            for g in held["gpus"]
        ]
        parts.append(",".join(shares))
    if held["cpu_ids"]:
        parts.append("CPU " + ",".join(map(str, held["cpu_ids"])))
    elif held["cpus"]:
        shared = "" if held.get("exclusive") else " shared"
        over = f" ({held['oversubscribed']})" if held.get("oversubscribed") else ""
        parts.append(f"{held['cpus']:g} CPUs{shared}{over}")
    if held["memory"]:
        parts.append(gib(held["memory"]))
    return " ".join(parts) or "-"


def replicas_table(services: list[dict[str, Any]], verbose: bool) -> tuple[Table, list[str]]:
    """The replicas of ``services``, and a note per service whose failed replicas were folded."""
    rows: list[tuple[str, ...]] = []
    notes = []
    for s in services:
        shown, folded = shown_replicas(s, verbose)
        for r in shown:
            row: tuple[str, ...] = (
                s["name"],
                str(r["id"]),
                str(r["version"]),
                status_text(r),
                r["endpoint"] or "-",
                age(float(r["age_seconds"])),
                str(r["pid"] or "-"),
                devices_text(r.get("devices")),
            )
            rows.append(row + ((r.get("failure") or "",) if verbose else ()))
        if folded:
            name = s["name"]
            notes.append(f"{name}: +{folded} older failed, see `corral status -v {name}`")
    table = Table(box=None)
    table.add_column("SERVICE", overflow="fold")
    table.add_column("ID", no_wrap=True)
    table.add_column("VERSION", no_wrap=True)
    table.add_column("STATUS", overflow="fold")
    table.add_column("ENDPOINT", no_wrap=True, min_width=_width([row[4] for row in rows]))
    table.add_column("AGE", no_wrap=True)
    table.add_column("PID", no_wrap=True)
    table.add_column("DEVICES", overflow="fold")
    if verbose:
        table.add_column("FAILURE", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table, notes


def backoff_text(backoff: dict[str, Any]) -> str:
    """``next replica launch in 12s (at 23:41:05), backing off after 3 failures in a row;
    last: ...``: when a service in backoff tries again, and why it waits."""
    left = float(backoff["next_attempt_in_seconds"])
    at = time.strftime("%H:%M:%S", time.localtime(float(backoff["next_attempt_at"])))
    when = f"in {left:.0f}s (at {at})" if left >= 0.5 else f"due now (at {at})"
    return f"next replica launch {when}, backing off after {backoff['reason']}"


def service_notes(service: dict[str, Any]) -> list[tuple[str, str]]:
    """Lines under the tables: (style, text)."""
    name = service["name"]
    notes = []
    scaler = service.get("autoscaler")
    if scaler:
        notes.append(
            ("", f"{name}: target {service['target']} at {scaler['qps']:g} QPS: {scaler['reason']}")
        )
    held = service.get("traffic_held_for_version")
    # A held version whose update failed never gets traffic: the failure line says so.
    if held is not None and not service.get("last_update_failure"):
        notes.append(
            ("", f"{name}: version {held} (blue-green) gets traffic once enough of it is READY")
        )
    for r in service.get("replicas") or ():
        if r.get("waiting"):
            notes.append(("", f"{name} replica {r['id']} waits: {r['waiting']}"))
    if service.get("backoff"):
        notes.append(("yellow", f"{name}: {backoff_text(service['backoff'])}"))
    if service.get("failure"):
        notes.append(("red", f"{name}: {service['failure']}"))
    if service.get("last_update_failure"):
        notes.append(
            (
                "yellow",
                f"{name}: update failed, {serving_text(service)}: {service['last_update_failure']}",
            )
        )
    for problem in service.get("balancer_errors") or ():
        # The endpoint is kept, not moved: whoever holds the port must let it go.
        notes.append(("red", f"{name}: endpoint not served: {problem}"))
    return notes


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{float(seconds) * 1000:.0f} ms"


def _llm_text(figures: dict[str, Any], queue_key: str) -> str:
    """One line of what an LLM operator watches; a figure the engine does not report is left out,
    never shown as 0."""
    p50, p99 = _ms(figures.get("ttft_p50_seconds")), _ms(figures.get("ttft_p99_seconds"))
    parts = [f"TTFT p50 {p50} p99 {p99} over {figures.get('streams', 0)} streams"]
    if figures.get("streaming"):
        parts[0] += f", {figures['streaming']} under way"
    queue = [
        f"{figures[key]:g} {word}"
        for key, word in ((queue_key, "waiting"), ("running", "running"))
        if figures.get(key) is not None
    ]
    if queue:
        parts.append(", ".join(queue))
    if figures.get("kv_cache_usage") is not None:
        parts.append(f"KV cache {float(figures['kv_cache_usage']):.0%} used")
    if figures.get("tokens_per_second") is not None:
        parts.append(f"{float(figures['tokens_per_second']):.0f} tokens/s")
    if figures.get("prefix_hit_rate") is not None:
        parts.append(f"prefix-cache hit rate {float(figures['prefix_hit_rate']):.2f}")
    if figures.get("held"):
        parts.append(f"{figures['held']} held in the balancer")
    if figures.get("held_expired"):
        parts.append(f"{figures['held_expired']} turned away (503) after the hold")
    return "; ".join(parts)


def llm_lines(service: dict[str, Any], verbose: bool) -> list[str]:
    """The LLM figures of ``service`` (the same as `status --json`'s ``llm``): the service's
    line, and with ``verbose`` one per replica that streamed or reported anything."""
    name = service["name"]
    lines = []
    if service.get("llm"):
        lines.append(f"{name}: {_llm_text(service['llm'], 'queue')}")
    if verbose:
        for r in service.get("replicas") or ():
            if r.get("llm"):
                lines.append(f"{name} replica {r['id']}: {_llm_text(r['llm'], 'waiting')}")
    return lines
