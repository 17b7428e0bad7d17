"""A fixed-port app whose `run` names its port through a variable of its own (`$APP_PORT`, as
SkyServe specs write `--port $SERVICE_PORT`) is served on that port: the check at `validate`
and the launch read "does `run` use $PORT" by one rule. The launch once took any "PORT" in
the text for `$PORT`, gave the replica a free port in $PORT, and probed that port while the
app listened on its own, so the replica was never READY (docs/spec.md, `resources.ports`)."""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import CorralHome, write_spec

from corral.deploy import launch_port
from corral.spec import parse_spec

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec_text(port: int) -> str:
    return (
        "name: appport\n"
        f'envs: {{APP_PORT: "{port}"}}\n'
        f"resources: {{ports: {port}}}\n"
        f"run: exec {sys.executable} -m http.server $APP_PORT --bind 127.0.0.1\n"
        "service:\n"
        "  readiness_probe: {path: /, period_seconds: 0.2, initial_delay_seconds: 8}\n"
        "  replicas: 1\n"
    )


def test_the_launch_port_follows_the_same_rule_as_the_check() -> None:
    spec = parse_spec(_spec_text(18080))
    assert launch_port(spec, spec.run or "") == 18080  # $APP_PORT is not $PORT
    for run in ("exec app --port $PORT", "exec app --port ${PORT}", "PORT=$PORT exec app"):
        assert launch_port(spec, run) is None, run  # a free port, handed over in $PORT


def test_a_fixed_port_named_by_another_variable_is_probed_there(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    port = _free_port()
    spec = write_spec(tmp_path / "appport.yaml", _spec_text(port))
    result = corral_home.run("up", str(spec), check=False, timeout=60)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, said
    svc = corral_home.service("appport")
    assert svc is not None and svc["status"] == "READY", svc
    assert [r["endpoint"] for r in svc["replicas"]] == [f"http://127.0.0.1:{port}"], svc
    with urllib.request.urlopen(svc["endpoint"] + "/", timeout=10) as answer:
        assert answer.status == 200
