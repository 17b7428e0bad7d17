"""An OpenAI-compatible LLM engine SIMULATOR, for testing and benchmarking LLM routing on a
machine with no GPU and no model. It is not a model: its output is meaningless tokens.

What it reproduces is what a router's choices change: a prefix KV cache as vLLM keeps it
(chained block hashes, LRU eviction), continuous batching under a batch cap with a FIFO queue,
decode steps that slow as the batch grows, and prefill only of the prompt tokens not cached, all
on real time so a client's TTFT shows them. It serves OpenAI's ``/v1/completions`` and
``/v1/chat/completions``, SGLang's and TGI's ``/generate``, and vLLM's metric names. See
docs/llmsim.md. It imports nothing of corral's: a helper for tests and benchmarks, and an
example service (examples/llm-sim.yaml).

In this process::

    async with SimServer(EngineConfig(max_batch=4)) as sim:
        ...  # requests to sim.url; sim.engine.stats counts tokens and cache hits

As a child process: ``process, url = spawn(EngineConfig(speed=10))``, or ``python -m
corral.llmsim --port 8000 [knobs]``.
"""

from corral.llmsim.cache import PrefixCache, Rejected, block_hashes, encode_text, token_count
from corral.llmsim.engine import Engine, EngineConfig, EngineStats, Generation, Scheduler, Sequence
from corral.llmsim.protocol import render_chat
from corral.llmsim.server import DEFAULT_MODEL, SimServer, build_app, command, spawn

__all__ = [
    "DEFAULT_MODEL",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Generation",
    "PrefixCache",
    "Rejected",
    "Scheduler",
    "Sequence",
    "SimServer",
    "block_hashes",
    "build_app",
    "command",
    "encode_text",
    "render_chat",
    "spawn",
    "token_count",
]
