"""What reading the engines' metrics costs the engines and the balancer workers, split between
the workers (``corral.dataplane.engine_shares``) or each worker reading every engine.

Why: with W balancer workers each reading every engine's ``/metrics`` every second, every
engine renders its metrics W times a second, in the process that also serves its requests
(vLLM's and SGLang's API servers; the simulator's aiohttp server here), and each worker reads
every engine every second. Split, each engine is read once a second whatever
W is. This script shows both costs side by side: the engines' CPU and the routers' CPU while
nothing else happens (the reads are all there is to measure).

What runs (127.0.0.1 only, bounded in time): 4 ``corral.llmsim`` engines; for each W in
``--workers`` and each mode, W processes of ``bench/_llm_lb.py`` (corral's balancer, uvloop,
``prefix_affinity``, one port with SO_REUSEPORT, refreshing the engines' metrics every second
as a balancer worker does) with ``--engine-share`` (``split``) or without (``each``). After a
warm-up, the engines' and the routers' CPU (every thread's, from ``/proc/PID/task/*/schedstat``)
over ``--duration`` seconds. ``--compare NAME=SRC`` adds rows of another tree's routers (its
``corral`` through PYTHONPATH; the engines stay this tree's), reading split. ``--clients N``
keeps N client connections open on the routers' port, idle (as an LLM client between turns,
or one waiting for its first token): what a router spends on its clients' deadlines.
Rounds interleave the rows, in an order that rotates.

Run: ``.venv/bin/python bench/engine_reads.py [--workers 1,2,4] [--duration 20] [--rounds 2]
[--clients 0] [--compare before=/tmp/before/src]``.
Prints a table (median over rounds, CPU ms per second) and writes
``bench/results/engine_reads.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _cpu import schedstat_seconds

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "engine_reads.json"
ENGINES = 4
WARMUP = 3.0


def start(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    """A process that prints ``PORT <n>`` once listening, and that port."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("PORT "):
            return proc, int(line.split()[1])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{argv[:3]} did not start")


def engine() -> tuple[subprocess.Popen[str], int]:
    """One simulator on a free port; its port, read back from its health endpoint."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "corral.llmsim", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("an engine did not start")


def cpu(procs: list[psutil.Process]) -> float:
    """CPU seconds of these processes, every thread's from the scheduler (nanoseconds; psutil's
    10 ms ticks are too coarse for a few ms a second)."""
    return sum(schedstat_seconds(p.pid) for p in procs)


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def one_run(
    urls: list[str],
    engines: list[psutil.Process],
    workers: int,
    mode: str,
    duration: float,
    tmp: Path,
    src: str | None = None,
    clients: int = 0,
) -> dict[str, float]:
    base = [sys.executable, str(HERE / "_llm_lb.py"), "--policy", "prefix_affinity"]
    base += [a for url in urls for a in ("--replica", url)]
    base += ["--workers", str(workers), "--reuse-port"]
    if mode == "split":
        base += ["--engine-share", str(tmp / f"engines-{workers}-{time.monotonic_ns()}")]
    routers: list[subprocess.Popen[str]] = []
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    held: list[socket.socket] = []
    try:
        first, port = start(base, env)
        routers.append(first)
        for slot in range(1, workers):
            more, _ = start([*base, "--port", str(port), "--slot", str(slot)], env)
            routers.append(more)
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(clients)]
        time.sleep(WARMUP)
        watched = [psutil.Process(p.pid) for p in routers]
        e0, r0, t0 = cpu(engines), cpu(watched), time.monotonic()
        time.sleep(duration)
        e1, r1, t1 = cpu(engines), cpu(watched), time.monotonic()
    finally:
        for sock in held:
            sock.close()
        stop(routers)
    span = t1 - t0
    return {"engines_ms_per_s": (e1 - e0) / span * 1e3, "routers_ms_per_s": (r1 - r0) / span * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="1,2,4", help="balancer processes per row")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="also run the routers of the tree at SRC (its corral through PYTHONPATH), split",
    )
    parser.add_argument(
        "--clients", type=int, default=0, help="idle client connections held open meanwhile"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    trees = dict(item.partition("=")[::2] for item in args.compare)
    rows = [(w, mode) for w in counts for mode in ("each", "split", *trees)]
    runs: dict[str, list[dict[str, float]]] = {f"{w} {m}": [] for w, m in rows}
    spawned = [engine() for _ in range(ENGINES)]
    try:
        urls = [f"http://127.0.0.1:{port}" for _, port in spawned]
        engines = [psutil.Process(p.pid) for p, _ in spawned]
        with tempfile.TemporaryDirectory(prefix="engine-reads-") as tmp:
            for r in range(args.rounds):
                order = rows[r % len(rows) :] + rows[: r % len(rows)]
                for w, mode in order:
                    reading, src = ("split", trees[mode]) if mode in trees else (mode, None)
                    got = one_run(
                        urls, engines, w, reading, args.duration, Path(tmp), src, args.clients
                    )
                    runs[f"{w} {mode}"].append(got)
                    print(
                        f"[{time.strftime('%H:%M:%S')}] round {r + 1} {w} workers, {mode}: "
                        f"engines {got['engines_ms_per_s']:.1f} ms/s, "
                        f"routers {got['routers_ms_per_s']:.1f} ms/s",
                        flush=True,
                    )
    finally:
        stop([p for p, _ in spawned])
    table: list[dict[str, Any]] = []
    print(
        f"\n{ENGINES} idle engines, {args.clients} idle client(s), CPU ms per second (median of "
        f"{args.rounds} round(s) of {args.duration:g} s)"
    )
    print("| workers | reading | engines' CPU | routers' CPU | engines vs each | routers vs each |")
    print("|---|---|---|---|---|---|")
    for w, mode in rows:
        got = runs[f"{w} {mode}"]
        eng = statistics.median(g["engines_ms_per_s"] for g in got)
        rout = statistics.median(g["routers_ms_per_s"] for g in got)
        each = runs[f"{w} each"]
        e_each = statistics.median(g["engines_ms_per_s"] for g in each)
        r_each = statistics.median(g["routers_ms_per_s"] for g in each)
        ratio_e = f"{eng / e_each:.2f}x" if mode != "each" and e_each else ""
        ratio_r = f"{rout / r_each:.2f}x" if mode != "each" and r_each else ""
        print(f"| {w} | {mode} | {eng:.1f} | {rout:.1f} | {ratio_e} | {ratio_r} |")
        table.append(
            {
                "workers": w,
                "mode": mode,
                "engines_ms_per_s": eng,
                "routers_ms_per_s": rout,
                "runs": got,
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "engines": ENGINES,
                "duration": args.duration,
                "rounds": args.rounds,
                "clients": args.clients,
                "rows": table,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
