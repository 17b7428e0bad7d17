"""`corral status NAME --json` with no daemon to ask: an error naming why, never an empty
list with exit code 0 (which says to a script that the service does not exist while its
replicas and balancers may still serve)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import CorralHome

from corral.cli_status import matching
from corral.client import ClientError
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


def test_named_status_json_in_a_home_without_services_is_json(corral_home: CorralHome) -> None:
    """No daemon and no service: the name is not there, said as JSON on stdout (README, "--json
    output"), not only as a line on stderr with nothing for a script to parse."""
    corral_home.path.mkdir(parents=True, exist_ok=True)
    named = corral_home.run("status", "nosuch", "--json", check=False)
    assert named.returncode == 1, named
    document = json.loads(named.stdout)
    assert document["services"] == []
    assert "no service matches nosuch" in document["error"], document


class _Listing:
    """A daemon's client that lists these services (all `matching` asks of one)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def services(self) -> list[dict[str, str]]:
        return [{"name": name} for name in self.names]


def test_a_glob_matching_nothing_is_a_client_error() -> None:
    """Raised as a missing name is (the daemon's 404), so `status --json` answers it as JSON
    and `down` says it as before; it once exited from inside, printing no JSON."""
    web: Any = _Listing(["web"])
    with pytest.raises(ClientError, match="no service matches 'svc-\\*'"):
        matching(web, ("svc-*",))
    both: Any = _Listing(["svc-a", "web"])
    assert [s["name"] for s in matching(both, ("svc-*",))] == ["svc-a"]
