"""A replica whose `run` binds a fixed port (no $PORT). Held by another process: the version
fails at its first launch, naming the holder (pid and command line), instead of three
relaunches that would each meet the same holder. Held by the service's own replica (an
update): the old replica goes first. Real daemon, real processes; the other holder is a socket
of this test's own process on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import urllib.request
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


def _fixed_spec(path: Path, port: int, text: str) -> Path:
    return write_spec(
        path,
        "name: onport\n"
        f"run: echo {text} > index.html; exec {sys.executable} -m http.server {port} "
        "--bind 127.0.0.1\n"
        f"resources: {{ports: {port}}}\n"
        "service:\n  readiness_probe: {path: /, period_seconds: 0.2}\n  replicas: 1\n",
    )


def test_an_update_of_a_replica_on_a_fixed_port_replaces_it_in_turn(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """One replica whose `run` binds its port itself (the usual SkyServe shape): the new
    version cannot start beside the old one, so a rolling update retires the old replica
    first and its successor starts on the port it freed; the balancer holds the requests of
    the gap, so none fails. A blue-green update, which needs both at once, is refused before
    anything changes. (Before, each new replica met the old one on the port, three failed
    and the update was given up.)"""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    corral_home.run("up", str(_fixed_spec(tmp_path / "v1.yaml", port, "one")), timeout=60)
    endpoint = corral_home.status("onport")["endpoint"]
    v2 = _fixed_spec(tmp_path / "v2.yaml", port, "two")
    refused = corral_home.run("update", "onport", str(v2), "--mode", "blue_green", check=False)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode != 0 and f"binds port {port} itself" in said, said
    assert corral_home.service("onport")["version"] == 1  # nothing changed

    answers: list[str] = []
    done = threading.Event()

    def traffic() -> None:
        deadline = time.monotonic() + 60  # bounded whatever happens
        while not done.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(endpoint + "/", timeout=30) as reply:
                    answers.append(reply.read().decode().strip())
            except OSError as exc:
                answers.append(f"error: {exc}")
            time.sleep(0.05)

    client = threading.Thread(target=traffic)
    client.start()
    try:
        result = corral_home.run("update", "onport", str(v2), check=False, timeout=60)
    finally:
        done.set()
        client.join(70)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, said
    # Why the old replica stops first is the port, not "no spare capacity" (a full machine).
    assert f"no room for version 2 beside the old replicas (binds port {port} itself" in said
    svc = corral_home.wait_replicas("onport", 1)
    assert [(r["version"], r["status"]) for r in svc["replicas"]] == [(2, "READY")], svc
    with urllib.request.urlopen(endpoint + "/", timeout=10) as reply:
        assert reply.read().decode().strip() == "two"
    assert answers and not [a for a in answers if a not in ("one", "two")], answers
