"""Helpers shared by the Ray test files: one local cluster per file, shared by xdist workers."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_cluster import LocalRayCluster


def cluster_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A short directory (Unix socket paths are limited to 107 bytes) that every xdist worker of
    this test run computes the same, so they share one cluster."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    digest = hashlib.sha1(f"{root}:{name}".encode()).hexdigest()[:10]
    return Path("/tmp") / f"corral-ray-{digest}"


@contextlib.contextmanager
def topology(cluster: LocalRayCluster, *, exclusive: bool) -> Iterator[None]:
    """Tests that add and remove nodes (exclusive) never run while another test (shared) runs on
    the other xdist worker: corral rightly prefers a fresh, empty node for new replicas, and a
    node removed under them would fail or move them (a correct outcome, not that test's)."""
    with open(cluster.dir / "topology.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def guard_topology(request: pytest.FixtureRequest, changes_topology: set[str]) -> Iterator[None]:
    """Body of each Ray test file's autouse fixture: every test holds the cluster's topology
    lock shared, except those in ``changes_topology`` (they take it exclusive around the change
    themselves, see :func:`topology`)."""
    if request.node.name in changes_topology:
        yield
        return
    cluster: LocalRayCluster = request.getfixturevalue("cluster")
    with topology(cluster, exclusive=False):
        yield
