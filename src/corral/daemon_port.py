"""The daemon's API port (the dashboard's too): one address per home, kept across restarts.

A daemon started without ``--port`` listens on the port this home's last daemon used
(``$CORRAL_HOME/api.port``), so a restart, an upgrade or a SIGKILL and its respawn keep
bookmarks, SSH tunnels and signed-in dashboard tabs working (the dashboard's sessions are
kept in the home too, see :mod:`corral.dashboard.session`). The first start takes a free port
and remembers it. When the remembered port is taken by another process, the daemon says so
(who holds it, where it listens instead), takes a free one and remembers that; ``daemon.json``
carries the note so ``corral dashboard`` can tell the user the address moved.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import ssl
from pathlib import Path
from typing import Final

from aiohttp import web

from corral.ports import port_holders

log = logging.getLogger("corral.daemon")

PORT_FILE: Final = "api.port"


def remembered(home: Path) -> int | None:
    """The port this home's last daemon listened on, or None (never started, or unreadable)."""
    try:
        text = (home / PORT_FILE).read_text().strip()
    except OSError:
        return None
    if text.isascii() and text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    return None


def remember(home: Path, port: int) -> None:
    """Keep ``port`` for the next daemon of ``home`` (written whole, then renamed)."""
    tmp = home / (PORT_FILE + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(f"{port}\n")
        os.replace(tmp, home / PORT_FILE)


async def listen(
    runner: web.AppRunner,
    home: Path,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
) -> tuple[int, str | None]:
    """Start the API's site; returns the port it listens on and, when the remembered port
    could not be had, a sentence saying so. An explicit ``port`` is used as given (a failure
    to bind it is the caller's error); ``port`` 0 means this home's remembered port."""
    note = None
    wanted = port or remembered(home)
    if wanted:
        site = web.TCPSite(runner, host, wanted, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            await site.stop()  # registered with the runner by start(), listening nowhere
            if port or exc.errno != errno.EADDRINUSE:
                raise
            holders = port_holders(wanted)
            who = f" by {', '.join(holders)}" if holders else " by another process"
            note = f"the port this home used last ({wanted}) is taken{who}"
        else:
            remember(home, wanted)
            return wanted, None
    await web.TCPSite(runner, host, 0, ssl_context=ssl_context).start()
    actual = int(runner.addresses[0][1])
    if note:
        note += f": the API and the dashboard moved to port {actual}"
        log.warning("%s (bookmarks and tunnels to the old port no longer reach it)", note)
    remember(home, actual)
    return actual, note
