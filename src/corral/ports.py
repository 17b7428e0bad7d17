"""Who listens on a local TCP port: what a replica that exited because its port was taken
needs to be told (the app itself only says "Address already in use", if anything)."""

from __future__ import annotations

import psutil


def port_holders(port: int) -> list[str]:
    """The processes listening on ``port`` on this machine, as ``pid N (name)``; empty when
    none is, or when they cannot be seen (another user's, without the right to look)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    pids = sorted(
        {
            c.pid
            for c in connections
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
    )
    holders = []
    for pid in pids:
        try:
            holders.append(f"pid {pid} ({psutil.Process(pid).name()})")
        except psutil.Error:
            holders.append(f"pid {pid}")
    return holders
