"""Reaction time of autoscaling: from a load step to the new replicas READY.

Two daemons run the same service and the same load step, side by side in one run:

* corral's defaults: decisions every 5 s;
* SkyServe's defaults: decisions every 20 s.

Both are scaled down by the same factor (``--scale``, default 1/20) so a run takes seconds, not
minutes: the decision interval and the spec's ``upscale_delay_seconds`` (300 s in both) are
multiplied by it. The QPS window is scaled too. What differs between the two rows is only the
decision cadence, so the ratio isolates what corral's faster decisions buy; everything else
(launch, probing, the app's start) is the same machinery.

The load is a bounded fixed-rate loop on 127.0.0.1 that stops by itself.

Run: ``.venv/bin/python bench/autoscale.py [--reps N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from corral.client import Client  # noqa: E402
from corral.home import read_info  # noqa: E402

SPEC = """\
name: step
workdir: {examples}
run: exec python3 app.py
service:
  readiness_probe: {{path: /health, period_seconds: 0.2, initial_delay_seconds: 60}}
  replica_policy:
    min_replicas: 1
    max_replicas: 3
    target_qps_per_replica: 5
    upscale_delay_seconds: {upscale}
    downscale_delay_seconds: {downscale}
"""


def run_cli(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "corral", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return result.stdout


def load(url: str, rate: float, stop: threading.Event, deadline: float) -> None:
    """Fixed-rate GETs on 4 threads until ``stop`` or ``deadline``."""

    def work() -> None:
        interval = 4 / rate
        while not stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url + "/", timeout=10) as response:
                    response.read()
            except OSError:
                pass
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_run(label: str, decision: float, scale: float, rate: float) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"corral-bench-autoscale-{label}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update(
        CORRAL_HOME=str(home),
        CORRAL_DECISION_INTERVAL=str(decision * scale),
        CORRAL_QPS_WINDOW=str(max(1.0, 60 * scale)),
    )
    spec = home / "step.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(
        SPEC.format(examples=REPO / "examples", upscale=300 * scale, downscale=1200 * scale)
    )
    client = Client(home)
    stop = threading.Event()
    try:
        run_cli(env, "up", str(spec))
        url = client.service("step")["endpoint"]
        step_at = time.monotonic()
        deadline = step_at + 300 * scale + 20 * decision * scale + 60
        loader = threading.Thread(target=load, args=(url, rate, stop, deadline), daemon=True)
        loader.start()
        target_at = ready_at = None
        while time.monotonic() < deadline and ready_at is None:
            svc = client.service("step")
            now = time.monotonic()
            if target_at is None and (svc.get("target") or 0) >= 3:
                target_at = now
            if sum(r["status"] == "READY" for r in svc["replicas"]) >= 3:
                ready_at = now
            time.sleep(0.05)
        stop.set()
        loader.join(timeout=15)
        return {
            "config": label,
            "decision_interval_s": decision * scale,
            "upscale_delay_s": 300 * scale,
            "to_target_s": None if target_at is None else target_at - step_at,
            "to_ready_s": None if ready_at is None else ready_at - step_at,
        }
    finally:
        stop.set()
        try:
            run_cli(env, "down", "--all", timeout=60)
        finally:
            info = read_info(home)
            run_cli(env, "daemon", "stop", timeout=60)
            if info and _alive(int(info["pid"])):
                os.kill(int(info["pid"]), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1 / 20, help="time scale of both configs")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rate", type=float, default=25.0, help="req/s of the load step")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/autoscale.json")
    args = parser.parse_args()
    configs = [("corral (5 s decisions)", 5.0), ("SkyServe defaults (20 s decisions)", 20.0)]
    runs = []
    for rep in range(args.reps):
        for label, decision in configs if rep % 2 == 0 else reversed(configs):
            result = one_run(label.split()[0].lower(), decision, args.scale, args.rate)
            result["config"] = label
            runs.append(result)
            print(json.dumps(result), flush=True)
    print(f"\nload step: 1 -> {args.rate:g} req/s, target_qps_per_replica 5 (wants 3 replicas);")
    print(f"times scaled by {args.scale:g}; medians of {args.reps} runs\n")
    print("| config | decision s | upscale delay s | to target 3, s | to 3 READY, s |")
    print("|---|---|---|---|---|")
    medians = {}
    for label, _ in configs:
        mine = [r for r in runs if r["config"] == label]
        to_target = statistics.median(r["to_target_s"] or float("nan") for r in mine)
        to_ready = statistics.median(r["to_ready_s"] or float("nan") for r in mine)
        medians[label] = to_ready
        print(
            f"| {label} | {mine[0]['decision_interval_s']:g} | {mine[0]['upscale_delay_s']:g} "
            f"| {to_target:.2f} | {to_ready:.2f} |"
        )
    corral, sky = (medians[label] for label, _ in configs)
    print(f"\nSkyServe-default reaction / corral reaction: {sky / corral:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"scale": args.scale, "rate": args.rate, "runs": runs}, indent=2)
    )


if __name__ == "__main__":
    main()
