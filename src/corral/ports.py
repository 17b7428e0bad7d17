"""Local TCP ports: one free right now for a replica or a service, and who listens on one (what
a replica that exited because its port was taken needs to be told: the app itself only says
"Address already in use", if anything)."""

from __future__ import annotations

import socket

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now. Another process may take it before it is bound; the
    local backend then keeps that process's answers from making a replica READY (see
    ``LocalInfra.endpoint_conflict``) and the replica fails and is replaced, which is cheaper
    than holding a reservation for every port handed out."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
