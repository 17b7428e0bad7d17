"""Process limits and attributes corral sets for itself at start.

Every client connection to a service costs a balancer worker one file descriptor (two while it
is proxied), and a daemon's probes, logs and replicas cost it more. The common default soft
limit of 1,024 open files let 1,100 idle connections to one service make every other service
and the API fail with "Too many open files". The soft limit may be raised up to the hard limit
by any process without privileges, so corral always does, and says what it got.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource

__all__ = ["libc", "open_files", "raise_open_files", "undumpable"]

PR_SET_DUMPABLE = 4


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, for the few system calls Python's ``os`` lacks (prctl, unshare, mount).
    Raises OSError when it cannot be loaded."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def undumpable() -> None:
    """Close this process's ``/proc/<pid>/{environ,maps,fd,...}`` to processes of the same
    user without CAP_SYS_PTRACE: a replica of a non-root daemon could otherwise read the
    home's path in the daemon's or a worker's environment and memory maps. (Root replicas
    keep that capability.) Reset by exec, so replicas are not affected. Best effort."""
    with contextlib.suppress(OSError, AttributeError):
        libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


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
