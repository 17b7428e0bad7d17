"""``corral dashboard``'s side of the login: ask the daemon (with the API token, which the CLI
reads from the home) for a one-time code and make it a link. The code is good for one sign-in
within two minutes, so the link may be printed on a terminal or in a shell history.

The daemon keeps one port per home across restarts (:mod:`corral.daemon_port`); when the one
it remembered was taken, the link goes to the new port and this says so on stderr (bookmarks
and tunnels to the old port need changing)."""

from __future__ import annotations

import sys

from corral.client import Client, ClientError, endpoint
from corral.home import read_info


def login_link(client: Client) -> str:
    answer = client.request("POST", "/v1/dashboard/login")
    if not isinstance(answer, dict) or not isinstance(answer.get("path"), str):
        raise ClientError("the daemon gave no dashboard login link (is it an older corral?)")
    moved = (read_info(client.home) or {}).get("port_moved")
    if isinstance(moved, str) and moved:
        sys.stderr.write(f"note: {moved}\n")
    return endpoint(client.home).url + str(answer["path"])
