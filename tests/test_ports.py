"""Ports handed out for replicas and services: never the same one twice from one daemon."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from corral.ports import free_port


def kernel_pick() -> int:
    """What free_port did before it remembered: the kernel's bind(0) answer, socket closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_kernel_alone_repeats_ports_that_nobody_bound_yet() -> None:
    """Why free_port remembers: a port picked and not yet bound by its app is offered again."""
    picks = [kernel_pick() for _ in range(3000)]
    assert len(set(picks)) < len(picks)


def test_free_port_never_hands_out_a_port_twice() -> None:
    """Launch jobs on several threads pick ports at once, and apps bind them later (after
    setup): two replicas must never be given the same one."""
    with ThreadPoolExecutor(8) as pool:
        picks = list(pool.map(lambda _: free_port(), range(3000)))
    assert len(set(picks)) == len(picks)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picks[-1]))  # and each was free when handed out
