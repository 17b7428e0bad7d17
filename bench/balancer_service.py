"""Benchmark: a real corral service (daemon and balancer workers, from ``corral up``) side by
side with nginx and with corral's balancer alone, in front of the same replicas.

Why: bench/balancer.py charges corral's ``LoadBalancer`` running alone in a process, which is
the engine's cost and nothing else. A user who measures corral measures what ``corral up``
starts: a balancer worker that also reports to the daemon 4 times a second, shares its counts
with the other workers and reads its route from the daemon's table, and a daemon that gathers
those reports, runs the autoscaler on them and checks the service's port. This script measures
that, and the daemon's own CPU under the load, next to nginx in one run.

What runs (everything on 127.0.0.1, every load bounded in time): per target (this tree, and
each ``--compare NAME=SRC``, a tree whose ``corral`` is run through PYTHONPATH), a fresh home
(temp dir) with ``CORRAL_BALANCER_WORKERS=N`` and one service of 4 replicas of
bench/_lb_replica.py, the default policy (``least_load``). Then nginx (Debian's package, N
workers, round robin, upstream keep-alive, as bench/balancer.py configures it) and
bench/_lb_proxy.py (``bare``: the balancer alone, N processes on one port) in front of the
first target's replicas. Rounds run ``wrk -t1 -c64`` for ``--duration`` seconds against every
target back to back, in an order that rotates, after a 1 s warm-up each. Reported per target:
req/s, and CPU per request (psutil, user + system): ``workers`` (the service's balancer
workers) and ``+daemon`` (the daemon's CPU over the same run added), with ratios to nginx's
within each round; medians over rounds (min-max of the ratios).

Run: ``.venv/bin/python bench/balancer_service.py [--rounds 3] [--duration 5] [--workers 1]
[--path /sse?events=50&interval=0.001] [--compare before=/tmp/before/src]``. Prints a table
and writes ``bench/results/balancer_service.json``. Needs wrk and nginx (installed with apt-get
when missing, as bench/balancer.py does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psutil  # noqa: E402
from _lb_peers import ensure_tools, free_port, start_nginx, stop_pid  # noqa: E402
from balancer import Proc, Run, cpu_by_process, parse_wrk, start_python  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results" / "balancer_service.json"
REPLICAS = 4


@dataclass
class Service:
    """A home with one service up: its endpoint, worker and daemon pids, replica ports."""

    name: str
    home: Path
    env: dict[str, str]
    port: int = 0
    workers: list[int] = field(default_factory=list)
    daemon: int = 0
    replica_ports: list[int] = field(default_factory=list)

    def cli(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "corral", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"corral {' '.join(args)}: {done.stderr[-500:]}")
        return done.stdout


def start_service(name: str, src: Path | None, workers: int, started: list[Service]) -> Service:
    """Up the service in a fresh home, added to ``started`` first (whatever fails, it goes)."""
    home = Path(tempfile.mkdtemp(prefix="corral-bsvc-"))
    env = {**os.environ, "CORRAL_HOME": str(home / "home"), "CORRAL_BALANCER_WORKERS": str(workers)}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    svc = Service(name, home, env)
    started.append(svc)
    spec = home / "svc.yaml"
    spec.write_text(
        f"name: bench\nrun: exec {sys.executable} {HERE / '_lb_replica.py'} --port $PORT\n"
        f"service:\n  readiness_probe: /\n  replicas: {REPLICAS}\n"
    )
    svc.cli("up", str(spec), "-y")
    state = json.loads(svc.cli("status", "bench", "--json"))
    state = state["services"][0] if "services" in state else state
    svc.port = int(str(state["endpoint"]).rsplit(":", 1)[1])
    svc.replica_ports = [
        int(str(r["endpoint"]).rstrip("/").rsplit(":", 1)[1]) for r in state["replicas"]
    ]
    svc.daemon = int(json.loads(svc.cli("daemon", "status", "--json"))["pid"])
    with sqlite3.connect(home / "home" / "state.db") as conn:
        svc.workers = [int(pid) for (pid,) in conn.execute("SELECT pid FROM balancer_workers")]
    if len(svc.workers) != workers or len(svc.replica_ports) != REPLICAS:
        raise RuntimeError(f"{name}: workers {svc.workers}, replicas {svc.replica_ports}")
    return svc


def stop_service(svc: Service) -> None:
    """Down, stop the daemon and workers, remove the home: whatever fails (a command timing
    out), every process of the home left is stopped by pid, never orphaned in a removed home."""
    procs: list[psutil.Process] = []
    for pid in [pid for pid in (svc.daemon, *svc.workers) if pid > 0]:  # 0: not known
        with contextlib.suppress(psutil.Error, ValueError):
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]  # the daemon's: its replicas
    for args in (("down", "--all", "-y"), ("daemon", "stop", "--all")):
        try:
            svc.cli(*args, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"{svc.name}: corral {' '.join(args)}: {exc}", file=sys.stderr)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():  # the same process (its start time), not a reused pid
                stop_pid(proc.pid)
    shutil.rmtree(svc.home, ignore_errors=True)


def quietly(step: Any, *args: Any) -> None:
    """One cleanup step; a failure is told and the next step still runs."""
    try:
        step(*args)
    except Exception as exc:  # whatever one step raised, the next runs
        print(f"cleanup: {exc!r}", file=sys.stderr)


@dataclass
class Target:
    name: str
    port: int
    pids: list[int]
    daemon: int | None = None


def own_cpu(pid: int | None) -> float:
    """User + system CPU seconds of this one process (the daemon: its replicas are its
    children, and never charged here)."""
    if not pid:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def measure(wrk: str, target: Target, duration: int, rnd: int, path: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{target.port}{path}"
    subprocess.run([wrk, "-t1", "-c64", "-d1s", url], capture_output=True, timeout=60)
    before, daemon_before = cpu_by_process(target.pids), own_cpu(target.daemon)
    out = subprocess.run(
        [wrk, "-t1", "-c64", f"-d{duration}s", "--latency", url],
        capture_output=True,
        text=True,
        timeout=duration + 30,
    )
    after, daemon_after = cpu_by_process(target.pids), own_cpu(target.daemon)
    run = Run("service", rnd, target.name, 64, duration)
    parse_wrk(out.stdout, run)
    zero = (0.0, 0.0)
    used = sum(sum(t) - sum(before.get(pid, zero)) for pid, t in after.items())
    requests = max(run.requests, 1)
    return {
        "target": target.name,
        "round": rnd,
        "requests": run.requests,
        "rps": run.rps,
        "errors": run.errors,
        "workers_us": used / requests * 1e6,
        "daemon_us": (daemon_after - daemon_before) / requests * 1e6,
    }


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per target: medians of req/s and CPU per request, and the per-round ratios to nginx's."""
    nginx = {r["round"]: r for r in runs if r["target"] == "nginx"}
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in runs if r["target"] == name]
        ratio = [r["workers_us"] / nginx[r["round"]]["workers_us"] for r in mine]
        whole = [(r["workers_us"] + r["daemon_us"]) / nginx[r["round"]]["workers_us"] for r in mine]
        rps = [r["rps"] / nginx[r["round"]]["rps"] for r in mine]
        out[name] = {
            "rps": statistics.median(r["rps"] for r in mine),
            "workers_us": statistics.median(r["workers_us"] for r in mine),
            "daemon_us": statistics.median(r["daemon_us"] for r in mine),
            "cpu_vs_nginx": [statistics.median(ratio), min(ratio), max(ratio)],
            "with_daemon_vs_nginx": [statistics.median(whole), min(whole), max(whole)],
            "rps_vs_nginx": [statistics.median(rps), min(rps), max(rps)],
            "errors": sum(r["errors"] for r in mine),
        }
    return out


def table(summary: dict[str, dict[str, Any]], rounds: int, path: str) -> str:
    def ratio(v: list[float]) -> str:
        return f"{v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})"

    lines = [
        f"wrk -c64 on {path}, medians of {rounds} rounds; CPU in us per request",
        f"{'target':<20}{'req/s':>9}{'workers':>9}{'daemon':>8}  {'CPU vs nginx':<20}"
        f"{'with daemon':<20}{'req/s vs nginx':<20}errors",
    ]
    for name, row in summary.items():
        daemon = f"{row['daemon_us']:.2f}" if row["daemon_us"] else "-"
        lines.append(
            f"{name:<20}{row['rps']:>9.0f}{row['workers_us']:>9.1f}{daemon:>8}  "
            f"{ratio(row['cpu_vs_nginx']):<20}{ratio(row['with_daemon_vs_nginx']):<20}"
            f"{ratio(row['rps_vs_nginx']):<20}{row['errors']}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--workers", type=int, default=1, help="balancer workers (and nginx's)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=SRC")
    parser.add_argument(
        "--path",
        default="/",
        help="what each request asks for: / (a small answer), or streamed answers of N "
        "chunks 1 ms apart with /sse?events=N&interval=0.001",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    tools = ensure_tools(lambda msg: print(msg, file=sys.stderr))
    if not tools.get("wrk") or not tools.get("nginx"):
        print("needs wrk and nginx", file=sys.stderr)
        return 1
    wrk, n = str(tools["wrk"]), args.workers
    services: list[Service] = []
    procs: list[Proc] = []
    nginx = None
    scratch = Path(tempfile.mkdtemp(prefix="corral-bsvc-nginx-"))
    try:
        # This tree by PYTHONPATH too: run from a clone, the venv's corral may be another's.
        trees: list[tuple[str, Path | None]] = [("corral", ROOT / "src")]
        trees += [(item.partition("=")[0], Path(item.partition("=")[2])) for item in args.compare]
        for name, src in trees:
            start_service(f"{name} service", src, n, services)
        ports = services[0].replica_ports
        nginx = start_nginx(str(tools["nginx"]), scratch, ports, n)
        replicas = [a for port in ports for a in ("--replica", f"http://127.0.0.1:{port}")]
        bare_port = None if n == 1 else str(free_port())
        for i in range(n):
            extra = [] if bare_port is None else ["--port", bare_port, "--reuse-port"]
            procs.append(
                start_python(
                    f"bare#{i}", [str(HERE / "_lb_proxy.py"), *replicas, *extra], src=ROOT / "src"
                )
            )
        targets = [
            Target("nginx", nginx.port, [nginx.popen.pid]),
            Target("corral bare", procs[0].port, [p.popen.pid for p in procs]),
        ]
        targets += [Target(s.name, s.port, s.workers, s.daemon) for s in services]
        runs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            k = rnd % len(targets)
            for target in targets[k:] + targets[:k]:
                runs.append(measure(wrk, target, args.duration, rnd, args.path))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            quietly(stop_pid, proc.popen.pid, proc.popen)
        if nginx is not None:
            quietly(nginx.stop)
        for svc in services:
            quietly(stop_service, svc)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs, [t.name for t in targets])
    print(table(summary, args.rounds, args.path))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/balancer_service.py " + " ".join(sys.argv[1:])
    args.out.write_text(
        json.dumps({"command": command, "runs": runs, "summary": summary}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
