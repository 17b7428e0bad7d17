"""Benchmark: how long `corral status` takes, start to exit, on an idle home with a running daemon.

Why this exists: the API answers in a few milliseconds, so what a person waits for on every
command is the CLI's own start-up: the Python interpreter and what the CLI imports. It used to
import everything (pydantic and the spec layer, rich, psutil, asyncio) whatever the command,
about 0.5 s on an idle machine. This puts a number on it, for this source tree and, with
``--compare NAME=SRC``, for another one (a git worktree of an earlier commit) against the same
daemon, side by side.

Measured per source tree: the wall time of ``python -m corral status`` (N runs, after one
warm-up run that fills the OS page cache), and of ``python -c "import corral.cli"`` (the
import alone), and of ``python -c pass`` (the interpreter's own start, the floor), as min /
median / p90. A fresh CORRAL_HOME (temp dir) holds the daemon, started
with ``corral daemon start``; it is stopped with ``corral daemon stop --all`` and, should it or a
balancer worker still run, killed by pid. All traffic is to 127.0.0.1.

    .venv/bin/python bench/cli_latency.py [--runs 30] [--compare before=/tmp/wt/src]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
SRC = BENCH_DIR.parent / "src"
DEFAULT_JSON = BENCH_DIR / "results" / "cli_latency.json"


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
    return time.perf_counter() - started


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {
        "min_ms": round(ordered[0] * 1000, 1),
        "median_ms": round(statistics.median(ordered) * 1000, 1),
        "p90_ms": round(p90 * 1000, 1),
    }


def measure(src: Path, home: Path, runs: int) -> dict[str, Any]:
    """`corral status` and `import corral.cli` from the tree at ``src``, interleaved."""
    env = {**os.environ, "CORRAL_HOME": str(home), "PYTHONPATH": str(src)}
    status = [sys.executable, "-m", "corral", "status"]
    imports = [sys.executable, "-c", "import corral.cli"]
    bare = [sys.executable, "-c", "pass"]
    timed(status, env)  # warm-up: page cache, .pyc files
    samples: dict[str, list[float]] = {"status": [], "import": [], "python": []}
    for _ in range(runs):
        samples["status"].append(timed(status, env))
        samples["import"].append(timed(imports, env))
        samples["python"].append(timed(bare, env))
    return {name: summary(values) for name, values in samples.items()}


def start_daemon(home: Path) -> tuple[int, list[int]]:
    env = {**os.environ, "CORRAL_HOME": str(home), "PYTHONPATH": str(SRC)}
    cli = [sys.executable, "-m", "corral"]
    subprocess.run([*cli, "daemon", "start"], env=env, check=True, capture_output=True, timeout=60)
    info = json.loads(
        subprocess.run(
            [*cli, "daemon", "status", "--json"], env=env, check=True, capture_output=True
        ).stdout
    )
    return int(info["pid"]), [int(w["pid"]) for w in info.get("balancer_workers") or ()]


def stop_daemon(home: Path, pids: list[int]) -> None:
    env = {**os.environ, "CORRAL_HOME": str(home), "PYTHONPATH": str(SRC)}
    with contextlib.suppress(subprocess.SubprocessError):
        subprocess.run(
            [sys.executable, "-m", "corral", "daemon", "stop", "--all"],
            env=env,
            capture_output=True,
            timeout=60,
        )
    deadline = time.monotonic() + 10
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def source_commit(src: Path) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def parse_compare(specs: list[str]) -> dict[str, Path]:
    compare: dict[str, Path] = {}
    for spec in specs:
        name, sep, src = spec.partition("=")
        if not sep or not name.strip() or not (Path(src) / "corral").is_dir():
            raise SystemExit(f"--compare wants NAME=SRC with SRC/corral a package, got {spec!r}")
        compare[name.strip()] = Path(src).resolve()
    return compare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per source tree (default 30)")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="another source tree's CLI against the same daemon (e.g. a git worktree's src)",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args()
    trees = {"this tree": SRC, **parse_compare(args.compare)}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="corral-cli-latency-") as tmp:
        home = Path(tmp) / "home"
        daemon, workers = start_daemon(home)
        try:
            for name, src in trees.items():
                rows[name] = {"src": str(src), "commit": source_commit(src)}
                rows[name].update(measure(src, home, args.runs))
        finally:
            stop_daemon(home, [daemon, *workers])
    print(f"`corral status`, idle home, daemon running; {args.runs} runs each (ms)")
    kinds = ("status", "import", "python")
    print(f"{'tree':<14}{'commit':<10}" + "".join(f"{k + ' min/med/p90':>24}" for k in kinds))
    for name, row in rows.items():
        cells = [
            "/".join(f"{row[kind][k]:.0f}" for k in ("min_ms", "median_ms", "p90_ms"))
            for kind in kinds
        ]
        print(f"{name:<14}{row['commit'] or '-':<10}" + "".join(f"{c:>24}" for c in cells))
    load = os.getloadavg()
    document = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": load},
        "runs": args.runs,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"load average {load[0]:.2f}; written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
