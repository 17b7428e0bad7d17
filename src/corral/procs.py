"""Small facts about processes that several layers need (stdlib and psutil only)."""

from __future__ import annotations

import psutil

__all__ = ["running"]


def running(proc: psutil.Process) -> bool:
    """Still running: not gone and not a zombie (a zombie is dead, whoever has to reap it)."""
    try:
        return proc.is_running() and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False
