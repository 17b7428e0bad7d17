"""The local backend's own rules for a spec: replicas on one machine need ``$PORT``, and
``file_mounts`` are copied in, so only relative destinations of local paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.infra.local_rules import local_mount_issues, local_port_problem
from corral.spec import parse_spec


def port_spec(run: str, service: str, extra: str = "resources: {ports: 8080}\n") -> str:
    return f"run: {run}\n{extra}service:\n  {service}\n"


AUTOSCALED = "replica_policy: {min_replicas: 1, max_replicas: 3, target_qps_per_replica: 1}"
OVERPROVISIONED = "replica_policy: {min_replicas: 1, num_overprovision: 1}"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (port_spec("python -m http.server 8080", "replicas: 2"), True),
        (port_spec("serve --port $PORT", "replicas: 2"), False),
        (port_spec("serve --port=${PORT}", "replicas: 2"), False),
        (port_spec("serve --port=${PORT:-8080}", "replicas: 2"), False),
        (port_spec("serve --port $PORTS", "replicas: 2"), True),
        (port_spec("python -m http.server 8080", "replicas: 1"), False),
        (port_spec("python -m http.server 8080", "replicas: 3", extra=""), False),
        (port_spec("serve 8080", AUTOSCALED), True),
        (port_spec("serve 8080", OVERPROVISIONED), True),
        (
            port_spec("serve 8080", "replicas: 2", "infra: kubernetes\nresources: {ports: 8080}\n"),
            False,
        ),
        (port_spec("serve", "{replicas: 2, ports: 9000}", extra=""), True),
    ],
)
def test_local_port_problem(text: str, problem: bool) -> None:
    spec = parse_spec(text)
    message = local_port_problem(spec)
    if problem:
        assert message is not None
        assert f"port {spec.replica_port()}" in message and "$PORT" in message
    else:
        assert message is None


def test_mounts_are_judged_only_on_local(tmp_path: Path) -> None:
    text = "run: x\nfile_mounts:\n  /data: s3://bucket/key\n"
    assert {i.loc for i in local_mount_issues(parse_spec(text), tmp_path)} == {"file_mounts./data"}
    assert local_mount_issues(parse_spec("infra: ray\n" + text), tmp_path) == []


@pytest.mark.parametrize("dest", ['""', ".", "./"])
def test_a_mount_onto_the_working_directory_itself_is_refused(tmp_path: Path, dest: str) -> None:
    # Its copy replaced the version's whole workdir: the replica ran without its code.
    (tmp_path / "data").mkdir()
    text = f"run: x\nworkdir: {tmp_path}\nfile_mounts:\n  {dest}: {tmp_path / 'data'}\n"
    issues = local_mount_issues(parse_spec(text), tmp_path)
    assert len(issues) == 1 and "working directory itself" in issues[0].message, issues
