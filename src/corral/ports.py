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


def listeners(port: int) -> list[tuple[str, int | None]]:
    """(address, pid) of every TCP socket listening on ``port``; the pid is None when the owner
    is not visible to this process (another user's)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return [
        (c.laddr.ip, c.pid)
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    ]


def port_holders(port: int) -> list[str]:
    """The processes listening on ``port`` on this machine, as ``pid N (name)``; empty when
    none is, or when they cannot be seen (another user's, without the right to look)."""
    holders = []
    for pid in sorted({pid for _, pid in listeners(port) if pid}):
        try:
            holders.append(f"pid {pid} ({psutil.Process(pid).name()})")
        except psutil.Error:
            holders.append(f"pid {pid}")
    return holders
