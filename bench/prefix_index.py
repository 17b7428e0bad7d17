"""Prefix indexes for LLM routing: chained block hashes against a character radix tree.

Why: a prefix-aware policy looks up every request's prompt in its index of what each replica
was sent, and records it, on the balancer's event loop. Two structures do that job in the
routers this project measures itself against: vLLM-style chained block hashes
(``corral.balancer.prefix.PrefixIndex``: one hash per 64-byte block, a dict from hash to a
bitmask of replicas, LRU per replica) and SGLang router's approximate radix tree of request
text (one tree for all replicas, a last-access time per replica on each node, the least
recently used leaves evicted per replica). This script times both on the same requests and
measures their memory, which decided the default; both are exact to their granularity (the
tree to the character, the hashes to the block), checked here to agree when nothing is
evicted.

Workloads, per prompt size L (1k, 4k, 16k characters), each conversation starting from one of
8 shared system prompts of L/4 characters, each request one turn of a random conversation (its
whole history plus a new message, the reply added to the history after it), a conversation
that would outgrow L replaced by a new one:

* ``chat``: 64 conversations, turns of L/16 characters (few long turns);
* ``agent``: 64 conversations, steps of L/128 characters (many short tool calls and results);
* ``typing``: 4 documents sent as ``/v1/completions`` prompts growing by 8 characters a
  request (an editor's autocomplete).

Requests are real bodies read by ``corral.balancer.prompt.extract_prompt``; each goes to one of
4 replicas by rendezvous hashing of its conversation's anchor (the same choice for both
structures). Each replica's index holds 16 x L characters (in blocks; the tree in
characters), less than its conversations send, so eviction runs during the measured requests.

Per request, timed: the hashes, then match and insert for the hash index; match and insert
for the tree (its eviction inline, where SGLang's router runs it on a timer thread). Memory:
tracemalloc of each structure after the L = 4k workload with no bound, per 1,000 64-character
blocks held (summed over replicas; the tree's per replica characters / 64).

Run: ``python bench/prefix_index.py [--requests N] [--rounds R]``. Prints a table (median over
the rounds of mean and p99 microseconds per request) and writes ``bench/results/prefix_index.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from corral.balancer.prefix import PrefixIndex, rendezvous_order, stable_key  # noqa: E402
from corral.balancer.prompt import extract_prompt, prompt_anchor  # noqa: E402

RESULTS = HERE / "results" / "prefix_index.json"
SIZES = (1000, 4000, 16000)
# name -> (characters a turn adds, as a function of L; conversations; chat or completions)
WORKLOADS: dict[str, tuple[Callable[[int], int], int, bool]] = {
    "chat": (lambda size: size // 16, 64, True),  # few long turns
    "agent": (lambda size: size // 128, 64, True),  # many short steps (tool calls, results)
    "typing": (lambda size: 4, 4, False),  # a few documents growing by keystrokes (autocomplete)
}
BLOCK = 64
# Each replica's index holds 16 prompts of the largest size (the 64 conversations hold more).
BUDGET_PROMPTS = 16
REPLICAS = (0, 1, 2, 3)
CHAT = "/v1/chat/completions"


class _Node:
    __slots__ = ("children", "label", "parent", "tenants")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[int, int] = {}  # replica -> tick of its last insert through here


def _common(text: str, pos: int, label: str) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``label`` (binary search in C)."""
    lo, hi = 0, min(len(label), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """SGLang router's approximate tree, in Python: characters, all replicas in one tree,
    per-replica size in characters, least recently used leaves evicted per replica (to 90% of
    the bound once over it, so the leaf scan is paid once per tenth of the budget)."""

    def __init__(self, max_chars: int) -> None:
        self.root = _Node("", None)
        self.max_chars = max_chars
        self.size: dict[int, int] = {}
        self.tick = 0

    def match(self, text: str) -> dict[int, int]:
        result: dict[int, int] = {}
        node, pos, n = self.root, 0, len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            label = child.label
            k = len(label) if text.startswith(label, pos) else _common(text, pos, label)
            for tenant in child.tenants:
                result[tenant] = pos + k
            if k < len(label):
                break
            node, pos = child, pos + k
        return result

    def insert(self, tenant: int, text: str) -> None:
        self.tick += 1
        tick, node, pos, n = self.tick, self.root, 0, len(text)
        size = self.size.get(tenant, 0)
        node.tenants[tenant] = tick
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                child = node.children[text[pos]] = _Node(text[pos:], node)
            elif not text.startswith(child.label, pos):
                child = self._split(node, child, _common(text, pos, child.label))
            if tenant not in child.tenants:
                size += len(child.label)
            child.tenants[tenant] = tick
            node, pos = child, pos + len(child.label)
        self.size[tenant] = size
        if size > self.max_chars:
            self._evict(tenant)

    @staticmethod
    def _split(parent: _Node, child: _Node, k: int) -> _Node:
        mid = _Node(child.label[:k], parent)
        mid.tenants = dict(child.tenants)
        child.label = child.label[k:]
        child.parent = mid
        mid.children[child.label[0]] = child
        parent.children[mid.label[0]] = mid
        return mid

    def _evict(self, tenant: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if tenant in c.tenants]
            if kids:
                stack.extend(kids)
            elif node is not self.root:
                heap.append((node.tenants[tenant], id(node), node))
        heapq.heapify(heap)
        size, target = self.size[tenant], self.max_chars * 9 // 10
        while size > target and heap:
            node = heapq.heappop(heap)[2]
            del node.tenants[tenant]
            size -= len(node.label)
            parent = node.parent
            assert parent is not None
            if not node.tenants:
                del parent.children[node.label[0]]
            if parent is not self.root and not any(
                tenant in c.tenants for c in parent.children.values()
            ):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        self.size[tenant] = size


_LETTERS = "etaoinshrdlucmfwypvbgk"
_VOCAB = [
    "".join(random.Random(i).choices(_LETTERS, k=random.Random(-i).randint(1, 9)))
    for i in range(2000)
]


def _words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    total = 0
    while total < chars:
        word = rng.choice(_VOCAB)
        out.append(word)
        total += len(word) + 1
    return " ".join(out)[:chars]


def workload(
    size: int, count: int, turn: int, conversations: int, chat: bool, seed: int = 1
) -> list[tuple[bytes, str, int]]:
    """``count`` requests of at most about ``size`` characters: (body, text, replica).

    Chat requests, each turn adding a user message and then a reply of ``turn`` characters;
    or completions of documents growing by ``2 * turn`` characters.
    """
    rng = random.Random(seed)
    systems = [_words(rng, size // 4) for _ in range(8)]
    histories = [[rng.choice(systems)] for _ in range(conversations)]
    out = []
    while len(out) < count:
        i = rng.randrange(conversations)
        if sum(map(len, histories[i])) + 2 * turn > size:
            histories[i] = [rng.choice(systems)]
        history = histories[i]
        history.append(_words(rng, turn))
        if chat:
            roles = ["system"] + ["user", "assistant"] * len(history)
            messages = [{"role": r, "content": c} for r, c in zip(roles, history, strict=False)]
            path, doc = CHAT, {"model": "m", "messages": messages, "stream": True}
        else:
            path, doc = "/v1/completions", {"model": "m", "prompt": " ".join(history)}
        body = json.dumps(doc).encode()
        text = extract_prompt(path, body)
        assert text is not None
        anchor = prompt_anchor(path, body, text, 1024)
        out.append((body, text, rendezvous_order(stable_key(anchor), REPLICAS)[0]))
        history.append(_words(rng, turn))
    return out


def _timed(requests: list[tuple[bytes, str, int]], step: Callable[[str, int], Any]) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for _, text, rid in requests:
        started = clock()
        step(text, rid)
        out.append((clock() - started) / 1000)
    return out


def run_hash(requests: list[tuple[bytes, str, int]], budget: int) -> list[float]:
    index = PrefixIndex(block_chars=BLOCK, max_blocks_per_replica=budget)

    def step(text: str, rid: int) -> None:
        hashes = index.hashes(text)
        index.match(hashes)
        index.insert(rid, hashes)

    return _timed(requests, step)


def run_hashes_only(requests: list[tuple[bytes, str, int]], budget: int) -> list[float]:
    index = PrefixIndex(block_chars=BLOCK, max_blocks_per_replica=budget)
    return _timed(requests, lambda text, rid: index.hashes(text))


def run_radix(requests: list[tuple[bytes, str, int]], budget: int) -> list[float]:
    tree = RadixTree(max_chars=budget * BLOCK)

    def step(text: str, rid: int) -> None:
        tree.match(text)
        tree.insert(rid, text)

    return _timed(requests, step)


def run_extract(requests: list[tuple[bytes, str, int]], budget: int) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for body, _, _ in requests:
        started = clock()
        extract_prompt(CHAT, body)  # any path: the body's field decides
        out.append((clock() - started) / 1000)
    return out


RUNS = {"extract": run_extract, "hashes": run_hashes_only, "hash": run_hash, "radix": run_radix}


def agreement(requests: list[tuple[bytes, str, int]]) -> float:
    """Share of requests on which both structures, unbounded, report the same whole blocks
    matched on every replica."""
    index = PrefixIndex(block_chars=BLOCK, max_blocks_per_replica=1 << 30)
    tree = RadixTree(max_chars=1 << 40)
    same = 0
    for _, text, rid in requests:
        hashes = index.hashes(text)
        by_blocks = index.match(hashes)
        by_chars = {r: c // BLOCK for r, c in tree.match(text).items() if c >= BLOCK}
        same += by_blocks == by_chars
        index.insert(rid, hashes)
        tree.insert(rid, text)
    return same / len(requests)


def memory(requests: list[tuple[bytes, str, int]]) -> dict[str, float]:
    """Bytes per 1,000 cached blocks of each structure, filled by ``requests`` unbounded."""
    out = {}
    for name in ("hash", "radix"):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        if name == "hash":
            index = PrefixIndex(block_chars=BLOCK, max_blocks_per_replica=1 << 30)
            for _, text, rid in requests:
                index.insert(rid, index.hashes(text))
            blocks = sum(index.size(r) for r in REPLICAS)
        else:
            tree = RadixTree(max_chars=1 << 40)
            for _, text, rid in requests:
                tree.insert(rid, text)
            blocks = sum(tree.size.values()) // BLOCK
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out[f"{name}_bytes_per_1k_blocks"] = used / blocks * 1000
        out[f"{name}_blocks"] = blocks
    return out


def measure(requests: list[tuple[bytes, str, int]], budget: int, rounds: int) -> dict[str, Any]:
    """Mean and p99 microseconds per request of each step, median over ``rounds``."""
    means: dict[str, list[float]] = {name: [] for name in RUNS}
    p99s: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(rounds):  # rounds outside: a busy moment of the machine hits every step
        for name, run in RUNS.items():
            times = sorted(run(requests, budget))
            means[name].append(statistics.mean(times))
            p99s[name].append(times[int(len(times) * 0.99)])
    per = {
        name: {"mean_us": statistics.median(means[name]), "p99_us": statistics.median(p99s[name])}
        for name in RUNS
    }
    return {
        "budget_blocks": budget,
        "mean_prompt_chars": statistics.mean(len(t) for _, t, _ in requests),
        "agreement_unbounded": agreement(requests),
        "us": per,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per workload and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results: dict[str, Any] = {"python": sys.version.split()[0], "workloads": {}}
    for kind, (turn, conversations, chat) in WORKLOADS.items():
        for size in SIZES:
            requests = workload(size, args.requests, turn(size), conversations, chat)
            budget = size * BUDGET_PROMPTS // BLOCK
            row = results["workloads"][f"{kind} {size}"] = measure(requests, budget, args.rounds)
            print(f"{kind} {size}: {row['mean_prompt_chars']:.0f} chars", file=sys.stderr)
    results["memory"] = {
        kind: memory(workload(4000, args.requests, turn(4000), conversations, chat))
        for kind, (turn, conversations, chat) in WORKLOADS.items()
    }
    results.update(requests=args.requests, rounds=args.rounds)
    _print(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _print(results: dict[str, Any]) -> None:
    print(
        f"us per request, mean / p99 (median of {results['rounds']} rounds of "
        f"{results['requests']}); 4 replicas, each {BUDGET_PROMPTS} x L chars in blocks of {BLOCK}"
    )
    print("| workload, prompt <= | mean chars | extract | hashes | hash index | radix | agree |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results["workloads"].items():
        cells = [f"{row['us'][k]['mean_us']:.1f} / {row['us'][k]['p99_us']:.1f}" for k in RUNS]
        print(
            f"| {name} | {row['mean_prompt_chars']:.0f} | "
            + " | ".join(cells)
            + f" | {row['agreement_unbounded']:.0%} |"
        )
    print("memory per 1k cached blocks (L=4k, unbounded):")
    for kind, mem in results["memory"].items():
        print(
            f"  {kind}: hash index {mem['hash_bytes_per_1k_blocks'] / 1024:.0f} KiB "
            f"({mem['hash_blocks']} blocks), radix tree "
            f"{mem['radix_bytes_per_1k_blocks'] / 1024:.0f} KiB ({mem['radix_blocks']} blocks)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
