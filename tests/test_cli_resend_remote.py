"""`up`/`update` cut through $CORRAL_API_URL (corral.cli_resend.deploy): never sent again.

The resend rule compares the CLI's clock with the daemon's and tells a crash from a late
answer by the local home's ``daemon.json``; a remote daemon has neither (its clock is another
machine's, its pid is not in this home). A remote update that timed out while the daemon
was still storing it (a large workdir copying) was sent again: two versions stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral import cli_resend
from corral.client import ENV_API_URL, DaemonUnreachable


class _Remote:
    """A remote daemon that answers health and service, and stores each update it gets."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.sent = 0

    def health(self) -> bool:
        return True

    def service(self, name: str) -> dict[str, Any]:
        return {"name": name, "versions": [{"version": 1, "created_at": 0.0}]}


def test_remote_update_cut_is_not_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_API_URL, "https://127.0.0.1:1")
    client = _Remote(tmp_path)  # a home without daemon.json: the daemon is elsewhere

    def send() -> dict[str, Any]:
        client.sent += 1  # the remote daemon got it, and stores it after the client gave up
        raise DaemonUnreachable("it did not answer in time (test)")

    with pytest.raises(DaemonUnreachable):
        cli_resend.deploy(client, "web", send, create=False)  # type: ignore[arg-type]
    assert client.sent == 1
