"""Tests for corral.spec: SkyServe-shaped specs in, normalised models or located errors out."""

import json
import pickle
import textwrap
from pathlib import Path

import pytest

from corral.spec import (
    DEFAULT_DOWNSCALE_DELAY_SECONDS,
    DEFAULT_FAILURE_TIMEOUT_SECONDS,
    DEFAULT_INITIAL_DELAY_SECONDS,
    DEFAULT_PERIOD_SECONDS,
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_UPSCALE_DELAY_SECONDS,
    ServiceSpec,
    SpecError,
    SpecIssue,
    load_spec,
    parse_spec,
    validate_name,
)

EXAMPLES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "skyserve-examples"


def write(tmp_path: Path, text: str, name: str = "svc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load(tmp_path: Path, text: str) -> ServiceSpec:
    return load_spec(write(tmp_path, text))


def errors_of(tmp_path: Path, text: str) -> SpecError:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.source == str(path)
    return caught.value


def by_loc(error: SpecError) -> dict[str, SpecIssue]:
    return {issue.loc: issue for issue in error.issues}


# ---------------------------------------------------------------------------------------------
# The real SkyServe examples

# file -> ("ok", warnings expected (loc prefixes)) or ("error", {loc: (line, words in message)})
EXPECTED: dict[str, tuple[str, object]] = {
    "auth-server.yaml": ("error", {"service.auth_key": (3, "auth key")}),
    "authentication__task.yaml": ("ok", []),
    "external-lb__service.yaml": (
        "ok",
        [
            "resources.cloud",
            "resources.any_of",
            "service.route53_hosted_zone",
            "service.external_load_balancers",
        ],
    ),
    "gorilla__gorilla.yaml": ("ok", ["resources.disk_size", "resources.disk_tier"]),
    "http_server__task.yaml": ("ok", []),
    "https__service.yaml": ("ok", ["service.https"]),
    "huggingface-tgi.yaml": ("ok", []),
    # SkyServe's model-first specs (no `run:`, corral picks the engine: docs/llm.md) parse;
    # whether this machine can run the model is `validate`'s and the daemon's question
    # (tests/test_model_first.py).
    "llama-3-8b.yaml": ("ok", []),
    "llama2__llama2.yaml": (
        "ok",
        ["resources.disk_size", "resources.disk_tier", "envs.HF_TOKEN"],
    ),
    "load_balancing_policies_example.yaml": ("ok", []),
    "min_replicas_zero.yaml": ("ok", []),
    "minimal.yaml": ("ok", []),
    "misc__cancel__service.yaml": ("ok", []),
    "multi_node__single_node.yaml": ("ok", ["resources.use_spot"]),
    "on-demand-policy.yaml": ("ok", ["resources.cloud", "service.replica_policy.on_demand_zones"]),
    "policy__base_on_demand_fallback_replicas.yaml": (
        "error",
        {
            "service.replica_policy.base_on_demand_fallback_replicas": (
                11,
                "did you mean 'base_ondemand_fallback_replicas'?",
            )
        },
    ),
    "policy__dynamic_on_demand_fallback.yaml": (
        "error",
        {
            "service.replica_policy.dynamic_on_demand_fallback": (
                11,
                "did you mean 'dynamic_ondemand_fallback'?",
            )
        },
    ),
    "policy__multi_accelerators.yaml": (
        "error",
        {"service.replica_policy.max_replicas": (8, "required when target_qps_per_replica")},
    ),
    "policy__spot_hedge.yaml": (
        "error",
        {"service.replica_policy.init_replicas": (8, "a service starts with min_replicas")},
    ),
    "quickstart.yaml": ("ok", ["resources.cloud"]),
    "qwen-7b.yaml": ("ok", ["service.autoscaling"]),  # queue_depth alone
    "ray_serve__ray_serve.yaml": (
        "ok",
        ["resources.cloud", "service.controller_resources", "service.port"],
    ),
    "spot_policy__spot_only.yaml": ("ok", ["resources.use_spot", "resources.any_of"]),
    "stable_diffusion_service.yaml": (
        "error",
        {"resources.load_balancing_policy": (16, "belongs under service")},
    ),
    "tgi_coder.yaml": ("ok", []),
    "vicuna-v1.5.yaml": ("ok", ["resources.disk_size", "resources.disk_tier"]),
    "vllm.yaml": ("ok", []),
}


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml")) if EXAMPLES.is_dir() else []


def test_every_example_has_an_expectation() -> None:
    if not EXAMPLES.is_dir():
        pytest.skip(f"shared examples not found at {EXAMPLES}")
    assert {p.name for p in example_files()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_skyserve_example(name: str) -> None:
    path = EXAMPLES / name
    if not path.is_file():
        pytest.skip(f"shared example {path} not found")
    outcome, expected = EXPECTED[name]
    if outcome == "ok":  # read as `corral validate` reads a file: `service:` required
        spec = load_spec(path, require_service=True)
        assert isinstance(expected, list)
        warned = [w.split(":", 1)[0] for w in spec.warnings]
        assert warned == expected
        json.dumps(spec.summary())
        return
    assert isinstance(expected, dict)
    with pytest.raises(SpecError) as caught:
        load_spec(path, require_service=True)
    issues = by_loc(caught.value)
    assert set(issues) == set(expected)
    for loc, (line, words) in expected.items():
        assert issues[loc].line == line, issues[loc]
        assert words in issues[loc].format("")
    for line_text in str(caught.value).splitlines():
        assert line_text.startswith(str(path))


def test_examples_details() -> None:
    if not EXAMPLES.is_dir():
        pytest.skip(f"shared examples not found at {EXAMPLES}")
    quick = load_spec(EXAMPLES / "quickstart.yaml")
    assert quick.resources.accelerators == [
        "L4:8",
        "A10g:8",
        "A100:4",
        "A100:8",
        "A100-80GB:2",
        "A100-80GB:4",
        "A100-80GB:8",
    ]
    multi = load_spec(EXAMPLES / "multi_node__single_node.yaml")
    assert multi.service.readiness_probe.post_data == {
        "model": "meta-llama/Llama-2-13b-chat-hf",  # envs filled in, as SkyPilot does
        "prompt": "Hello world,",
        "max_tokens": 7,
    }
    https = load_spec(EXAMPLES / "https__service.yaml")
    assert https.service.tls is not None
    assert https.service.tls.keyfile == "examples/serve/https/key.pem"
    assert https.service.tls.certfile == "examples/serve/https/cert.pem"
    ray = load_spec(EXAMPLES / "ray_serve__ray_serve.yaml")
    assert ray.replica_port() == 8000
    llama2 = load_spec(EXAMPLES / "llama2__llama2.yaml")
    assert llama2.envs == {"MODEL_SIZE": "7"}
    assert llama2.unset_values() == {"envs.HF_TOKEN": 29}
    auto = load_spec(EXAMPLES / "load_balancing_policies_example.yaml")
    policy = auto.service.replica_policy
    assert (policy.min_replicas, policy.max_replicas, policy.target_qps_per_replica) == (2, 4, 1.0)
    assert policy.autoscaling
    assert auto.service.load_balancing_policy == "round_robin"


# ---------------------------------------------------------------------------------------------
# Defaults and normalisation


def test_defaults(tmp_path: Path) -> None:
    spec = load(tmp_path, "run: python3 -m http.server $PORT\n")
    assert spec.name is None
    assert spec.infra == "local"
    assert spec.envs == {}
    assert spec.setup is None and spec.workdir is None
    probe = spec.service.readiness_probe
    assert probe.path == "/"
    assert probe.post_data is None
    assert probe.initial_delay_seconds == DEFAULT_INITIAL_DELAY_SECONDS == 1200
    assert probe.timeout_seconds == DEFAULT_TIMEOUT_SECONDS == 15
    assert probe.period_seconds == DEFAULT_PERIOD_SECONDS == 5
    assert probe.failure_timeout_seconds == DEFAULT_FAILURE_TIMEOUT_SECONDS == 180
    assert probe.headers == {}
    policy = spec.service.replica_policy
    assert (policy.min_replicas, policy.max_replicas) == (1, 1)
    assert policy.target_qps_per_replica is None
    assert policy.upscale_delay_seconds == DEFAULT_UPSCALE_DELAY_SECONDS == 300
    assert policy.downscale_delay_seconds == DEFAULT_DOWNSCALE_DELAY_SECONDS == 1200
    assert policy.num_overprovision == 0
    assert not policy.autoscaling
    assert spec.service.load_balancing_policy == "least_load"
    assert spec.service.tls is None
    assert spec.replica_port() is None
    assert spec.warnings == []


def test_replicas_is_normalised_to_a_fixed_policy(tmp_path: Path) -> None:
    spec = load(tmp_path, "run: x\nservice:\n  replicas: 3\n")
    policy = spec.service.replica_policy
    assert (policy.min_replicas, policy.max_replicas, policy.target_qps_per_replica) == (3, 3, None)


def test_replica_policy_without_max_is_fixed_at_min(tmp_path: Path) -> None:
    spec = load(tmp_path, "run: x\nservice:\n  replica_policy:\n    min_replicas: 0\n")
    assert (spec.service.replica_policy.min_replicas, spec.service.replica_policy.max_replicas) == (
        0,
        0,
    )


def test_autoscaling_policy_keeps_every_field(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        service:
          replica_policy:
            min_replicas: 1
            max_replicas: 5
            target_qps_per_replica: 2.5
            upscale_delay_seconds: 10
            downscale_delay_seconds: 20
            num_overprovision: 1
        """,
    )
    policy = spec.service.replica_policy
    assert policy.max_replicas == 5
    assert policy.target_qps_per_replica == 2.5
    assert (policy.upscale_delay_seconds, policy.downscale_delay_seconds) == (10, 20)
    assert policy.num_overprovision == 1
    assert policy.autoscaling


def test_null_value_means_default(tmp_path: Path) -> None:
    spec = load(tmp_path, "run: x\nservice:\n  replicas:\n  readiness_probe:\nresources:\n")
    assert spec.service.replica_policy.min_replicas == 1
    assert spec.service.readiness_probe.path == "/"


def test_shorthand_probe(tmp_path: Path) -> None:
    spec = load(tmp_path, "run: x\nservice:\n  readiness_probe: /health\n")
    probe = spec.service.readiness_probe
    assert probe.path == "/health"
    assert probe.initial_delay_seconds == 1200
    assert probe.post_data is None


def test_probe_object(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            path: /v1/models
            initial_delay_seconds: 0
            timeout_seconds: 2.5
            period_seconds: 1
            failure_timeout_seconds: 30
            headers:
              Authorization: Bearer abc
              X-Version: 2.10
        """,
    )
    probe = spec.service.readiness_probe
    assert (probe.path, probe.initial_delay_seconds, probe.timeout_seconds) == (
        "/v1/models",
        0,
        2.5,
    )
    assert (probe.period_seconds, probe.failure_timeout_seconds) == (1, 30)
    # Header values are text as written, not YAML's float 2.1.
    assert probe.headers == {"Authorization": "Bearer abc", "X-Version": "2.10"}


def test_skyserve_names_of_probe_period_and_failure_timeout(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            path: /
            endpoint_probe_interval_seconds: 2
            consecutive_failure_threshold_timeout: 60
        """,
    )
    assert spec.service.readiness_probe.period_seconds == 2
    assert spec.service.readiness_probe.failure_timeout_seconds == 60


def test_both_names_of_one_probe_setting_is_an_error(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            period_seconds: 1
            endpoint_probe_interval_seconds: 2
        """,
    )
    issue = by_loc(error)["service.readiness_probe.endpoint_probe_interval_seconds"]
    assert issue.line == 5
    assert "give only one" in issue.message


def test_post_data_as_json_string(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            path: /generate
            post_data: '{"prompt": "hi", "max_tokens": 1}'
        """,
    )
    assert spec.service.readiness_probe.post_data == {"prompt": "hi", "max_tokens": 1}
    assert spec.summary()["service"]["readiness_probe"]["method"] == "POST"


def test_post_data_invalid_json_is_located(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            path: /generate
            post_data: '{"prompt": '
        """,
    )
    issue = by_loc(error)["service.readiness_probe.post_data"]
    assert issue.line == 5
    assert "not valid JSON" in issue.message


def test_post_data_must_be_an_object(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nservice:\n  readiness_probe:\n    post_data: '[1, 2]'\n")
    assert "JSON object" in by_loc(error)["service.readiness_probe.post_data"].message


def test_envs_are_text_as_written(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        envs:
          PYTHON: 3.10
          WORKERS: 4
          DEBUG: yes
          EMPTY: ""
          TOKEN:
        """,
    )
    assert spec.envs == {
        "PYTHON": "3.10",
        "WORKERS": "4",
        "DEBUG": "yes",
        "EMPTY": "",
    }
    assert spec.unset_values() == {"envs.TOKEN": 7}
    assert spec.warnings == [
        "envs.TOKEN: has no value in the spec: give it at `corral up`/`update` with "
        "--env TOKEN=VALUE"
    ]


def test_envs_programmatic_scalars_become_text() -> None:
    spec = ServiceSpec.model_validate({"run": "x", "envs": {"A": 1, "B": True, "C": 0.5}})
    assert spec.envs == {"A": "1", "B": "true", "C": "0.5"}


def test_bad_env_name_and_value(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nenvs:\n  bad-name: 1\n  OK: [1, 2]\n")
    issues = by_loc(error)
    assert issues["envs.bad-name"].line == 3
    assert "environment variable name" in issues["envs.bad-name"].message
    assert issues["envs.OK"].line == 4
    assert "got a list" in issues["envs.OK"].message


@pytest.mark.parametrize(
    ("ports", "expected", "replica_port"),
    [
        ("8080", [(8080, 8080)], 8080),
        ("'8080'", [(8080, 8080)], 8080),
        ("[8080, '9000-9002']", [(8080, 8080), (9000, 9002)], None),
        ("[]", [], None),
    ],
)
def test_resource_ports_forms(
    tmp_path: Path, ports: str, expected: list[tuple[int, int]], replica_port: int | None
) -> None:
    service = "service:\n  ports: 8080\n" if len(expected) > 1 else ""
    spec = load(tmp_path, f"run: x\nresources:\n  ports: {ports}\n{service}")
    assert spec.resources.ports == expected
    if len(expected) > 1:
        assert spec.replica_port() == 8080
    else:
        assert spec.replica_port() == replica_port


def test_port_range_expands() -> None:
    spec = parse_spec("run: x\nresources:\n  ports: 8000-8002\nservice:\n  ports: 8001\n")
    assert spec.resources.port_numbers() == [8000, 8001, 8002]
    assert spec.replica_port() == 8001
    assert spec.summary()["resources"]["ports"] == ["8000-8002"]


def test_bad_ports_are_reported_per_item(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path, "run: x\nresources:\n  ports:\n    - 8080\n    - 9000-8000\n    - 70000\n"
    )
    issues = by_loc(error)
    assert set(issues) == {"resources.ports[1]", "resources.ports[2]"}
    assert issues["resources.ports[1]"].line == 5
    assert "low to high" in issues["resources.ports[1]"].message
    assert issues["resources.ports[2]"].line == 6
    assert "70000" in issues["resources.ports[2]"].message


def test_several_ports_need_service_ports(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nresources:\n  ports: 8000-8010\n")
    issue = by_loc(error)["resources.ports"]
    assert issue.line == 3
    assert "set service.ports" in issue.message


def test_service_port_must_be_opened(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nservice:\n  ports: 9000\nresources:\n  ports: 8080\n")
    issue = by_loc(error)["service.ports"]
    assert issue.line == 3
    assert "9000" in issue.message and "8080" in issue.message


def test_accelerators_and_sizes(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        "run: x\nresources:\n  accelerators: A100\n  cpus: 4+\n  memory: 32\n",
    )
    assert spec.resources.accelerators == ["A100:1"]
    assert (spec.resources.cpus, spec.resources.memory) == ("4+", "32")
    listed = parse_spec("run: x\nresources:\n  accelerators: [V100, 'T4:2']\n")
    assert listed.resources.accelerators == ["V100:1", "T4:2"]
    error = errors_of(tmp_path, "run: x\nresources:\n  cpus: lots\n  accelerators: 5\n")
    assert set(by_loc(error)) == {"resources.cpus", "resources.accelerators"}


def test_tls_needs_both_files(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nservice:\n  tls:\n    keyfile: k.pem\n")
    issue = by_loc(error)["service.tls.certfile"]
    assert issue.line == 3  # the tls: line, certfile itself is absent
    assert "required" in issue.message
    spec = load(tmp_path, "run: x\nservice:\n  tls:\n    keyfile: k.pem\n    certfile: c.pem\n")
    assert spec.service.tls is not None
    assert (spec.service.tls.keyfile, spec.service.tls.certfile) == ("k.pem", "c.pem")


def test_legacy_and_current_spellings_together_are_errors(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          port: 80
          ports: 81
          https: {key: k, cert: c}
          tls: {keyfile: k, certfile: c}
        """,
    )
    issues = by_loc(error)
    assert "give only ports" in issues["service.ports"].message
    assert issues["service.ports"].line == 4
    assert "give only tls" in issues["service.tls"].message


def test_load_balancing_policy(tmp_path: Path) -> None:
    assert (
        load(
            tmp_path, "run: x\nservice:\n  load_balancing_policy: Power_Of_Two\n"
        ).service.load_balancing_policy
        == "power_of_two"
    )
    error = errors_of(tmp_path, "run: x\nservice:\n  load_balancing_policy: round-robin\n")
    issue = by_loc(error)["service.load_balancing_policy"]
    assert issue.line == 3
    assert issue.hint == "did you mean 'round_robin'?"
    assert "'round-robin'" in issue.message


def test_infra_values(tmp_path: Path) -> None:
    k8s = load(tmp_path, "run: x\ninfra: kubernetes\n")
    assert k8s.infra == "kubernetes"
    # docs/spec.md listed it beside local and ray, and validate said "valid", while every
    # daemon refuses it at `up`: the one place a user learns that is a warning.
    assert any("kubernetes has no corral backend yet" in w for w in k8s.warnings), k8s.warnings
    issue = by_loc(errors_of(tmp_path, "run: x\ninfra: k8s\n"))["infra"]
    assert issue.line == 2
    assert issue.hint == "did you mean 'kubernetes'?"


def test_num_nodes_must_be_one(tmp_path: Path) -> None:
    assert load(tmp_path, "run: x\nnum_nodes: 1\n").num_nodes == 1
    issue = by_loc(errors_of(tmp_path, "run: x\nnum_nodes: 2\n"))["num_nodes"]
    assert issue.line == 2
    assert "must be 1" in issue.message


def test_placement_fields_are_kept_and_warned(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        run: x
        infra: ray
        file_mounts:
          /data: ./data
        resources:
          cloud: aws
          region: us-east-1
          use_spot: true
        service:
          replica_policy:
            min_replicas: 1
            spot_placer: dynamic_fallback
        """,
    )
    assert spec.resources.cloud == "aws"
    assert spec.resources.use_spot is True
    assert spec.file_mounts == {"/data": "./data"}
    assert [w.split(":", 1)[0] for w in spec.warnings] == [
        "file_mounts",
        "resources.cloud",
        "resources.region",
        "resources.use_spot",
        "service.replica_policy.spot_placer",
    ]
    assert all("has no meaning on infra ray" in w for w in spec.warnings)


def test_kept_fields_dump_as_json(tmp_path: Path) -> None:
    # Other modules put model_dump() into JSON; YAML dates and sets must not break that.
    spec = load(
        tmp_path,
        """\
        run: x
        resources:
          labels: {since: 2024-01-01, 1: .inf}
        service:
          replica_policy:
            min_replicas: 1
            spot_zones: [2024-01-02]
        """,
    )
    assert spec.resources.labels == {"since": "2024-01-01", "1": "inf"}
    assert spec.service.replica_policy.spot_zones == ["2024-01-02"]
    assert json.loads(json.dumps(spec.model_dump()))["resources"]["labels"]["since"] == "2024-01-01"


def test_missing_run_is_an_error(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "service:\n  replicas: 1\n")
    issue = by_loc(error)["run"]
    assert issue.line is None
    assert "is required" in issue.message
    blank = errors_of(tmp_path, "run: '  '\n")
    assert by_loc(blank)["run"].line == 1


# ---------------------------------------------------------------------------------------------
# Replica policy errors


def test_replicas_and_replica_policy_conflict(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          replicas: 2
          replica_policy:
            min_replicas: 1
        """,
    )
    issue = by_loc(error)["service.replica_policy"]
    assert issue.line == 4
    assert "replicas" in issue.message and "not both" in issue.message


def test_max_below_min(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          replica_policy:
            min_replicas: 3
            max_replicas: 2
            target_qps_per_replica: 1
        """,
    )
    issue = by_loc(error)["service.replica_policy.max_replicas"]
    assert issue.line == 5
    assert "at least min_replicas (3), got 2" in issue.message


def test_max_differs_from_min_without_target_qps(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        "run: x\nservice:\n  replica_policy:\n    min_replicas: 1\n    max_replicas: 3\n",
    )
    issue = by_loc(error)["service.replica_policy.max_replicas"]
    assert issue.line == 5
    assert "target_qps_per_replica" in issue.message


def test_target_qps_needs_max(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        "run: x\nservice:\n  replica_policy:\n    min_replicas: 1\n    target_qps_per_replica: 2\n",
    )
    issue = by_loc(error)["service.replica_policy.max_replicas"]
    assert issue.line == 3  # absent field: the line of its section
    assert "required" in issue.message


def test_min_replicas_required(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nservice:\n  replica_policy:\n    max_replicas: 2\n")
    assert by_loc(error)["service.replica_policy.min_replicas"].message == "is required"


@pytest.mark.parametrize(
    ("yaml_value", "words"),
    [
        ("-1", "must be at least 0, got -1"),
        ("true", "expected a whole number, got true"),
        ("'2'", "expected a whole number, got '2'"),
        ("2.5", "expected a whole number, got 2.5"),
        ("100000", "must be at most 10000"),
    ],
)
def test_bad_replica_counts(tmp_path: Path, yaml_value: str, words: str) -> None:
    issue = by_loc(errors_of(tmp_path, f"run: x\nservice:\n  replicas: {yaml_value}\n"))[
        "service.replicas"
    ]
    assert issue.line == 3
    assert words in issue.message


def test_a_number_yaml_reads_as_text_says_so(tmp_path: Path) -> None:
    """YAML 1.1 reads `2e3` as the text '2e3' (a float needs a dot and a signed exponent), so
    the bare "expected a number, got '2e3'" contradicted what the writer sees: a number. The
    message says why, and how to write it."""
    error = errors_of(
        tmp_path,
        "run: x\nservice:\n  replicas: 1\n  max_replicas: 3\n  autoscaling:\n"
        "    metrics:\n      - type: tokens_per_second\n        target: 2e3\n"
        "  load_balancer:\n    hold_timeout_seconds: 1.5e1\n    max_in_flight_per_replica: 6.4e1\n",
    )
    issues = by_loc(error)
    target = issues["service.autoscaling.metrics[0].target"].message
    assert target == "expected a number, got '2e3' (YAML reads 2e3 as text: write 2000)"
    assert "write 15)" in issues["service.load_balancer.hold_timeout_seconds"].message
    assert "write 64)" in issues["service.load_balancer.max_in_flight_per_replica"].message
    plain = by_loc(errors_of(tmp_path, "run: x\nservice:\n  replicas: '2'\n"))
    assert "YAML reads" not in plain["service.replicas"].message  # text that is no exponent


def test_bad_durations(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        run: x
        service:
          readiness_probe:
            timeout_seconds: 0
            period_seconds: .nan
            initial_delay_seconds: -1
            failure_timeout_seconds: 1.0e+9
        """,
    )
    issues = by_loc(error)
    probe = "service.readiness_probe."
    assert "greater than 0, got 0" in issues[probe + "timeout_seconds"].message
    assert "finite" in issues[probe + "period_seconds"].message
    assert "at least 0" in issues[probe + "initial_delay_seconds"].message
    assert "at most" in issues[probe + "failure_timeout_seconds"].message
    assert [issues[probe + f].line for f in ("timeout_seconds", "period_seconds")] == [4, 5]


# ---------------------------------------------------------------------------------------------
# Unknown fields, several errors, YAML errors


def test_unknown_field_suggests_and_locates(tmp_path: Path) -> None:
    path = write(tmp_path, "run: x\nservice:\n  replicas: 1\n  readines_probe: /health\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    (issue,) = caught.value.issues
    assert issue == SpecIssue(
        "service.readines_probe",
        "unknown field 'readines_probe'",
        4,
        "did you mean 'readiness_probe'?",
    )
    assert str(caught.value) == (
        f"{path}:4: service.readines_probe: unknown field 'readines_probe'; "
        "did you mean 'readiness_probe'?"
    )


def test_unknown_field_in_the_wrong_section(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nports: 8080\nservice:\n  min_replicas: 2\n")
    issues = by_loc(error)
    assert issues["ports"].hint == "it belongs under resources or service"
    assert issues["service.min_replicas"].hint == "it belongs under service.replica_policy"
    assert (issues["ports"].line, issues["service.min_replicas"].line) == (2, 4)


def test_unknown_field_without_a_close_match_lists_allowed(tmp_path: Path) -> None:
    issue = by_loc(errors_of(tmp_path, "run: x\nzzzz: 1\n"))["zzzz"]
    assert "allowed in the top level" in issue.message
    assert "resources" in issue.message


def test_all_errors_reported_at_once(tmp_path: Path) -> None:
    error = errors_of(
        tmp_path,
        """\
        name: My_Service
        run: x
        envs:
          1BAD: x
        resources:
          ports: abc
          gpu: A100
        service:
          readiness_probe: health
          replica_policy:
            min_replicas: 2
            max_replicas: 1
          load_balancing_policy: random
        """,
    )
    assert [(i.loc, i.line) for i in error.issues] == [
        ("name", 1),
        ("envs.1BAD", 4),
        ("resources.ports[0]", 6),
        ("resources.gpu", 7),
        ("service.readiness_probe.path", 9),
        ("service.replica_policy.max_replicas", 12),
        ("service.load_balancing_policy", 13),
    ]
    assert len(str(error).splitlines()) == 7


def test_errors_come_in_file_order(tmp_path: Path) -> None:
    # The model checks name before service; the report follows the file instead.
    error = errors_of(tmp_path, "service:\n  replicas: -1\nrun: x\nrun: y\nname: Bad\n")
    assert [(i.loc, i.line) for i in error.issues] == [
        ("service.replicas", 2),
        ("run", 4),
        ("name", 5),
    ]


def test_self_referencing_alias_is_refused_quickly(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nconfig: &loop [*loop]\n")
    (issue,) = error.issues
    assert "deeper than" in issue.message
    assert issue.line == 2


def test_bad_yaml_reports_the_parser_line(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: x\nservice:\n  replicas: 1\n   bad: [\n")
    (issue,) = error.issues
    assert issue.loc == ""
    assert issue.line is not None and issue.line >= 4
    assert issue.message.startswith("not valid YAML")
    tab = errors_of(tmp_path, "run: x\nservice:\n\treplicas: 1\n")
    assert tab.issues[0].line == 3


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "run: a\nservice:\n  replicas: 1\n  replicas: 2\nrun: b\n")
    issues = by_loc(error)
    assert issues["service.replicas"].line == 4
    assert "first at line 3" in issues["service.replicas"].message
    assert issues["run"].line == 5


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("- run: x\n", "got a list"),
        ("just text\n", "got 'just text'"),
        ("run: x\n---\nrun: y\n", "not valid YAML"),
        ("run: !!python/object:os.system x\n", "not valid YAML"),
    ],
)
def test_not_a_spec(tmp_path: Path, text: str, words: str) -> None:
    error = errors_of(tmp_path, text)
    assert len(error.issues) == 1
    assert words in error.issues[0].message


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as caught:
        load_spec(missing)
    assert str(caught.value) == f"{missing}: no such file"
    with pytest.raises(SpecError) as caught:
        load_spec(tmp_path)
    assert "directory" in str(caught.value)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"run: x\n\xff\xfe\x00")
    with pytest.raises(SpecError) as caught:
        load_spec(binary)
    assert caught.value.issues[0].line == 2
    assert "UTF-8" in caught.value.issues[0].message


def test_name_override(tmp_path: Path) -> None:
    path = write(tmp_path, "name: from-file\nrun: x\n")
    assert load_spec(path).name == "from-file"
    assert load_spec(path, name="from-cli").name == "from-cli"
    with pytest.raises(SpecError) as caught:
        load_spec(path, name="../etc")
    (issue,) = caught.value.issues
    assert (issue.loc, issue.line) == ("name", None)
    assert "lowercase letters" in issue.message


@pytest.mark.parametrize("name", ["a", "web", "my-svc-2", "x" * 63])
def test_valid_names(name: str) -> None:
    validate_name(name)
    assert parse_spec(f"name: {name}\nrun: x\n").name == name


@pytest.mark.parametrize(
    "name",
    ["", "Web", "my_svc", "a/b", "..", "../x", "a b", "rm;x", "$(id)", "-a", "a-", "1a", "x" * 64],
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate_name(name)
    (issue,) = caught.value.issues
    assert issue.loc == "name"
    assert "starts with a letter" in issue.message
    assert str(caught.value).startswith("name: ")


def test_never_raises_anything_but_spec_error() -> None:
    nasty = [
        "run: " + "[" * 3000 + "]" * 3000,  # flow nesting: PyYAML's scanner is quadratic
        "run: x\nconfig:\n"
        + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(600))
        + " " * 601
        + "v\n",  # block nesting deeper than PyYAML's recursion
        "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
        "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
        "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nrun: x\n",  # a billion laughs
        "run: x\nconfig: &a [*a]\n",  # a self-referencing value
        "run: x\nname: 2024-13-01\n",  # a date PyYAML cannot build
        "run: x\x00\n",
        "run: x\n1: 2\n? [a, b]\n: c\n",
        "run: !!int nope\n",
        "{",
        ":",
        "run: x\nservice: {replica_policy: [1]}\nresources: 7\nenvs: [1]\n",
    ]
    for text in nasty:
        with pytest.raises(SpecError) as caught:
            parse_spec(text)
        assert caught.value.issues, text
        assert not caught.value.issues[0].message.startswith("internal error"), text


# ---------------------------------------------------------------------------------------------
# summary, SpecError


def test_summary_is_normalised_and_hides_secret_values(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """\
        name: web
        run: serve --port $PORT
        envs:
          HF_TOKEN: hf_s3cr3t
        resources:
          ports: 8080
          cloud: gcp
        service:
          readiness_probe:
            path: /health
            headers: {Authorization: Bearer s3cr3t}
          replicas: 2
          load_balancing_policy: round_robin
        """,
    )
    summary = spec.summary()
    dumped = json.dumps(summary)
    assert "s3cr3t" not in dumped
    assert summary["name"] == "web"
    assert summary["infra"] == "local"
    assert summary["envs"] == ["HF_TOKEN"]
    assert summary["resources"]["ports"] == ["8080"]
    service = summary["service"]
    assert service["replica_port"] == 8080
    assert service["readiness_probe"]["method"] == "GET"
    assert service["readiness_probe"]["path"] == "/health"
    assert service["readiness_probe"]["headers"] == ["Authorization"]
    assert service["replica_policy"]["min_replicas"] == 2
    assert service["replica_policy"]["max_replicas"] == 2
    assert service["replica_policy"]["autoscaling"] is False
    assert service["load_balancing_policy"] == "round_robin"
    assert service["tls"] is None
    # Every balancer setting, defaults filled in (the hold, sessions: an operator checks them).
    balancer = service["load_balancer"]
    assert balancer["max_in_flight_per_replica"] is None and balancer["hold_timeout_seconds"] == 30
    assert {"session_header", "balance_factor", "connect_timeout_seconds"} <= set(balancer)
    assert summary["warnings"] == [
        "resources.cloud: has no meaning on infra local; kept but not used"
    ]


def test_spec_is_frozen() -> None:
    spec = parse_spec("run: x\n")
    with pytest.raises(Exception, match="frozen"):
        spec.run = "y"  # type: ignore[misc]


def test_spec_error_format_and_pickle() -> None:
    error = SpecError(
        [SpecIssue("service.replicas", "bad", 3), SpecIssue("run", "is required", None)],
        source="svc.yaml",
    )
    assert str(error) == "svc.yaml:3: service.replicas: bad\nsvc.yaml: run: is required"
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert copy.issues == error.issues and copy.source == "svc.yaml"
    assert str(parse_error("run: [\n")).startswith("<string>:")


def parse_error(text: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    return caught.value


def test_a_colon_in_run_hints_at_a_block(tmp_path: Path) -> None:
    """`run: echo "a: b"` is not YAML, and `run:` over an indented `echo a: b` is a mapping:
    either way the writer meant one command, and a block (`run: |`) says so."""
    for text in ('name: x\nrun: echo "a: b"\n', "name: x\nsetup:\n  pip install a: b\nrun: y\n"):
        (issue,) = errors_of(tmp_path, text).issues
        key = "run" if text.startswith("name: x\nrun") else "setup"
        assert issue.line == 2 and issue.hint is not None, issue
        assert f"`{key}: |`" in issue.hint, issue
    (plain,) = errors_of(tmp_path, "name: x\nrun: y\nservice: [\n").issues
    assert plain.hint is None


def test_a_file_without_service_is_a_task_not_a_service(tmp_path: Path) -> None:
    """SkyServe refuses a YAML without `service:` (a task); so does what a person submits. A
    spec stored without one (an older corral accepted it) still reads, with the defaults."""
    path = write(tmp_path, "name: task\nrun: echo hi\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path, require_service=True)
    (issue,) = caught.value.issues
    assert issue.loc == "service" and "readiness_probe" in issue.message, issue
    empty = write(tmp_path, "run: echo hi\nservice:\n", "empty.yaml")
    with pytest.raises(SpecError) as caught:
        load_spec(empty, require_service=True)
    assert [(i.loc, i.line) for i in caught.value.issues] == [("service", 2)]
    stored = load_spec(path)
    assert stored.service.replica_policy.min_replicas == 1
    served = load_spec(
        write(tmp_path, "run: x\nservice:\n  replicas: 2\n", "s.yaml"), require_service=True
    )
    assert served.service.replica_policy.min_replicas == 2
    typo = write(tmp_path, "run: x\nservce:\n  replicas: 2\n", "typo.yaml")
    with pytest.raises(SpecError) as caught:
        load_spec(typo, require_service=True)
    assert [i.loc for i in caught.value.issues] == ["servce"]  # did you mean, not "missing"


def test_envs_fill_in_the_service_section_as_skypilot_does(tmp_path: Path) -> None:
    # SkyPilot fills `envs` into `service`, `workdir` and `file_mounts` ($VAR and ${VAR}):
    # its LLM examples probe with `model: $MODEL_NAME`, and a probe that sent the text
    # "$MODEL_NAME" would be a 404 from vLLM, so no replica would ever be READY.
    (tmp_path / "app-7b").mkdir()
    spec = load_spec(
        write(
            tmp_path,
            f"""
            envs:
              MODEL_NAME: meta-llama/Llama-3.1-8B-Instruct
              SIZE: 7
            workdir: {tmp_path}/app-${{SIZE}}b
            service:
              readiness_probe:
                path: /v1/chat/completions
                post_data:
                  model: $MODEL_NAME
                  messages: [{{role: user, content: "cost: $5, ${{SIZE}}b, $UNKNOWN"}}]
              replicas: 1
            run: exec serve --port $PORT --model $MODEL_NAME
            """,
        )
    )
    probe = spec.service.readiness_probe
    assert probe.post_data is not None
    assert probe.post_data["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    # Only names `envs` gives are filled in; anything else stays as written.
    assert probe.post_data["messages"][0]["content"] == "cost: $5, 7b, $UNKNOWN"
    assert spec.workdir == f"{tmp_path}/app-7b"
    # `run` is the shell's to expand, with the replica's own environment.
    assert spec.run == "exec serve --port $PORT --model $MODEL_NAME"


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ("{id: Qwen/Qwen2.5-0.5B, revision: main}", "'revision'"),
        ("42", "expected text"),
        ("''", "at least 1 character"),
    ],
)
def test_a_bad_model_is_not_also_a_missing_run(tmp_path: Path, model: str, said: str) -> None:
    # The writer of a model-first spec gave `model:`: telling them `run:` is required as well
    # sends them to write an engine command they do not need.
    error = errors_of(tmp_path, f"model: {model}\nservice:\n  replicas: 1\n")
    assert [i.loc for i in error.issues] == ["model"], error
    assert said in error.issues[0].message


def test_a_bad_run_beside_a_model_is_still_reported(tmp_path: Path) -> None:
    error = errors_of(tmp_path, "model: corral-llmsim\nrun: [a, b]\nservice:\n  replicas: 1\n")
    assert [i.loc for i in error.issues] == ["run"]
    error = errors_of(tmp_path, "model: 42\nrun: [a]\nservice:\n  replicas: 1\n")
    assert sorted(i.loc for i in error.issues) == ["model", "run"]


@pytest.mark.parametrize(
    ("text", "loc", "line"),
    [
        ('run: "python3 -m http.server $PORT\\0"\nservice:\n  replicas: 1\n', "run", 1),
        ('run: x\nsetup: "pip install a\\0"\nservice:\n  replicas: 1\n', "setup", 2),
        ('run: x\nenvs:\n  A: "a\\x00b"\nservice:\n  replicas: 1\n', "envs.A", 3),
        ('model: "org/m\\0"\nservice:\n  replicas: 1\n', "model", 1),
        ('run: x\nfile_mounts:\n  "data\\0": ./x\nservice:\n  replicas: 1\n', "file_mounts", 3),
    ],
)
def test_a_nul_character_is_refused_where_it_is(
    tmp_path: Path, text: str, loc: str, line: int
) -> None:
    # YAML's "\0" escape makes one; no command, argument, path or environment value can hold
    # it: `up` accepted such a spec and every launch then failed with a Python traceback
    # ("ValueError: embedded null byte"), and `validate` crashed on a model path.
    error = errors_of(tmp_path, text)
    assert [(i.loc, i.line) for i in error.issues] == [(loc, line)], error
    assert "NUL" in error.issues[0].message


@pytest.mark.parametrize(
    ("text", "loc", "line"),
    [
        ('run: "python3 -m http.server $PORT # \\uD800"\nservice:\n  replicas: 1\n', "run", 1),
        ('run: x\nsetup: "pip install \\udc80"\nservice:\n  replicas: 1\n', "setup", 2),
        ('run: x\nenvs:\n  A: "a\\uD800b"\nservice:\n  replicas: 1\n', "envs.A", 3),
        ('run: x\nsecrets:\n  S: "\\uDFFF"\nservice:\n  replicas: 1\n', "secrets.S", 3),
    ],
)
def test_a_lone_surrogate_is_refused_where_it_is(
    tmp_path: Path, text: str, loc: str, line: int
) -> None:
    # YAML's "\uD800" escape makes one; no UTF-8 text holds it: `validate` and `up` accepted
    # such a spec and every launch then failed with "UnicodeEncodeError ... surrogates not
    # allowed", naming no field.
    error = errors_of(tmp_path, text)
    assert [(i.loc, i.line) for i in error.issues] == [(loc, line)], error
    assert "surrogate" in error.issues[0].message


def test_labels_are_no_note_on_ray_where_they_select_the_nodes() -> None:
    """`resources.labels` is Ray's label_selector (tests/test_infra_ray.py pins a replica by
    it); `validate` said it had "no meaning on infra ray", so a user would drop the one field
    that places the replicas."""
    text = (
        "run: python3 -m http.server $PORT\n"
        "resources: {labels: {zone: a}}\nservice: {replicas: 1}\n"
    )
    ray = parse_spec("infra: ray\n" + text)
    assert not [w for w in ray.warnings if w.startswith("resources.labels")], ray.warnings
    local = parse_spec(text)
    assert [w for w in local.warnings if w.startswith("resources.labels")] == [
        "resources.labels: has no meaning on infra local; kept but not used"
    ]


def test_several_accelerator_options_on_ray_say_only_the_first_is_asked() -> None:
    """A Ray actor is one request (corral.infra._ray_resources takes the first option): validate
    called them "any one of" the options on Ray too, as locally, and said nothing of a plain
    `{H100: 1, A100: 1}`, so a cluster with A100 nodes alone never placed a replica."""
    run = "run: python3 -m http.server $PORT\nservice: {replicas: 1}\n"
    plain = parse_spec(f"infra: ray\n{run}resources: {{accelerators: {{H100: 1, A100: 1}}}}\n")
    said = [w for w in plain.warnings if w.startswith("resources.accelerators")]
    assert said == [
        "resources.accelerators: on infra ray only the first, H100:1, is asked; A100:1 never "
        "(a Ray actor is one request)"
    ], plain.warnings
    alternatives = "resources: {any_of: [{accelerators: H100:1}, {accelerators: A100:1}]}\n"
    any_of = parse_spec(f"infra: ray\n{run}{alternatives}")
    (note,) = [w for w in any_of.warnings if w.startswith("resources.any_of")]
    assert "only the first, H100:1, is asked" in note and "any one of" not in note, note
    local = parse_spec(f"{run}{alternatives}")
    (note,) = [w for w in local.warnings if w.startswith("resources.any_of")]
    assert "any one of H100:1, A100:1" in note, note
    one = parse_spec(f"infra: ray\n{run}resources: {{accelerators: H100:1}}\n")
    assert not [w for w in one.warnings if w.startswith("resources.accelerators")]
