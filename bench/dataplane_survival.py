"""Benchmark: does traffic notice the control plane dying, stopping and coming back?

Issue 11's proof. Three services (examples/app.py, 2 replicas each) behind corral's balancer
workers take an open-loop load of mixed GET and POST (every third request a POST) at 200 req/s in
all, on 127.0.0.1, while this script:

1. SIGKILLs the daemon ``--cycles`` times (20 by default). The balancer workers bring a new
   daemon back by themselves (``CORRAL_DAEMON_RESPAWN`` is left on); the time from the kill to
   a new daemon answering is recorded per cycle. The next kill waits for the new daemon to have
   adopted every service.
2. Runs ``corral daemon restart-workers`` ``--restarts`` times (5 by default): every balancer
   worker replaced by a new process, the upgrade path. Each time waits until the old workers
   have exited (they finish what they hold: an idle keep-alive connection gets 3 s for its next
   request) before the next.
3. Runs ``corral daemon stop`` (the workers must not bring that one back), SIGKILLs one replica
   while no daemon runs, waits 3 s (traffic must pass over the dead replica), then
   ``corral daemon start``, which replaces the replica.

Counted: every request sent, every failure with its kind, and which failures could be requests
in flight on the killed replica (sent to its service within 100 ms before the kill, a POST that
reached it cannot be retried). The verdict: 0 failures other than those. Also checked: the
balancer workers after step 3 are the ones from before it (adopted, never a second set) and each
service kept its port.

Run: ``.venv/bin/python bench/dataplane_survival.py [--cycles 20] [--restarts 5]`` (about 2-3
minutes here).
Results: a table on stdout and bench/results/dataplane_survival.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the tests' open-loop load generator

from load import PacedLoad  # noqa: E402

from corral.procfs import running  # noqa: E402

RESULTS = HERE / "results" / "dataplane_survival.json"
SERVICES = ("alpha", "beta", "gamma")
TOTAL_RATE = 200.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Home:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        self.env["CORRAL_HOME"] = str(path)

    def cli(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "corral", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if result.returncode != 0:
            raise RuntimeError(f"corral {' '.join(args)}: {result.stdout}{result.stderr}")
        return result.stdout

    def info(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.path / "daemon.json").read_text()))
        except (OSError, ValueError):
            return None

    def api(self, path: str) -> Any:
        info = self.info()
        assert info is not None
        token = (self.path / "token").read_text().strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{info['port']}{path}", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())

    def healthy(self) -> bool:
        try:
            return bool(self.api("/v1/health").get("ok"))
        except (OSError, AssertionError, ValueError):
            return False

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except (OSError, ValueError, AssertionError, KeyError):
                value = None
            if value:
                return value
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")

    def all_ready(self) -> bool:
        services = self.api("/v1/services")["services"]
        ready = [sum(r["status"] == "READY" for r in s["replicas"]) for s in services]
        return len(services) == len(SERVICES) and all(n == 2 for n in ready)


def spec(directory: Path, name: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nworkdir: {REPO / 'examples'}\nrun: exec {sys.executable} app.py\n"
        "service:\n  readiness_probe:\n    path: /health\n    period_seconds: 0.5\n"
        "    initial_delay_seconds: 30\n  replicas: 2\n"
    )
    return path


def run(cycles: int, restarts: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="corral-survival-") as tmp:
        home = Home(Path(tmp) / "home")
        try:
            return _run(home, Path(tmp), cycles, restarts)
        finally:
            try:
                home.cli("daemon", "start")
                home.cli("down", "--all", "--purge", "--timeout", "60")
            finally:
                home.cli("daemon", "stop", "--all")


def restart_workers(home: Home, restarts: int) -> list[float]:
    """Seconds from each ``restart-workers`` to the last old worker gone."""
    gone: list[float] = []
    for n in range(restarts):
        old = []
        for worker in home.api("/v1/daemon")["balancer_workers"]:
            with contextlib.suppress(psutil.Error):
                old.append(psutil.Process(worker["pid"]))  # bound to this process, not the pid
        started = time.monotonic()
        home.cli("daemon", "restart-workers")
        home.wait(lambda old=old: not any(map(running, old)), 30, "the old workers to exit")
        gone.append(time.monotonic() - started)
        log(f"restart {n + 1}/{restarts}: old workers gone after {gone[-1]:.2f}s")
    return gone


def _run(home: Home, tmp: Path, cycles: int, restarts: int) -> dict[str, Any]:
    endpoints = {}
    for name in SERVICES:
        home.cli("up", str(spec(tmp, name)))
    home.wait(home.all_ready, 60, "every replica READY")
    for svc in home.api("/v1/services")["services"]:
        endpoints[svc["name"]] = svc["endpoint"]
    duration = cycles * 3.5 + restarts * 8.0 + 25.0
    rate = TOTAL_RATE / len(SERVICES)
    loads = {
        n: PacedLoad(endpoints[n], rate=rate, duration=duration, post_every=3) for n in SERVICES
    }
    for load in loads.values():
        load.start()
    back: list[float] = []
    try:
        time.sleep(2.0)
        for cycle in range(cycles):
            info = home.info()
            assert info is not None
            old = int(info["pid"])
            os.kill(old, signal.SIGKILL)
            killed = time.monotonic()

            def respawned(old: int = old) -> bool:
                info = home.info()
                return info is not None and int(info["pid"]) != old and home.healthy()

            home.wait(respawned, 30, "the workers to bring a daemon back")
            back.append(time.monotonic() - killed)
            home.wait(home.all_ready, 30, "the new daemon to adopt every service")
            log(f"cycle {cycle + 1}/{cycles}: daemon back in {back[-1]:.2f}s")
            time.sleep(1.0)
        replaced = restart_workers(home, restarts)
        workers_before = [w["pid"] for w in home.api("/v1/daemon")["balancer_workers"]]
        victim_service = SERVICES[0]
        victim = next(
            int(r["pid"])
            for r in json.loads(home.cli("status", "--json", victim_service))["services"][0][
                "replicas"
            ]
            if r["status"] == "READY"
        )
        home.cli("daemon", "stop")
        assert home.info() is None
        kill_at = loads[victim_service].result.sent
        os.killpg(os.getpgid(victim), signal.SIGKILL)
        log(f"daemon stopped; replica pid {victim} of {victim_service} killed")
        time.sleep(3.0)
        stayed_stopped = home.info() is None
        home.cli("daemon", "start")
        home.wait(home.all_ready, 60, "the dead replica to be replaced")
        log("daemon started; replica replaced")
    finally:
        for load in loads.values():
            load.stop()
        results = {n: load.join() for n, load in loads.items()}
    workers_after = [w["pid"] for w in home.api("/v1/daemon")["balancer_workers"]]
    ports_after = {s["name"]: s["endpoint"] for s in home.api("/v1/services")["services"]}
    sent = sum(r.sent for r in results.values())
    failed = sum(r.failed for r in results.values())
    return {
        "cycles": cycles,
        "requests": sent,
        "failed": failed,
        "failed_by_service": {n: r.failed for n, r in results.items()},
        "errors": {n: dict(r.errors) for n, r in results.items() if r.errors},
        "examples": {n: r.examples for n, r in results.items() if r.examples},
        "victim_requests_before_kill": kill_at,
        "p50_ms": statistics.median(
            [r.quantile_ms(0.5) for r in results.values() if r.latencies] or [0.0]
        ),
        "p99_ms": max(r.quantile_ms(0.99) for r in results.values()),
        "daemon_back_s": {
            "median": round(statistics.median(back), 2) if back else None,
            "max": round(max(back), 2) if back else None,
        },
        "restart_workers": restarts,
        "old_workers_gone_s": {
            "median": round(statistics.median(replaced), 2) if replaced else None,
            "max": round(max(replaced), 2) if replaced else None,
        },
        "daemon_stop_stayed_stopped": stayed_stopped,
        "workers_adopted": workers_before == workers_after,
        "ports_kept": ports_after == endpoints,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    result = run(args.cycles, args.restarts)
    result["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(f"{'daemon SIGKILL cycles':<34} {result['cycles']}")
    print(f"{'requests (GET + POST)':<34} {result['requests']}")
    print(f"{'failed':<34} {result['failed']}  {result['failed_by_service']}")
    print(f"{'p50 / p99 (ms)':<34} {result['p50_ms']:.1f} / {result['p99_ms']:.1f}")
    back = result["daemon_back_s"]
    print(f"{'daemon back after SIGKILL (s)':<34} median {back['median']}, max {back['max']}")
    gone = result["old_workers_gone_s"]
    print(f"{'restart-workers cycles':<34} {result['restart_workers']}")
    print(f"{'old workers gone after (s)':<34} median {gone['median']}, max {gone['max']}")
    print(f"{'daemon stop stayed stopped':<34} {result['daemon_stop_stayed_stopped']}")
    print(f"{'same workers adopted':<34} {result['workers_adopted']}")
    print(f"{'every service kept its port':<34} {result['ports_kept']}")
    if result["failed"]:
        print("failures:", json.dumps(result["examples"], indent=1))
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
