"""Run the REAL corral daemon over the real local backend, wrapped so it fails on cue.

Usage: ``python faulty_daemon.py HOME`` (with ``CORRAL_HOME=HOME`` in the environment, as for
``corral daemon run``). Everything is the real daemon (``corral.bootstrap.serve``): API,
controllers, balancers, JobPool, SQLite, and :class:`corral.infra.local.LocalInfra` starting real
processes. The only difference is :class:`FaultyInfra` in front of LocalInfra, which reads a cue
file, ``HOME/faults.json``, on every call, so a test turns faults on and off while the daemon runs::

    {"SERVICE": {"launch_raise": "before" | "after",   # raise instead of launching, or after the
                                                       # real launch started (and was recorded)
                 "launch_hold": true,                  # launches wait (cancellably) ...
                 "release": [3, 5],                    # ... except these replica ids
                 "terminate_raise": "before" | "after", # raise instead of / after terminating
                 "terminate_hang": true,               # terminate blocks, ignoring cancellation
                 "check_unknown": true}}               # liveness checks answer UNKNOWN (a
                                                       # cluster that does not answer)

A missing file, service or key means "no fault". Every call is also written, one JSON line per
event, to ``HOME/faults.log`` (``op``, ``service``, ``replica``, ``fault``, monotonic ``t``), so
the test can check the order of launches and what the backend was asked to do.

Why a file and not an API: the fault must be outside the daemon under test (nothing in corral
knows about it) and must survive nothing: one small JSON read per backend call costs nothing
next to starting a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from corral import jobs
from corral.bootstrap import serve
from corral.infra.base import LaunchRequest, Liveness, ReplicaHandle
from corral.infra.local import LocalInfra

# A hang or a hold never outlives this (seconds): a forgotten cue cannot keep a thread forever.
HANG_LIMIT = 300.0


class InjectedFault(RuntimeError):
    """What FaultyInfra raises on cue (its name shows in status, events and the launch log)."""


class FaultyInfra:
    """A real backend (``inner``) that raises, hangs or holds when the cue file says so."""

    def __init__(self, inner: LocalInfra, cue: Path, journal: Path) -> None:
        self.inner = inner
        self.name = inner.name
        self._cue = cue
        self._journal = journal
        self._lock = threading.Lock()

    # -- cue and journal ----------------------------------------------------------------------

    def _faults(self, service: str) -> dict[str, Any]:
        try:
            cue = json.loads(self._cue.read_text())
        except (OSError, ValueError):
            return {}  # no file, or caught mid-rewrite (the test writes it atomically anyway)
        faults = cue.get(service) if isinstance(cue, dict) else None
        return faults if isinstance(faults, dict) else {}

    def _note(self, op: str, service: str, replica: int, **extra: Any) -> None:
        line = {"op": op, "service": service, "replica": replica, "t": time.monotonic(), **extra}
        with self._lock, open(self._journal, "a") as f:
            f.write(json.dumps(line) + "\n")

    @staticmethod
    def _who(handle: ReplicaHandle) -> tuple[str, int]:
        """(service, replica id) from the local handle's replica key ``marker/service/id``."""
        key = str(handle.data.get("key", "?/?/0"))
        _, service, replica = key.rsplit("/", 2)
        return service, int(replica)

    # -- the Infra protocol -------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        service, rid = request.service, request.replica_id
        self._note("launch_enter", service, rid)
        deadline = time.monotonic() + HANG_LIMIT
        while time.monotonic() < deadline:
            faults = self._faults(service)
            if not faults.get("launch_hold") or rid in faults.get("release", []):
                break
            jobs.sleep(0.05)  # cooperative: a cancelled launch stops holding at once
        faults = self._faults(service)
        mode = faults.get("launch_raise")
        if mode == "before":
            self._note("launch_raise", service, rid, fault="before")
            print(f"[faulty] injected launch failure of replica {rid}", flush=True)
            raise InjectedFault(f"injected launch failure (replica {rid})")
        handle = self.inner.launch(request)
        if mode == "after":
            self._note("launch_raise", service, rid, fault="after", pid=handle.data.get("pid"))
            raise InjectedFault(f"injected launch failure after start (replica {rid})")
        self._note("launch_exit", service, rid, pid=handle.data.get("pid"))
        return handle

    def terminate(self, handle: ReplicaHandle, grace: float) -> None:
        service, rid = self._who(handle)
        self._note("terminate_enter", service, rid)
        if self._faults(service).get("terminate_hang"):
            self._note("terminate_hang", service, rid)
            # time.sleep, not jobs.sleep: this models a backend call that ignores cancellation
            # (a stuck RPC), which is exactly what the controller must bound from outside.
            deadline = time.monotonic() + HANG_LIMIT
            while time.monotonic() < deadline and self._faults(service).get("terminate_hang"):
                time.sleep(0.05)
            self._note("terminate_unhang", service, rid)
        mode = self._faults(service).get("terminate_raise")
        if mode == "before":
            self._note("terminate_raise", service, rid, fault="before")
            raise InjectedFault(f"injected teardown failure (replica {rid})")
        self.inner.terminate(handle, grace)
        if mode == "after":
            self._note("terminate_raise", service, rid, fault="after")
            raise InjectedFault(f"injected teardown failure after terminating (replica {rid})")
        self._note("terminate_exit", service, rid)

    def check(self, handle: ReplicaHandle) -> Liveness:
        service, _ = self._who(handle)
        if self._faults(service).get("check_unknown"):
            return Liveness.UNKNOWN
        return self.inner.check(handle)

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        return self.inner.exit_code(handle)

    def sweep(
        self,
        home_marker: str,
        known: Collection[ReplicaHandle],
        recorded: Collection[str] | None = None,
    ) -> list[str]:
        return self.inner.sweep(home_marker, known, recorded)


def main() -> None:
    home = Path(sys.argv[1]).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    infra = FaultyInfra(LocalInfra(), home / "faults.json", home / "faults.log")
    print(f"faulty daemon pid {os.getpid()} for {home}", flush=True)
    asyncio.run(serve(home, infras={"local": infra}))


if __name__ == "__main__":
    main()
