"""``corral dashboard``'s side of the login: ask the daemon (with the API token, which the CLI
reads from the home) for a one-time code and make it a link. The code is good for one sign-in
within two minutes, so the link may be printed on a terminal or in a shell history."""

from __future__ import annotations

from corral.client import Client, ClientError, endpoint


def login_link(client: Client) -> str:
    answer = client.request("POST", "/v1/dashboard/login")
    if not isinstance(answer, dict) or not isinstance(answer.get("path"), str):
        raise ClientError("the daemon gave no dashboard login link (is it an older corral?)")
    return endpoint(client.home).url + str(answer["path"])
