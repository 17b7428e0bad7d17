"""A replica torn down for good leaves nothing on disk: its working directory (a spec without
workdir runs in a scratch directory outside the home) goes with it, as a Ray replica's node-local
directory does. It was kept, with everything the replica wrote there, until the whole service
went down: one more for every replica replaced, and the README says corral tears replicas
down "without leaking anything". Real daemon, real processes."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import CorralHome, write_spec

from corral.infra.base import drop_replica_scratch, scratch_root

pytestmark = pytest.mark.timeout(120)


def _ready(corral_home: CorralHome, name: str) -> list[dict[str, object]]:
    svc = corral_home.service(name)
    assert svc is not None
    return [r for r in svc["replicas"] if r["status"] == "READY"]


def test_a_replaced_replica_takes_its_scratch_directory_with_it(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    spec = write_spec(
        tmp_path / "scratch.yaml",
        "name: scratch\n"
        f"run: echo data > mine.txt; exec {sys.executable} -m http.server $PORT "
        "--bind 127.0.0.1\n"
        "service:\n  readiness_probe: {path: /, period_seconds: 0.2}\n  replicas: 1\n",
    )
    corral_home.run("up", str(spec), timeout=60)
    (first,) = _ready(corral_home, "scratch")
    place = Path(os.readlink(f"/proc/{first['pid']}/cwd"))
    assert (place / "mine.txt").read_text() == "data\n"
    corral_home.run("down", "scratch", "--replica-id", "1", "-y", timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        svc = corral_home.service("scratch")
        assert svc is not None
        if [r["id"] for r in svc["replicas"]] == [2] and _ready(corral_home, "scratch"):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"replica 1 was not replaced: {corral_home.service('scratch')}")
    assert not place.exists(), sorted(p.name for p in place.parent.iterdir())


def test_only_a_key_of_this_backend_names_a_directory(tmp_path: Path) -> None:
    """Nothing outside a replica's own two directories is ever removed."""
    marker = f"test-{os.getpid()}-{time.monotonic_ns()}"
    place = scratch_root(marker) / "svc"
    for name in ("7", "7.writes", "8"):
        (place / name).mkdir(parents=True)
    try:
        for key in (None, 7, "", f"{marker}/svc", f"{marker}/svc/..", f"{marker}/../svc/7"):
            drop_replica_scratch(key)
        assert sorted(p.name for p in place.iterdir()) == ["7", "7.writes", "8"]
        drop_replica_scratch(f"{marker}/svc/7")
        assert sorted(p.name for p in place.iterdir()) == ["8"]
    finally:
        shutil.rmtree(scratch_root(marker), ignore_errors=True)


def test_a_failed_launch_takes_its_scratch_directory_with_it(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A launch whose ``setup`` failed (or timed out, or was cancelled) left its directory,
    with all setup had written there (a partial download), until the whole service went down:
    one more for every attempt, and a version that was READY once retries for as long as its
    launches fail."""
    spec = write_spec(
        tmp_path / "failing.yaml",
        "name: failing\n"
        "setup: head -c 1000000 /dev/zero > part.bin; exit 1\n"
        "run: exec sleep 300\n"
        "service:\n  readiness_probe: {path: /, period_seconds: 0.2}\n  replicas: 1\n",
    )
    up = corral_home.run("up", str(spec), check=False, timeout=60)
    assert "FAILED" in up.stderr, up
    marker = corral_home.marker
    assert marker is not None
    place = scratch_root(marker) / "failing"
    left = sorted(p.name for p in place.iterdir()) if place.exists() else []
    assert left == [], left
