"""A replica whose teardown failed (FAILED_CLEANUP) may still run, and its teardown is tried
again with backoff for as long as it fails. `status` said only FAILED_CLEANUP: not that
corral keeps trying, nor when the next attempt comes."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

from corral import cliview
from corral.replicas import ReplicaStatus, TeardownState
from corral.state import ReplicaRow
from corral.views import replica_view


def row(**facts: Any) -> ReplicaRow:
    now = time.time()
    base: dict[str, Any] = {
        "id": 7,
        "service": "svc",
        "version": 1,
        "infra": "local",
        "launch_state": "succeeded",
        "teardown_state": None,
        "teardown_attempts": 0,
        "endpoint": None,
        "handle_json": None,
        "launched_at": now - 60,
        "first_ready_at": now - 50,
        "ready": 0,
        "app_failed": 0,
        "exit_code": None,
        "preempted": 0,
        "probe_failed": 0,
        "initial_delay_failed": 0,
        "scale_down": 1,
        "failure": "teardown failed: backend down",
        "created_at": now - 60,
        "updated_at": now,
        "seq": 3,
    }
    return ReplicaRow(**{**base, **facts})


def test_a_failed_teardown_says_when_it_is_tried_again() -> None:
    svc = cast(Any, SimpleNamespace(rt=SimpleNamespace(hung={})))
    now = time.time()
    r = row(teardown_state=TeardownState.FAILED, teardown_attempts=4, updated_at=now - 3)
    view = replica_view(svc, r, ReplicaStatus.FAILED_CLEANUP, now)
    assert view["teardown_attempts"] == 4
    assert view["teardown_retry_in_seconds"] == 5.0  # backoff(4) = 8 s from its last failure
    assert cliview.status_text(view) == "FAILED_CLEANUP (teardown attempt 5 in 5s)"
    due = replica_view(
        svc,
        row(teardown_state=TeardownState.FAILED, updated_at=now - 60),
        ReplicaStatus.FAILED_CLEANUP,
        now,
    )
    assert cliview.status_text(due) == "FAILED_CLEANUP (teardown attempt 1 now)"
    # An abandoned attempt still inside its backend call: the next waits for it.
    stuck = cast(
        Any, SimpleNamespace(rt=SimpleNamespace(hung={7: SimpleNamespace(returned=lambda: False)}))
    )
    assert "teardown_retry_in_seconds" not in replica_view(
        stuck, r, ReplicaStatus.FAILED_CLEANUP, now
    )
