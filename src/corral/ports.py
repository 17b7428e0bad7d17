"""Local TCP ports: one free right now for a replica or a service, and who listens on one (what
a replica that exited because its port was taken needs to be told: the app itself only says
"Address already in use", if anything)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Final

import psutil

# A port handed out is not handed out again by this process for this long, or until this
# many newer ones were: between the pick and the app's own bind (its setup, its start-up) the
# kernel sees the port free and returns it to the next bind(0), and two replicas launched
# together were given the same port (seen in the chaos suite: one of them could not bind).
HANDED_OUT_SECONDS: Final = 900.0
HANDED_OUT_MAX: Final = 8192
_ATTEMPTS: Final = 64

_lock = threading.Lock()
_handed_out: OrderedDict[tuple[str, int], float] = OrderedDict()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now and not handed out by this process recently (launch
    jobs call this from several threads). Another process may still take it before it is
    bound; the local backend then keeps that process's answers from making a replica READY
    (see ``LocalInfra.endpoint_conflict``) and the replica fails and is replaced, which is
    cheaper than holding a socket open for every port handed out."""
    with contextlib.closing(_pick(host, reuse_port=False)) as sock:
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A free port that stays taken for as long as the block runs: a socket bound to it (not
    listening, so it takes no connection) with SO_REUSEPORT alone. The balancer workers, of
    this user and binding with SO_REUSEPORT, join it; any other bind fails, and the kernel
    offers it to no ``bind(0)``. A service's port is held so from its pick until its route
    holds it (:func:`hold_port`): without it, a port picked at the same moment by another
    process (another home's replica, between its pick and its app's bind) was bound first and
    the new service could not listen on its own endpoint (seen in the suite: CONTROLLER_FAILED
    at `corral up`)."""
    with contextlib.closing(_pick(host, reuse_port=True)) as sock:
        yield int(sock.getsockname()[1])


def hold_port(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port`` as :func:`reserved_port` binds one (SO_REUSEPORT alone,
    not listening): while it is open, the balancer workers may join the port and no other
    program's bind takes it, also in a moment when no worker listens (one replaced or
    respawned). None when the port cannot be joined: another program holds it, which the
    daemon's port check reports."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def _pick(host: str, *, reuse_port: bool) -> socket.socket:
    """A socket bound to a free port of ``host`` that this process did not hand out lately."""
    held: list[socket.socket] = []
    try:
        with _lock:
            now = time.monotonic()
            while _handed_out and (
                len(_handed_out) > HANDED_OUT_MAX
                or next(iter(_handed_out.values())) < now - HANDED_OUT_SECONDS
            ):
                _handed_out.popitem(last=False)
            for _ in range(_ATTEMPTS):
                # Each candidate stays bound while the next is asked for, so the kernel
                # cannot offer the same one twice.
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
                if (host, port) not in _handed_out:
                    _handed_out[(host, port)] = now
                    held.remove(sock)
                    return sock
            raise OSError(
                f"no port on {host} that this process did not hand out in the last "
                f"{HANDED_OUT_SECONDS / 60:g} minutes"
            )
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()


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


class PortTaken(RuntimeError):
    """The replica's fixed port (a ``run`` that ignores ``$PORT``) is held by a process that is
    not this home's: the next launch would bind the same port and meet the same holder.

    Its repr is its message: a launch failure quotes ``repr`` of what the launch raised, and
    this one is meant for the user as it is."""

    def __repr__(self) -> str:
        return str(self)


def fixed_port_taken(port: int, home_marker: str) -> str | None:
    """Why a replica cannot have its fixed ``port``: who listens there (pid and command line),
    when it is a process this user can see that is not a replica of this home (a replica of
    the home, e.g. the version being replaced, is not in the way for ever); None otherwise."""
    found = []
    for pid in sorted({pid for _, pid in listeners(port) if pid is not None}):
        try:
            proc = psutil.Process(pid)
            if proc.environ().get("CORRAL_HOME_MARKER") == home_marker:
                continue
            command = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue  # gone, or not this user's to look at: not named, not judged
        found.append(f"pid {pid} ({command})")
    if not found:
        return None
    return (
        f"its fixed port {port} is in use by {', '.join(found)}: no relaunch can free it "
        "(the replica's `run` ignores $PORT); stop that process, or start the server on $PORT"
    )


def _proc_address(text: str) -> str:
    """An address of /proc/net/tcp{,6} (hex, each 32-bit word in host order) as text."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def listening_on(ports: set[int]) -> dict[int, list[tuple[str, int]]]:
    """Per port of ``ports``, (address, socket inode) of every TCP socket listening on it in
    this network namespace: no descriptor of any process is looked at, so it sees another
    user's listener as well as one's own (undumpable) workers'. One look for all the ports:
    the daemon checks every service's port each ``PORT_CHECK_INTERVAL``.

    Asked of the kernel's socket diagnostics (netlink, listeners only), which answer in time
    proportional to the listeners: /proc/net/tcp is written out for every socket of the
    namespace, TIME_WAIT ones included, after a walk of the whole connection hash table (4.5 ms
    a read here with 280 sockets, most of it in the kernel; a busy server holds tens of
    thousands). /proc/net/tcp and tcp6 where netlink is refused (a sandbox)."""
    try:
        return _diag_listening(ports)
    except OSError:
        return _proc_listening(ports)


# Linux's sock_diag ABI (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h).
_NETLINK_SOCK_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_NLM_F_REQUEST_DUMP: Final = 0x1 | 0x300
_NLMSG_ERROR: Final = 2
_NLMSG_DONE: Final = 3
_TCP_LISTEN: Final = 10
_HEADER: Final = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_REQUEST: Final = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states
_ANSWER_SIZE: Final = 72  # inet_diag_msg: the socket's id at 4 (ports big-endian), inode at 68


def _diag_listening(ports: set[int]) -> dict[int, list[tuple[str, int]]]:
    found: dict[int, list[tuple[str, int]]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(5.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
            sock.send(
                _HEADER.pack(
                    _HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, seq, 0
                )
                + body
            )
            while not _diag_answers(sock.recv(1 << 16), family, ports, found):
                pass
    return found


def _diag_answers(
    data: bytes, family: int, ports: set[int], found: dict[int, list[tuple[str, int]]]
) -> bool:
    """Add the listeners of one datagram of answers to ``found``; True once the dump ended."""
    at = 0
    while at + _HEADER.size <= len(data):
        length, kind = _HEADER.unpack_from(data, at)[:2]
        if kind == _NLMSG_DONE:  # its payload: 0, or the error that cut the dump short
            if (
                int.from_bytes(
                    data[at + _HEADER.size : at + _HEADER.size + 4], sys.byteorder, signed=True
                )
                < 0
            ):
                raise OSError("socket diagnostics ended the dump with an error")
            return True
        if kind == _NLMSG_ERROR or length < _HEADER.size:
            raise OSError("socket diagnostics refused the request")
        msg = data[at + _HEADER.size : at + length]
        if len(msg) >= _ANSWER_SIZE:
            port = int.from_bytes(msg[4:6], "big")
            if port in ports:
                raw = msg[8:12] if family == socket.AF_INET else msg[8:24]
                inode = int.from_bytes(msg[68:72], sys.byteorder)
                found.setdefault(port, []).append((socket.inet_ntop(family, raw), inode))
        at += (length + 3) & ~3
    return False


def _proc_listening(ports: set[int]) -> dict[int, list[tuple[str, int]]]:
    """:func:`listening_on` from /proc/net/tcp and tcp6."""
    found: dict[int, list[tuple[str, int]]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            address, _, hex_port = fields[1].rpartition(":")
            port = int(hex_port, 16)
            if port not in ports:
                continue
            with contextlib.suppress(ValueError, OSError):
                found.setdefault(port, []).append((_proc_address(address), int(fields[9])))
    return found


WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})


def reaches(listener: str, host: str) -> bool:
    """A socket listening on address ``listener`` may take connections meant for ``host``
    (the same address, or either of them a wildcard, or IPv4 under its IPv6 form)."""
    if listener.startswith("::ffff:"):
        listener = listener[7:]
    return listener == host or listener in WILDCARDS or host in WILDCARDS


def socket_owner(inode: int) -> str | None:
    """``pid N (name)`` of the process holding socket ``inode``, when this user may look at its
    descriptors (root may look at all); None otherwise. A scan of every process's descriptors:
    only for the rare moment a foreign listener was found."""
    target = f"socket:[{inode}]"
    for proc in psutil.process_iter(["name"]):
        try:
            fds = os.listdir(f"/proc/{proc.pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{proc.pid}/fd/{fd}") == target:
                    return f"pid {proc.pid} ({proc.info.get('name') or '?'})"
    return None
