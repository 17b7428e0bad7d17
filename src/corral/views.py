"""A service as the API shows it: plain data computed from the store and the controller's
in-memory state at the moment it is asked (nothing here is stored or changes anything)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

from corral.autoscale import Decision
from corral.jobs import JobState
from corral.llm_view import replica_llm, service_llm
from corral.plan import backoff
from corral.replicas import (
    ReplicaStatus,
    ServiceStatus,
    TeardownState,
    replica_status,
    service_status,
)
from corral.servicecore import ServiceCore
from corral.spec import ServiceSpec
from corral.state import ReplicaRow, ServiceRow


def service_view(svc: ServiceCore, decision: Decision | None, failed: str | None) -> dict[str, Any]:
    """The service now; ``failed``: why the controller itself failed, if it did."""
    row = svc.store.service(svc.name)
    if row is None:
        raise KeyError(svc.name)
    rows = svc.store.replicas(svc.name)
    statuses = [replica_status(r) for r in rows]
    balancer_errors = svc.balancer.bind_errors() if svc.balancer is not None else []
    stats = svc.balancer.stats() if svc.balancer is not None else None
    status = service_status(
        statuses,
        shutting_down=row.intent == "shutting_down",
        gave_up=row.failure is not None,
        controller_running=svc.balancer is not None,
        # An endpoint the workers cannot serve, or serve only in part (another process
        # listens on its port too), is not READY whatever its replicas are.
        controller_failed=failed is not None or bool(balancer_errors),
    )
    # A failed update leaves the old version serving: the service is not FAILED then,
    # and why the update failed is a field of its own.
    update_failed = row.failure is not None and status is not ServiceStatus.FAILED
    return {
        "name": svc.name,
        "status": str(status),
        "endpoint": _endpoint(svc, row),
        "version": row.current_version,
        "target": decision.target if decision else None,
        "autoscaler": {
            "qps": round(decision.qps, 3),
            "raw_target": decision.raw_target,
            "reason": decision.reason,
        }
        if decision
        else None,
        "policy": _policy(svc, row),
        "versions": _versions(svc),
        "traffic_held_for_version": svc.held_version,
        "traffic_versions": _serving(svc),
        "balancer_errors": balancer_errors,
        "failure": failed or (None if update_failed else row.failure),
        "last_update_failure": row.failure if update_failed else None,
        "last_decision": svc.last_decision,
        "backoff": _backoff(svc, row),
        "created_at": row.created_at,
        "llm": service_llm(stats),
        "replicas": _replicas(svc, rows, statuses, stats),
    }


def _backoff(svc: ServiceCore, row: ServiceRow) -> dict[str, Any] | None:
    """While relaunches wait out their backoff: when the next attempt comes (an absolute
    time, and the seconds left by the daemon's clock, so a client's clock does not matter)
    and why. ``last_decision`` says only how long was left when the step ran."""
    if svc.backoff is None or row.intent == "shutting_down":
        return None
    until, why = svc.backoff
    left = round(max(0.0, until - time.time()), 1)
    return {"next_attempt_at": until, "next_attempt_in_seconds": left, "reason": why}


def _endpoint(svc: ServiceCore, row: ServiceRow) -> str | None:
    if svc.balancer is not None:
        https = svc.balancer.url.startswith("https")
    else:  # no route (its controller failed): what its spec, if read already, asks for
        spec = svc.specs.get(row.current_version)
        https = spec is not None and spec.service.tls is not None
    scheme = "https" if https else "http"
    return f"{scheme}://127.0.0.1:{row.lb_port}" if row.lb_port else None


def _policy(svc: ServiceCore, row: ServiceRow) -> dict[str, Any]:
    try:
        return svc.spec(row.current_version).service.replica_policy.model_dump()
    except Exception as exc:  # a stored spec this corral cannot read any more
        return {"error": repr(exc)}


def _versions(svc: ServiceCore) -> list[dict[str, Any]]:
    return [
        {
            "version": v.version,
            "mode": v.mode,
            "created_at": v.created_at,
            "first_ready_at": v.first_ready_at,
        }
        for v in svc.store.versions(svc.name)
    ]


def _serving(svc: ServiceCore) -> list[int]:
    """Versions whose READY replicas get traffic now (blue-green may hold the newest)."""
    held = svc.held_version
    return sorted({v for rid, v in svc.rt.versions.items() if rid in svc.rt.ready and v != held})


def _replicas(
    svc: ServiceCore,
    rows: list[ReplicaRow],
    statuses: list[ReplicaStatus],
    stats: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    capacity = svc.deps.capacity
    devices = capacity.devices() if capacity is not None else {}
    waiting = capacity.waiting if capacity is not None else {}
    balanced = (stats or {}).get("replicas") or {}
    engines = (stats or {}).get("engines") or {}
    now = time.time()
    views = []
    for r, status in zip(rows, statuses, strict=True):
        view = replica_view(
            svc,
            r,
            status,
            now,
            devices=devices.get(r.id),
            waiting=(waiting.get(r.id) or launch_wait(svc, r))
            if status is ReplicaStatus.PENDING
            else None,
        )
        view["llm"] = replica_llm(balanced.get(str(r.id)), engines.get(str(r.id)))
        views.append(view)
    return views


def launch_wait(svc: ServiceCore, r: ReplicaRow) -> str | None:
    """Why a PENDING replica that fits has not started launching, or None.

    Why say it: a launch slot can be held for as long as a setup may run (30 minutes by
    default), and a replica shown PENDING with no reason for that long looks lost.
    """
    job = svc.rt.launches.get(r.id)
    if job is None:
        share = svc.deps.launches_per_service
        if len(svc.rt.launches) < share:
            return None
        return (
            f"launch slots busy: this service launches {share} replicas at a time "
            "(CORRAL_LAUNCHES_PER_SERVICE)"
        )
    if job.state is not JobState.PENDING:
        return None
    pool = svc.deps.pool
    running = [j for j in pool.jobs() if j.kind == job.kind and j.state is JobState.RUNNING]
    holders = Counter(j.group or j.name for j in running)  # a launch's group: its service
    held = ", ".join(f"{name} {count}" for name, count in sorted(holders.items()))
    lane = pool.stats().get(job.kind, {})
    limit, guests = lane.get("limit", ""), lane.get("guests", 0)
    # The holders then number more than the slots: each service with no launch in a slot
    # gets one past them (JobPool._serve_starved), this one's included.
    past = f", and {guests} launch(es) past them, one per service that had none" if guests else ""
    return f"launch slots busy: all {limit} of the daemon's are held{past} ({held or 'starting'})"


def replica_view(
    svc: ServiceCore,
    r: ReplicaRow,
    status: ReplicaStatus,
    now: float,
    *,
    devices: Any = None,
    waiting: str | None = None,
) -> dict[str, Any]:
    """One replica as the API shows it: ``id`` is its number within the service (what
    users type, and what names its files, events and Ray actor); ``uid`` the internal key
    (the state file, the balancer's counters); ``devices`` what it holds on this machine,
    ``waiting`` why a PENDING one does not fit yet."""
    view: dict[str, Any] = {
        "id": r.seq or r.id,
        "uid": r.id,
        "version": r.version,
        "status": str(status),
        "endpoint": r.endpoint,
        "infra": r.infra,
        "age_seconds": round(now - r.created_at, 1),
        "failure": r.failure,
        "exit_code": r.exit_code,
        "pid": (r.handle_data or {}).get("data", {}).get("pid"),
        "devices": devices,
        "waiting": waiting,
    }
    hung = svc.rt.hung.get(r.id)
    if r.teardown_state is TeardownState.FAILED and (hung is None or hung.returned()):
        # FAILED_CLEANUP: it may still run, and its teardown is tried again, with backoff,
        # for as long as it fails (plan.teardown_retry_due): say when, not only that it failed.
        # (Not while an abandoned attempt is still inside its backend call: the next one waits
        # for it, and its failure says so.)
        view["teardown_attempts"] = r.teardown_attempts
        retry = r.updated_at + backoff(r.teardown_attempts)
        view["teardown_retry_in_seconds"] = round(max(0.0, retry - now), 1)
    if status in (ReplicaStatus.STARTING, ReplicaStatus.NOT_READY):
        # What the last readiness probe got, while it is not READY (None before the first).
        probed = svc.rt.probes.get(r.id)
        view["last_probe"] = probed.last_error if probed is not None else None
    if status is ReplicaStatus.STARTING and r.launched_at is not None:
        # How long it has been trying, against how long it may (then FAILED_INITIAL_DELAY).
        view["starting_seconds"] = round(now - r.launched_at, 1)
        with contextlib.suppress(Exception):
            view["initial_delay_seconds"] = _initial_delay(svc.spec(r.version))
    return view


def _initial_delay(spec: ServiceSpec) -> float:
    return float(spec.service.readiness_probe.initial_delay_seconds)


def keyed_by_replica_id(
    stats: dict[str, dict[str, Any]], rows: list[ReplicaRow]
) -> dict[str, dict[str, Any]]:
    """The balancers' ``stats`` with each service's replicas and engines keyed by the replica's
    id within its service (what `status`, logs, events and `down --replica-id` say), not by the
    key unique to the home that the balancers count by. A key with no row left keeps its own."""
    ids: dict[str, dict[str, str]] = {}
    for row in rows:
        ids.setdefault(row.service, {})[str(row.id)] = str(row.seq or row.id)
    out = {}
    for name, st in stats.items():
        mine = ids.get(name, {})
        out[name] = {
            **st,
            "replicas": {mine.get(k, k): v for k, v in (st.get("replicas") or {}).items()},
            "engines": {mine.get(k, k): v for k, v in (st.get("engines") or {}).items()},
        }
    return out
