"""Process limits corral raises for itself at start.

Every client connection to a service costs a balancer worker one file descriptor (two while it
is proxied), and a daemon's probes, logs and replicas cost it more. The common default soft
limit of 1,024 open files let 1,100 idle connections to one service make every other service
and the API fail with "Too many open files". The soft limit may be raised up to the hard limit
by any process without privileges, so corral always does, and says what it got.
"""

from __future__ import annotations

import os
import resource

__all__ = ["open_files", "raise_open_files"]


def raise_open_files() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard limit; return (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # some sandboxes refuse even this; the limit stays, and is reported
    return soft, hard


def open_files() -> dict[str, int]:
    """Descriptors in use and the soft limit, for `corral daemon status`."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = -1
    return {"in_use": used, "limit": soft}
