"""Is a service's port answered by its balancer workers alone?

SO_REUSEPORT lets any process of the same user join a port's listeners, and a socket bound to a
more specific address (``127.0.0.1`` where ours has ``0.0.0.0``) takes the connections meant
for it. So a program that bound a service's port while no corral process ran would get some or
all of the service's traffic, with the service still READY. The workers bind the address
clients use (the endpoint's, ``127.0.0.1`` by default), which a more specific bind cannot
shadow, and the daemon compares, every ``PORT_CHECK_INTERVAL``, the sockets listening on each
service's port (``ports.listening_on``, no descriptor of anyone's needed) with the socket inodes its
workers report holding. A listener that is not one of theirs, seen twice in a row (a worker
just started has not reported its own yet), is the service's problem: in ``balancer_errors``,
an event, the dashboard, and the service is not READY until it goes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from corral.ports import listening_on, reaches, socket_owner

PORT_CHECK_INTERVAL: Final = 2.0


def foreign_listeners(
    routes: Mapping[str, tuple[str, int]], ours: set[int]
) -> dict[str, list[tuple[str, int]]]:
    """Per service, the (address, inode) of sockets on its port that may take its connections
    and are not its workers'."""
    found: dict[str, list[tuple[str, int]]] = {}
    listening = listening_on({port for _, port in routes.values()})
    for name, (host, port) in routes.items():
        extra = [
            (address, inode)
            for address, inode in listening.get(port, ())
            if inode not in ours and reaches(address, host)
        ]
        if extra:
            found[name] = extra
    return found


def describe(port: int, sockets: list[tuple[str, int]]) -> str:
    """The problem in one line, naming the other process where this user may see it."""
    address, inode = sockets[0]
    owner = socket_owner(inode) or "a process this user cannot see"
    return (
        f"another process listens on {address}:{port} too ({owner}) and takes connections "
        "meant for this service: stop it, or move the service with `corral update`"
    )


class PortWatch:
    """The problems found so far, debounced: a foreign listener counts once seen twice."""

    def __init__(self) -> None:
        self.problems: dict[str, str] = {}
        self._seen: set[tuple[str, int]] = set()
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Whether PORT_CHECK_INTERVAL has passed since the last look (and so, a look now)."""
        if now < self._next:
            return False
        self._next = now + PORT_CHECK_INTERVAL
        return True

    def check(
        self, routes: Mapping[str, tuple[str, int]], reports: Sequence[Mapping[str, Any]]
    ) -> list[str]:
        """Look again, ``reports`` being the workers' latest per-service reports (each lists
        the socket inodes it listens on); return the services whose problem is new."""
        ours = {int(inode) for report in reports for inode in report.get("inodes") or ()}
        found = foreign_listeners(routes, ours)
        seen = {(name, inode) for name, sockets in found.items() for _, inode in sockets}
        confirmed = {
            name: [s for s in sockets if (name, s[1]) in self._seen]
            for name, sockets in found.items()
        }
        self._seen = seen
        new = []
        for name in list(self.problems):
            if not confirmed.get(name):
                del self.problems[name]
        for name, sockets in confirmed.items():
            if sockets and name not in self.problems:
                self.problems[name] = describe(routes[name][1], sockets)
                new.append(name)
        return new
