"""`corral validate` checks the spec behind a refused field (corral.spec.behind), but what
those later checks say about a field it refused is not a problem of the file: a model-first
spec whose `resources.accelerators` is mistyped was told, beside that error, that "the spec
asks none (resources.accelerators)", as if the GPU had not been asked for at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral.cli import main

SPEC = """\
name: m
model: Qwen/Qwen2.5-0.5B-Instruct
resources:
  accelerators: "A100:x"
service:
  replicas: 1
"""


def test_no_later_problem_speaks_of_a_refused_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC)
    args = ["--home", str(tmp_path / "home"), "validate", "--json", str(spec)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = json.loads(result.stdout)["errors"]
    assert [e["field"] for e in errors if e["field"] == "resources.accelerators"], errors
    others = [e for e in errors if e["field"] != "resources.accelerators"]
    assert not [e for e in others if "resources.accelerators" in e["message"]], others
