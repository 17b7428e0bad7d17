"""Benchmark: what running replicas on Ray costs next to local processes.

Why: ``infra: ray`` puts every replica in a Ray actor (a worker process per replica, placed by
the GCS, its app a child of that worker) and streams its output back to the daemon, where the
local backend starts one process group. This measures the price of that, on this machine, with
the real CLI and daemon:

1. Time to N replicas READY (N = 1, 8, 32): from the ``corral up --detach`` invocation until the
   daemon's API shows N READY (probe period 0.2 s), with ``infra: ray`` and with ``infra: local``,
   same app (examples/app.py), on an already running daemon (its own start is reported apart:
   with Ray it imports Ray and connects). The ratio ray/local is the engine's overhead.
2. The daemon's memory (RSS, USS) with 32 READY replicas on each backend, and its CPU use over
   10 s of idle (the Ray backend polls every actor twice a second for output and state); plus,
   for scale, the memory of the Ray worker processes that host the 32 actors.

The cluster is a private ``ray.cluster_utils.Cluster`` on this machine (head + 2 workers, 2
logical CPUs each; ``tests/ray_cluster.py``), in its own ``RAY_TMPDIR``, on 127.0.0.1,
shut down by its handles and by pid. Each run gets a fresh ``CORRAL_HOME`` and is torn down in
``finally`` (``down --all``, ``daemon stop``, then a check by pid that every replica process and
actor is gone, and on the cluster that no actor of that home is left). Runs of the two backends
are interleaved so a change in the machine's load hits both.

    .venv/bin/python bench/ray_vs_local.py            # N = 1, 8, 32; 3/2/1 rounds
    .venv/bin/python bench/ray_vs_local.py --quick    # N = 1, 8; one round each
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))  # the test cluster lives with the tests, not in corral

from ray_cluster import LocalRayCluster  # noqa: E402

from corral.client import Client, ensure_daemon  # noqa: E402

EXAMPLES = REPO / "examples"
DEFAULT_JSON = BENCH / "results" / "ray_vs_local.json"
NODES: list[dict[str, Any]] = [
    {"num_cpus": 2, "resources": {"node-0": 100}},
    {"num_cpus": 2, "resources": {"node-1": 100}},
    {"num_cpus": 2, "resources": {"node-2": 100}},
]
READY_TIMEOUT = 300.0


def progress(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def spec_text(name: str, infra: str, replicas: int) -> str:
    run = f"exec {sys.executable} app.py"
    return (
        f"name: {name}\n"
        f"infra: {infra}\n"
        f"workdir: {json.dumps(str(EXAMPLES))}\n"
        f"run: {json.dumps(run)}\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 120\n"
        "    period_seconds: 0.2\n"
        f"  replicas: {replicas}\n"
    )


@dataclass
class Run:
    infra: str
    replicas: int
    round: int
    daemon_start_s: float
    up_cli_s: float
    first_ready_s: float
    all_ready_s: float
    daemon_rss_mb: float | None = None
    daemon_uss_mb: float | None = None
    daemon_idle_cpu_pct: float | None = None
    actor_workers_rss_mb: float | None = None
    actor_workers_uss_mb: float | None = None
    leftovers: list[str] = field(default_factory=list)


class Home:
    """One fresh corral home, its daemon, and every pid it was seen to run."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.path = root / "home"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        self.env.update(env)
        self.env["CORRAL_HOME"] = str(self.path)
        self.pids: set[int] = set()

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "corral", *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start_daemon(self) -> float:
        """Start the daemon (as `corral up` would) and return how long until it answered."""
        since = time.perf_counter()
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            ensure_daemon(self.path, timeout=60.0)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return time.perf_counter() - since

    @property
    def client(self) -> Client:
        return Client(self.path, timeout=30.0)

    def daemon_pid(self) -> int | None:
        try:
            return int(json.loads((self.path / "daemon.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def note(self, service: dict[str, Any]) -> None:
        for r in service["replicas"]:
            if r.get("pid"):
                self.pids.add(int(r["pid"]))

    def note_actors(self) -> None:
        """Actor worker pids from the recorded handles (read-only look at the state file)."""
        import sqlite3

        db = sqlite3.connect(f"file:{self.path / 'state.db'}?mode=ro", uri=True, timeout=5)
        try:
            for (raw,) in db.execute("SELECT handle_json FROM replicas WHERE handle_json NOT NULL"):
                data = json.loads(raw)["data"]
                for key in ("pid", "actor_pid"):
                    if data.get(key):
                        self.pids.add(int(data[key]))
        finally:
            db.close()

    def teardown(self) -> list[str]:
        """Down everything, stop the daemon; report (and kill by pid) whatever survived."""
        problems = []
        if self.daemon_pid() is not None:
            down = self.cli("down", "--all", "--timeout", "120", timeout=180)
            if down.returncode != 0:
                problems.append(f"down --all failed: {down.stderr.strip()[-300:]}")
            pid = self.daemon_pid()
            self.cli("daemon", "stop", "--all", timeout=60)  # workers too
            if pid is not None:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).wait(30)
        deadline = time.monotonic() + 20
        alive = [p for p in self.pids if _alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _alive(p)]
        for pid in alive:
            problems.append(f"pid {pid} survived teardown: killed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return problems


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _mb(value: float) -> float:
    return round(value / 1024**2, 1)


def actor_workers(home: Home) -> tuple[float, float]:
    """Summed RSS and USS (MB) of the Ray worker processes hosting this home's actors."""
    import sqlite3

    rss = uss = 0.0
    db = sqlite3.connect(f"file:{home.path / 'state.db'}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute("SELECT handle_json FROM replicas WHERE handle_json NOT NULL").fetchall()
    finally:
        db.close()
    for (raw,) in rows:
        pid = json.loads(raw)["data"].get("actor_pid")
        if not pid:
            continue
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(int(pid)).memory_full_info()
            rss += info.rss
            uss += info.uss
    return _mb(rss), _mb(uss)


def one_run(
    infra: str, replicas: int, rnd: int, cluster: LocalRayCluster, measure_memory: bool
) -> Run:
    root = Path(tempfile.mkdtemp(prefix=f"corral-bench-ray-{infra}-"))
    env = {}
    if infra == "ray":
        env = dict(cluster.env) | {"RAY_ADDRESS": cluster.address}
    home = Home(root, env)
    try:
        daemon_s = home.start_daemon()
        spec = root / "svc.yaml"
        spec.write_text(spec_text("bench", infra, replicas))
        since = time.perf_counter()
        up = home.cli("up", "--detach", str(spec))
        up_s = time.perf_counter() - since
        if up.returncode != 0:
            raise RuntimeError(f"corral up failed: {up.stderr.strip()[-500:]}")
        first = None
        client = home.client
        while True:
            elapsed = time.perf_counter() - since
            service = client.service("bench")
            home.note(service)
            ready = sum(1 for r in service["replicas"] if r["status"] == "READY")
            if ready and first is None:
                first = elapsed
            if ready >= replicas:
                break
            if elapsed > READY_TIMEOUT:
                raise RuntimeError(f"{ready}/{replicas} READY after {READY_TIMEOUT:g}s")
            time.sleep(0.05)
        run = Run(
            infra,
            replicas,
            rnd,
            round(daemon_s, 3),
            round(up_s, 3),
            round(first or 0, 3),
            round(elapsed, 3),
        )
        if measure_memory:
            time.sleep(2.0)  # let the launch burst settle
            pid = home.daemon_pid()
            assert pid is not None
            proc = psutil.Process(pid)
            info = proc.memory_full_info()
            run.daemon_rss_mb, run.daemon_uss_mb = _mb(info.rss), _mb(info.uss)
            cpu0 = sum(proc.cpu_times()[:2])
            time.sleep(10.0)
            run.daemon_idle_cpu_pct = round((sum(proc.cpu_times()[:2]) - cpu0) / 10.0 * 100, 1)
            if infra == "ray":
                run.actor_workers_rss_mb, run.actor_workers_uss_mb = actor_workers(home)
        if infra == "ray":
            home.note_actors()
        return run
    finally:
        problems = home.teardown()
        if home.path.joinpath("home_id").exists() and infra == "ray":
            marker = home.path.joinpath("home_id").read_text().strip()
            left = cluster.named_actors(f"corral-{marker}-")
            if left:
                problems.append(f"actors left on the cluster: {left}")
        for line in problems:
            progress(f"LEAK {infra} N={replicas}: {line}")
        shutil.rmtree(root, ignore_errors=True)


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r.replicas for r in runs}):
        row: dict[str, Any] = {"replicas": n}
        for infra in ("local", "ray"):
            mine = [r for r in runs if r.replicas == n and r.infra == infra]
            row[f"{infra}_rounds"] = len(mine)
            row[f"{infra}_first_ready_s"] = round(
                statistics.median(r.first_ready_s for r in mine), 2
            )
            row[f"{infra}_all_ready_s"] = round(statistics.median(r.all_ready_s for r in mine), 2)
            row[f"{infra}_daemon_start_s"] = round(
                statistics.median(r.daemon_start_s for r in mine), 2
            )
        row["ratio_all_ready"] = round(row["ray_all_ready_s"] / row["local_all_ready_s"], 2)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], runs: list[Run]) -> str:
    out = [
        "| N | local: first READY s | local: all READY s | ray: first READY s "
        "| ray: all READY s | ray / local (all) | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        out.append(
            f"| {row['replicas']} | {row['local_first_ready_s']:.2f} | "
            f"{row['local_all_ready_s']:.2f} | {row['ray_first_ready_s']:.2f} | "
            f"{row['ray_all_ready_s']:.2f} | {row['ratio_all_ready']:.2f}x | "
            f"{row['local_rounds']}+{row['ray_rounds']} |"
        )
    mem = [r for r in runs if r.daemon_rss_mb is not None]
    if mem:
        out += [
            "",
            "| backend | N | daemon RSS MB | daemon USS MB | daemon idle CPU % "
            "| actor workers RSS MB | actor workers USS MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in mem:
            out.append(
                f"| {r.infra} | {r.replicas} | {r.daemon_rss_mb} | {r.daemon_uss_mb} | "
                f"{r.daemon_idle_cpu_pct} | {r.actor_workers_rss_mb or '-'} | "
                f"{r.actor_workers_uss_mb or '-'} |"
            )
    starts = {i: [r.daemon_start_s for r in runs if r.infra == i] for i in ("local", "ray")}
    out += [
        "",
        f"daemon start (to answering), median: local {statistics.median(starts['local']):.2f} s, "
        f"ray {statistics.median(starts['ray']):.2f} s (imports Ray, connects, sweeps the nodes)",
    ]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="N = 1 and 8, one round each")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    p.add_argument("--sizes", type=int, nargs="*", help="replica counts (default 1 8 32)")
    args = p.parse_args()
    sizes = args.sizes or ([1, 8] if args.quick else [1, 8, 32])
    rounds = {n: (1 if args.quick else (3 if n == 1 else 2 if n <= 8 else 1)) for n in sizes}
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    cluster_dir = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))  # short: socket paths
    cluster = LocalRayCluster(cluster_dir, NODES)
    since = time.perf_counter()
    progress("starting a 3-node Ray cluster on 127.0.0.1")
    cluster.attach(timeout=180)
    cluster_start = time.perf_counter() - since
    progress(f"cluster up at {cluster.address} in {cluster_start:.1f}s")
    runs: list[Run] = []
    survivors: list[int] = []
    try:
        for n in sizes:
            for rnd in range(rounds[n]):
                order = ("local", "ray") if rnd % 2 == 0 else ("ray", "local")
                for infra in order:
                    memory = n == max(sizes) and rnd == 0
                    progress(f"{infra}: {n} replica(s), round {rnd + 1}/{rounds[n]}")
                    run = one_run(infra, n, rnd, cluster, memory)
                    progress(f"  -> all READY in {run.all_ready_s:.2f}s")
                    runs.append(run)
    finally:
        survivors = cluster.detach()
        shutil.rmtree(cluster_dir, ignore_errors=True)
        if survivors:
            progress(f"LEAK: cluster processes needed SIGKILL: {survivors}")
    rows = summarize(runs)
    report = table(rows, runs)
    print(report)
    payload = {
        "benchmark": "ray_vs_local",
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "ray": _ray_version(),
            "mem_total_gb": round(psutil.virtual_memory().total / 1024**3, 1),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "cluster": {"nodes": NODES, "start_s": round(cluster_start, 2)},
        "quick": args.quick,
        "summary": rows,
        "runs": [asdict(r) for r in runs],
        "cluster_survivors": survivors,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    progress(f"results written to {args.json}")
    return 0


def _ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


if __name__ == "__main__":
    sys.exit(main())
