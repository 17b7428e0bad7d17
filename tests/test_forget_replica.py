"""A replica's row and its last event go together (``Store.forget_replica``).

They were two writes, the event first so that no row went without a word. A daemon killed
between them kept the row; the next daemon repeated the replica's end and wrote the event
again: `replica.terminated` twice for one replica (and `replica.purge` twice for a purge the
CLI sent again after the crash cut it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import CorralHome, spec_text, write_spec

from corral.state import StateError, Store

# The real daemon, killed (as SIGKILL) right after its first write of a `replica.terminated`
# event: as two writes, before the row's delete; as one, after both.
DIES_AFTER_TERMINATED = """
import asyncio, functools, os, sys
from pathlib import Path
from corral import state
from corral.bootstrap import serve

def dying(method, *positions):
    @functools.wraps(method)
    def write(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if "replica.terminated" in [args[p] for p in positions if p < len(args)]:
            os._exit(137)
        return result
    return write

state.Store.event = dying(state.Store.event, 1)
if hasattr(state.Store, "forget_replica"):
    state.Store.forget_replica = dying(state.Store.forget_replica, 2)
asyncio.run(serve(Path(sys.argv[1])))
"""


def test_a_replica_ended_across_a_crash_is_told_once(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    argv = [sys.executable, "-c", DIES_AFTER_TERMINATED, str(corral_home.path)]
    daemon = corral_home.start_daemon(argv=argv)
    corral_home.run("up", str(write_spec(tmp_path / "s.yaml", spec_text("once", 1))))
    corral_home.run("down", "once", "--replica-id", "1", "-y", check=False)
    corral_home.wait_for(lambda: not corral_home.healthy(), 30, "the daemon to die")
    assert corral_home.daemon_pid() == daemon
    corral_home._reap()
    corral_home.start_daemon()
    corral_home.wait_for(
        lambda: (
            corral_home.service("once")
            and not corral_home.db_rows(
                "SELECT id FROM replicas WHERE service = 'once' AND seq = 1"
            )
        ),
        30,
        "replica 1 gone",
    )
    told = corral_home.db_rows(
        "SELECT action FROM events WHERE service = 'once' AND replica = 1"
        " AND action = 'replica.terminated'"
    )
    assert len(told) == 1, told


def test_the_row_and_its_event_go_together_or_not_at_all(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.create_service("web", "name: web", source=None, base_dir=None, lb_port=None)
    row = store.add_replica("web", 1, "local", "test")
    store._execute(
        "CREATE TRIGGER cut BEFORE DELETE ON replicas"
        " BEGIN SELECT RAISE(ABORT, 'the daemon died here'); END"
    )
    with pytest.raises(StateError, match="the daemon died here"):
        store.forget_replica("web", row.id, "replica.purge", "FAILED; purged")
    assert store.replica(row.id) is not None
    assert [e.action for e in store.events("web") if e.action == "replica.purge"] == []
    store._execute("DROP TRIGGER cut")
    store.forget_replica("web", row.id, "replica.purge", "FAILED; purged")
    assert store.replica(row.id) is None
    (purged,) = [e for e in store.events("web") if e.action == "replica.purge"]
    assert (purged.replica, purged.reason) == (row.seq, "FAILED; purged")
