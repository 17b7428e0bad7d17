"""The daemon's settings from its environment (``CORRAL_DECISION_INTERVAL`` and the like).

A bad value stops the daemon with a message naming the variable, before anything runs (the
daemon reads them all first, ``corral.bootstrap.serve``): a typo must not leave a setting at a
default the user did not mean (an uncapped log, say), nor leave balancer workers started by a
daemon that then refused to run.
"""

from __future__ import annotations

import os

from corral import logfiles


class DaemonError(RuntimeError):
    """The daemon cannot start (another one runs, the home is unusable, a setting is bad)."""


def env_seconds(name: str, default: float, top: float = 3600) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise DaemonError(f"${name} must be a number of seconds, not {value!r}") from None
    if not 0 < number < top:
        raise DaemonError(f"${name} must be between 0 and {top:g} seconds, not {number}")
    return number


def check_read_elsewhere() -> None:
    """The settings other processes and code paths read on their own, checked with the rest
    at the daemon's start: the API reads its header timeout per request (a bad value once fell
    back to 10 s unsaid), and each balancer worker, started with the daemon's environment,
    reads its idle exit (``1m`` made every worker fail at its start, so nothing was served)."""
    env_seconds("CORRAL_API_HEADER_TIMEOUT", 10.0)
    env_seconds("CORRAL_WORKER_IDLE_EXIT", 60.0, top=7 * 86400)
    env_choice("CORRAL_DAEMON_RESPAWN", ("0", "1"))
    env_choice("CORRAL_CONFINE", ("auto", "off"))


def env_choice(name: str, allowed: tuple[str, ...]) -> None:
    """A switch read as "is it exactly this word" (``CORRAL_DAEMON_RESPAWN`` is off only at
    ``0``, ``CORRAL_CONFINE`` only at ``off``): any other word kept the default in silence, so
    ``CORRAL_DAEMON_RESPAWN=false`` left the workers restarting the daemon the user's own
    supervisor was meant to restart."""
    value = os.environ.get(name)
    if value and value not in allowed:
        raise DaemonError(f"${name} must be {' or '.join(allowed)}, not {value!r}")


def env_bytes(name: str) -> int:
    """A size cap from the environment (``CORRAL_LOG_MAX_BYTES``: bytes, or 64M / 1G; 0 turns
    the cap off); a bad value stops the daemon with a message rather than run uncapped."""
    try:
        return logfiles.parse_max_bytes(os.environ.get(name))
    except ValueError as exc:
        raise DaemonError(f"${name}: {exc}") from None


def env_count(name: str, default: int, top: int = 64) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise DaemonError(f"${name} must be a whole number, not {value!r}") from None
    if not 1 <= number <= top:
        raise DaemonError(f"${name} must be between 1 and {top}, not {number}")
    return number
