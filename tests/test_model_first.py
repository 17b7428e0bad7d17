"""SkyServe's model-first specs (``model:``, no ``run:``): corral picks the engine, or says
exactly what this machine lacks before anything starts (docs/llm.md)."""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from pathlib import Path

import pytest
from conftest import CorralHome, write_spec

from corral.model_engines import SIMULATOR, ModelUnavailable, engine_command
from corral.spec import parse_spec

LLAMA = "model: meta-llama/Llama-3.1-8B-Instruct\n"


def test_a_model_first_spec_is_a_service_with_llm_defaults() -> None:
    spec = parse_spec(LLAMA)
    assert spec.run is None and spec.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.service.readiness_probe.path == "/health"
    assert spec.service.load_balancing_policy == "prefix_affinity"
    said = parse_spec(LLAMA + "service:\n  readiness_probe: /v1/models\n  replicas: 2\n")
    assert said.service.readiness_probe.path == "/v1/models"  # what the spec says wins
    assert said.service.replica_policy.min_replicas == 2


def test_what_is_missing_is_said_engine_by_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(ModelUnavailable) as caught:
        engine_command(parse_spec(LLAMA))
    said = str(caught.value)
    for part in (
        "vllm is not installed",
        "sglang is not installed",
        "need a GPU",
        "llama-server) is not on PATH",
        "weights are not on this machine",
        str(tmp_path / "hf" / "hub"),
        f"model: {SIMULATOR}",
    ):
        assert part in said, (part, said)


def test_llama_cpp_serves_a_cached_gguf_on_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With llama.cpp's server on PATH and the model's GGUF in the Hugging Face cache, that
    is the engine (only the choice is tested: this machine has no llama.cpp to run)."""
    snapshot = tmp_path / "hf/hub/models--org--tiny/snapshots/abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-q4.gguf").write_bytes(b"GGUF")
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PATH", str(server.parent) + os.pathsep + os.environ["PATH"])
    run = engine_command(parse_spec("model: org/tiny\n"))
    assert run.startswith(f"exec {server} -m {snapshot / 'tiny-q4.gguf'}"), run
    assert "--port $PORT" in run and "--host 127.0.0.1" in run
    (snapshot / "tiny-q4.gguf").unlink()
    with pytest.raises(ModelUnavailable, match=r"needs a \.gguf file"):
        engine_command(parse_spec("model: org/tiny\n"))


def test_validate_and_up_refuse_a_model_this_machine_cannot_run(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "llama.yaml", LLAMA)
    checked = corral_home.run("validate", str(spec), check=False)
    assert checked.returncode == 1 and "cannot run here" in checked.stderr, checked.stderr
    up = corral_home.run("up", str(spec), "-n", "llama", "-y", check=False)
    assert up.returncode != 0 and "cannot run here" in up.stdout + up.stderr, up
    assert corral_home.status() == []  # nothing was started, nothing kept


def test_the_simulator_serves_a_model_first_spec(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "sim.yaml", f"name: sim\nmodel: {SIMULATOR}\n")
    corral_home.run("validate", str(spec))
    corral_home.run("up", str(spec), "-y", timeout=120)
    svc = corral_home.wait_replicas("sim", 1, timeout=60)
    assert (
        svc["policy"]["load_balancing_policy"] == "prefix_affinity"
        if "load_balancing_policy" in svc["policy"]
        else True
    )
    body = json.dumps({"model": SIMULATOR, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        str(svc["endpoint"]) + "/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert json.loads(answer.read())["choices"][0]["message"]["role"] == "assistant"
