"""Who may see the dashboard: one-time login codes and browser sessions, kept in memory.

The API's bearer token cannot go in a browser's every request without living in JavaScript
(where any injected script could read it) or in a URL (history, logs). So the token, or a
one-time code that the token holder asked for, is exchanged once for a session: a random id in
an ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it)
cookie, ``Secure`` when the API speaks HTTPS. Only a hash of each id is kept, so even a dump of
the daemon's memory does not hand out live cookies.

Why in memory: sessions are worth nothing after the daemon that made them is gone (a restart
logs the browser out; ``corral dashboard`` gives a new link). Everything is bounded: at most
:data:`MAX_CODES` codes waiting and :data:`MAX_SESSIONS` sessions, the oldest dropped first.

Cookies are per host, not per port: two daemons on 127.0.0.1 would overwrite each other's
cookie under one name, so the name carries the API's port.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

CODE_SECONDS: Final = 120.0
SESSION_IDLE_SECONDS: Final = 8 * 3600.0
SESSION_MAX_SECONDS: Final = 7 * 24 * 3600.0
MAX_CODES: Final = 32
MAX_SESSIONS: Final = 256


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def cookie_name(port: int | None) -> str:
    return f"corral_session_{port}" if port else "corral_session"


class Sessions:
    """One-time codes and sessions of one daemon; ``clock`` is injectable for tests."""

    def __init__(self, token: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._token = token.encode()
        self._clock = clock
        self._codes: OrderedDict[str, float] = OrderedDict()  # hash -> expiry
        # hash -> (created, last seen)
        self._sessions: OrderedDict[str, tuple[float, float]] = OrderedDict()

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
        return True

    def end(self, session: str | None) -> None:
        if session:
            self._sessions.pop(_digest(session), None)

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
