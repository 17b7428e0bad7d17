"""Small facts about processes that several layers need (stdlib and psutil only)."""

from __future__ import annotations

import contextlib

import psutil

__all__ = ["running", "terminate_all"]


def running(proc: psutil.Process) -> bool:
    """Still running: not gone and not a zombie (a zombie is dead, whoever has to reap it)."""
    try:
        return proc.is_running() and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False


def terminate_all(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM every process, SIGKILL those still alive after ``grace`` seconds; return the
    ones alive 5 s after that (psutil checks each one's identity, so a recycled pid is never
    signalled)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return list(alive)
