"""Ports handed out for replicas and services: never the same one twice from one daemon, and a
service's port kept from everyone but its workers until they listen on it."""

from __future__ import annotations

import contextlib
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from corral.ports import (
    _diag_listening,
    _proc_listening,
    free_port,
    listening_on,
    reserved_port,
)


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


def test_a_reserved_port_admits_the_workers_and_no_other_bind() -> None:
    """A service's port between its pick and its workers' listen: an app binding it (as a
    replica of another home does, its port picked by bind(0) a moment before) is refused on
    the loopback address and on the wildcard; balancer workers (SO_REUSEPORT, this user) join
    and take every connection, also once the reservation ends."""
    with contextlib.ExitStack() as stack:
        with reserved_port() as port:
            for address in ("127.0.0.1", "0.0.0.0"):
                app = stack.enter_context(socket.socket())
                app.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError):
                    app.bind((address, port))
            worker = stack.enter_context(socket.socket())
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            worker.bind(("127.0.0.1", port))
            worker.listen()
            worker.settimeout(5)
            for _ in range(8):  # none lands on the reservation, which does not listen
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    worker.accept()[0].close()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            worker.accept()[0].close()


def test_listeners_from_the_kernel_s_diagnostics_match_proc_net_tcp() -> None:
    """The port check asks netlink for listeners only (proc net tcp writes out every socket of
    the namespace, TIME_WAIT ones included); both tell the same listeners, with their inodes,
    on IPv4 and IPv6, loopback and wildcard, and nothing that does not listen."""
    with contextlib.ExitStack() as stack:
        inodes: dict[int, tuple[str, int]] = {}
        for family, address in (
            (socket.AF_INET, "127.0.0.1"),
            (socket.AF_INET, "0.0.0.0"),
            (socket.AF_INET6, "::1"),
            (socket.AF_INET6, "::"),
        ):
            sock = stack.enter_context(socket.socket(family))
            sock.bind((address, 0))
            sock.listen()
            inodes[sock.getsockname()[1]] = (address, os.fstat(sock.fileno()).st_ino)
        quiet = stack.enter_context(socket.socket())
        quiet.bind(("127.0.0.1", 0))  # bound, not listening
        client = stack.enter_context(socket.create_connection(("127.0.0.1", next(iter(inodes)))))
        asked = {*inodes, quiet.getsockname()[1], client.getsockname()[1]}
        from_diag = _diag_listening(asked)
        assert from_diag == {port: [entry] for port, entry in inodes.items()}
        assert from_diag == _proc_listening(asked) == listening_on(asked)
