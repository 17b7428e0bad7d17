"""Teardown that nothing escapes: a replica's descendant that leaves its process group AND
clears its environment (no replica key left to find it by) is still stopped, because every
local replica runs in a cgroup of its own where cgroup v2 is writable.

Real daemon, real process trees (tests/apps/faulty.py --mode tree --scrub-env).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from conftest import APPS, CorralHome, kill_pids, pid_alive, wait_for

from corral.infra import cgroups

pytestmark = pytest.mark.timeout(120)


def _cgroups_usable() -> bool:
    usable = cgroups.replica_root(PROBE) is not None
    cgroups.release_root(PROBE)
    return usable


PROBE = "probe-for-tests"


def test_a_setsid_child_with_a_cleared_environment_does_not_survive_down(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    if not _cgroups_usable():
        pytest.skip(f"no writable cgroup v2: {cgroups.unavailable_reason(PROBE)}")
    pidfile = tmp_path / "tree.pids"
    run = (
        f"exec {sys.executable} faulty.py --mode tree --children 2 --depth 1 --scrub-env "
        f"--pidfile {pidfile}"
    )
    spec = (
        f"name: escape\nworkdir: {APPS}\nrun: {json.dumps(run)}\n"
        "service:\n  readiness_probe: {path: /health, period_seconds: 0.2}\n  replicas: 1\n"
    )
    corral_home.start_daemon()
    answer = corral_home.api("POST", "/v1/services", body={"spec": spec}, timeout=30)
    assert answer.status == 201, answer.body
    corral_home.wait_replicas("escape", 1, timeout=60)

    def tree() -> list[int] | None:
        pids = [int(p) for p in pidfile.read_text().split()] if pidfile.exists() else []
        return pids if len(pids) >= 3 else None  # the server and its two children

    pids = wait_for(tree, 30, "the tree to start")
    scrubbed = pids[-1]  # recorded last: the odd child (setsid + empty environment) or not
    try:
        answer = corral_home.api("DELETE", "/v1/services/escape?purge=1")
        assert answer.status == 202, answer.body
        wait_for(lambda: corral_home.service("escape") is None, 60, "the service to go")
        alive = [pid for pid in pids if pid_alive(pid)]
        assert alive == [], f"processes of the replica survived `down`: {alive}"
    finally:
        kill_pids([pid for pid in pids if pid_alive(pid)])
    assert not pid_alive(scrubbed)


def test_the_daemon_says_when_replicas_get_no_cgroup(corral_home: CorralHome) -> None:
    """Where no cgroup is available, the daemon says so loudly at start (and where one is, it
    says nothing about it)."""
    corral_home.start_daemon()
    log = corral_home.tail("daemon.log", 100)
    if not _cgroups_usable():
        assert "replicas get no cgroup of their own" in log, log
    else:
        assert "replicas get no cgroup of their own" not in log, log
    corral_home.stop_daemon(signal.SIGTERM)
