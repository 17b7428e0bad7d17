"""The store's named replica transitions: typed states in, the same text in the state file out.

The states are str-valued enums so that a state file written before them (and the JSON the API
shows) stays byte-identical; a state the enums do not know is refused before anything is
written, so a misspelt state cannot reach a row.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from corral.replicas import LaunchState, ReplicaStatus, TeardownState, UpdateMode, replica_status
from corral.state import FailureKind, Store


def _raw(path: Path, replica_id: int) -> tuple[str, str | None]:
    db = sqlite3.connect(path)
    try:
        row = db.execute(
            "SELECT launch_state, teardown_state FROM replicas WHERE id = ?", (replica_id,)
        ).fetchone()
    finally:
        db.close()
    return row[0], row[1]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "state.db")
    store.create_service("s", "run: x", source=None, base_dir=None, lb_port=None)
    return store


def test_a_launch_and_teardown_write_the_plain_text_and_read_back_as_enums(
    store: Store, tmp_path: Path
) -> None:
    r = store.add_replica("s", 1, "local", "test")
    assert r.launch_state is LaunchState.PENDING and r.teardown_state is None
    store.mark_launch(r.id, LaunchState.RUNNING)
    store.record_handle(r.id, {"backend": "local", "data": {"pid": 1}}, "http://x", 5.0)
    store.mark_launch(r.id, LaunchState.SUCCEEDED)
    store.mark_ready(r.id, 6.0)
    row = store.replica(r.id)
    assert row is not None and replica_status(row) is ReplicaStatus.READY
    assert _raw(tmp_path / "state.db", r.id) == ("succeeded", None)
    row = store.mark_teardown(r.id, TeardownState.PENDING)
    assert row is not None and row.ready == 0 and row.teardown_state is TeardownState.PENDING
    store.mark_teardown(r.id, TeardownState.FAILED, attempts=1, failure="boom")
    row = store.replica(r.id)
    assert row is not None and row.teardown_attempts == 1 and row.failure == "boom"
    assert _raw(tmp_path / "state.db", r.id) == ("succeeded", "failed")
    # None clears the failure text; leaving it out keeps it.
    store.mark_teardown(r.id, TeardownState.SUCCEEDED)
    assert (store.replica(r.id) or row).failure == "boom"
    store.mark_teardown(r.id, TeardownState.SUCCEEDED, failure=None)
    assert (store.replica(r.id) or row).failure is None


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        (FailureKind.APP, ReplicaStatus.FAILED),
        (FailureKind.PREEMPTED, ReplicaStatus.PREEMPTED),
        (FailureKind.INITIAL_DELAY, ReplicaStatus.FAILED_INITIAL_DELAY),
    ],
)
def test_a_failure_kind_is_the_status_it_shows(
    store: Store, kind: FailureKind, status: ReplicaStatus
) -> None:
    r = store.add_replica("s", 1, "local", "test")
    store.mark_launch(r.id, LaunchState.SUCCEEDED)
    store.mark_failed(r.id, kind, "why", exit_code=3)
    row = store.replica(r.id)
    assert row is not None and replica_status(row) is status and row.failure == "why"
    assert row.exit_code == (3 if kind is FailureKind.APP else None)


def test_a_relaunch_forgets_what_was_started(store: Store) -> None:
    r = store.add_replica("s", 1, "local", "test")
    store.record_handle(r.id, {"backend": "local"}, "http://x", 1.0)
    store.mark_launch(r.id, LaunchState.RUNNING)
    store.mark_relaunch(r.id)
    row = store.replica(r.id)
    assert row is not None and row.launch_state is LaunchState.PENDING
    assert row.handle_json is None and row.endpoint is None


def test_a_state_the_enums_do_not_know_is_refused_before_it_is_written(
    store: Store, tmp_path: Path
) -> None:
    r = store.add_replica("s", 1, "local", "test")
    with pytest.raises(ValueError, match="pendng"):
        store.update_replica(r.id, launch_state="pendng")
    with pytest.raises(ValueError, match="done"):
        store.update_replica(r.id, teardown_state="done")
    assert _raw(tmp_path / "state.db", r.id) == ("pending", None)


def test_a_version_mode_reads_back_as_its_enum(store: Store) -> None:
    store.add_version(
        "s", "run: y", source=None, base_dir=None, mode="blue_green", adopt_live=False
    )
    row = store.version("s", 2)
    assert row is not None and row.mode is UpdateMode.BLUE_GREEN and row.mode == "blue_green"
