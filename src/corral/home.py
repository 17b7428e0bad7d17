"""The files of a corral home, shared by the daemon and its clients.

Kept apart from :mod:`corral.daemon` so the CLI can find and talk to a daemon without importing
the daemon's machinery (aiohttp, the controller, the balancer): every ``corral`` command pays
that import time, and most never need it.

The token is the only secret of a home: whoever can read ``token`` controls every service (and
runs commands as the daemon's user through a spec's ``run``). Hence the file's mode 0600, the
home's 0700, and the daemon refusing a token too short to be one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

# The exit code of `corral daemon run` when another daemon already holds the home's lock.
EXIT_DAEMON_RUNNING = 75

# A token shorter than this is not one (an empty file would otherwise make "Bearer " the key).
MIN_TOKEN_CHARS = 16

# Addresses that mean "every interface": a client of a daemon bound to one connects to loopback.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def hello_proof(token: str, nonce: str, port: int) -> str:
    """What only the holder of the token can answer to ``nonce``, bound to the port the
    question arrived on: a process that took a dead daemon's port cannot compute it, and one
    that relays the question to the live daemon gets an answer for that daemon's own port,
    which the client rejects. So the CLI knows whom it talks to before it sends the token."""
    message = f"corral-hello:{nonce}:{port}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def valid_nonce(nonce: str) -> bool:
    return 16 <= len(nonce) <= 128 and all(c in "0123456789abcdef" for c in nonce)


def default_home() -> Path:
    return Path(os.environ.get("CORRAL_HOME") or Path.home() / ".corral").expanduser()


# `corral` exits with this code (EX_CONFIG) when the home cannot be used at all.
EXIT_BAD_HOME = 78


def home_problem(home: Path) -> str | None:
    """Why ``home`` cannot serve as a corral home, in one line, or None when it can (or can
    be created). Checked before anything touches it: otherwise the first write deep inside a
    command fails with a traceback."""
    fix = "set CORRAL_HOME (or --home) to a directory you can write"
    if home.is_symlink() and not home.exists():
        target = os.readlink(home)
        return f"corral home {home} is a symlink to {target}, which does not exist; {fix}"
    if home.exists():
        if not home.is_dir():
            return f"corral home {home} is a file, not a directory; {fix}"
        if not os.access(home, os.W_OK | os.X_OK):
            return f"corral home {home} is not writable by this user; {fix}"
        return None
    parent = home.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():
            return f"corral home {home} is under {parent}, a symlink to nothing; {fix}"
        parent = parent.parent
    if not parent.is_dir():
        return f"corral home {home} cannot be created: {parent} is not a directory; {fix}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"corral home {home} cannot be created: {parent} is not writable; {fix}"
    return None


def read_token(home: Path) -> str:
    return (home / "token").read_text().strip()


def read_info(home: Path) -> dict[str, Any] | None:
    """The running daemon's ``daemon.json`` (pid, host, port, scheme, tls_cert), or None."""
    try:
        return dict(json.loads((home / "daemon.json").read_text()))
    except (OSError, ValueError):
        return None


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: ``localhost``, 127.0.0.0/8, ``::1``.

    Any other name counts as reachable from elsewhere (a hostname may resolve to anything), so
    binding the API to it needs TLS.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _usable(token: str) -> bool:
    """A token the API can compare: long enough, and printable ASCII without spaces (it travels
    in a header, and ``hmac.compare_digest`` on text takes ASCII only)."""
    return len(token) >= MIN_TOKEN_CHARS and all(33 <= ord(c) < 127 for c in token)


def ensure_token(home: Path) -> tuple[str, list[str]]:
    """The home's API token, created (mode 0600) when missing or unusable; and what was fixed.

    A token file found with a wider mode is narrowed to 0600 (reported: the token may have been
    read while it was open). An empty or too short token is replaced by a fresh one, never
    accepted: an empty file would make a bare ``Authorization: Bearer `` the password.
    """
    path = home / "token"
    notes: list[str] = []
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if mode & 0o077:
            path.chmod(0o600)
            notes.append(f"{path} had mode {mode:04o}; narrowed to 0600")
        token = read_token(home)
        if _usable(token):
            return token, notes
        notes.append(
            f"{path} held no usable token (at least {MIN_TOKEN_CHARS} printable characters); "
            "wrote a new one"
        )
    token = secrets.token_urlsafe(32)
    # Written beside and renamed over: a reader never sees a half-written or wider file.
    tmp = home / f".token.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    tmp.replace(path)
    return token, notes


def read_state(home: Path, sql: str) -> list[tuple[Any, ...]] | None:
    """Rows of a read-only query on the home's state file, with no daemon running: [] for a
    home never used (no file), None when the file cannot be read."""
    import sqlite3

    path = home / "state.db"
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return [tuple(row) for row in db.execute(sql).fetchall()]
        finally:
            db.close()
    except sqlite3.Error:
        return None
