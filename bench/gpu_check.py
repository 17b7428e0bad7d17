"""GPU check and placement timing (issue 15).

Where NVML sees GPUs (a real GPU machine): a throwaway corral home brings up a service with one
replica per GPU (``accelerators: GPU:1``); each replica (``bench/_gpu_replica.py``) reports its
``CUDA_VISIBLE_DEVICES``, the devices the CUDA driver shows it and NVML's names, and the check
passes when every replica sees exactly its own device, by UUID, and no device is given twice.
Exit 1 when it does not.

Where NVML sees none (this project's machines and CI): it says so and exits 0; the timings it
prints then come from a DECLARED inventory (``CORRAL_INVENTORY``, fake devices), labelled so:
they time corral's placement, not a device.

Timed either way: ``place()`` alone (pure, per call), ``Capacity.grant`` (placement plus its
SQLite transaction, per replica), and the end-to-end ``corral up`` of N GPU replicas to READY.
Writes ``bench/results/gpu_check.json``.

    .venv/bin/python bench/gpu_check.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _ctrl_harness import PYTHON, REPO, corral_home, progress, ready_count

from corral.capacity import Capacity, Grant
from corral.infra.inventory import Gpu, Inventory, load_inventory, read_nvml
from corral.infra.placement import Claim, Holder, ask_of, place
from corral.state import Store

RESULTS = REPO / "bench" / "results"
REPLICA = REPO / "bench" / "_gpu_replica.py"


def declared_inventory() -> Inventory:
    gpus = tuple(
        Gpu(i, "NVIDIA H100 80GB HBM3" if i < 4 else "NVIDIA L4", f"GPU-declared-{i}")
        for i in range(8)
    )
    return Inventory(gpus, 64, 512 * 1024**3, (), "declared (fake devices)")


def time_place(inventory: Inventory, rounds: int) -> dict[str, float]:
    """Microseconds per ``place()`` call with half the devices held."""
    half = inventory.gpus[: len(inventory.gpus) // 2]
    holders = [Holder("other", i, Claim(gpus={g.address: 1.0})) for i, g in enumerate(half)]
    ask = ask_of({"accelerators": ["H100:1", "L4:1", "GPU:1"], "cpus": 1})
    start = time.perf_counter()
    for _ in range(rounds):
        place(ask, inventory, holders)
    return {"place_us": (time.perf_counter() - start) / rounds * 1e6, "holders": len(holders)}


def time_grant(inventory: Inventory) -> dict[str, float]:
    """Milliseconds per ``Capacity.grant`` (one SQLite transaction) until the machine is full."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "state.db")
        store.create_service("bench", "run: x\n", source=None, base_dir=None, lb_port=None)
        capacity = Capacity(store, inventory)
        times = []
        for _ in inventory.gpus:
            row = store.add_replica("bench", 1, "local", "bench")
            start = time.perf_counter()
            granted = capacity.grant(row.id, {"accelerators": ["GPU:1"]})
            times.append(time.perf_counter() - start)
            assert isinstance(granted, Grant), granted
        store.close()
    return {"grant_ms_mean": sum(times) / len(times) * 1e3, "grant_ms_max": max(times) * 1e3}


def spec(name: str, replicas: int) -> str:
    return (
        f"name: {name}\n"
        f"run: {json.dumps(f'exec {PYTHON} {REPLICA}')}\n"
        "resources:\n  accelerators: GPU:1\n"
        "service:\n  readiness_probe:\n    path: /health\n    period_seconds: 0.2\n"
        "    initial_delay_seconds: 120\n"
        f"  replicas: {replicas}\n"
    )


def up_and_check(replicas: int, real: bool, problems: list[str]) -> dict[str, Any]:
    """``corral up`` of one replica per device; the seconds to READY and every report."""
    with corral_home("gpu", problems) as h:
        path = h.root / "gpu.yaml"
        path.write_text(spec("gpu", replicas))
        start = time.perf_counter()
        result = h.cli("up", "-d", str(path))
        if result.returncode != 0:
            raise RuntimeError(f"corral up failed: {result.stderr}")
        h.wait_until(
            lambda services: bool(services) and ready_count(services[0]) == replicas,
            timeout=180,
        )
        seconds = time.perf_counter() - start
        service = h.service("gpu") or {}
        reports = []
        for r in service.get("replicas", []):
            reports.append(
                {
                    "replica": r["id"],
                    "assigned": [g["uuid"] for g in (r["devices"] or {}).get("gpus", [])],
                    "report": _get(r["endpoint"] + "/report") if real else _get(r["endpoint"]),
                }
            )
        h.down_all(problems)
    return {"seconds_to_ready": seconds, "reports": reports}


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as response:  # 127.0.0.1 only
        return dict(json.loads(response.read()))


def verify(reports: list[dict[str, Any]], real: bool) -> list[str]:
    """What is wrong with the replicas' reports (empty: the check passed)."""
    wrong = []
    given = [r["report"]["given"] for r in reports]
    if len(set(given)) != len(given):
        wrong.append(f"a device was given twice: {given}")
    for r in reports:
        rep = r["report"]
        if rep["given"] != ",".join(r["assigned"]):
            wrong.append(f"replica {r['replica']}: given {rep['given']}, status {r['assigned']}")
        if real:
            cuda = rep.get("cuda", {})
            if cuda.get("uuids") != r["assigned"]:
                wrong.append(f"replica {r['replica']}: CUDA shows {cuda}, assigned {r['assigned']}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    gpus, why = read_nvml()
    real = bool(gpus)
    if real:
        inventory = load_inventory()
        label = f"real: {len(gpus)} GPU(s) seen by NVML"
    else:
        progress(f"NVML sees no GPU here ({why}): the device check needs a GPU machine.")
        progress("Timing placement on a DECLARED inventory of 8 fake GPUs instead.")
        inventory = declared_inventory()
        label = "declared: 8 fake GPUs (CORRAL_INVENTORY), no device verified"
    out: dict[str, Any] = {"source": label, "nvml": why, "inventory": inventory.to_json()}
    out.update(time_place(inventory, args.rounds))
    out.update(time_grant(inventory))
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not real:
            path = Path(tmp) / "inventory.yaml"
            path.write_text(json.dumps({"gpus": [g.to_json() for g in inventory.gpus]}))
            os.environ["CORRAL_INVENTORY"] = str(path)
        replicas = min(len(inventory.gpus), 8)
        run = up_and_check(replicas, real, problems)
    out["up_replicas"] = replicas
    out["up_seconds_to_ready"] = run["seconds_to_ready"]
    wrong = verify(run["reports"], real)
    out["check"] = wrong or "passed"
    out["cleanup_problems"] = problems
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_check.json").write_text(json.dumps(out, indent=2))
    print(f"| figure ({label}) | value |\n|---|---|")
    print(f"| place() with {out['holders']} holders | {out['place_us']:.1f} us |")
    print(
        f"| Capacity.grant (SQLite) mean / max | {out['grant_ms_mean']:.2f} / "
        f"{out['grant_ms_max']:.2f} ms |"
    )
    print(f"| corral up of {replicas} GPU:1 replicas to READY | {run['seconds_to_ready']:.2f} s |")
    what = "devices seen by CUDA in each replica" if real else "CUDA_VISIBLE_DEVICES only"
    print(f"| check ({what}) | {'passed' if not wrong else 'FAILED'} |")
    for line in wrong + problems:
        print(f"  {line}")
    return 1 if wrong and real else 0


if __name__ == "__main__":
    sys.exit(main())
