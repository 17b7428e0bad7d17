"""The wire format between the daemon and its balancer workers.

Newline-delimited JSON over a stream Unix socket. JSON rather than pickle: a worker of one corral
version may meet a daemon of the next one during an upgrade, and both must be able to read (and
ignore what they do not know of) each other's messages; nothing received is ever executed.

Daemon to worker::

    {"t": "hello", "history": bool, "respawn": {"argv": [...], "env": {...}, "cwd": str} | null}
    {"t": "table", "seq": int, "services": {NAME: ROUTE}}
    {"t": "exit"}

Worker to daemon::

    {"t": "hello", "slot": int, "pid": int, "created": float, "seq": int,
     "accelerated": "compiled" | "pure"}      (the fast path's build: corral.balancer.speedups)
    {"t": "report", "seq": int, "services": {NAME: {"stats": {...}, "times": [[bucket, n]...],
                                                    "port": int | null, "error": str | null}}}

ROUTE is :meth:`Route.to_json`. ``seq`` of a table grows across daemon restarts (it starts from
the wall clock in milliseconds), so a worker's report says which table it had applied, and a
drain can wait for every worker to have seen the table without the replica.

``times`` are accepted-request counts per ``TIME_BUCKET`` seconds of ``time.monotonic()``
(system-wide on Linux, so comparable between processes): deltas since the previous report, or
the last ``HISTORY_SECONDS`` when the daemon's hello asked for history (a restarted daemon gets
the autoscaler's load signal back).
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = [
    "HISTORY_SECONDS",
    "MAX_MESSAGE",
    "NO_RESPAWN_MARKER",
    "SOCKET_NAME",
    "STOPPED_MARKER",
    "TIME_BUCKET",
    "Route",
    "bucket_times",
    "clock_seq",
    "decode",
    "encode",
    "note_respawn",
    "socket_path",
]

SOCKET_NAME: Final = "dataplane.sock"
# Written by a daemon that stops on purpose (SIGTERM, `corral daemon stop`); workers do not
# restart a daemon while it exists. A daemon that crashes or is SIGKILLed leaves none.
STOPPED_MARKER: Final = "daemon.stopped"
# Written by a daemon that tells its workers not to start it again (CORRAL_DAEMON_RESPAWN=0,
# under a supervisor of one's own), removed by one that tells them to: workers do as the last
# daemon said, whichever daemon started them, so this, not a worker's environment, is what the
# CLI reads to know whether a crashed daemon is coming back.
NO_RESPAWN_MARKER: Final = "dataplane/no-respawn"
TIME_BUCKET: Final = 0.05
HISTORY_SECONDS: Final = 600.0
# A single message above this is a bug or an attack: the connection is dropped.
MAX_MESSAGE: Final = 64 << 20

# AF_UNIX paths are limited to 108 bytes; a home deep in a temp dir exceeds that. Binding and
# connecting through /proc/self/fd/N/NAME (N: an open descriptor of the home) stays short.
_UNIX_PATH_MAX: Final = 100
_dir_fds: dict[str, int] = {}


def socket_path(home: Path) -> str:
    """A path to the home's data-plane socket that fits in ``sockaddr_un``."""
    direct = str(home / SOCKET_NAME)
    if len(direct.encode()) < _UNIX_PATH_MAX:
        return direct
    key = str(home)
    fd = _dir_fds.get(key)
    if fd is None:
        fd = _dir_fds[key] = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{SOCKET_NAME}"


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """One message; ValueError for anything that is not a JSON object with a string ``t``."""
    message = json.loads(line)
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise ValueError("not a data-plane message")
    return message


@dataclass(frozen=True)
class Route:
    """What a worker needs to serve one service: where, how, and to which replicas.

    ``ready`` maps replica id to its base URL; None means "not known yet" (a restarted daemon
    whose controller has not re-adopted the replicas): the worker then keeps the ready set it
    already has, so a daemon restart never empties a service's ready set for a moment.
    ``config`` holds the keyword arguments of :class:`corral.balancer.LoadBalancer` that come
    from the spec (policy, timeouts, limits, the hold at zero replicas).
    """

    port: int
    host: str = "127.0.0.1"
    tls_cert: str | None = None
    tls_key: str | None = None
    # What the TLS files held when the daemon read them: a certificate replaced at the same
    # path (a renewal) is a new listener at the next update, as a new path is.
    tls_stamp: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    ready: Mapping[int, str] | None = None
    versions: Mapping[int, int] = field(default_factory=dict)
    # Of ready replicas placed on a GPU: its model as the spec names it, and what it serves
    # relative to the others (instance_aware_least_load: the accelerator's target QPS).
    accelerators: Mapping[int, str] = field(default_factory=dict)
    weights: Mapping[int, float] = field(default_factory=dict)
    # Each ready replica's id within its service (what status, logs and events say), by its
    # internal key: the balancer's messages name a replica by it, as everything else does.
    ids: Mapping[int, int] = field(default_factory=dict)

    def listener_key(self) -> str:
        """Settings that need a new listener when they change (everything but the ready set)."""
        return json.dumps(
            [self.port, self.host, self.tls_cert, self.tls_key, self.tls_stamp, dict(self.config)],
            sort_keys=True,
        )

    def server_context(self) -> ssl.SSLContext | None:
        """The TLS context a listener of this route serves with (None: plain HTTP). The daemon
        builds it too, once, so that a missing or unreadable file is an error the user sees in
        `status`, not a log line in each worker. Raises OSError or ssl.SSLError."""
        if not (self.tls_cert and self.tls_key):
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        # A key with a passphrase is an error, never a prompt on the daemon's terminal (which
        # would block its event loop).
        context.load_cert_chain(self.tls_cert, self.tls_key, password=_no_passphrase)
        return context

    def to_json(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "host": self.host,
            "tls": {"cert": self.tls_cert, "key": self.tls_key, "stamp": self.tls_stamp}
            if self.tls_cert
            else None,
            "config": dict(self.config),
            "ready": None
            if self.ready is None
            else {str(rid): self._replica(rid, url) for rid, url in self.ready.items()},
        }

    def _replica(self, rid: int, url: str) -> dict[str, Any]:
        out: dict[str, Any] = {"url": url, "version": self.versions.get(rid)}
        if rid in self.accelerators:
            out["accelerator"] = self.accelerators[rid]
        if rid in self.weights:
            out["weight"] = self.weights[rid]
        if rid in self.ids:
            out["id"] = self.ids[rid]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Route:
        tls = data.get("tls") or {}
        ready_in = data.get("ready")
        ready: dict[int, str] | None = None
        versions: dict[int, int] = {}
        accelerators: dict[int, str] = {}
        weights: dict[int, float] = {}
        ids: dict[int, int] = {}
        if isinstance(ready_in, Mapping):
            ready = {}
            for key, value in ready_in.items():
                ready[int(key)] = str(value["url"])
                if value.get("version") is not None:
                    versions[int(key)] = int(value["version"])
                if value.get("accelerator") is not None:
                    accelerators[int(key)] = str(value["accelerator"])
                if value.get("weight") is not None:
                    weights[int(key)] = float(value["weight"])
                if value.get("id") is not None:
                    ids[int(key)] = int(value["id"])
        return cls(
            port=int(data["port"]),
            host=str(data.get("host") or "127.0.0.1"),
            tls_cert=tls.get("cert"),
            tls_key=tls.get("key"),
            tls_stamp=tls.get("stamp"),
            config=dict(data.get("config") or {}),
            ready=ready,
            versions=versions,
            accelerators=accelerators,
            weights=weights,
            ids=ids,
        )


def bucket_times(times: Iterable[float]) -> list[list[int]]:
    """Request times as ``[[bucket, count], ...]`` (bucket = int(t / TIME_BUCKET)), in order."""
    out: list[list[int]] = []
    last = None
    for t in times:
        b = int(t / TIME_BUCKET)
        if b == last:
            out[-1][1] += 1
        else:
            out.append([b, 1])
            last = b
    return out


def _no_passphrase() -> bytes:
    raise ssl.SSLError("the key is encrypted: give it without its passphrase")


def note_respawn(home: Path, respawn: bool) -> None:
    """Leave :data:`NO_RESPAWN_MARKER` as the daemon about to greet its workers decided."""
    marker = home / NO_RESPAWN_MARKER
    if respawn:
        marker.unlink(missing_ok=True)
    else:
        marker.touch()


def clock_seq() -> int:
    """A table seq from the clock, in microseconds: a daemon's seqs only grow, and a new daemon's
    come after its predecessor's, which workers judge drains by. In milliseconds a busy daemon
    (a change per loop turn) ran hundreds ahead of the clock, and one restarted within that
    started below it."""
    return int(time.time() * 1_000_000)
