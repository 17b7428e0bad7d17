"""What corral costs while nothing happens: the daemon's and the balancer workers' CPU with N
idle services, this tree side by side with others (``--compare NAME=SRC``).

Why: a controller runs all day, mostly idle, next to the services it keeps. Each periodic loop
(probes, reconciles, reports, deadline tickers) wakes its process, and on these VMs a wake-up
costs 0.1-0.3 ms of CPU whatever it does, so an idle home's cost is mostly how often its
processes wake. This measures it: for each target, a fresh home (a temp dir), N services of one
replica each (``examples/app.py``, probed every second), 2 balancer workers; once every
replica is READY and a few seconds have passed, each process's CPU over ``--duration`` seconds,
read from ``/proc/PID/task/*/schedstat`` (the scheduler's own nanoseconds: psutil's times come
in 10 ms ticks, too coarse for a few ms a second). Then ``down --all``, ``daemon stop``, and
the home is deleted. Rounds interleave the targets, in an order that rotates.

Run: ``.venv/bin/python bench/idle_home.py [--services 10] [--duration 20] [--rounds 2]
[--compare before=/tmp/before/src]`` (SRC: a tree whose ``corral`` package is run instead,
through PYTHONPATH). Prints a table (median over rounds, CPU ms per second) and writes
``bench/results/idle_home.json``. Traffic: none; the probes go to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cpu import schedstat_seconds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "idle_home.json"
SETTLE = 3.0


def spec(path: Path, name: str) -> Path:
    path.write_text(
        f"name: {name}\nworkdir: {ROOT / 'examples'}\nrun: exec {sys.executable} app.py\n"
        "service:\n  readiness_probe:\n    path: /health\n    period_seconds: 1\n"
        "  replicas: 1\n"
    )
    return path


def one_run(src: Path | None, services: int, duration: float) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="corral-idle-"))
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_BALANCER_WORKERS": "2"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    corral = [sys.executable, "-m", "corral"]

    def cli(*args: str, check: bool = True) -> str:
        done = subprocess.run(
            [*corral, *args], env=env, capture_output=True, text=True, timeout=120
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"corral {' '.join(args)}: {done.stderr[-500:]}")
        return done.stdout

    try:
        for i in range(services):
            cli("up", str(spec(home / f"s{i}.yaml", f"s{i}")), "-y", "--detach")
        deadline = time.monotonic() + 120
        while True:
            state = json.loads(cli("status", "--json") or "{}")
            listed = state.get("services", []) if isinstance(state, dict) else state
            ready = sum(
                1 for s in listed if any(r["status"] == "READY" for r in s.get("replicas", []))
            )
            if ready == services:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {ready} of {services} services READY")
            time.sleep(0.5)
        time.sleep(SETTLE)
        pids = {"daemon": int(json.loads((home / "daemon.json").read_text())["pid"])}
        (db,) = [p for p in home.iterdir() if p.suffix in (".db", ".sqlite", ".sqlite3")]
        with sqlite3.connect(db) as conn:
            for slot, pid in conn.execute("SELECT slot, pid FROM balancer_workers"):
                pids[f"worker {slot}"] = int(pid)
        before = {name: schedstat_seconds(pid) for name, pid in pids.items()}
        start = time.monotonic()
        time.sleep(duration)
        after = {name: schedstat_seconds(pid) for name, pid in pids.items()}
        span = time.monotonic() - start
        got = {name: (after[name] - before[name]) / span * 1e3 for name in pids}
        got["workers"] = sum(v for k, v in got.items() if k.startswith("worker "))
        got["total"] = got["daemon"] + got["workers"]
        return got
    finally:
        cli("down", "--all", check=False)
        cli("daemon", "stop", check=False)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--services", type=int, default=10)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", action="append", default=[], help="NAME=SRC, repeatable")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    targets: dict[str, Path | None] = {"corral": None}
    for item in args.compare:
        name, _, src = item.partition("=")
        if not name or not (Path(src) / "corral").is_dir():
            raise SystemExit(f"--compare wants NAME=SRC with SRC/corral a package, got {item!r}")
        targets[name] = Path(src).resolve()
    names = list(targets)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got = one_run(targets[name], args.services, args.duration)
            runs[name].append(got)
            print(
                f"[{time.strftime('%H:%M:%S')}] round {r + 1} {name}: daemon "
                f"{got['daemon']:.1f}, workers {got['workers']:.1f} ms/s",
                flush=True,
            )
    print(
        f"\n{args.services} idle services of 1 replica, 2 balancer workers; CPU ms per second "
        f"(scheduler time), median of {args.rounds} round(s) of {args.duration:g} s"
    )
    print("| target | daemon | each worker | workers | total | total vs corral |")
    print("|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    base = statistics.median(g["total"] for g in runs["corral"])
    for name in names:
        med = {
            k: statistics.median(g[k] for g in runs[name]) for k in ("daemon", "workers", "total")
        }
        ratio = "" if name == "corral" else f"{med['total'] / base:.2f}x"
        print(
            f"| {name} | {med['daemon']:.1f} | {med['workers'] / 2:.1f} | {med['workers']:.1f} "
            f"| {med['total']:.1f} | {ratio} |"
        )
        rows.append({"target": name, **med, "runs": runs[name]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"services": args.services, "duration": args.duration, "rows": rows}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
