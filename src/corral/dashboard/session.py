"""Who may see the dashboard: one-time login codes and browser sessions, kept in memory.

The API's bearer token cannot go in a browser's every request without living in JavaScript
(where any injected script could read it) or in a URL (history, logs). So the token, or a
one-time code that the token holder asked for, is exchanged once for a session: a random id in
an ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it)
cookie, ``Secure`` when the API speaks HTTPS. Only a hash of each id is kept, so even a dump of
the daemon's memory does not hand out live cookies.

Sessions outlive the daemon: their hashes (never the ids) are kept in the home
(:data:`SESSIONS_FILE`, 0600 in the 0700 home), written when one opens or ends, at most every
:data:`SAVE_SECONDS` for "last seen", and at a clean stop; a new daemon of the home reads them.
With the API's port kept too (:mod:`corral.daemon_port`), a restart, an upgrade or a SIGKILL
and its respawn leave every tab signed in. The file also keeps a hash of the API token: a
new token ends every session. One-time codes stay in memory (two minutes are worth nothing
across a restart). Everything is bounded: at most :data:`MAX_CODES` codes waiting and
:data:`MAX_SESSIONS` sessions, the oldest dropped first.

Cookies are per host, not per port: two daemons on 127.0.0.1 would overwrite each other's
cookie under one name, so the name carries the API's port.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Final

CODE_SECONDS: Final = 120.0
SESSION_IDLE_SECONDS: Final = 8 * 3600.0
SESSION_MAX_SECONDS: Final = 7 * 24 * 3600.0
MAX_CODES: Final = 32
MAX_SESSIONS: Final = 256
SESSIONS_FILE: Final = "dashboard-sessions.json"
SAVE_SECONDS: Final = 60.0


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def cookie_name(port: int | None) -> str:
    return f"corral_session_{port}" if port else "corral_session"


class Sessions:
    """One-time codes and sessions of one daemon; ``clock`` (wall-clock seconds: the file
    outlives the process) is injectable for tests; ``path``, where sessions are kept."""

    def __init__(
        self, token: str, clock: Callable[[], float] = time.time, path: Path | None = None
    ) -> None:
        self._token = token.encode()
        self._clock = clock
        self._path = path
        self._saved_at = 0.0
        self._codes: OrderedDict[str, float] = OrderedDict()  # hash -> expiry
        # hash -> (created, last seen)
        self._sessions: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._load()

    # -- kept in the home ---------------------------------------------------------------------

    def _load(self) -> None:
        if self._path is None:
            return
        try:
            data = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(data, dict) or data.get("token") != _digest(self._token.decode()):
            return  # another token: those sessions were for it
        for entry in data.get("sessions") or []:
            with contextlib.suppress(TypeError, ValueError):
                key, created, seen = entry
                self._sessions[str(key)] = (float(created), float(seen))
        self._expire()

    def save(self) -> None:
        """Write the sessions' hashes to the home (0600, whole then renamed); a failure to
        write costs only the sessions' survival of a restart."""
        if self._path is None:
            return
        self._saved_at = self._clock()
        data = {
            "token": _digest(self._token.decode()),
            "sessions": [[k, c, s] for k, (c, s) in self._sessions.items()],
        }
        tmp = self._path.with_name(self._path.name + ".tmp")
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self._path)

    # -- one-time codes -----------------------------------------------------------------------

    def new_code(self) -> str:
        """A code good for one login within :data:`CODE_SECONDS` (for ``corral dashboard``)."""
        self._expire()
        code = secrets.token_urlsafe(24)
        self._codes[_digest(code)] = self._clock() + CODE_SECONDS
        while len(self._codes) > MAX_CODES:
            self._codes.popitem(last=False)
        return code

    def redeem(self, code: str) -> str | None:
        """A new session id for a valid, unused, unexpired code (which is used up), or None."""
        self._expire()
        if not code or len(code) > 200:
            return None
        expiry = self._codes.pop(_digest(code), None)
        if expiry is None:
            return None
        return self._open()

    # -- the token ----------------------------------------------------------------------------

    def login(self, token: str) -> str | None:
        """A new session id when ``token`` is the API token (compared in constant time)."""
        given = token.strip().encode("utf-8", "surrogateescape")
        if not given or not hmac.compare_digest(given, self._token):
            return None
        self._expire()
        return self._open()

    # -- sessions -----------------------------------------------------------------------------

    def _open(self) -> str:
        session = secrets.token_urlsafe(32)
        now = self._clock()
        self._sessions[_digest(session)] = (now, now)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        self.save()
        return session

    def valid(self, session: str | None) -> bool:
        """Whether ``session`` is a live session; using it keeps it alive (idle expiry)."""
        if not session or len(session) > 200:
            return False
        key = _digest(session)
        entry = self._sessions.get(key)
        if entry is None:
            return False
        created, seen = entry
        now = self._clock()
        if now - seen > SESSION_IDLE_SECONDS or now - created > SESSION_MAX_SECONDS:
            del self._sessions[key]
            return False
        self._sessions[key] = (created, now)
        self._sessions.move_to_end(key)
        if now - self._saved_at >= SAVE_SECONDS:
            self.save()
        return True

    def end(self, session: str | None) -> None:
        if session and self._sessions.pop(_digest(session), None) is not None:
            self.save()

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, expiry in self._codes.items() if expiry <= now]:
            del self._codes[key]
        for key, (created, seen) in list(self._sessions.items()):
            if now - seen > SESSION_IDLE_SECONDS or now - created > SESSION_MAX_SECONDS:
                del self._sessions[key]

    def counts(self) -> tuple[int, int]:
        """(codes waiting, sessions open): for tests and the bound's check."""
        self._expire()
        return len(self._codes), len(self._sessions)
