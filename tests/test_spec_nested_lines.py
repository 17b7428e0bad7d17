"""Problems found after parsing name their field's own line, not its section's: a missing
``service.tls.keyfile`` was reported at the line of ``service:``, and a GPU this machine lacks
at the line of ``resources:``, several lines above what to change."""

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from corral.cli import main
from corral.spec import parse_spec, path_issues

SPEC = """\
service:
  readiness_probe: /
  replicas: 1
  tls:
    keyfile: key.pem
    certfile: cert.pem
run: x $PORT
resources:
  cpus: 1
  memory: 100000
"""


def test_tls_files_are_located_at_their_own_lines(tmp_path: Path) -> None:
    issues = {i.loc: i.line for i in path_issues(parse_spec(SPEC, "svc.yaml"), tmp_path)}
    assert issues == {"service.tls.keyfile": 5, "service.tls.certfile": 6}


def test_the_legacy_https_files_too(tmp_path: Path) -> None:
    text = SPEC.replace("tls:", "https:").replace("keyfile", "key").replace("certfile", "cert")
    issues = {i.loc: i.line for i in path_issues(parse_spec(text, "svc.yaml"), tmp_path)}
    assert issues == {"service.tls.keyfile": 5, "service.tls.certfile": 6}


def test_a_resource_the_machine_lacks_is_located_at_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inventory = tmp_path / "small.yaml"
    inventory.write_text("gpus: []\ncpus: 2\nmemory: 8\n")
    monkeypatch.setenv("CORRAL_INVENTORY", str(inventory))
    text = SPEC.replace("  tls:\n    keyfile: key.pem\n    certfile: cert.pem\n", "")
    (tmp_path / "svc.yaml").write_text(text)
    args = ["--home", str(tmp_path / "home"), "validate", "--json", "svc.yaml"]
    document: dict[str, Any] = json.loads(CliRunner().invoke(main, args).stdout)
    lines = {e["field"]: e["line"] for e in document["errors"]}
    assert lines == {"resources.memory": 7}, document["errors"]
