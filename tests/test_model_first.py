"""SkyServe's model-first specs (``model:``, no ``run:``): corral picks the engine, or says
exactly what this machine lacks before anything starts (docs/llm.md)."""

from __future__ import annotations

import functools
import json
import os
import stat
import urllib.request
from pathlib import Path

import pytest
from conftest import CorralHome, write_spec

from corral.admission import check_spec
from corral.deploy import replica_command
from corral.errors import Unrunnable
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
    assert "model: meta-llama/Llama-3.1-8B-Instruct cannot run here" in checked.stderr
    setup = write_spec(tmp_path / "setup.yaml", LLAMA + "setup: pip install vllm\n")
    said = corral_home.run("validate", str(setup), check=False).stderr
    assert "`setup:` is not run before this check" in said, said
    corral_home.start_daemon()  # a daemon that runs judges the spec for itself (admission)
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


def test_a_probe_given_only_its_delays_keeps_the_engines_health_path() -> None:
    """LLM specs raise the probe's delay (an engine loads for minutes) and say nothing of its
    path: the engines answer /health, and 404 on "/"."""
    spec = parse_spec(LLAMA + "service:\n  readiness_probe:\n    initial_delay_seconds: 600\n")
    assert spec.service.readiness_probe.path == "/health"
    assert spec.service.readiness_probe.initial_delay_seconds == 600
    # `key:` with no value is "the default": the model-first one.
    blank = parse_spec(LLAMA + "service:\n  readiness_probe:\n  load_balancing_policy:\n")
    assert blank.service.readiness_probe.path == "/health"
    assert blank.service.load_balancing_policy == "prefix_affinity"
    said = parse_spec(LLAMA + "service:\n  readiness_probe: {path: /v1/models}\n")
    assert said.service.readiness_probe.path == "/v1/models"


def test_a_model_first_spec_with_a_fixed_port_runs_several_replicas() -> None:
    """The engine corral starts listens on $PORT: a port in the spec is not a `run` that
    would bind one port for every replica (and there is no `run` to blame)."""
    from corral.infra.local_rules import local_port_problem

    for ports in (
        "resources:\n  ports: 8000\nservice:\n  replicas: 2\n",
        "service:\n  ports: 8000\n  replicas: 2\n",
    ):
        spec = parse_spec(f"model: {SIMULATOR}\n" + ports)
        assert local_port_problem(spec) is None
        assert "$PORT" in engine_command(spec)


def test_up_without_a_daemon_refuses_the_model_before_starting_one(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The daemon `up` would start runs in this shell's environment: its verdict is known
    here, and a refused spec must not leave a daemon and its balancer workers behind."""
    spec = write_spec(tmp_path / "llama.yaml", LLAMA + "resources:\n  accelerators: H100:1\n")
    up = corral_home.run("up", str(spec), "-n", "llama", "-y", check=False)
    assert up.returncode == 1 and "cannot run here" in up.stderr, up
    assert "no daemon was started" in up.stderr, up.stderr
    # Everything this machine lacks, as validate says it: the GPU too, not at the next `up`.
    validate = corral_home.run("validate", str(spec), check=False)
    assert "H100" in validate.stderr and "H100" in up.stderr, (validate.stderr, up.stderr)
    daemon = corral_home.run("daemon", "status", check=False)
    assert "no daemon running" in daemon.stdout + daemon.stderr, daemon


def _snapshot(hub: Path, repo: str, revision: str, files: dict[str, str]) -> Path:
    snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def _fake_engine(root: Path, package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable package of that name: find_spec is all engine_command asks of it."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root))


def test_vllm_gets_the_snapshot_refs_main_names_whole_under_the_specs_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _fake_engine(tmp_path / "site", "vllm", monkeypatch)
    repo = "org/chat"
    current = _snapshot(hub, repo, "3f1c", {"config.json": "{}", "model.safetensors": "w"})
    _snapshot(hub, repo, "a9e0", {"config.json": "{}"})  # an older revision: its config only
    (hub / "models--org--chat" / "refs").mkdir()
    (hub / "models--org--chat" / "refs" / "main").write_text("3f1c")
    gpu = parse_spec(f"model: {repo}\nresources:\n  accelerators: L4:1\n")
    run = engine_command(gpu)
    assert f"--model {current} " in run, run
    assert "--served-model-name org/chat" in run, run  # what clients send as "model"
    (hub / "models--org--chat" / "refs" / "main").write_text("a9e0")
    with pytest.raises(ModelUnavailable, match="has no weights"):
        engine_command(gpu)


def test_llama_cpp_never_takes_a_projector_nor_picks_among_quantizations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hf" / "hub"
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("PATH", str(server.parent) + os.pathsep + os.environ["PATH"])
    vl = _snapshot(hub, "org/vl", "1", {"mmproj-vl-f16.gguf": "G", "vl-q4_k_m.gguf": "G"})
    run = engine_command(parse_spec("model: org/vl\n"))
    assert run.startswith(f"exec {server} -m {vl / 'vl-q4_k_m.gguf'} "), run
    assert "--metrics" in run and "--alias org/vl" in run, run
    _snapshot(hub, "org/quants", "1", {"q-f16.gguf": "G", "q-q4_k_m.gguf": "G"})
    with pytest.raises(ModelUnavailable, match=r"holds 2 GGUF files .*q-f16\.gguf"):
        engine_command(parse_spec("model: org/quants\n"))
    split = _snapshot(hub, "org/big", "1", {f"big-0000{i}-of-00002.gguf": "G" for i in (1, 2)})
    run = engine_command(parse_spec("model: org/big\n"))
    assert f"-m {split / 'big-00001-of-00002.gguf'} " in run, run


def test_a_relative_model_path_is_launched_as_the_absolute_path_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_text("G")
    monkeypatch.setenv("PATH", str(server.parent) + os.pathsep + os.environ["PATH"])
    monkeypatch.chdir(tmp_path)
    run = engine_command(parse_spec("model: ./models/tiny.gguf\n"))
    assert f"-m {tmp_path / 'models' / 'tiny.gguf'} " in run, run


def test_a_relative_model_path_is_taken_from_where_corral_was_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a relative workdir: from the directory the CLI sent (base_dir), not the daemon's
    own directory, both when the daemon admits the spec and when it launches a replica."""
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "tiny.gguf").write_text("G")
    monkeypatch.setenv("PATH", str(server.parent) + os.pathsep + os.environ["PATH"])
    monkeypatch.chdir(tmp_path)  # the daemon's directory: no models/ here
    text = "name: tiny\nmodel: ./models/tiny.gguf\n"
    admit = functools.partial(check_spec, source=None, name=None, infras={"local": None})
    with pytest.raises(Unrunnable, match="cannot run here"):
        admit(text, capacity=None)
    spec = admit(text, capacity=None, base_dir=str(project))
    run = replica_command(spec, str(project))
    assert f"-m {project / 'models' / 'tiny.gguf'} " in run, run
    assert "exit 78" in replica_command(spec)  # from the daemon's directory, nothing to run


def test_an_engine_off_the_local_machine_listens_beyond_the_loopback() -> None:
    """On Ray the balancer reaches a replica at its node's address, not 127.0.0.1."""
    run = engine_command(parse_spec(f"model: {SIMULATOR}\ninfra: ray\n"))
    assert "--host 0.0.0.0" in run, run
    assert "--host 127.0.0.1" in engine_command(parse_spec(f"model: {SIMULATOR}\n"))


def test_the_cache_is_found_where_the_hub_library_puts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral.model_engines import hf_cache

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hf_cache() == tmp_path / "old"


def _problems(text: str) -> list[str]:
    from corral.spec import SpecError

    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    return [
        f"{issue.loc}: {issue.message}" + (f"; {issue.hint}" if issue.hint else "")
        for issue in caught.value.issues
    ]


SIM_SCALED = f"model: {SIMULATOR}\nservice:\n"
QUEUE = "  autoscaling:\n    metrics:\n      - type: queue_depth\n        target: 5\n"


def test_the_service_level_sizing_errors_name_what_the_spec_says() -> None:
    # Metrics without a most never scale anything (SkyServe's reading too): said, as a warning.
    kept = parse_spec(SIM_SCALED + "  replicas: 1\n" + QUEUE)
    assert not kept.service.replica_policy.autoscaling
    assert any(w.startswith("service.autoscaling: has no effect") for w in kept.warnings)
    # SkyServe's names of two metrics.
    skyserve = parse_spec(
        SIM_SCALED + "  max_replicas: 3\n  autoscaling:\n    metrics:\n"
        "      - {type: kv_cache_utilization, target: 0.8}\n"
        "      - {type: requests_per_second, target: 4}\n"
    ).service.replica_policy
    assert (skyserve.target_kv_cache_usage, skyserve.target_qps_per_replica) == (0.8, 4)
    # The fields the spec has, not replica_policy's.
    assert _problems(SIM_SCALED + "  replicas: 3\n  max_replicas: 2\n" + QUEUE) == [
        "service.max_replicas: must be at least replicas (3), got 2"
    ]
    # One wrong metric is one problem: no second one blaming a replica_policy not written.
    for metric, says in (
        ("      - type: queue_depth\n", "service.autoscaling.metrics[0].target: is required"),
        ("      - {type: queue_depth, targt: 5}\n", "did you mean 'target'?"),
    ):
        said = _problems(SIM_SCALED + "  max_replicas: 3\n  autoscaling:\n    metrics:\n" + metric)
        assert not [p for p in said if "replica_policy" in p], said
        assert any(says in p for p in said), said
    assert _problems(SIM_SCALED + "  max_replicas: 3\n  autoscaling:\n    metrics: []\n") == [
        "service.autoscaling.metrics: must have at least 1 item, got 0"
    ]


def test_a_kv_cache_target_above_1_is_named_where_the_spec_wrote_it() -> None:
    """`kv_cache_usage` is a share of a replica's KV cache: a target over 1 is refused at the
    metric's own `target` and line, not as replica_policy.target_kv_cache_usage (a field the
    spec does not have) on the line of its first key."""
    from corral.spec import SpecError

    text = SIM_SCALED + "  max_replicas: 3\n  autoscaling:\n    metrics:\n"
    text += "      - type: queue_depth\n        target: 5\n"
    text += "      - type: kv_cache_utilization\n        target: 1.5\n"
    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    (issue,) = caught.value.issues
    assert issue.loc == "service.autoscaling.metrics[1].target", issue
    assert "at most 1" in issue.message and issue.line == 9, issue
    kept = parse_spec(text.replace("1.5", "1"))
    assert kept.service.replica_policy.target_kv_cache_usage == 1


def test_skyserve_v2s_other_spellings_are_read() -> None:
    """SkyServe v2 (sky/serve/serve_spec_v2.py) writes the model as `{id: ...}`, may give
    max_replicas and the delays inside `autoscaling`, with its own delays' defaults there."""
    spec = parse_spec(
        f"model: {{id: {SIMULATOR}}}\nservice:\n  autoscaling:\n    max_replicas: 3\n"
        "    upscale_delay: 30\n    metrics:\n      - {type: queue_depth, target: 5}\n"
    )
    policy = spec.service.replica_policy
    assert spec.model == SIMULATOR and policy.max_replicas == 3 and policy.autoscaling
    assert (policy.upscale_delay_seconds, policy.downscale_delay_seconds) == (30, 300)
    assert not [w for w in spec.warnings if "has no effect" in w]
    said = _problems(
        SIM_SCALED + "  replicas: 2\n  autoscaling:\n    max_replicas: 1\n" + QUEUE[15:]
    )
    assert said == ["service.autoscaling: max_replicas must be at least replicas (2), got 1"], said
    engine = _problems(f"model: {SIMULATOR}\nengine: vllm\n")
    assert engine and "write its command as `run:`" in engine[0], engine
    assert any("expected the model's id" in p for p in _problems("model: {name: x}\n"))


def test_a_whole_safetensors_checkpoint_beside_the_bin_index_is_whole(tmp_path: Path) -> None:
    """Repositories hold both formats' indexes, and a download (vLLM's own: *.json and
    *.safetensors) only one format's shards: the checkpoint is whole, whatever order the
    directory lists the two indexes in; a shard missing from both is still refused."""
    from corral.model_engines import weights_problem

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    bins = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    (tmp_path / "config.json").write_text("{}")
    for name, files in (("pytorch_model.bin", bins), ("model.safetensors", shards)):
        index = {"weight_map": {"a": files[0], "b": files[1]}}
        (tmp_path / f"{name}.index.json").write_text(json.dumps(index))
    (tmp_path / shards[0]).write_bytes(b"w")
    assert "lacks" in (weights_problem(tmp_path) or "")
    (tmp_path / shards[1]).write_bytes(b"w")
    assert weights_problem(tmp_path) is None


def test_a_model_beside_a_run_is_warned_of_not_ignored_silently() -> None:
    """With `run:` the replicas run that command: `model:` picks no engine and brings none of
    the model-first defaults. A spec with both validated clean, so its writer could believe
    corral served the model with prefix_affinity and /health while it ran least_load on /."""
    both = parse_spec("model: corral-llmsim\nrun: exec python3 app.py --port $PORT\n")
    assert both.service.load_balancing_policy == "least_load"  # the defaults do not apply
    assert [w for w in both.warnings if w.startswith("model: not used")], both.warnings
    alone = parse_spec("model: corral-llmsim\n")
    assert not [w for w in alone.warnings if w.startswith("model:")], alone.warnings
