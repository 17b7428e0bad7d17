"""The per-replica limit through a hand-over: what the engines hold while a balancer is replaced.

Why: ``max_in_flight_per_replica`` keeps requests in the balancer instead of an engine's queue.
Two moments replace a service's balancer while its requests run: ``corral daemon
restart-workers`` (a new worker process per slot, the old one draining) and an update of a
balancer setting (a new balancer in each worker, the old one retired). This measures the most
requests each engine held (vLLM's ``num_requests_running`` plus ``num_requests_waiting``, read
from its own ``/metrics`` every 20 ms) in each phase of a run, against the limit.

What runs: a real daemon in a temporary home with 2 balancer workers, a service of 2
``corral.llmsim`` engines (``--max-batch 8``) with the limit (default 4) and a 60 s hold,
``--clients`` closed-loop clients each streaming ``/v1/completions`` of ``--max-tokens`` tokens
on 127.0.0.1. Phases: ``steady`` (8 s), ``restart-workers`` (until the command returns),
``between`` (4 s), ``update`` (a hold of 61 s in place of 60, until it returns, then 8 s more)
and ``after``. Bounded: the clients stop after ``--seconds``. ``--compare SRC`` runs the same
with the engine from another source tree (a worktree's ``src/``) first, in the same run.

Run: ``.venv/bin/python bench/handover_limit.py [--clients 16] [--compare /tmp/before/src]``.
Prints each phase's peak per engine and every answer's status; writes
``bench/results/handover_limit.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "handover_limit.json"
SPEC = """name: ho
run: >-
  exec {python} -m corral.llmsim --host 127.0.0.1 --port $PORT --model sim-llm
  --max-batch 8 --step-base-ms 10 --step-per-seq-ms 1 --prefill-per-token-ms 0.2
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 30
    period_seconds: 1
  replicas: 2
  load_balancer:
    max_in_flight_per_replica: {limit}
    hold_timeout_seconds: {hold}
    drain_timeout_seconds: 30
"""


def corral(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "corral", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


async def client(url: str, stop: float, tokens: int, answers: dict[str, int]) -> None:
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop:
            body = {"model": "sim-llm", "prompt": f"q {time.monotonic_ns()}", "stream": True}
            body["max_tokens"] = tokens
            try:
                timeout = aiohttp.ClientTimeout(total=90)
                async with session.post(f"{url}/v1/completions", json=body, timeout=timeout) as r:
                    await r.read()
                    key = str(r.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                key = type(exc).__name__
            answers[key] = answers.get(key, 0) + 1


async def watch(engines: list[str], stop: float, phase: list[str], peaks: dict[str, Any]) -> None:
    """The most requests each engine holds, per phase, from its own metrics."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop:
            for i, url in enumerate(engines):
                try:
                    async with session.get(f"{url}/metrics") as r:
                        text = await r.text()
                except aiohttp.ClientError:
                    continue
                held = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                )
                row = peaks.setdefault(phase[0], [0.0] * len(engines))
                row[i] = max(row[i], held)
            await asyncio.sleep(0.02)


async def scenario(env: dict[str, str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    status = json.loads(corral(env, "status", "ho", "--json").stdout)["services"][0]
    engines = [r["endpoint"] for r in status["replicas"] if r["status"] == "READY"]
    stop = time.monotonic() + args.seconds
    answers: dict[str, int] = {}
    peaks: dict[str, Any] = {}
    phase = ["steady"]
    tasks = [
        asyncio.create_task(client(status["endpoint"], stop, args.max_tokens, answers))
        for _ in range(args.clients)
    ]
    tasks.append(asyncio.create_task(watch(engines, stop, phase, peaks)))
    await asyncio.sleep(8)
    phase[0] = "restart-workers"
    await asyncio.to_thread(corral, env, "daemon", "restart-workers")
    phase[0] = "between"
    await asyncio.sleep(4)
    phase[0] = "update"
    await asyncio.to_thread(corral, env, "update", "ho", str(work / "spec2.yaml"))
    await asyncio.sleep(8)
    phase[0] = "after"
    await asyncio.gather(*tasks)
    return {"peaks": peaks, "answers": answers}


def run_one(source: str | None, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="corral-handover-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "CORRAL_HOME": str(work / "home"), "CORRAL_BALANCER_WORKERS": "2"}
        if source:
            env["PYTHONPATH"] = source
        for name, hold in (("spec.yaml", 60), ("spec2.yaml", 61)):
            text = SPEC.format(python=sys.executable, limit=args.limit, hold=hold)
            (work / name).write_text(text)
        try:
            up = corral(env, "up", str(work / "spec.yaml"), "--timeout", "120")
            if up.returncode:
                raise SystemExit(f"up failed: {up.stderr}")
            return asyncio.run(scenario(env, args, work))
        finally:
            corral(env, "down", "ho")
            corral(env, "daemon", "stop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=45.0, help="how long the clients run")
    parser.add_argument("--compare", metavar="SRC", help="another tree's src/, run first")
    args = parser.parse_args()
    runs = {}
    for name, source in ((("before", args.compare),) if args.compare else ()) + (("now", None),):
        runs[name] = run_one(source, args)
    print(f"limit {args.limit} per engine, {args.clients} clients, {args.max_tokens} tokens each")
    print("| run | phase | peak per engine (running + waiting) |\n|---|---|---|")
    for name, run in runs.items():
        for phase, row in run["peaks"].items():
            print(f"| {name} | {phase} | {', '.join(f'{n:g}' for n in row)} |")
    for name, run in runs.items():
        print(f"{name}: answers {run['answers']}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
