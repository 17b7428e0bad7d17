"""Restart recovery: rows a previous daemon left, brought back under control.

Every row is judged from its facts and the backend's answer about its handle, by pure rules
(:func:`corral.plan.recover`, shared with the running loop's resuming of a lost launch): a
live recorded process is adopted, a launch interrupted before anything was recorded is
launched again, an interrupted teardown is run again, and a recorded replica found gone is
judged by :meth:`corral.servicecore.ServiceCore.mark_gone`, the same code a running daemon's
probe uses, so the two can never disagree about the same fact (an exited app FAILED and
counted toward the crash-loop rule, a lost host PREEMPTED and replaced). A backend that cannot
answer is not evidence of death: the row is kept, out of the ready set, and asked again later.
"""

from __future__ import annotations

from corral import plan
from corral.executor import Executor
from corral.replicas import UpdateMode, is_live
from corral.servicecore import ServiceCore, handle_from_row


def adopt(svc: ServiceCore, executor: Executor) -> None:
    """Bring rows left by a previous daemon back under control (at start; run again while
    the state file refuses writes, so every step must be safe to repeat): the rules are
    :func:`corral.plan.recover`, applied by the executor one row at a time."""
    for r in svc.store.replicas(svc.name):
        liveness = None
        if plan.asks_backend(r):
            handle = handle_from_row(r)
            assert handle is not None
            liveness = svc.liveness(r, handle)
        executor.apply(plan.recover(r, liveness), [r])
    svc.held_version = held_version(svc)
    svc.publish_ready()


def held_version(svc: ServiceCore) -> int | None:
    """The blue-green version whose traffic is held, as the previous daemon held it: the
    hold lived in its memory, and without it the ready set pushed now would give the new
    version's READY replicas traffic before the switch (until the first reconcile step held
    them again). Held while an older version still has a live READY replica: then the switch
    has not happened (it retires every old replica at once). The first step decides again."""
    service = svc.store.service(svc.name)
    if service is None:
        return None
    version = svc.store.version(svc.name, service.current_version)
    if version is None or version.mode is not UpdateMode.BLUE_GREEN:
        return None
    rows = svc.store.replicas(svc.name)
    old_ready = any(r.version != version.version and r.ready and is_live(r) for r in rows)
    return version.version if old_ready else None
