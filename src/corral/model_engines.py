"""SkyServe's model-first specs: ``model: ORG/NAME`` and no ``run:``, so corral picks the engine.

Which engine, and why:

* **vLLM**, then **SGLang**, when the spec asks for a GPU (``resources.accelerators``: corral
  places one before launch) and the engine is installed for this Python: both serve the OpenAI
  API, ``/health`` and Prometheus metrics, which is what the LLM policy and the queue autoscaler
  read (docs/llm.md).
* **llama.cpp's server** (``llama-server`` on ``PATH``) on CPUs, with a GGUF file of the model
  on this machine: the one engine that serves a model at useful speed without a GPU.
* ``model: corral-llmsim``: corral's engine *simulator* (docs/llmsim.md), not a model, so the
  model-first path runs on any machine (the demo, the tests).

Weights are never fetched: a model must be a local path or already in the Hugging Face cache
(:func:`hf_cache`). Where nothing fits, :func:`engine_command` raises :class:`ModelUnavailable`
saying what is missing for each engine, so ``corral validate`` and ``corral up`` refuse the spec
before anything starts. The command is chosen on the daemon's machine (on Ray too: the nodes
must have what it has); ``validate`` answers for the shell it runs in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from corral.spec import ServiceSpec

SIMULATOR = "corral-llmsim"
_LISTEN = "--host 127.0.0.1 --port $PORT"


class ModelUnavailable(ValueError):
    """This machine cannot run the spec's model; the message says what is missing."""


def hf_cache() -> Path:
    """Where the Hugging Face Hub library keeps models, found as it finds it: HF_HUB_CACHE
    (or its old name HUGGINGFACE_HUB_CACHE), else HF_HOME/hub, HF_HOME defaulting to
    $XDG_CACHE_HOME/huggingface (~/.cache when XDG_CACHE_HOME is not set)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or str(Path(xdg) / "huggingface")
    return Path(home).expanduser() / "hub"


def local_weights(model: str, base_dir: str | None = None) -> Path | None:
    """Where the model's files are on this machine (a path given as the model, made absolute,
    a relative one taken from ``base_dir``: the directory corral was run in, as a relative
    ``workdir`` is; or the Hugging Face cache's snapshot of ``ORG/NAME`` that ``refs/main``
    names, as the Hub library itself loads it offline), or None."""
    given = Path(base_dir or ".", Path(model).expanduser())
    if given.exists():
        return given.resolve()
    repo = hf_cache() / f"models--{model.replace('/', '--')}"
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    if main and (snapshots / main).is_dir():
        return snapshots / main
    # No refs/main (a revision fetched by hash alone): the newest snapshot.
    found = (
        sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    )
    return found[-1] if found else None


# What vLLM and SGLang load a checkpoint from.
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def weights_problem(weights: Path) -> str | None:
    """Why the checkpoint at ``weights`` cannot be served by vLLM or SGLang, or None: a
    snapshot of which only the config (or some shards) was fetched is not a model."""
    if weights.is_file():
        return None
    if not (weights / "config.json").is_file():
        return f"{weights} has no config.json"
    # A repository often holds the index of both formats (model.safetensors.index.json and
    # pytorch_model.bin.index.json) and a download only one's shards (vLLM's own fetches
    # *.json and *.safetensors): whole if any index has all its shards.
    lacking: str | None = None
    for index in sorted(weights.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            continue
        absent = sorted(name for name in shards if not (weights / name).is_file())
        if not absent:
            return None
        if lacking is None:
            first = absent[0]
            lacking = f"{weights} lacks {len(absent)} of its {len(shards)} shards ({first}, ...)"
    if lacking is not None:
        return lacking
    if not any(any(weights.glob(pattern)) for pattern in _WEIGHTS):
        return f"{weights} has no weights (no .safetensors or .bin file)"
    return None


def _gguf(weights: Path | None) -> list[Path]:
    """The model GGUF files at ``weights`` (a vision model's projector, ``mmproj-*``, is not
    one; a split model counts once, by its first part)."""
    if weights is None:
        return []
    if weights.is_file():
        return [weights] if weights.suffix == ".gguf" else []
    files = sorted(weights.rglob("*.gguf")) if weights.is_dir() else []
    return [
        f
        for f in files
        if not f.name.lower().startswith("mmproj")
        and (re.search(r"-\d{5}-of-\d{5}\.gguf$", f.name) is None or "-00001-of-" in f.name)
    ]


def _weights_missing(weights: Path | None, ggufs: list[Path]) -> list[str]:
    """What llama-server lacks of the model's files (nothing when it has one GGUF file)."""
    if weights is None:
        return [
            f"its weights are not on this machine (not a path, not in {hf_cache()}) and corral "
            "does not download them"
        ]
    if not ggufs:
        return [f"llama-server needs a .gguf file; none under {weights}"]
    if len(ggufs) > 1:
        names = ", ".join(f.name for f in ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        return [
            f"{weights} holds {len(ggufs)} GGUF files ({names}): give the one to serve as "
            "`model:` (its path)"
        ]
    return []


def engine_command(spec: ServiceSpec, base_dir: str | None = None) -> str:
    """The ``run`` of a model-first spec on this machine; ModelUnavailable when none fits.
    ``base_dir``: what a relative model path is relative to (the process's directory when
    None)."""
    model = spec.model or ""
    python = shlex.quote(sys.executable)
    # Local replicas are reached on the loopback; on other infra the balancer reaches the
    # replica's node by its address.
    listen = _LISTEN if spec.infra == "local" else _LISTEN.replace("127.0.0.1", "0.0.0.0")
    if model == SIMULATOR:
        return f"exec {python} -m corral.llmsim {listen} --model {SIMULATOR}"
    quoted = shlex.quote(model)
    weights = local_weights(model, base_dir)
    unusable = weights_problem(weights) if weights is not None else None
    gpu = bool(spec.resources.accelerators)
    missing: list[str] = []
    # The name clients send as "model" is the spec's, not the snapshot's path; the engines'
    # metrics are what the LLM policy and the autoscaler read (SGLang's are off by default).
    for package, module, flag, extra in (
        ("vllm", "vllm.entrypoints.openai.api_server", "--model", ""),
        ("sglang", "sglang.launch_server", "--model-path", " --enable-metrics"),
    ):
        installed = importlib.util.find_spec(package) is not None
        if gpu and installed and weights is not None and unusable is None:
            return (
                f"exec {python} -m {module} {flag} {shlex.quote(str(weights))} "
                f"--served-model-name {quoted}{extra} {listen}"
            )
        if not installed:
            missing.append(f"{package} is not installed for {sys.executable}")
    if not gpu:
        missing.append("vLLM and SGLang need a GPU: the spec asks none (resources.accelerators)")
    elif unusable is not None:
        missing.append(f"vLLM and SGLang need the whole checkpoint: {unusable}")
    server = shutil.which("llama-server")
    ggufs = _gguf(weights)
    if server is not None and len(ggufs) == 1:
        return (
            f"exec {shlex.quote(server)} -m {shlex.quote(str(ggufs[0]))} --alias {quoted} "
            f"--metrics {listen}"
        )
    if server is None:
        missing.append("llama.cpp's server (llama-server) is not on PATH")
    missing += _weights_missing(weights, ggufs)
    if spec.setup:
        missing.append(
            "`setup:` is not run before this check: install the engine for the daemon's Python "
            "and fetch the weights before `up`"
        )
    raise ModelUnavailable(
        f"model {quoted} cannot run here: " + "; ".join(missing) + ". Give a `run:` command, "
        f"or `model: {SIMULATOR}` for corral's engine simulator (not a model)"
    )
