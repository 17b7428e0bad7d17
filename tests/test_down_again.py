"""A `down` asked again, and a `down` cut by the daemon's crash between its writes.

The CLI sends a `down` again when the daemon's crash cut its answer (corral.cli_resend), and a
person re-runs `corral down` on a service still going down. The second ask wrote a second
``service.down`` event, and one without ``--purge`` cleared the purge the first one asked (the
failed replicas the user asked to forget were kept). And the shutdown and its event were two
writes: a daemon killed between them left a service going down that no event said was asked.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from conftest import spec_text

from corral.daemon import Daemon
from corral.errors import NoSuchService
from corral.state import StateError, Store


def _daemon(tmp_path: Path) -> tuple[Daemon, Store]:
    store = Store(tmp_path / "state.db")
    store.create_service("web", spec_text("web", 1), source=None, base_dir=None, lb_port=None)
    daemon = Daemon(tmp_path, store, mock.MagicMock(capacity=None))
    daemon.controllers["web"] = mock.MagicMock()
    return daemon, store


def _downs(store: Store) -> list[tuple[str, str | None]]:
    return [
        (e.action, e.reason)
        for e in store.events("web")
        if e.action in ("service.down", "service.purge")
    ]


def test_a_down_asked_again_keeps_the_purge_and_writes_one_down_event(tmp_path: Path) -> None:
    daemon, store = _daemon(tmp_path)
    daemon.down("web", purge=True)
    daemon.down("web", purge=False)  # re-run without --purge, or re-sent by the CLI
    svc = store.service("web")
    assert svc is not None and svc.purge == 1
    daemon.down("web", purge=True)
    svc = store.service("web")
    assert svc is not None and svc.intent == "shutting_down" and svc.purge == 1
    assert _downs(store) == [("service.down", "purge")]


def test_a_purge_asked_by_a_later_down_is_kept_and_said(tmp_path: Path) -> None:
    daemon, store = _daemon(tmp_path)
    daemon.down("web", purge=False)
    daemon.down("web", purge=False)
    daemon.down("web", purge=True)
    svc = store.service("web")
    assert svc is not None and svc.purge == 1
    assert _downs(store) == [
        ("service.down", None),
        ("service.purge", "asked by a later down"),
    ]


def test_a_down_is_stored_with_its_event_or_not_at_all(tmp_path: Path) -> None:
    """The event's write fails (as a daemon killed right before it): the shutdown must not
    be stored without it, so the next daemon never finds a `down` no event explains."""
    daemon, store = _daemon(tmp_path)
    trap = Store(tmp_path / "state.db")
    trap._execute(
        "CREATE TRIGGER cut BEFORE INSERT ON events WHEN NEW.action = 'service.down'"
        " BEGIN SELECT RAISE(ABORT, 'the daemon died here'); END"
    )
    trap.close()
    with pytest.raises(StateError, match="the daemon died here"):
        daemon.down("web", purge=True)
    svc = store.service("web")
    assert svc is not None and svc.intent == "running" and svc.purge == 0


def test_a_down_of_a_service_removed_meanwhile_is_no_such_service(tmp_path: Path) -> None:
    """Its controller not yet forgotten, its row gone: 404 (the CLI's re-sent `down` reads it
    as done), not a shutdown of nothing and an event for a service that is gone."""
    daemon, store = _daemon(tmp_path)
    store.delete_service("web")
    with pytest.raises(NoSuchService, match="no service named"):
        daemon.down("web", purge=False)
    assert _downs(store) == []
