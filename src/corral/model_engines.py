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
(``$HF_HOME/hub``, default ``~/.cache/huggingface/hub``). Where nothing fits, :func:`engine_command`
raises :class:`ModelUnavailable` saying what is missing for each engine, so ``corral validate``
and ``corral up`` refuse the spec before anything starts. The command is chosen where the replica
runs (the daemon's machine); ``validate`` answers for the shell it runs in.
"""

from __future__ import annotations

import importlib.util
import os
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
    home = os.environ.get("HF_HOME") or str(Path("~/.cache/huggingface").expanduser())
    return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub")


def local_weights(model: str) -> Path | None:
    """Where the model's files are on this machine (a path given as the model, or the Hugging
    Face cache's snapshot of ``ORG/NAME``), or None."""
    given = Path(model).expanduser()
    if given.exists():
        return given
    snapshots = hf_cache() / f"models--{model.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
    return found[-1] if found else None


def _gguf(weights: Path | None) -> Path | None:
    if weights is None:
        return None
    if weights.is_file() and weights.suffix == ".gguf":
        return weights
    files = sorted(weights.rglob("*.gguf")) if weights.is_dir() else []
    return files[0] if files else None


def engine_command(spec: ServiceSpec) -> str:
    """The ``run`` of a model-first spec on this machine; ModelUnavailable when none fits."""
    model = spec.model or ""
    python = shlex.quote(sys.executable)
    if model == SIMULATOR:
        return f"exec {python} -m corral.llmsim {_LISTEN} --model {SIMULATOR}"
    quoted = shlex.quote(model)
    weights = local_weights(model)
    gpu = bool(spec.resources.accelerators)
    missing: list[str] = []
    for package, module, flag in (
        ("vllm", "vllm.entrypoints.openai.api_server", "--model"),
        ("sglang", "sglang.launch_server", "--model-path"),
    ):
        installed = importlib.util.find_spec(package) is not None
        if gpu and installed and weights is not None:
            return f"exec {python} -m {module} {flag} {shlex.quote(str(weights))} {_LISTEN}"
        if not installed:
            missing.append(f"{package} is not installed for {sys.executable}")
    if not gpu:
        missing.append("vLLM and SGLang need a GPU: the spec asks none (resources.accelerators)")
    server = shutil.which("llama-server")
    gguf = _gguf(weights)
    if server is not None and gguf is not None:
        return f"exec {shlex.quote(server)} -m {shlex.quote(str(gguf))} {_LISTEN}"
    if server is None:
        missing.append("llama.cpp's server (llama-server) is not on PATH")
    if weights is None:
        missing.append(
            f"its weights are not on this machine (not a path, not in {hf_cache()}) and corral "
            "does not download them"
        )
    elif gguf is None:
        missing.append(f"llama-server needs a .gguf file; none under {weights}")
    raise ModelUnavailable(
        f"model {quoted} cannot run here: " + "; ".join(missing) + ". Give a `run:` command, "
        f"or `model: {SIMULATOR}` for corral's engine simulator (not a model)"
    )
