"""State that refuses to be lost: a state file that lost what the home had is never taken for
"no services", the running replicas are never killed for it, and a backup brings it back.

Real daemon, real replicas, real SQLite files.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest
from conftest import CorralHome, pid_alive, spec_text, wait_for, write_spec

pytestmark = pytest.mark.timeout(150)


def _up_one(home: CorralHome, tmp_path: Path) -> int:
    home.run("up", str(write_spec(tmp_path / "keep.yaml", spec_text("keep", 1))))
    svc = home.wait_replicas("keep", 1)
    return int(svc["replicas"][0]["pid"])


def _break(db: Path, how: str) -> None:
    for suffix in ("-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    if how == "empty":
        db.write_bytes(b"")
    elif how == "truncated":
        db.write_bytes(db.read_bytes()[:100])
    elif how == "foreign":
        db.unlink()
        conn = sqlite3.connect(db)
        conn.execute("CREATE TABLE notes (text TEXT)")
        conn.commit()
        conn.close()


@pytest.mark.parametrize("how", ["empty", "truncated", "foreign"])
def test_a_lost_state_file_is_refused_and_restored(
    corral_home: CorralHome, tmp_path: Path, how: str
) -> None:
    pid = _up_one(corral_home, tmp_path)
    corral_home.stop_daemon(signal.SIGTERM)  # a clean stop takes a backup
    db = corral_home.path / "state.db"
    assert (corral_home.path / "state.db.backup").exists()
    _break(db, how)

    started = corral_home.run("daemon", "start", check=False)
    assert started.returncode != 0
    said = started.stdout + started.stderr
    assert "refusing to start" in said and "corral daemon restore" in said, said
    assert pid_alive(pid), "a replica was killed over a lost state file"
    assert corral_home.daemon_info() is None

    restored = corral_home.run("daemon", "restore")
    assert "restored" in restored.stdout and "1 service(s)" in restored.stdout, restored.stdout
    assert list(corral_home.path.glob("state.db.broken-*")), "the broken file was not kept"
    corral_home.run("daemon", "start")
    svc = corral_home.wait_replicas("keep", 1)
    assert int(svc["replicas"][0]["pid"]) == pid, "the running replica was not adopted"


def test_a_deleted_state_file_ends_the_home_and_restore_brings_it_back(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """docs/reliability.md listed "missing" with the files whose replicas are kept, and the
    refusal said "no replica was stopped", while the workers take a deleted state file for
    the home's end (corral.ownership) and end its replicas: say so, and restore still works."""
    pid = _up_one(corral_home, tmp_path)
    corral_home.stop_daemon(signal.SIGTERM)  # a clean stop takes a backup; the workers serve on
    db = corral_home.path / "state.db"
    for path in (db, db.with_name("state.db-wal"), db.with_name("state.db-shm")):
        path.unlink(missing_ok=True)
    wait_for(lambda: not pid_alive(pid), 20, "the workers to end the replica of a gone home")

    started = corral_home.run("daemon", "start", check=False)
    said = started.stdout + started.stderr
    assert started.returncode != 0 and "is missing" in said, said
    assert "no replica was stopped" not in said and "replicas were ended" in said, said
    corral_home.run("daemon", "restore")
    corral_home.run("daemon", "start")
    svc = corral_home.wait_replicas("keep", 1)
    (ready,) = [r for r in svc["replicas"] if r["status"] == "READY"]
    assert int(ready["pid"]) != pid  # a new process: the old one was ended with the file


def test_restore_refuses_while_a_daemon_runs(corral_home: CorralHome, tmp_path: Path) -> None:
    _up_one(corral_home, tmp_path)
    result = corral_home.run("daemon", "restore", check=False)
    assert result.returncode != 0
    assert "stop it first" in result.stdout + result.stderr


def test_the_sweep_spares_a_replica_the_state_file_does_not_know(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Restored from a backup older than a replica: that replica is not provably a leftover
    (its row was never in this file), so the sweep reports it and does not kill it."""
    corral_home.run("up", str(write_spec(tmp_path / "old.yaml", spec_text("old", 1))))
    corral_home.wait_replicas("old", 1)
    corral_home.stop_daemon(signal.SIGTERM)
    backup = tmp_path / "older.db"
    (corral_home.path / "state.db.backup").replace(backup)
    corral_home.start_daemon()
    pid = _up_one(corral_home, tmp_path)  # a replica the older backup does not know
    corral_home.stop_daemon(signal.SIGTERM)
    corral_home.run("daemon", "restore", "--from", str(backup))
    corral_home.start_daemon()
    corral_home.wait_replicas("old", 1)
    wait_for(lambda: "spared pid" in corral_home.tail("daemon.log", 200), 10, "the sweep report")
    assert pid_alive(pid), "the sweep killed a replica it could not prove to be a leftover"
    assert corral_home.service("keep") is None
    # Nothing of corral's knows it any more: the test stops it, by its process group.
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, "the spared replica to stop")
