"""`corral validate` reports every problem of a file at once, also those its later checks
(workdir, `run` on a fixed port, resources) find behind a field the parser refuses.

SkyServe's policy examples spell a field SkyServe no longer reads (`init_replicas`,
`base_on_demand_fallback_replicas`) *and* start several replicas on one fixed port: naming only
the field sent the user back to `validate` to learn about the port.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from corral.cli import main

SPEC = """\
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: 1
    max_replicas: 3
    target_qps_per_replica: 1
    init_replicas: 2
resources:
  ports: 8081
run: python3 server.py
"""


def _validate(tmp_path: Path, text: str) -> dict[str, Any]:
    spec = tmp_path / "svc.yaml"
    spec.write_text(text)
    args = ["--home", str(tmp_path / "home"), "validate", "--json", str(spec)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_validate_names_the_port_problem_behind_an_unknown_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    document = _validate(tmp_path, SPEC)
    lines = {e["field"]: e["line"] for e in document["errors"]}
    assert lines.get("service.replica_policy.init_replicas") == 7, document["errors"]
    assert lines.get("run") == 10, document["errors"]  # the file's own line, kept
    run = next(e["message"] for e in document["errors"] if e["field"] == "run")
    assert "$PORT" in run and "8081" in run


def test_nothing_is_guessed_when_a_field_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = SPEC.replace("    max_replicas: 3\n", "").replace("    init_replicas: 2\n", "")
    document = _validate(tmp_path, text)
    assert [e["field"] for e in document["errors"]] == ["service.replica_policy.max_replicas"]


# SkyServe's policy__multi_accelerators.yaml, as it is: a target without max_replicas, a
# workdir of the SkyPilot checkout, `run` on a fixed port with at least 2 replicas, and
# placement fields. `validate` named max_replicas alone, and no warning: three rounds.
MULTI = """\
service:
  readiness_probe:
    path: /health
  replica_policy:
    min_replicas: 2
    target_qps_per_replica: 1
    base_ondemand_fallback_replicas: 1
resources:
  ports: 8081
  use_spot: true
workdir: examples/serve/http_server
run: python3 server.py
"""


def test_a_missing_field_does_not_hide_the_other_problems_nor_the_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    document = _validate(tmp_path, MULTI)
    lines = {e["field"]: e["line"] for e in document["errors"]}
    assert lines == {"service.replica_policy.max_replicas": 4, "workdir": 11, "run": 12}
    run = next(e["message"] for e in document["errors"] if e["field"] == "run")
    assert "up to 2 replicas" in run  # min_replicas: the least it runs, nothing guessed
    warned = " ".join(document["warnings"])
    assert "resources.use_spot" in warned
    assert "service.replica_policy.base_ondemand_fallback_replicas" in warned
    assert document["spec"] is None and not document["valid"]


def test_validate_prints_the_warnings_of_a_spec_with_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "svc.yaml").write_text(MULTI)
    args = ["--home", str(tmp_path / "home"), "validate", "svc.yaml"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "warning: resources.use_spot" in result.stderr
    assert "svc.yaml:11: workdir" in result.stderr and "svc.yaml:12: run" in result.stderr
    assert "3 problem(s)" in result.stderr


def test_up_names_the_problems_behind_a_refused_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "svc.yaml").write_text(MULTI)
    args = ["--home", str(tmp_path / "home"), "up", "-n", "svc", "svc.yaml"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    for where in ("svc.yaml:4: service.replica_policy.max_replicas", "svc.yaml:11: workdir"):
        assert where in result.stderr, result.stderr
    assert not (tmp_path / "home" / "daemon.json").exists()


def test_a_refused_run_leaves_nothing_to_check_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    document = _validate(tmp_path, MULTI.replace("run: python3 server.py", "run: [a, b]"))
    assert {e["field"] for e in document["errors"]} == {
        "service.replica_policy.max_replicas",
        "run",
    }


def test_no_warning_about_a_field_the_errors_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = (
        "service:\n  readiness_probe: /\n  replicas: 3\n  max_replicas: 2\n  autoscaling:\n"
        "    metrics: [{type: qps, target: 1}]\nresources:\n  use_spot: true\nrun: x $PORT\n"
    )
    document = _validate(tmp_path, text)
    assert [e["field"] for e in document["errors"]] == ["service.max_replicas"]
    assert not [w for w in document["warnings"] if "max_replicas" in w], document["warnings"]
    assert [w.split(":")[0] for w in document["warnings"]] == ["resources.use_spot"]
