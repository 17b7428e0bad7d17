"""No service can starve the others, nor the daemon, through its probes or its traffic.

Real daemon, real replicas (tests/apps/faulty.py), traffic on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytest
from conftest import APPS, CorralHome, http, wait_for

pytestmark = pytest.mark.timeout(120)


def faulty_spec(name: str, mode: str, replicas: int = 1) -> str:
    return (
        f"name: {name}\nworkdir: {APPS}\n"
        f"run: {json.dumps(f'exec {sys.executable} faulty.py --mode {mode}')}\n"
        "service:\n  readiness_probe:\n    path: /health\n    initial_delay_seconds: 60\n"
        "    period_seconds: 0.5\n    timeout_seconds: 2\n"
        f"  replicas: {replicas}\n"
    )


def test_a_huge_health_answer_is_not_read(corral_home: CorralHome) -> None:
    """/health answers 200 announcing 1 GiB and never sends most of it: the status decides,
    the body is not read (reading it whole cost the daemon its size in memory, and a body
    that never ends kept the replica from ever being READY)."""
    corral_home.start_daemon()
    answer = corral_home.api(
        "POST", "/v1/services", body={"spec": faulty_spec("huge", "huge-health")}, timeout=30
    )
    assert answer.status == 201, answer.body
    svc = corral_home.wait_replicas("huge", 1, timeout=30)
    assert http(svc["endpoint"] + "/").status == 200
    pid = corral_home.daemon_pid()
    rss_kib = _rss_kib(pid)
    assert rss_kib < 400 * 1024, f"daemon RSS {rss_kib} KiB after probing a 1 GiB /health"


def test_open_file_limit_is_raised_to_the_hard_limit(corral_home: CorralHome) -> None:
    """A daemon started under a low soft limit of open files (1,024 is common) raises it to
    the hard limit, and so do its balancer workers: client connections are what fills it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 512:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    env = dict(corral_home.env)
    argv = [
        sys.executable,
        "-c",
        "import resource, sys; from corral.cli import main; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
        "resource.RLIMIT_NOFILE)[1])); sys.argv = ['corral', 'daemon', 'run']; main()",
    ]
    pid = corral_home.start_daemon(argv=argv, env=env)
    assert _soft_nofile(pid) == hard
    workers = wait_for(corral_home.worker_pids, 20, "the balancer workers")
    for worker in workers:
        wait_for(lambda w=worker: _soft_nofile(w) == hard, 20, f"worker {worker}'s limit")
    info = corral_home.api("GET", "/v1/daemon").json()
    assert info["open_files"]["limit"] == hard, info


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            return resource.RLIM_INFINITY if value == "unlimited" else int(value)
    raise AssertionError(f"no open-file limit for pid {pid}")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no RSS for pid {pid}")
