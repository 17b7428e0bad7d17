"""The state file: schema, migrations, facts in and out, concurrency from threads."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from corral.state import SCHEMA_VERSION, StateError, Store


def test_schema_version_and_wal(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.close()
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"services", "versions", "replicas", "events"} <= tables


def test_reopen_is_idempotent_and_keeps_rows(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source="/x.yaml", base_dir="/", lb_port=1234)
    store.close()
    again = Store(tmp_path / "state.db")
    svc = again.service("a")
    assert svc is not None and svc.lb_port == 1234 and svc.current_version == 1
    version = again.version("a", 1)
    assert version is not None and version.spec_yaml == "run: x" and version.source == "/x.yaml"


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Store(tmp_path / "state.db").close()
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StateError, match="newer than this corral"):
        Store(tmp_path / "state.db")


def test_unusable_file_is_a_state_error(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StateError, match="cannot open state file"):
        Store(path)


def test_duplicate_service_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source=None, base_dir=None, lb_port=None)
    with pytest.raises(KeyError):
        store.create_service("a", "run: y", source=None, base_dir=None, lb_port=None)
    version = store.version("a", 1)
    assert version is not None and version.spec_yaml == "run: x"


def test_replica_facts_round_trip_and_events(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source=None, base_dir=None, lb_port=None)
    r = store.add_replica("a", 1, "local", "target 1")
    assert r.launch_state == "pending" and r.teardown_state is None and r.handle_data is None
    updated = store.update_replica(
        r.id, launch_state="running", handle={"backend": "local", "data": {"pid": 42}}
    )
    assert updated is not None
    assert updated.launch_state == "running"
    assert updated.handle_data == {"backend": "local", "data": {"pid": 42}}
    with pytest.raises(ValueError, match="not replica facts"):
        store.update_replica(r.id, status="READY")
    store.event("a", "replica.ready", None, replica_id=r.id)
    actions = [e.action for e in store.events("a")]
    assert actions == ["service.create", "replica.create", "replica.ready"]
    assert [e.action for e in store.events("a", after=2)] == ["replica.ready"]


def test_delete_service_removes_everything(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source=None, base_dir=None, lb_port=None)
    store.add_replica("a", 1, "local", "t")
    store.delete_service("a")
    assert store.service("a") is None
    assert store.replicas("a") == []
    assert store.version("a", 1) is None


def test_writes_from_many_threads(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source=None, base_dir=None, lb_port=None)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                r = store.add_replica("a", 1, "local", "t")
                store.update_replica(r.id, launch_state="running")
                store.event("a", "x", None, replica_id=r.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    rows = store.replicas("a")
    assert len(rows) == 400
    assert len({r.id for r in rows}) == 400
    assert all(r.launch_state == "running" for r in rows)


def test_migrates_a_version_1_file(tmp_path: Path) -> None:
    """A state file written by the first schema opens with every row kept."""
    from corral.state import _MIGRATIONS, _split

    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    for statement in _split(_MIGRATIONS[0]):
        db.execute(statement)
    db.execute("PRAGMA user_version = 1")
    db.execute(
        "INSERT INTO services (name, current_version, created_at, updated_at)"
        " VALUES ('old', 1, 0, 0)"
    )
    db.execute(
        "INSERT INTO versions (service, version, spec_yaml, created_at)"
        " VALUES ('old', 1, 'run: x', 0)"
    )
    db.commit()
    db.close()
    store = Store(path)
    version = store.version("old", 1)
    assert version is not None and version.spec_yaml == "run: x" and version.mode == "rolling"
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_add_version_in_place_relabels_live_replicas(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("a", "run: x", source=None, base_dir=None, lb_port=None)
    live = store.add_replica("a", 1, "local", "t")
    leaving = store.add_replica("a", 1, "local", "t")
    store.update_replica(leaving.id, teardown_state="running")
    store.mark_version_ready("a", 1)
    version = store.add_version(
        "a",
        "run: x\nservice: {replicas: 2}",
        source=None,
        base_dir=None,
        mode="rolling",
        adopt_live=True,
    )
    assert version == 2
    assert store.replica(live.id).version == 2  # type: ignore[union-attr]
    assert store.replica(leaving.id).version == 1  # type: ignore[union-attr]
    new = store.version("a", 2)
    assert new is not None and new.first_ready_at is not None
    svc = store.service("a")
    assert svc is not None and svc.current_version == 2
    relaunch = store.add_version(
        "a", "run: y", source=None, base_dir=None, mode="blue_green", adopt_live=False
    )
    assert relaunch == 3 and store.replica(live.id).version == 2  # type: ignore[union-attr]
    assert store.version("a", 3).mode == "blue_green"  # type: ignore[union-attr]
