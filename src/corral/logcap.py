"""Replica logs kept under their size cap while a service runs (see corral.logfiles)."""

from __future__ import annotations

import asyncio
import logging

from corral import logfiles
from corral.replicas import TeardownState
from corral.servicecore import ServiceCore
from corral.state import StateError

log = logging.getLogger("corral.controller")

# How often replica logs are checked against ControllerDeps.log_max_bytes.
LOG_CAP_PERIOD = 2.0


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
                    for path in (svc.replica_log(r.id), svc.launch_log(r.id))
                ),
            ]
            done = await asyncio.to_thread(logfiles.rotate_all, paths, cap)
        except StateError as exc:
            log.warning("service %s: log size check postponed: %s", svc.name, exc)
            continue
        except Exception:
            log.exception("service %s: log size check failed", svc.name)
            continue
        for item in done:
            if isinstance(item, str):
                log.warning("service %s: log over the cap not rotated: %s", svc.name, item)
            elif item.error is not None:
                what = f"{item.path.name} over {cap} bytes emptied, old content dropped"
                log.warning("service %s: %s: %s", svc.name, what, item.error)
            else:
                what = f"{item.path.name} over {cap} bytes: {item.kept} bytes moved"
                log.info("service %s: %s to %s", svc.name, what, item.backup.name)
