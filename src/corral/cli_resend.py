"""A request of `up`, `update` or `down` that the daemon's own crash cut: sent again, or not.

The balancer workers start a crashed daemon again within seconds (docs/reliability.md). A
request the daemon was handling when it died gets no answer: the connection is cut
(:class:`DaemonUnreachable`). The CLI used to end there, advising `corral daemon start` while
the workers were already starting a daemon, and what was asked was perhaps left undone
(a `down` lost: the service kept serving). Here the CLI waits for the new daemon, as the
waits of :mod:`corral.cli_wait` do, and then:

* ``down`` is sent again: it is idempotent (a service going down is asked to go down again;
  one already gone answers 404, which here means the first request did its work, as the
  service was listed a moment before).
* ``up`` and ``update`` are not idempotent (a second update makes a second version), so they
  are sent again only when the first one provably was not applied. Each is stored in one
  transaction of the state file, which the killed daemon either committed or not, and a
  restarted daemon never replays a request: once it answers, the service's state is final
  for this request. A version stored after the request was sent (the CLI and the daemon read
  the same clock: only a local home's daemon is respawned) is this request's, applied: the
  command goes on with it. None such (or no service, for `up`): not applied, sent again. The
  one case this could misread, another client storing a version of the same service within
  the same moment, would have raced this command anyway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from corral.cli_common import say
from corral.cli_nodaemon import await_respawn, respawn_expected
from corral.client import ENV_API_URL, Client, ClientError, DaemonUnreachable
from corral.home import read_info

# As long as the waits of `up`/`update`/`down` wait for a respawn (cli_wait.RESPAWN_PATIENCE).
RESPAWN_PATIENCE = 30.0
# A request cut again by the next daemon's crash is sent at most this often in all.
ATTEMPTS = 3


def _back(client: Client, exc: ClientError, doing: str) -> None:
    """Return once a daemon the workers started again answers; else raise ``exc``, or when a
    restart was under way and is late, an error saying so (not "start one": that would race
    the workers' own start)."""
    if not isinstance(exc, DaemonUnreachable):
        raise exc
    if await_respawn(client, say, RESPAWN_PATIENCE):
        return
    if os.environ.get(ENV_API_URL) or not respawn_expected(client.home):
        raise exc
    raise DaemonUnreachable(
        f"the corral daemon stopped while {doing}, and its balancer workers have not started "
        f"it again within {RESPAWN_PATIENCE:g}s: `corral daemon status` shows whether it is "
        "back (`corral daemon start` if none runs), and `corral status` what was done"
    ) from None


def down(client: Client, name: str, *, purge: bool) -> None:
    """``client.down``, sent again after the daemon's crash cut it (see the module)."""
    for attempt in range(ATTEMPTS):
        try:
            client.down(name, purge=purge)
            return
        except ClientError as exc:
            if attempt and exc.status == 404:
                return  # the cut request took it down, and it is gone already
            if attempt == ATTEMPTS - 1:
                raise
            _back(client, exc, f"taking {name} down")
        say(f"the daemon restarted: asking again to take {name} down (down is idempotent)")


def terminate_replica(client: Client, name: str, replica: int, *, purge: bool) -> str:
    """``client.terminate_replica``, sent again after the daemon's crash cut it: the state it
    asks for is the same however often it is asked (a second ask of a replica the first one
    retired answers that it is shutting down already, which is then what happened)."""
    for attempt in range(ATTEMPTS):
        try:
            return client.terminate_replica(name, replica, purge=purge)
        except ClientError as exc:
            done = _done_before(exc, name, replica, purge=purge) if attempt else None
            if done is not None:
                return done
            if attempt == ATTEMPTS - 1:
                raise
            _back(client, exc, f"taking replica {replica} of {name} down")
        say(f"the daemon restarted: asking again to take replica {replica} of {name} down")
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _done_before(exc: ClientError, name: str, replica: int, *, purge: bool) -> str | None:
    """What a cut request to take a replica down did, read from the refusal of the same
    request sent again: the replica shutting down already (409, ``shutting_down``), or gone
    (404: torn down and forgotten, or purged); None for a refusal it did not cause."""
    if exc.status == 409 and isinstance(exc.body, dict) and exc.body.get("shutting_down"):
        return f"replica {replica} of {name} is shutting down (asked before the daemon restarted)"
    if exc.status == 404:
        gone = "forgotten" if purge else "gone"
        return f"replica {replica} of {name} is {gone} (asked before the daemon restarted)"
    return None


def _daemon_pid(client: Client) -> int | None:
    """The pid of the home's daemon (its ``daemon.json``), to tell a respawn from a slow one."""
    info = read_info(client.home)
    return int(info["pid"]) if info and info.get("pid") else None


def _stored_since(service: dict[str, Any], sent: float) -> int | None:
    """The newest version of ``service`` stored at or after ``sent`` (epoch s), if any."""
    newer = [int(v["version"]) for v in service.get("versions") or () if v["created_at"] >= sent]
    return max(newer, default=None)


def deploy(
    client: Client, name: str, send: Callable[[], dict[str, Any]], *, create: bool
) -> dict[str, Any]:
    """``send()`` (a create, or an update of ``name``), sent again after the daemon's crash
    cut it only when it was not applied (see the module); the service as `send` answers it,
    its ``version`` the one this request stored."""
    doing = f"creating {name}" if create else f"storing a new version of {name}"
    for attempt in range(ATTEMPTS):
        sent, daemon = time.time(), _daemon_pid(client)
        try:
            return send()
        except ClientError as exc:
            if attempt == ATTEMPTS - 1:
                raise
            _back(client, exc, doing)
            if os.environ.get(ENV_API_URL) or daemon is None or _daemon_pid(client) == daemon:
                # The same daemon answers: no crash cut it (its answer was late, say, a large
                # workdir still being copied), and it may yet store it: never sent twice. Nor
                # where that cannot be told: a remote one ($CORRAL_API_URL), whose pid this
                # home's daemon.json does not hold and whose clock is not this machine's.
                raise
        try:
            service = client.service(name)
        except ClientError as exc:
            if not (create and exc.status == 404):
                raise
            service = {}
        version = _stored_since(service, sent)
        if version is not None:
            say(f"the daemon restarted after {doing} (version {version} stored): going on")
            return {**service, "version": version}
        say(f"the daemon restarted before {doing} was stored: sending it again")
    raise AssertionError("unreachable")  # the last attempt returns or raises
