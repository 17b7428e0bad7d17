"""Where a chat run's prefix-cache misses go, router by router.

Why: a fleet's hit rate is one number; to know what a router could still win, and at what price
in balance, the misses have to be split by cause. Each request of bench/llm_routing.py's chat
workload (conversations over ``--system-prompts`` shared ~600-token system prompts, 5 by
default; streamed, a new connection per turn) asks the engine for its usage, so the engine's
own count of cached tokens is known per request. A miss is then one of:

* **first placement**: a conversation's first turn on an engine that never served its system
  prompt in this run (the system prompt is computed there once);
* **moved**: a later turn on another engine than the previous turn's (the history is
  computed again);
* **new text**: the rest, what no router can cache (each turn's new message, the previous
  answer where the engine did not write it, the partial last block).

Run: ``.venv/bin/python bench/llm_chat_misses.py [--rate 20] [--rounds 2] [--routers ...]``
(same fleet and workload as bench/llm_routing.py's chat; about 1 min per router and round).
Prints a table per round and writes bench/results/llm_chat_misses.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import llm_routing as lr

from corral.balancer.http1 import ChunkedDecoder
from corral.llmsim import EngineConfig

RESULTS = lr.HERE / "results" / "llm_chat_misses.json"
DEFAULT_ROUTERS = (
    "corral round_robin,corral prefix_affinity,corral prefix_aff x2,sglang cache_aware"
)


async def ask(port: int, body: dict[str, Any], session: str) -> tuple[str, str, dict[str, Any]]:
    """One streamed chat request with usage: (answer, engine, usage)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {lr.HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"Connection: close\r\nX-Session-ID: {session}\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(lr.HOST, port)
    try:
        writer.write(head.encode() + payload)
        raw = await reader.read(-1)
    finally:
        writer.close()
    end = raw.find(b"\r\n\r\n")
    data = raw[end + 4 :]
    if b"transfer-encoding: chunked" in raw[:end].lower():
        pieces, _, _ = ChunkedDecoder().feed(data)
        data = b"".join(pieces)
    text, engine, usage = [], "", {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        chunk = json.loads(line[5:])
        engine = engine or chunk.get("model", "")
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or "")
    if not usage:
        raise RuntimeError(f"no usage in the answer: {raw[:300]!r}")
    return "".join(text), engine, usage


async def play(port: int, args: argparse.Namespace, seed: str) -> list[dict[str, Any]]:
    """The chat workload of bench/llm_routing.py; one row per request."""
    shape, text = random.Random(seed), random.Random(f"{seed}/{port}")
    systems = [lr.words(text, 600) for _ in range(args.system_prompts)]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter() + 0.05

    async def conversation(offset: float, family: int, users: list[str], thinks: list[float]):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        conv = f"{seed}-{offset}"
        messages = [{"role": "system", "content": systems[family]}]
        for turn, (user, think) in enumerate(zip(users, thinks, strict=True)):
            messages.append({"role": "user", "content": user})
            body = {"model": lr.MODEL, "messages": messages, "max_tokens": args.max_tokens}
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            answer, engine, usage = await ask(port, body, conv)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            rows.append(
                {"conv": conv, "family": family, "turn": turn, "engine": engine,
                 "prompt": usage["prompt_tokens"], "cached": cached, "at": time.perf_counter()}
            )  # fmt: skip
            messages = [*messages, {"role": "assistant", "content": answer}]
            await asyncio.sleep(think)

    tasks, offset = [], 0.0
    for _ in range(args.conversations):
        offset += shape.expovariate(args.rate / args.turns)
        family = shape.randrange(args.system_prompts)
        users = [lr.words(text, shape.randint(40, 100)) for _ in range(args.turns)]
        thinks = [shape.expovariate(1 / args.think) for _ in range(args.turns)]
        tasks.append(asyncio.create_task(conversation(offset, family, users, thinks)))
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return rows


def causes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Missed prompt tokens by cause, as fractions of all prompt tokens."""
    rows = sorted(rows, key=lambda r: r["at"])
    placed: set[tuple[int, str]] = set()
    last: dict[str, str] = {}
    missed: Counter[str] = Counter()
    served: Counter[str] = Counter()
    for row in rows:
        served[row["engine"]] += 1
        if row["turn"] == 0:
            first = (row["family"], row["engine"]) not in placed
            placed.add((row["family"], row["engine"]))
            cause = "first placement" if first else "new text"
        else:
            cause = "moved" if last[row["conv"]] != row["engine"] else "new text"
        last[row["conv"]] = row["engine"]
        missed[cause] += row["prompt"] - row["cached"]
    total = sum(r["prompt"] for r in rows)
    return {
        "requests": len(rows),
        "hit": sum(r["cached"] for r in rows) / total,
        "placements": len(placed),
        "max_share": max(served.values()) / len(rows),
        **{k: missed[k] / total for k in ("first placement", "moved", "new text")},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=20.0, help="offered req/s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--routers", default=DEFAULT_ROUTERS, help="row names of llm_routing.py")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument(
        "--system-prompts",
        type=int,
        default=lr.SYSTEM_PROMPTS,
        help="shared system prompts (prompt families)",
    )
    p.add_argument("--think", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--cache-blocks", type=int, default=1536)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    specs = [s for s in lr.default_specs() if s.name in names]
    if "sglang" in args.routers:
        lr.ensure_peers()
    started: list[Any] = []
    out: list[dict[str, Any]] = []
    head = f"{'router':24} {'round':>5} {'hit':>6} {'placed':>6} {'first':>6} {'moved':>6}"
    head += f" {'new':>6} {'share':>6}"
    try:
        with tempfile.TemporaryDirectory(prefix="llm-misses-") as tmp_name:
            tmp = Path(tmp_name)
            fleet = lr.start_fleet(EngineConfig(cache_blocks=args.cache_blocks), tmp, started)
            urls = [engine.url for engine in fleet]
            routers = [lr.start_router(spec, urls, tmp, None, started) for spec in specs]
            print("missed prompt tokens by cause, as fractions of all prompt tokens")
            print(head)
            for rnd in range(args.rounds):
                for router in routers:
                    rows = asyncio.run(play(router.port, args, f"misses-{rnd}"))
                    row = {"router": router.spec.name, "round": rnd + 1, **causes(rows)}
                    out.append(row)
                    print(
                        f"{row['router']:24} {rnd + 1:>5} {row['hit']:6.3f} {row['placements']:>6}"
                        f" {row['first placement']:6.3f} {row['moved']:6.3f}"
                        f" {row['new text']:6.3f} {row['max_share']:6.2f}",
                        flush=True,
                    )
    finally:
        for proc in started:
            lr.end_tree(proc, grace=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "runs": out}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
