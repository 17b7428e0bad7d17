"""A service's logs: named by the replicas' ids within the service, and kept under their size
cap while it runs (see corral.logfiles); the home's own logs under the same cap."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from corral import logfiles
from corral.loglines import worker_logs
from corral.replicas import TeardownState
from corral.servicecore import ServiceCore
from corral.state import StateError

log = logging.getLogger("corral.controller")

# How often replica logs are checked against ControllerDeps.log_max_bytes.
LOG_CAP_PERIOD = 2.0
# How often the daemon's and the balancer workers' logs are: they grow with the home's traffic
# and events, not with an app's output.
HOME_LOG_CAP_PERIOD = 10.0


def prepare_logs(svc: ServiceCore) -> None:
    """Before the controller writes its log: the service's logs directory, its files renamed
    once from the internal ids a home of an earlier corral used (:func:`logfiles.by_seq`).
    A Ray replica's pump appends to the path its handle recorded: that follows the rename."""
    try:
        rows = svc.store.replicas(svc.name)
        if not logfiles.by_seq(svc.logs, {r.id: r.seq for r in rows}):
            return
        for r in rows:
            data, before = r.handle_data, str(svc.logs / f"replica_{r.id}.log")
            if data is not None and data["data"].get("log") == before:
                data["data"]["log"] = str(svc.replica_log(r.seq))
                svc.store.update_replica(r.id, handle=data)
    except (OSError, StateError) as exc:  # tried again at the next start
        svc.logs.mkdir(parents=True, exist_ok=True)
        log.warning("service %s: log files not renamed to replica ids: %s", svc.name, exc)


async def cap_logs(svc: ServiceCore) -> None:
    """Every ~2 s, rotate the logs of this service's replicas that passed the cap
    (``deps.log_max_bytes``): an app flooding its output must not fill the disk. The copy
    runs on a thread; a replica's log is written by the replica itself, so only
    copy-and-truncate works (see corral.logfiles for what that may lose)."""
    cap = svc.deps.log_max_bytes
    if cap <= 0:
        return
    while not svc.stopping:
        await asyncio.sleep(LOG_CAP_PERIOD)
        try:
            paths = [
                svc.logs / "controller.log",  # opened for append too (corral.capture)
                *(
                    path
                    for r in svc.store.replicas(svc.name)
                    if r.teardown_state is not TeardownState.SUCCEEDED
                    for path in (svc.replica_log(r.seq), svc.launch_log(r.seq))
                ),
            ]
            done = await asyncio.to_thread(logfiles.rotate_all, paths, cap)
        except StateError as exc:
            log.warning("service %s: log size check postponed: %s", svc.name, exc)
            continue
        except Exception:
            log.exception("service %s: log size check failed", svc.name)
            continue
        _say(done, cap, f"service {svc.name}: ")


async def cap_home_logs(home: Path, cap: int) -> None:
    """Every HOME_LOG_CAP_PERIOD s (until cancelled), the same cap on ``daemon.log`` and the
    balancer workers' logs, which the daemon and the workers keep open for append (so
    copy-and-truncate, as for a replica's). They had none: a worker logs every service's
    balancer events for as long as the data plane runs, across daemons."""
    if cap <= 0:
        return
    while True:
        await asyncio.sleep(HOME_LOG_CAP_PERIOD)
        try:
            paths = [home / "daemon.log", *worker_logs(home)]
            done = await asyncio.to_thread(logfiles.rotate_all, paths, cap)
        except Exception:
            log.exception("the home's log size check failed")
            continue
        _say(done, cap, "")


def _say(done: list[logfiles.Rotation | str], cap: int, prefix: str) -> None:
    """What one pass of the cap did, a line each, in the daemon's log."""
    for item in done:
        if isinstance(item, str):
            log.warning("%slog over the cap not rotated: %s", prefix, item)
        elif item.error is not None:
            what = f"{item.path.name} over {cap} bytes emptied, old content dropped"
            log.warning("%s%s: %s", prefix, what, item.error)
        else:
            what = f"{item.path.name} over {cap} bytes: {item.kept} bytes moved"
            log.info("%s%s to %s", prefix, what, item.backup.name)
