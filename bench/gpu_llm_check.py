"""One real small model through corral, where a GPU exists (docs/llm.md).

On a GPU machine with vLLM installed and the model's weights in the Hugging Face cache (corral
downloads nothing): a throwaway home brings up ``examples/vllm.yaml`` (Qwen2.5-0.5B-Instruct
under ``prefix_affinity``), sends a few multi-turn conversations (streamed, a new connection
per turn), and checks that every answer is a real completion, that later turns hit the engine's
prefix cache, and that ``corral status --json`` shows the TTFT and the engine's signals. Exit 1
when a check fails. Writes ``bench/results/gpu_llm_check.json``.

Where there is no GPU, no vLLM or no cached weights (this project's machines and CI), it says
which and exits 0: nothing here can stand in for a real engine on a GPU.

    .venv/bin/python bench/gpu_llm_check.py [--conversations 4] [--turns 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import urllib.request
from typing import Any

from _ctrl_harness import REPO, corral_home, progress

from corral.infra.inventory import read_nvml
from corral.model_engines import local_weights

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
SPEC = REPO / "examples" / "vllm.yaml"
RESULTS = REPO / "bench" / "results"


def missing() -> str | None:
    """Why this machine cannot run the check, or None."""
    gpus, why = read_nvml()
    if not gpus:
        return f"no GPU ({why or 'NVML sees none'})"
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed for {sys.executable}"
    if local_weights(MODEL) is None:
        return f"{MODEL} is not in the Hugging Face cache (huggingface-cli download {MODEL})"
    return None


def turn(endpoint: str, messages: list[dict[str, str]]) -> tuple[str, float, int]:
    """One streamed turn: the answer's text, the client's TTFT, the prompt's cached tokens."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 32,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        endpoint + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start, first, text, cached = time.monotonic(), 0.0, [], 0
    with urllib.request.urlopen(request, timeout=120) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event: dict[str, Any] = json.loads(line[6:])
            first = first or time.monotonic() - start
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
            usage = event.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
    return "".join(text), first, cached


def check(conversations: int, turns: int) -> dict[str, Any]:
    problems: list[str] = []
    report: dict[str, Any] = {"model": MODEL, "turns": []}
    with corral_home("gpu-llm", problems) as h:
        up = h.cli("up", str(SPEC), "-y", timeout=1800)
        if up.returncode != 0:
            raise SystemExit(f"corral up failed:\n{up.stdout}{up.stderr}")
        status = json.loads(h.cli("status", "--json", "vllm").stdout)["services"][0]
        endpoint = status["endpoint"]
        system = "You are a terse assistant. Answer in one sentence. " * 20
        for c in range(conversations):
            messages = [{"role": "system", "content": system}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"Conversation {c}, question {t}?"})
                text, ttft, cached = turn(endpoint, messages)
                report["turns"].append({"conv": c, "turn": t, "ttft": ttft, "cached": cached})
                if not text.strip():
                    problems.append(f"conversation {c} turn {t}: an empty answer")
                if t and cached == 0:
                    problems.append(f"conversation {c} turn {t}: no cached prefix")
                messages.append({"role": "assistant", "content": text})
        time.sleep(2)  # one report of the workers' engine reads
        status = json.loads(h.cli("status", "--json", "vllm").stdout)["services"][0]
        report["llm"] = status["llm"]
        if not (status["llm"] and status["llm"]["streams"]):
            problems.append("status --json shows no streamed answers")
        h.cli("down", "vllm", "-y", timeout=300)
    report["problems"] = problems
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    why = missing()
    if why is not None:
        print(f"gpu_llm_check: skipped: {why}")
        return
    report = check(args.conversations, args.turns)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_llm_check.json").write_text(json.dumps(report, indent=2))
    ttfts = sorted(t["ttft"] for t in report["turns"])
    progress(f"{len(ttfts)} turns, client TTFT median {ttfts[len(ttfts) // 2] * 1000:.0f} ms")
    print(json.dumps(report["llm"], indent=2))
    for problem in report["problems"]:
        print(f"FAILED: {problem}")
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
