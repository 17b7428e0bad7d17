"""Replica and service statuses derived from facts, and the scale-down order."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from corral.replicas import (
    ReplicaStatus,
    ServiceStatus,
    is_live,
    replica_status,
    scale_down_victims,
    service_status,
)


@dataclass(frozen=True)
class Facts:
    id: int = 1
    version: int = 1
    launch_state: str = "succeeded"
    teardown_state: str | None = None
    first_ready_at: float | None = None
    ready: int = 0
    app_failed: int = 0
    preempted: int = 0
    probe_failed: int = 0
    initial_delay_failed: int = 0
    scale_down: int = 0


@pytest.mark.parametrize(
    ("facts", "status"),
    [
        (Facts(launch_state="pending"), ReplicaStatus.PENDING),
        (Facts(launch_state="running"), ReplicaStatus.PROVISIONING),
        (Facts(), ReplicaStatus.STARTING),
        (Facts(ready=1, first_ready_at=1.0), ReplicaStatus.READY),
        (Facts(ready=0, first_ready_at=1.0), ReplicaStatus.NOT_READY),
        (Facts(launch_state="failed"), ReplicaStatus.FAILED_PROVISION),
        (Facts(app_failed=1), ReplicaStatus.FAILED),
        (Facts(initial_delay_failed=1), ReplicaStatus.FAILED_INITIAL_DELAY),
        (Facts(probe_failed=1, first_ready_at=1.0), ReplicaStatus.FAILED_PROBING),
        (Facts(preempted=1), ReplicaStatus.PREEMPTED),
        (Facts(teardown_state="running", ready=1), ReplicaStatus.SHUTTING_DOWN),
        (Facts(teardown_state="pending", app_failed=1), ReplicaStatus.SHUTTING_DOWN),
        # A failure stays visible after the teardown that cleaned it up.
        (Facts(teardown_state="succeeded", app_failed=1), ReplicaStatus.FAILED),
        (Facts(teardown_state="failed", app_failed=1), ReplicaStatus.FAILED_CLEANUP),
        (Facts(launch_state="cancelled"), ReplicaStatus.SHUTTING_DOWN),
    ],
)
def test_status_from_facts(facts: Facts, status: ReplicaStatus) -> None:
    assert replica_status(facts) is status


def test_live_excludes_failed_and_leaving() -> None:
    assert is_live(Facts(ready=1, first_ready_at=1.0))
    assert not is_live(Facts(app_failed=1))
    assert not is_live(Facts(scale_down=1, ready=1, first_ready_at=1.0))
    assert not is_live(Facts(teardown_state="pending"))


def test_scale_down_order_old_versions_then_least_useful() -> None:
    ready_new = Facts(id=1, version=2, ready=1, first_ready_at=1.0)
    pending_new = Facts(id=2, version=2, launch_state="pending")
    ready_old = Facts(id=3, version=1, ready=1, first_ready_at=1.0)
    starting_new = Facts(id=4, version=2)
    not_ready_new = Facts(id=5, version=2, first_ready_at=1.0)
    failed = Facts(id=6, version=1, app_failed=1)
    pool = [ready_new, pending_new, ready_old, starting_new, not_ready_new, failed]
    order = [r.id for r in scale_down_victims(pool, 5, current_version=2)]
    assert order == [3, 2, 4, 5, 1]
    assert [r.id for r in scale_down_victims(pool, 2, current_version=2)] == [3, 2]
    assert scale_down_victims(pool, 0, current_version=2) == []


def test_scale_down_prefers_newest_among_equals() -> None:
    a, b = Facts(id=1, ready=1, first_ready_at=1.0), Facts(id=2, ready=1, first_ready_at=1.0)
    assert [r.id for r in scale_down_victims([a, b], 1, current_version=1)] == [2]


def test_service_status() -> None:
    ready, starting = ReplicaStatus.READY, ReplicaStatus.STARTING
    kw = {"shutting_down": False, "gave_up": False, "controller_running": True}
    assert service_status([ready, starting], **kw) is ServiceStatus.READY
    assert service_status([starting], **kw) is ServiceStatus.REPLICA_INIT
    assert service_status([], **kw) is ServiceStatus.NO_REPLICA
    assert service_status([ReplicaStatus.FAILED], **{**kw, "gave_up": True}) is ServiceStatus.FAILED
    assert service_status([ready], **{**kw, "shutting_down": True}) is ServiceStatus.SHUTTING_DOWN
    assert (
        service_status([ReplicaStatus.FAILED_CLEANUP, ready], **kw) is ServiceStatus.FAILED_CLEANUP
    )
    assert service_status([], **{**kw, "controller_running": False}) is (
        ServiceStatus.CONTROLLER_INIT
    )
    assert replace(Facts(), id=9).id == 9


def test_a_backends_runtime_error_is_shown_in_its_own_words() -> None:
    """A replica's failure in `status` says what the backend said ("setup did not finish
    within 2s ..."), not "RuntimeError('setup did not finish ...')"; any other type keeps its
    name, the clue to an error nobody meant to raise."""
    from corral.errors import in_words

    assert in_words(RuntimeError("setup did not finish within 2s")) == (
        "setup did not finish within 2s"
    )
    assert in_words(KeyError("x")) == "KeyError('x')"
    assert in_words(RuntimeError()) == "RuntimeError()"
    assert in_words(None) == "None"
