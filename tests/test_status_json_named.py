"""`corral status NAME --json` with no daemon to ask: an error naming why, never an empty
list with exit code 0 (which says to a script that the service does not exist while its
replicas and balancers may still serve)."""

from __future__ import annotations

import json

from conftest import CorralHome

from corral.state import Store


def test_named_status_json_without_a_daemon_is_an_error(corral_home: CorralHome) -> None:
    corral_home.path.mkdir(parents=True, exist_ok=True)
    store = Store(corral_home.path / "state.db")
    store.create_service("kept", "run: x", source=None, base_dir=None, lb_port=None)
    try:
        named = corral_home.run("status", "kept", "--json", check=False)
        assert named.returncode == 1, named
        document = json.loads(named.stdout)
        assert document["services"] == []
        assert "corral daemon start" in document["error"], document
        # Without a name, the documented answer stays: no service known, exit 0.
        listing = corral_home.run("status", "--json", check=False)
        assert listing.returncode == 0 and json.loads(listing.stdout) == {"services": []}
    finally:
        for db in corral_home.path.glob("state.db*"):
            db.unlink()  # no service for the fixture to take down
