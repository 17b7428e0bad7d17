"""What open dashboard tabs cost the daemon: CPU and memory with 0 and 20 tabs.

Why this exists: the issue's bound is "many open tabs must not load the daemon". The dashboard
is built for it (one sampler encodes one state per second and every tab is handed the same
bytes; a followed log is one ``stat`` every 0.25 s), and this measures it on the real daemon:

* a fresh home with two services of two examples/app.py replicas each, under light steady
  traffic (``--rate`` requests/s per service, sent from this process), so the states carry real
  figures;
* three phases of ``--seconds`` each, in this order: no tab open; 20 tabs on the services page
  (20 state streams); 20 tabs on a replica page (20 state streams and 40 followed logs: output
  and launch log). A "tab" is an aiohttp client reading the server-sent events, exactly what
  the page's EventSource reads;
* per phase: the daemon's CPU time (user + system, psutil) over the phase as a share of one
  core, its RSS at the end, and the states each tab received (about one per second is right).

The table goes to stdout, everything to JSON (bench/results/dashboard_tabs.json by default).
Run: ``.venv/bin/python bench/dashboard_tabs.py`` (about 2.5 minutes; ``--seconds 10`` for a
trial). All traffic is to 127.0.0.1; everything started is stopped by pid in ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from _ctrl_harness import corral_home, progress, ready_count
from controller import machine_info

from corral.home import read_info

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "results" / "dashboard_tabs.json"
SERVICES = ("alpha", "beta")
TABS = 20
MB = 1024 * 1024
# The bound this project states (docs/benchmarks.md): what 20 tabs may add to the daemon.
LIMITS = {"cpu_share_of_a_core": 0.05, "rss_mb": 5.0}


async def _traffic(endpoints: list[str], rate: float, stop: asyncio.Event) -> int:
    """``rate`` GETs per second to each endpoint, paced, until ``stop``; the count sent."""
    sent = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        next_at = time.monotonic()
        while not stop.is_set():
            for url in endpoints:
                async with http.get(url + "/bench") as answer:
                    await answer.read()
                sent += 1
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return sent


async def _tab(http: aiohttp.ClientSession, url: str, counts: dict[str, int]) -> None:
    """Read one server-sent event stream until cancelled, counting events and bytes."""
    async with http.get(url) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {await answer.text()}")
        async for line in answer.content:
            counts["bytes"] = counts.get("bytes", 0) + len(line)
            if line.startswith(b"event: "):
                kind = line[7:].strip().decode()
                counts[kind] = counts.get(kind, 0) + 1


async def _phase(
    base: str, cookie: dict[str, str], urls: list[str], seconds: float, daemon: psutil.Process
) -> dict[str, Any]:
    counts: list[dict[str, int]] = [{} for _ in urls]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(base, cookies=cookie, timeout=timeout) as http:
        tasks = [asyncio.create_task(_tab(http, u, c)) for u, c in zip(urls, counts, strict=True)]
        await asyncio.sleep(1.0)  # the streams are open and have had their first state
        before = daemon.cpu_times()
        started = time.monotonic()
        peak = daemon.memory_info().rss
        while time.monotonic() - started < seconds:
            await asyncio.sleep(1.0)
            peak = max(peak, daemon.memory_info().rss)
        after = daemon.cpu_times()
        elapsed = time.monotonic() - started
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [repr(r) for r in results if not isinstance(r, asyncio.CancelledError)]
    cpu = (after.user - before.user) + (after.system - before.system)
    states = [c.get("state", 0) for u, c in zip(urls, counts, strict=True) if u.endswith("/feed")]
    log_events = sum(c.get("log", 0) for u, c in zip(urls, counts, strict=True) if "/log" in u)
    return {
        "streams": len(urls),
        "seconds": round(elapsed, 1),
        "cpu_seconds": round(cpu, 3),
        "cpu_share_of_a_core": round(cpu / elapsed, 4),
        "rss_mb_end": round(daemon.memory_info().rss / MB, 1),
        "rss_mb_peak": round(peak / MB, 1),
        "states_per_tab_min": min(states, default=0),
        "states_per_tab_max": max(states, default=0),
        "log_events": log_events,
        "bytes_received": sum(c.get("bytes", 0) for c in counts),
        "stream_errors": failed,
    }


async def _measure(
    base: str,
    token: str,
    endpoints: list[str],
    args: argparse.Namespace,
    daemon: psutil.Process,
    replica: int,
) -> dict[str, Any]:
    async with aiohttp.ClientSession(base) as http:
        async with http.post(
            "/v1/dashboard/login", headers={"Authorization": f"Bearer {token}"}
        ) as answer:
            path = (await answer.json())["path"]
        async with http.get(path, allow_redirects=False) as answer:
            assert answer.status == 303, answer.status
            cookie = {k: v.value for k, v in answer.cookies.items()}
    stop = asyncio.Event()
    traffic = asyncio.create_task(_traffic(endpoints, args.rate, stop))
    feed = "/ui/api/feed"
    log = f"/ui/api/services/{SERVICES[0]}/replicas/{replica}/log"
    phases = {}
    try:
        await asyncio.sleep(12)  # a live window of traffic before measuring
        for label, urls in (
            ("0 tabs", []),
            (f"{TABS} tabs: services page", [feed] * TABS),
            (
                f"{TABS} tabs: replica page",
                [feed] * TABS + [f"{log}?kind=replica"] * TABS + [f"{log}?kind=launch"] * TABS,
            ),
        ):
            progress(f"  phase {label!r}: {args.seconds:g} s")
            phases[label] = await _phase(base, cookie, urls, args.seconds, daemon)
    finally:
        stop.set()
        sent = await traffic
    return {"phases": phases, "requests_sent": sent}


def _table(phases: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| phase | streams | daemon CPU (share of a core) | CPU s | RSS end (MB) | RSS peak (MB) "
        "| states per tab |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, p in phases.items():
        states = f"{p['states_per_tab_min']}-{p['states_per_tab_max']}" if p["streams"] else "-"
        lines.append(
            f"| {label} | {p['streams']} | {p['cpu_share_of_a_core'] * 100:.2f}% "
            f"| {p['cpu_seconds']:.2f} | {p['rss_mb_end']} | {p['rss_mb_peak']} | {states} |"
        )
    return "\n".join(lines)


def _verdict(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each phase with tabs against the idle one: within LIMITS?"""
    idle = next(iter(phases.values()))
    out: dict[str, Any] = {"ok": True, "lines": []}
    for label, p in list(phases.items())[1:]:
        cpu = p["cpu_share_of_a_core"] - idle["cpu_share_of_a_core"]
        rss = p["rss_mb_peak"] - idle["rss_mb_peak"]
        ok = cpu <= LIMITS["cpu_share_of_a_core"] and rss <= LIMITS["rss_mb"]
        out["ok"] = out["ok"] and ok
        out["lines"].append(
            f"{label}: +{cpu * 100:.2f}% of a core, +{rss:.1f} MB RSS "
            f"(bound {LIMITS['cpu_share_of_a_core'] * 100:g}%, {LIMITS['rss_mb']:g} MB): "
            + ("within" if ok else "OVER")
        )
    out["text"] = "\n".join(out["lines"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s per service")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args()
    if not 1 <= args.seconds <= 600 or not 0 < args.rate <= 200:
        parser.error("--seconds must be 1-600 and --rate 0-200 (the run is bounded)")
    problems: list[str] = []
    with corral_home("dashboard", problems) as h:
        for name in SERVICES:
            result = h.cli("up", str(h.write_spec(name, 2, 0.5)), "--timeout", "60")
            if result.returncode != 0:
                raise SystemExit(f"corral up {name} failed: {result.stderr}")
        services = {s["name"]: s for s in h.services()}
        assert all(ready_count(s) == 2 for s in services.values()), services
        pid = h.daemon_pid()
        info = read_info(h.home)
        assert pid is not None and info is not None
        base = f"http://127.0.0.1:{info['port']}"
        token = (h.home / "token").read_text().strip()
        replica = services[SERVICES[0]]["replicas"][0]["id"]
        endpoints = [services[n]["endpoint"] for n in SERVICES]
        try:
            measured = asyncio.run(
                _measure(base, token, endpoints, args, psutil.Process(pid), replica)
            )
        finally:
            h.down_all(problems)
            h.cli("daemon", "stop", "--all", timeout=60)  # the balancer workers too
    print(_table(measured["phases"]))
    verdict = _verdict(measured["phases"])
    print(verdict["text"])
    report = {
        "machine": machine_info(),
        "args": {"seconds": args.seconds, "rate": args.rate, "tabs": TABS},
        **measured,
        "limits": LIMITS,
        "verdict": verdict,
        "problems": problems,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    progress(f"results written to {args.json}")
    for line in problems:
        progress(f"problem: {line}")
    return 1 if problems or not verdict["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
