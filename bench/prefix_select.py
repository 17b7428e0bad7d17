"""``prefix_affinity``'s choice per request, warm and with the caches cold, build by build.

Why: the policy's ``select`` reads the prompt from the body, hashes its blocks, matches and
records them in the index, and reads and writes the shared table, on the balancer's event
loop, once a request. Timed back to back it costs tens of microseconds; inside a router on a
busy machine it costs several times that (a throwaway timer around ``select`` in
``bench/_llm_lb.py`` during ``bench/llm_routing.py``'s control workload read 205 us a request
on 2026-12-06, where this script's warm loop reads about 50), because between two requests
the engines, the client and the kernel evict the router's code and data from the CPU caches.
So this script times each request twice: warm (back to back) and cold (64 MiB written between
requests, which empties the caches of these VMs), the second being what a router sees.

Workloads (each request a real body, read by the policy as a balancer worker hands it over):

* ``chat``: 100 conversations over 5 shared system prompts of ~2,400 characters, each turn
  the history plus an answer and a new message (``/v1/chat/completions``);
* ``rag``: questions after one of 4 shared documents of ~6,000 characters
  (``/v1/completions``);
* ``one-off``: prompts of ~3,400 characters that share nothing (``/v1/completions``).

The policy has the shared table (a temp file, as the data plane's) and 4 replicas; loads are
fixed, so every build makes the same choices. Targets: this tree as installed (its build, as
``corral.balancer.speedups`` chose it), ``pure`` (``CORRAL_BALANCER_PURE=1``) with
``--pure``, and any ``--compare NAME=SRC`` (a tree whose ``corral`` is run instead, through
PYTHONPATH; its compiled module must be built there). Each target runs in its own process,
interleaved over ``--rounds``.

Run: ``.venv/bin/python bench/prefix_select.py [--requests 600] [--rounds 3] [--pure]
[--compare before=/tmp/before/src]``. Prints a table (median over rounds of the mean
microseconds per request) and writes ``bench/results/prefix_select.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "prefix_select.json"
WORKLOADS = ("chat", "rag", "one-off")
THRASH_BYTES = 64 << 20


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 9)))
        for _ in range(count)
    )


def bodies(workload: str, requests: int, seed: int) -> list[tuple[bytes, bytes]]:
    """(target, body) of each request, the same for every target."""
    rng = random.Random(f"{workload}-{seed}")
    out: list[tuple[bytes, bytes]] = []
    if workload == "chat":
        systems = [_words(rng, 400) for _ in range(5)]
        chats: list[list[dict[str, str]]] = []
        while len(out) < requests:
            if len(chats) < 100 or rng.random() < 0.3:
                chats.append([{"role": "system", "content": rng.choice(systems)}])
            chat = rng.choice(chats)
            if len(chat) > 1:
                chat.append({"role": "assistant", "content": _words(rng, 60)})
            chat.append({"role": "user", "content": _words(rng, 40)})
            body = {"model": "m", "messages": chat, "stream": True}
            out.append((b"/v1/chat/completions", json.dumps(body).encode()))
            if len(chat) > 12:
                chats.remove(chat)
        return out
    documents = [_words(rng, 1000) for _ in range(4)]
    for _ in range(requests):
        if workload == "rag":
            prompt = rng.choice(documents) + "\nQuestion: " + _words(rng, 20)
        else:
            prompt = _words(rng, 560)
        body = {"model": "m", "prompt": prompt, "max_tokens": 16, "stream": True}
        out.append((b"/v1/completions", json.dumps(body).encode()))
    return out


def child(requests: int, seed: int) -> dict[str, Any]:
    """Run in the target's process: mean microseconds of ``select``, warm and cold."""
    from corral.balancer import speedups
    from corral.balancer.policies import RequestView
    from corral.balancer.routing import make_policy

    junk = bytearray(THRASH_BYTES)
    line = b"\x01" * (THRASH_BYTES // 64)
    result: dict[str, Any] = {"build": speedups.ACCELERATED}
    for workload in WORKLOADS:
        reqs = bodies(workload, requests, seed)
        for mode in ("warm", "cold"):
            with tempfile.TemporaryDirectory() as tmp:
                policy = make_policy("prefix_affinity", affinity_file=f"{tmp}/table")
                policy.update([1, 2, 3, 4], {})
                loads = {1: 1, 2: 2, 3: 0, 4: 1}
                total = 0
                for target, body in reqs:
                    view = RequestView(target=target, body=body, headers=b"")
                    if mode == "cold":
                        junk[::64] = line  # one write per cache line of 64 MiB
                    start = time.thread_time_ns()
                    policy.select([1, 2, 3, 4], loads, view)
                    total += time.thread_time_ns() - start
                result[f"{workload} {mode}"] = total / len(reqs) / 1000
    return result


def run_target(src: Path | None, pure: bool, requests: int, seed: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("CORRAL_BALANCER_PURE", None)
    if pure:
        env["CORRAL_BALANCER_PURE"] = "1"
    if src is not None:
        env["PYTHONPATH"] = str(src)
    argv = [sys.executable, __file__, "--child", "--requests", str(requests), "--seed", str(seed)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=600, help="per workload and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pure", action="store_true", help="add this tree's pure build")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=SRC")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.requests, args.seed)))
        return 0
    targets: list[tuple[str, Path | None, bool]] = [("corral", None, False)]
    if args.pure:
        targets.append(("corral pure", None, True))
    for item in args.compare:
        name, _, src = item.partition("=")
        targets.append((name, Path(src), False))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in targets}
    for r in range(args.rounds):
        for name, src, pure in targets[r % len(targets) :] + targets[: r % len(targets)]:
            runs[name].append(run_target(src, pure, args.requests, args.seed))
            print(f"round {r + 1}/{args.rounds} {name}", file=sys.stderr, flush=True)
    columns = [f"{w} {m}" for w in WORKLOADS for m in ("warm", "cold")]
    summary = {
        name: {c: statistics.median(run[c] for run in rs) for c in columns}
        | {"build": rs[0]["build"]}
        for name, rs in runs.items()
    }
    print(f"prefix_affinity select, us per request (median of {args.rounds} rounds)")
    print(f"{'target':<14}{'build':<10}" + "".join(f"{c:>14}" for c in columns))
    for name, row in summary.items():
        print(f"{name:<14}{row['build']:<10}" + "".join(f"{row[c]:>14.1f}" for c in columns))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/prefix_select.py " + " ".join(sys.argv[1:])
    result = {"command": command, "runs": runs, "summary": summary}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
