"""The contract between the controller and a backend that runs replicas.

It is shaped so that a local process, a Ray actor and a Kubernetes pod all fit:

* ``launch`` returns a :class:`ReplicaHandle` whose ``endpoint`` the daemon can reach, and whose
  ``data`` is plain JSON stored in SQLite, enough to find the replica again after a daemon
  restart (a pid and its start time; an actor name; a pod name and uid).
* ``launch`` runs inside a JobPool job: it may block, it checks ``jobs.checkpoint()`` between
  steps, and it calls ``request.on_started(handle)`` the moment something exists that could leak,
  so the handle is written to state before the launch goes on. If the launch is cancelled or
  fails after that, the controller tears the replica down through the stored handle.
* ``terminate`` is idempotent (terminating a replica that is already gone succeeds) and raises
  when it could not make sure the replica is gone: that becomes FAILED_CLEANUP, never hidden.
* ``check`` answers liveness without waiting long; it distinguishes an app that exited (FAILED)
  from a replica whose host went away (PREEMPTED: replace it).
* ``sweep`` kills what a backend started but the state does not know (a launch interrupted by
  SIGKILL between starting a process and recording it).
* ``endpoint_conflict`` (optional, :class:`EndpointOwner`): a backend that hands out ports it
  does not hold until the app binds them can say, before the first READY, whether the process
  answering on the endpoint is really the replica's.
"""

from __future__ import annotations

import contextlib
import enum
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class Liveness(enum.StrEnum):
    ALIVE = "alive"
    EXITED = "exited"  # the app ended: a failure of the app, not of the infra
    LOST = "lost"  # the host or slot went away (node removed, preempted)
    UNKNOWN = "unknown"  # could not ask (backend unreachable)


@dataclass(frozen=True)
class ReplicaHandle:
    backend: str
    endpoint: str  # base URL the daemon's balancer and prober use, e.g. "http://127.0.0.1:41234"
    data: Mapping[str, Any] = field(default_factory=dict)  # JSON-able, stored in state


def scratch_root(home_marker: str) -> Path:
    """Where a home's replicas without a ``workdir`` run: ``$TMPDIR/corral-<uid>/<home id>``.
    Not inside the home, which a confined replica cannot see (nor learn the path of from its
    own working directory). The per-user directory must be this user's and 0700 (checked by
    the backend that creates it), so another local user cannot plant a symlink there."""
    return Path(tempfile.gettempdir()) / f"corral-{os.getuid()}" / home_marker


def leave_scratch(home_marker: str, lost: bool) -> None:
    """A stopping daemon's last word on its home's scratch directory: removed with what is in
    it when the home is gone (nothing will run there again), and when empty (no service left)
    otherwise. It was left, one per home: thousands on a machine that runs the tests."""
    root = scratch_root(home_marker)
    if lost:
        shutil.rmtree(root, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            root.rmdir()


def drop_replica_scratch(key: object) -> None:
    """A replica torn down for good (ids are never reused): its working directory (a spec
    without workdir) and what it wrote over its view of the workdir (``ID.writes``) go, as a
    Ray replica's node-local directory goes with its actor. They were kept until the whole
    service went down: one more for every replica replaced, scaled away or updated, however
    much each had written. ``key``: the replica's key (``marker/service/id``)."""
    parts = key.split("/") if isinstance(key, str) else []
    if len(parts) != 3 or any(part in ("", ".", "..") for part in parts):
        return  # not a key this backend made: nothing of it is touched
    marker, service, replica = parts
    place = scratch_root(marker) / service
    for name in (replica, f"{replica}.writes"):
        shutil.rmtree(place / name, ignore_errors=True)


@dataclass
class LaunchRequest:
    service: str
    replica_id: int
    version: int
    run: str
    setup: str | None
    envs: Mapping[str, str]
    workdir: Path | None  # where run/setup execute; None: the replica's own directory
    # The replica's own directory (its cwd without a workdir): outside the home, which a
    # confined replica cannot see (see scratch_root). The backend creates it.
    replica_dir: Path
    log_path: Path  # where the replica's own stdout/stderr go (daemon side)
    port: int | None  # the port the spec asks for; None lets the backend pick a free one
    resources: Mapping[str, Any]
    home_marker: str  # identifies this corral home in what the backend starts (for sweep)
    on_started: Callable[[ReplicaHandle], None]
    setup_timeout: float | None = None  # seconds `setup` may run (None: no limit)
    # The id users see (the replica's number within its service); the replica gets it as
    # CORRAL_REPLICA_ID, and its launch log and Ray actor name carry it, as `corral status`
    # names it. ``replica_id`` is the internal key (process keys, cgroups, scratch).
    display_id: int | None = None
    # CPUs the replica is pinned to (its own, see corral.capacity); empty: not pinned.
    cpu_ids: tuple[int, ...] = ()

    @property
    def shown_id(self) -> int:
        """The id users see (``replica_id`` when the caller gave none)."""
        return self.display_id or self.replica_id


class Infra(Protocol):
    name: str

    def launch(self, request: LaunchRequest) -> ReplicaHandle: ...

    def terminate(self, handle: ReplicaHandle, grace: float) -> None: ...

    def check(self, handle: ReplicaHandle) -> Liveness: ...

    def exit_code(self, handle: ReplicaHandle) -> int | None: ...

    def sweep(
        self,
        home_marker: str,
        known: Collection[ReplicaHandle],
        recorded: Collection[str] | None = None,
    ) -> list[str]:
        """Stop what this home started that no known handle accounts for. ``recorded``: the
        replica keys of every row of the state file; what belongs to none of them is not
        provably a leftover and is spared (reported with a line starting "spared ")."""
        ...


def terminate_told(infra: Infra, handle: ReplicaHandle, grace: float, reason: str) -> None:
    """Tear a replica down with its launch log saying so, and why: the log a user reads after a
    replica vanished from ``status`` otherwise ends on the replica's last line, as if it were
    still running."""
    print(f"[corral] tearing the replica down ({reason}); grace {grace:g}s", flush=True)
    infra.terminate(handle, grace)
    print("[corral] replica torn down", flush=True)


@runtime_checkable
class EndpointOwner(Protocol):
    """Optional part of a backend: who answers on a replica's endpoint.

    The local backend picks a free port, releases it and lets the app bind it later; in
    between, any other process may bind that port, and a probe answered by it would make a
    replica READY that is not serving at all (and send it traffic meant for the replica). The
    controller asks this once per successful probe until the replica is READY the first time.
    """

    def endpoint_conflict(self, handle: ReplicaHandle) -> str | None:
        """None when the endpoint's listener is the replica's own, or when that cannot be told
        (the listener's owner is not visible); otherwise the reason it is not (who holds it)."""
        ...


@runtime_checkable
class Connecting(Protocol):
    """Optional part of a backend that becomes usable some time after the daemon starts (a
    cluster connected in the background, :mod:`corral.infra._ray_link`), so that the daemon
    answers at once. Until then its replicas wait, with the reason shown, instead of failing."""

    def not_ready(self) -> str | None:
        """None once it can launch; otherwise why not, in words shown to users."""
        ...

    def settling(self) -> bool:
        """True while its first connection attempt is under way (bounded by the backend):
        a restarted daemon adopts its rows after it, so they are judged on a real answer."""
        ...


@runtime_checkable
class EndsHome(Protocol):
    """Optional part of a backend whose replicas run where the local process table cannot
    reach them (a Ray cluster's actors): what the daemon of a home that was deleted calls, since
    no daemon, worker or ``corral doctor`` will ever find them again."""

    def end_home(self, home_marker: str, grace: float) -> list[str]:
        """Stop every replica of ``home_marker`` this backend knows, whatever any record says
        (TERM, KILL after ``grace`` s); one line per thing stopped, or left."""
        ...
