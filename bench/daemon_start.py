"""Benchmark: how soon a daemon answers its API after it starts, with and without Ray.

Why this exists: a daemon that answers late fails every CLI call that started it (``corral up``
gives up after 20 s), and the daemon with ``RAY_ADDRESS`` set once took 19 s to answer because
it connected to Ray before it listened. The promise now is that the API answers within 2 s of
start whatever its backends do (the Ray backend connects in the background: replicas on Ray wait
for it, with the reason shown). This puts a number on it, on this machine, with the real
daemon:

* from spawning ``corral daemon run`` (a fresh ``CORRAL_HOME``) to the first answered
  ``GET /v1/health`` (the CLI's own check, proof of the token included), polled every 10 ms;
* with no Ray address (``local``), with ``RAY_ADDRESS`` pointing at a live Ray cluster on
  this machine (``ray``), and at a port that accepts connections and never answers
  (``ray_silent``: a cluster that hangs, which the daemon used to wait 10 s for), rounds
  interleaved so a change in the machine's load hits all three;
* for ``ray`` also when the daemon says it is connected to the cluster (its log line), which is
  when replicas on Ray may launch: the time the API no longer waits for.

The cluster is a private one-node ``ray.cluster_utils.Cluster`` (``tests/ray_cluster.py``), in
its own ``RAY_TMPDIR`` on 127.0.0.1, started by this script and shut down by its handles and by
pid (never ``ray stop``). Each round gets a fresh home torn down in ``finally`` (``daemon stop
--all``, then by pid whatever is left; bench/_ctrl_harness.py). Every wait is bounded.

    .venv/bin/python bench/daemon_start.py              # 5 rounds of each
    .venv/bin/python bench/daemon_start.py --rounds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))  # the test cluster lives with the tests

from _ctrl_harness import CORRAL_BIN, CorralHome, corral_home, progress  # noqa: E402
from ray_cluster import LocalRayCluster  # noqa: E402

from corral.client import Client  # noqa: E402

DEFAULT_JSON = BENCH / "results" / "daemon_start.json"
NODES: list[dict[str, Any]] = [{"num_cpus": 2}]
BACKENDS = ("local", "ray", "ray_silent")
PROMISE_S = 2.0  # the API answers within this long of start
ANSWER_TIMEOUT = 60.0  # s: a daemon that has not answered by then is a failed round
CONNECT_TIMEOUT = 90.0  # s: the same for the Ray connection
POLL = 0.01
CONNECTED = "connected to the Ray cluster at"


@dataclass
class Round:
    backend: str  # "local", "ray" or "ray_silent"
    index: int
    answered_s: float | None  # spawn -> first answered GET /v1/health
    ray_connected_s: float | None = None  # spawn -> the daemon's "connected" log line


def _spawn(h: CorralHome, env: dict[str, str]) -> subprocess.Popen[bytes]:
    h.home.mkdir(parents=True, exist_ok=True)
    with open(h.root / "daemon.out", "ab") as log:
        return subprocess.Popen(
            [CORRAL_BIN, "daemon", "run"],
            env=env | {"CORRAL_HOME": str(h.home), "CORRAL_DAEMON_RESPAWN": "0"},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def _connected(h: CorralHome) -> bool:
    try:
        return CONNECTED in (h.root / "daemon.out").read_text(errors="replace")
    except OSError:
        return False


def one_round(backend: str, index: int, env: dict[str, str], problems: list[str]) -> Round:
    """One daemon start in a fresh home; stopped (and checked by pid) before returning."""
    result = Round(backend, index, None)
    with corral_home(f"{backend}{index}", problems) as h:
        client = Client(h.home, timeout=2.0)
        since = time.perf_counter()
        proc = _spawn(h, env)
        try:
            want_ray = backend == "ray"
            deadline = since + (CONNECT_TIMEOUT if want_ray else ANSWER_TIMEOUT)
            while time.perf_counter() < deadline:
                now = time.perf_counter() - since
                if result.answered_s is None and client.health():
                    result.answered_s = round(time.perf_counter() - since, 3)
                    h.daemon_pid()  # remembered for the cleanup by pid
                if want_ray and result.ray_connected_s is None and _connected(h):
                    result.ray_connected_s = round(now, 3)
                if result.answered_s is not None and (not want_ray or result.ray_connected_s):
                    break
                if proc.poll() is not None:
                    problems.append(f"{backend} round {index}: daemon exited {proc.returncode}")
                    break
                if result.answered_s is None and now > ANSWER_TIMEOUT:
                    break
                time.sleep(POLL)
        finally:
            h.daemon_pid()
    try:  # the harness stopped it; reap our child (killed by pid if it lingers)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        problems.append(f"{backend} round {index}: daemon pid {proc.pid} needed SIGKILL")
    return result


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def summarize(rounds: list[Round]) -> list[dict[str, Any]]:
    rows = []
    for backend in BACKENDS:
        mine = [r for r in rounds if r.backend == backend]
        answered = [r.answered_s for r in mine]
        known = [a for a in answered if a is not None]
        rows.append(
            {
                "backend": backend,
                "rounds": len(mine),
                "answered_median_s": _median(answered),
                "answered_max_s": max(known) if known else None,
                "within_promise": sum(1 for a in known if a <= PROMISE_S),
                "ray_connected_median_s": _median([r.ray_connected_s for r in mine]),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    out = [
        f"| backend | API answered, median s | max s | within {PROMISE_S:g} s "
        "| Ray connected, median s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        out.append(
            f"| {row['backend']} | {s(row['answered_median_s'])} | {s(row['answered_max_s'])} "
            f"| {row['within_promise']}/{row['rounds']} | {s(row['ray_connected_median_s'])} |"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5, help="daemon starts per backend")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = p.parse_args()
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    cluster_dir = Path(tempfile.mkdtemp(prefix="crd-", dir="/tmp"))  # short: socket paths
    cluster = LocalRayCluster(cluster_dir, NODES)
    problems: list[str] = []
    rounds: list[Round] = []
    survivors: list[int] = []
    since = time.perf_counter()
    progress("starting a one-node Ray cluster on 127.0.0.1")
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts, never answers
    try:
        cluster.attach(timeout=180)
        progress(f"cluster up at {cluster.address} in {time.perf_counter() - since:.1f}s")
        base = dict(os.environ) | cluster.env
        base.pop("RAY_ADDRESS", None)
        base.pop("CORRAL_RAY_ADDRESS", None)
        envs = {
            "local": base,
            "ray": base | {"RAY_ADDRESS": cluster.address},
            "ray_silent": base | {"RAY_ADDRESS": f"127.0.0.1:{silent.getsockname()[1]}"},
        }
        for index in range(args.rounds):
            for backend in BACKENDS[index % 3 :] + BACKENDS[: index % 3]:
                one = one_round(backend, index, envs[backend], problems)
                progress(
                    f"{backend} round {index + 1}/{args.rounds}: answered {one.answered_s}s"
                    + (f", Ray connected {one.ray_connected_s}s" if backend == "ray" else "")
                )
                rounds.append(one)
    finally:
        silent.close()
        survivors = cluster.detach()
        shutil.rmtree(cluster_dir, ignore_errors=True)
        if survivors:
            problems.append(f"cluster processes needed SIGKILL: {survivors}")
    rows = summarize(rounds)
    print(table(rows))
    for line in problems:
        print(f"PROBLEM: {line}")
    payload = {
        "benchmark": "daemon_start",
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "promise_s": PROMISE_S,
        "cluster": {"nodes": NODES},
        "summary": rows,
        "rounds": [asdict(r) for r in rounds],
        "problems": problems,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    progress(f"results written to {args.json}")
    return 1 if problems or any(r.answered_s is None for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
