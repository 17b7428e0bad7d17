"""A service's listener in a balancer worker, built from its route in the daemon's table.

Apart from :mod:`corral.dataplane.worker` so the worker module keeps to its lifecycle (the
channel, reports, its home and its slot) and this one to what a route turns into.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

from corral.balancer import LoadBalancer
from corral.balancer.affinity import table_path
from corral.balancer.load_board import board_path, streams_board_path
from corral.dataplane.engine_shares import share_dir
from corral.dataplane.protocol import Route

log = logging.getLogger("corral.worker")


def make_balancer(
    name: str,
    route: Route,
    on_drained: Callable[[int], None],
    home: Path,
    slot: int = 0,
    workers: int = 1,
) -> LoadBalancer:
    """The listener of ``route`` for the worker in ``slot`` of ``workers`` (how many share a
    per-replica limit and a board of counts); what a policy keeps for all of them is shared in
    the home's ``dataplane/``."""
    context = route.server_context()
    # A setting this worker's engine does not know (a newer daemon, during an upgrade) is left
    # out rather than refusing the whole service. The engines' metrics path is the worker's.
    known = inspect.signature(LoadBalancer).parameters
    given = {k: v for k, v in route.config.items() if k != "engine_metrics_path"}
    config = {k: v for k, v in given.items() if k in known}
    if config.get("max_connections", 0) is None:
        config["max_connections"] = default_max_connections()
    for key in sorted(set(given) - set(config)):
        log.warning("service %s: setting %r unknown to this worker, ignored", name, key)
    shared = home / "dataplane"
    config["routing"] = {
        **dict(config.get("routing") or {}),
        "workers": workers,
        "slot": slot,
        "affinity_file": str(table_path(shared, name)),
        "load_file": str(board_path(shared, name)),
    }
    return LoadBalancer(
        name=name,
        host=route.host,
        port=route.port,
        ssl_context=context,
        reuse_port=True,
        on_drained=on_drained,
        **config,
    )


def remove_shared(home: Path, name: str) -> None:
    """Delete what the workers of service ``name`` share in the home's ``dataplane/``: its
    conversation table, its boards of counts and streams, its engine readings."""
    shared = home / "dataplane"
    for path in (table_path, board_path, streams_board_path):
        with contextlib.suppress(OSError):
            path(shared, name).unlink()
    shutil.rmtree(share_dir(shared, name), ignore_errors=True)


def default_max_connections() -> int:
    """A service's share of this worker's descriptors when its spec sets none: a quarter of
    the open-file limit (each proxied connection holds two)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft // 4)
