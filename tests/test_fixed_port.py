"""A replica whose `run` binds a fixed port (no $PORT) held by another process: the version
fails at its first launch, naming the holder (pid and command line), instead of three
relaunches that would each meet the same holder. Real daemon, real processes; the holder is a
socket of this test's own process on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import CorralHome, write_spec

pytestmark = pytest.mark.timeout(120)


def test_a_fixed_port_held_by_another_process_fails_the_version_at_once(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        spec = write_spec(
            tmp_path / "fixed.yaml",
            "name: fixed\n"
            f"run: exec {sys.executable} -m http.server {port} --bind 127.0.0.1\n"
            f"resources: {{ports: {port}}}\n"
            "service:\n  readiness_probe: {path: /, period_seconds: 0.2}\n  replicas: 1\n",
        )
        started = time.monotonic()
        result = corral_home.run("up", str(spec), check=False, timeout=60)
        took = time.monotonic() - started
        said = " ".join((result.stdout + result.stderr).split())
        assert result.returncode != 0, said
        assert f"its fixed port {port} is in use by pid {os.getpid()} (" in said, said
        assert "stop that process, or start the server on $PORT" in said, said
        assert "PortTaken(" not in said, said  # the user reads the message, not a repr
        assert took < 20, (took, said)  # no backoff between relaunches
        svc = corral_home.service("fixed")
        assert svc is not None and svc["status"] == "FAILED", svc
        assert "version 1 never became ready and 1 replica failed" in svc["failure"], svc
        assert [r["status"] for r in svc["replicas"]] == ["FAILED_PROVISION"], svc
        assert all(r["pid"] is None for r in svc["replicas"])  # `run` never started
