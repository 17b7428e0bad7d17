"""Durable state: one SQLite file (WAL) per corral home.

Every change is written here BEFORE it is acted on, so a daemon killed at any point restarts into
the same services and replicas. Replicas are rows of explicit facts (launch state, teardown state,
first ready time, app failed, ...), not pickles: their status is derived from the facts by
:mod:`corral.replicas`, never stored by hand, so it cannot drift from what happened.

One connection guarded by a lock serves the event-loop thread and the job threads; statements are
short (no lock is held across anything but one statement or one small transaction).

The file may be locked by ANOTHER process (an operator's ``sqlite3 state.db``, a backup tool, a
second corral by mistake). SQLite's own busy handler would wait inside the statement, holding
this store's lock and, on the event-loop thread, freezing every balancer of the daemon for the
whole wait. So the connection never waits itself (``busy_timeout`` 0): :meth:`Store._run` retries
with the store's lock RELEASED between attempts, for a bounded time that depends on the caller.
The event loop's thread waits at most ``loop_busy_timeout`` (a fraction of a second: it serves
traffic), any other thread (launch jobs, ``asyncio.to_thread``) up to ``busy_timeout``. A caller
that runs out of time gets :class:`StateBusy` and nothing was written. Once the loop's thread
has run out of time, its calls for the next ``LOOP_BUSY_COOLDOWN`` seconds try once and do not
wait: with several services writing during a long outside lock, 0.25 s per call would add up to
a loop that is blocked most of the time. The API answers 503
("locked, retry") and the controller retries on its next reconcile step. Any other SQLite
failure (disk I/O error, read-only or full disk) is a :class:`StateError` with the file named.

Size: longer than corral's usual module on purpose: it is the schema, its migrations and the one
:class:`Store` every write goes through (the chaos tests count writes there), and splitting
the store's tables across modules would spread the locking rules above over all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import EllipsisType
from typing import Any, TypeVar

from corral.backup import take_backup
from corral.replicas import LaunchState, TeardownState, UpdateMode

T = TypeVar("T")

SCHEMA_VERSION = 7

# Each entry migrates from version i to i+1; a new schema change appends one entry.
_MIGRATIONS: list[str] = [
    """
    CREATE TABLE services (
        name TEXT PRIMARY KEY,
        intent TEXT NOT NULL DEFAULT 'running',   -- running | shutting_down
        current_version INTEGER NOT NULL,
        lb_port INTEGER,
        purge INTEGER NOT NULL DEFAULT 0,
        failure TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE versions (
        service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
        version INTEGER NOT NULL,
        spec_yaml TEXT NOT NULL,
        source TEXT,
        base_dir TEXT,
        first_ready_at REAL,
        created_at REAL NOT NULL,
        PRIMARY KEY (service, version)
    );
    CREATE TABLE replicas (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
        version INTEGER NOT NULL,
        infra TEXT NOT NULL,
        launch_state TEXT NOT NULL DEFAULT 'pending',
        teardown_state TEXT,
        teardown_attempts INTEGER NOT NULL DEFAULT 0,
        endpoint TEXT,
        handle_json TEXT,
        launched_at REAL,
        first_ready_at REAL,
        ready INTEGER NOT NULL DEFAULT 0,
        app_failed INTEGER NOT NULL DEFAULT 0,
        exit_code INTEGER,
        preempted INTEGER NOT NULL DEFAULT 0,
        probe_failed INTEGER NOT NULL DEFAULT 0,
        initial_delay_failed INTEGER NOT NULL DEFAULT 0,
        scale_down INTEGER NOT NULL DEFAULT 0,
        failure TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX replicas_by_service ON replicas(service);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        service TEXT NOT NULL,
        replica_id INTEGER,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        reason TEXT
    );
    CREATE INDEX events_by_service ON events(service, id);
    """,
    # 2: updates. How a version replaces the one before it.
    """
    ALTER TABLE versions ADD COLUMN mode TEXT NOT NULL DEFAULT 'rolling'
    """,
    # 3: the data plane. Balancer worker processes outlive the daemon; the next daemon adopts
    # them by (pid, process creation time) instead of starting a second set.
    """
    CREATE TABLE balancer_workers (
        slot INTEGER PRIMARY KEY,
        pid INTEGER NOT NULL,
        created REAL NOT NULL,
        started_at REAL NOT NULL
    )
    """,
    # 4: replica ids per service (1, 2, 3 in each), as SkyServe numbers them; the global id
    # stays the internal key (rows, process keys, claims). The counter lives on the
    # service so an id is never reused within it, even after rows are pruned.
    """
    ALTER TABLE replicas ADD COLUMN seq INTEGER;
    ALTER TABLE services ADD COLUMN next_replica_seq INTEGER NOT NULL DEFAULT 1;
    UPDATE replicas SET seq = (SELECT COUNT(*) FROM replicas AS o
        WHERE o.service = replicas.service AND o.id <= replicas.id);
    UPDATE services SET next_replica_seq = 1 + COALESCE(
        (SELECT MAX(seq) FROM replicas WHERE replicas.service = services.name), 0);
    CREATE UNIQUE INDEX replicas_by_seq ON replicas(service, seq)
    """,
    # 5: placement on the local backend (corral.capacity). What a replica holds (devices, CPUs,
    # memory) is written before it is launched and held until its teardown succeeded; the row
    # goes with its replica.
    """
    CREATE TABLE placements (
        replica_id INTEGER PRIMARY KEY REFERENCES replicas(id) ON DELETE CASCADE,
        service TEXT NOT NULL,
        claim_json TEXT NOT NULL,
        created_at REAL NOT NULL
    )
    """,
    # 6: an event names its replica by the id users see (``replica``, the row's ``seq``),
    # written with the event: the row may be gone by the time the event is read.
    """
    ALTER TABLE events ADD COLUMN replica INTEGER;
    UPDATE events SET replica = (SELECT seq FROM replicas WHERE replicas.id = events.replica_id)
    """,
    # 7: the version whose files a replica runs in, once an update of the service section
    # relabelled it (NULL: its own version's). Pruning keeps those files while it runs.
    """
    ALTER TABLE replicas ADD COLUMN files_version INTEGER
    """,
]


class FailureKind(enum.Enum):
    """Which failure fact a replica gets (the column set to 1; see corral.replicas)."""

    APP = "app_failed"
    PREEMPTED = "preempted"
    PROBE = "probe_failed"
    INITIAL_DELAY = "initial_delay_failed"


class StateError(RuntimeError):
    """The state file cannot be used (locked, read-only, newer schema)."""


class StateBusy(StateError):
    """Another connection held the state file's write lock for longer than this caller may
    wait. Nothing was written; the same operation can simply be retried."""


# SQLite primary result codes meaning "another connection holds a lock": worth waiting for.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    text = str(exc)
    return "locked" in text or "busy" in text


def _on_event_loop() -> bool:
    """True on a thread that runs an asyncio loop right now (the daemon's main thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class ServiceRow:
    name: str
    intent: str
    current_version: int
    lb_port: int | None
    purge: int
    failure: str | None
    created_at: float
    updated_at: float
    next_replica_seq: int = 1


@dataclass(frozen=True)
class VersionRow:
    service: str
    version: int
    spec_yaml: str
    source: str | None
    base_dir: str | None
    first_ready_at: float | None
    created_at: float
    mode: UpdateMode

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", UpdateMode(self.mode))


@dataclass(frozen=True)
class ReplicaRow:
    id: int
    service: str
    version: int
    infra: str
    launch_state: LaunchState
    teardown_state: TeardownState | None
    teardown_attempts: int
    endpoint: str | None
    handle_json: str | None
    launched_at: float | None
    first_ready_at: float | None
    ready: int
    app_failed: int
    exit_code: int | None
    preempted: int
    probe_failed: int
    initial_delay_failed: int
    scale_down: int
    failure: str | None
    created_at: float
    updated_at: float
    seq: int = 0  # the replica's id within its service, the one users see
    files_version: int | None = None  # launched from this version's files, when relabelled since

    @property
    def launched_from(self) -> int:
        """The version whose files the replica runs in (a relabel leaves it where it was)."""
        return self.version if self.files_version is None else self.files_version

    def __post_init__(self) -> None:
        # The columns hold the enums' text: typed here once, so every reader compares members.
        object.__setattr__(self, "launch_state", LaunchState(self.launch_state))
        if self.teardown_state is not None:
            object.__setattr__(self, "teardown_state", TeardownState(self.teardown_state))

    @property
    def handle_data(self) -> dict[str, Any] | None:
        return None if self.handle_json is None else dict(json.loads(self.handle_json))


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    service: str
    replica_id: int | None  # the internal key
    actor: str
    action: str
    reason: str | None
    replica: int | None = None  # the replica's id within its service, the one users see


@dataclass(frozen=True)
class WorkerRow:
    """A balancer worker process (see corral.dataplane): ``created`` is its creation time as
    psutil reports it, so a recycled pid is never taken for the worker."""

    slot: int
    pid: int
    created: float
    started_at: float


_REPLICA_FACTS = frozenset(f.name for f in fields(ReplicaRow)) - {
    "id",
    "service",
    "created_at",
    "seq",
}


def _row(cls: type[Any], row: sqlite3.Row) -> Any:
    return cls(**{k: row[k] for k in row.keys()})  # noqa: SIM118 - sqlite3.Row has no __iter__ of keys


# After the event loop's thread found the file locked for its whole wait, how long its later
# calls try once without waiting (see the module docstring).
LOOP_BUSY_COOLDOWN = 1.0


class Store:
    """Typed queries over the state file. Safe to share between threads.

    ``busy_timeout``: how long a thread other than the event loop's waits for a lock another
    process holds; ``loop_busy_timeout``: the same for the event loop's thread (see the module
    docstring for why the two differ).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout: float = 15.0,
        loop_busy_timeout: float = 0.25,
    ) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self.loop_busy_timeout = loop_busy_timeout
        self._loop_busy_until = 0.0  # monotonic; see LOOP_BUSY_COOLDOWN
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            # While opening, nothing else uses this store: SQLite's own busy handler may wait.
            self._db = sqlite3.connect(
                self.path,
                timeout=busy_timeout,
                isolation_level=None,  # autocommit; explicit BEGIN for multi-statement changes
                check_same_thread=False,
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            # From now on a busy file fails at once and _run() waits, without the store's lock.
            self._db.execute("PRAGMA busy_timeout = 0")
        except sqlite3.Error as exc:
            raise StateError(f"cannot open state file {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def changes(self) -> int:
        """Rows changed through this connection so far (to skip backups of nothing new)."""
        with self._lock:
            return int(self._db.total_changes)

    def backup(self, home: Path) -> Path:
        """A consistent copy of the whole file as the home's rolling backup
        (:func:`corral.backup.take_backup`); StateError if SQLite refuses."""
        try:
            with self._lock:
                return take_backup(self._db, home)
        except (sqlite3.Error, OSError) as exc:
            raise StateError(f"backup of {self.path} failed: {exc}") from exc

    def _migrate(self) -> None:
        current = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if current > SCHEMA_VERSION:
            raise StateError(
                f"{self.path} has schema version {current}, newer than this corral "
                f"({SCHEMA_VERSION}); upgrade corral"
            )
        for version in range(current, SCHEMA_VERSION):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _split(_MIGRATIONS[version]):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {version + 1}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work(connection)`` under the store's lock; retry while the file is locked.

        Between attempts the store's lock is released, so other threads' statements (reads the
        event loop needs to keep probing and balancing) are not queued behind the wait. ``work``
        must be safe to run again after it failed busy: one statement, or one transaction
        (:meth:`_transaction`) that was rolled back.
        """
        deadline: float | None = None
        delay = 0.005
        while True:
            with self._lock:
                if self._db.in_transaction:
                    # A ROLLBACK that failed earlier left a transaction open: later autocommit
                    # writes would join it and hold the write lock for good.
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error as exc:
                        raise StateError(f"state file {self.path}: {exc}") from exc
                try:
                    return work(self._db)
                except sqlite3.Error as exc:
                    # Corrupt or not a database (DatabaseError), a broken constraint
                    # (IntegrityError), disk full or read-only: all a StateError naming the file.
                    if not (isinstance(exc, sqlite3.OperationalError) and _is_busy(exc)):
                        raise StateError(f"state file {self.path}: {exc}") from exc
                    busy = exc
            now = time.monotonic()
            on_loop = _on_event_loop()
            if deadline is None:
                if on_loop:
                    cooling = now < self._loop_busy_until
                    deadline = now + (0.0 if cooling else self.loop_busy_timeout)
                else:
                    deadline = now + self.busy_timeout
            if now >= deadline:
                if on_loop:
                    self._loop_busy_until = now + LOOP_BUSY_COOLDOWN
                raise StateBusy(
                    f"state database {self.path} is locked by another process ({busy}); "
                    "nothing was changed, retry"
                ) from busy
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.05)

    def _transaction(self, body: Callable[[sqlite3.Connection], T]) -> T:
        """``body`` in one write transaction (``BEGIN IMMEDIATE``: the write lock is taken up
        front, so a busy file fails before anything ran), retried as a whole by :meth:`_run`."""

        def work(db: sqlite3.Connection) -> T:
            db.execute("BEGIN IMMEDIATE")
            try:
                result = body(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
            return result

        return self._run(work)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return self._run(lambda db: db.execute(sql, params).fetchall())

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """One statement that changes something (autocommit)."""
        self._run(lambda db: db.execute(sql, params))

    # -- services and versions ----------------------------------------------------------------

    def create_service(
        self,
        name: str,
        spec_yaml: str,
        *,
        source: str | None,
        base_dir: str | None,
        lb_port: int | None,
    ) -> ServiceRow:
        now = time.time()

        def create(db: sqlite3.Connection) -> None:
            if db.execute("SELECT 1 FROM services WHERE name = ?", (name,)).fetchone():
                raise KeyError(name)
            db.execute(
                "INSERT INTO services (name, current_version, lb_port, created_at, updated_at)"
                " VALUES (?, 1, ?, ?, ?)",
                (name, lb_port, now, now),
            )
            db.execute(
                "INSERT INTO versions (service, version, spec_yaml, source, base_dir, created_at)"
                " VALUES (?, 1, ?, ?, ?, ?)",
                (name, spec_yaml, source, base_dir, now),
            )
            db.execute(
                "INSERT INTO events (ts, service, actor, action, reason) VALUES (?, ?, ?, ?, ?)",
                (now, name, "api", "service.create", f"version 1 from {source or 'request'}"),
            )

        self._transaction(create)
        service = self.service(name)
        assert service is not None
        return service

    def service(self, name: str) -> ServiceRow | None:
        rows = self._query("SELECT * FROM services WHERE name = ?", (name,))
        return _row(ServiceRow, rows[0]) if rows else None

    def services(self) -> list[ServiceRow]:
        return [_row(ServiceRow, r) for r in self._query("SELECT * FROM services ORDER BY name")]

    def update_service(self, name: str, **facts: Any) -> None:
        allowed = {"intent", "current_version", "lb_port", "purge", "failure"}
        unknown = set(facts) - allowed
        if unknown:
            raise ValueError(f"not service facts: {sorted(unknown)}")
        if not facts:
            return
        cols = ", ".join(f"{k} = ?" for k in facts)
        self._execute(
            f"UPDATE services SET {cols}, updated_at = ? WHERE name = ?",
            (*facts.values(), time.time(), name),
        )

    def mark_down(self, name: str, *, purge: bool) -> bool:
        """Ask service ``name`` to go down, and its ``service.down`` event, in one transaction
        (a daemon killed between two writes left a service shutting down that no event said
        was asked). A service already going down keeps what was asked: a purge asked by either
        request stays (a second `down` without ``--purge``, or the CLI sending a `down` its
        daemon's crash cut, cleared it), and no second ``service.down`` is written; a purge
        asked only now is its own ``service.purge`` event. Whether this request asked it first;
        KeyError when there is no such service."""
        now = time.time()

        def mark(db: sqlite3.Connection) -> bool:
            row = db.execute(
                "SELECT intent, purge FROM services WHERE name = ?", (name,)
            ).fetchone()
            if row is None:
                raise KeyError(name)
            again = row[0] == "shutting_down"
            if again and (row[1] or not purge):
                return False
            db.execute(
                "UPDATE services SET intent = 'shutting_down', purge = ?, updated_at = ?"
                " WHERE name = ?",
                (int(purge), now, name),  # asked again: only to add a purge
            )
            reason: str | None = "asked by a later down"
            if again:
                action = "service.purge"
            else:
                action, reason = "service.down", "purge" if purge else None
            db.execute(
                "INSERT INTO events (ts, service, actor, action, reason) VALUES (?, ?, ?, ?, ?)",
                (now, name, "api", action, reason),
            )
            return not again

        return self._transaction(mark)

    def delete_service(self, name: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM replicas WHERE service = ?", (name,))
            db.execute("DELETE FROM versions WHERE service = ?", (name,))
            db.execute("DELETE FROM services WHERE name = ?", (name,))

        self._transaction(delete)

    def version(self, service: str, version: int) -> VersionRow | None:
        rows = self._query(
            "SELECT * FROM versions WHERE service = ? AND version = ?", (service, version)
        )
        return _row(VersionRow, rows[0]) if rows else None

    def versions(self, service: str) -> list[VersionRow]:
        rows = self._query("SELECT * FROM versions WHERE service = ? ORDER BY version", (service,))
        return [_row(VersionRow, r) for r in rows]

    def add_version(
        self,
        service: str,
        spec_yaml: str,
        *,
        source: str | None,
        base_dir: str | None,
        mode: str,
        adopt_live: bool,
        adopt_from: int | None = None,
    ) -> int:
        """Store a new version and make it current, in one transaction. ``adopt_live``: the
        new version differs only in how the service is run (policy, probe), so the live replicas
        of the current version (or of ``adopt_from``, one still serving) simply become replicas
        of the new one, still in the files they were launched from (``files_version``)."""
        now = time.time()

        def add(db: sqlite3.Connection) -> int:
            row = db.execute(
                "SELECT current_version FROM services WHERE name = ?", (service,)
            ).fetchone()
            if row is None:
                raise KeyError(service)
            old = int(row[0])
            keep = old if adopt_from is None else adopt_from  # whose replicas it keeps
            (latest,) = db.execute(
                "SELECT MAX(version) FROM versions WHERE service = ?", (service,)
            ).fetchone()
            version = int(latest) + 1
            db.execute(
                "INSERT INTO versions (service, version, spec_yaml, source, base_dir, created_at,"
                " mode) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (service, version, spec_yaml, source, base_dir, now, mode),
            )
            if adopt_live:
                db.execute(
                    "UPDATE replicas SET version = ?, updated_at = ?, files_version ="
                    " COALESCE(files_version, version) WHERE service = ? AND version = ?"
                    " AND teardown_state IS NULL AND scale_down = 0",
                    (version, now, service, keep),
                )
                db.execute(
                    "UPDATE versions SET first_ready_at = (SELECT first_ready_at FROM versions"
                    " WHERE service = ? AND version = ?) WHERE service = ? AND version = ?",
                    (service, keep, service, version),
                )
            db.execute(
                "UPDATE services SET current_version = ?, failure = NULL, updated_at = ?"
                " WHERE name = ?",
                (version, now, service),
            )
            kept = "same replicas" if keep == old else f"the replicas of version {keep}"
            how = f"in place ({kept})" if adopt_live else mode
            db.execute(
                "INSERT INTO events (ts, service, actor, action, reason) VALUES (?, ?, ?, ?, ?)",
                (now, service, "api", "service.update", f"version {old} -> {version}, {how}"),
            )
            return version

        return self._transaction(add)

    def mark_version_ready(self, service: str, version: int) -> None:
        self._execute(
            "UPDATE versions SET first_ready_at = ? WHERE service = ? AND version = ?"
            " AND first_ready_at IS NULL",
            (time.time(), service, version),
        )

    # -- replicas -----------------------------------------------------------------------------

    def add_replica(self, service: str, version: int, infra: str, reason: str) -> ReplicaRow:
        now = time.time()

        def add(db: sqlite3.Connection) -> int:
            (seq,) = db.execute(
                "SELECT next_replica_seq FROM services WHERE name = ?", (service,)
            ).fetchone()
            db.execute(
                "UPDATE services SET next_replica_seq = ? WHERE name = ?", (seq + 1, service)
            )
            cur = db.execute(
                "INSERT INTO replicas (service, version, infra, created_at, updated_at, seq)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (service, version, infra, now, now, seq),
            )
            replica_id = int(cur.lastrowid or 0)
            db.execute(
                "INSERT INTO events (ts, service, replica_id, replica, actor, action, reason)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (now, service, replica_id, seq, "controller", "replica.create", reason),
            )
            return replica_id

        row = self.replica(self._transaction(add))
        assert row is not None
        return row

    def replica(self, replica_id: int) -> ReplicaRow | None:
        rows = self._query("SELECT * FROM replicas WHERE id = ?", (replica_id,))
        return _row(ReplicaRow, rows[0]) if rows else None

    def replica_by_seq(self, service: str, seq: int) -> ReplicaRow | None:
        """A replica by the id users see (its number within the service)."""
        rows = self._query("SELECT * FROM replicas WHERE service = ? AND seq = ?", (service, seq))
        return _row(ReplicaRow, rows[0]) if rows else None

    def replicas(self, service: str | None = None) -> list[ReplicaRow]:
        if service is None:
            rows = self._query("SELECT * FROM replicas ORDER BY id")
        else:
            rows = self._query("SELECT * FROM replicas WHERE service = ? ORDER BY id", (service,))
        return [_row(ReplicaRow, r) for r in rows]

    def update_replica(self, replica_id: int, **facts: Any) -> ReplicaRow | None:
        """Set facts of one replica; ``handle`` (a mapping) is stored as JSON.

        The one write every named transition below goes through (so a test that counts writes
        sees them all). The controller uses the named transitions: their states are enums, so a
        misspelt state fails mypy; here a misspelt state or fact is a ValueError."""
        if "handle" in facts:
            handle = facts.pop("handle")
            facts["handle_json"] = None if handle is None else json.dumps(dict(handle))
        unknown = set(facts) - _REPLICA_FACTS
        if unknown:
            raise ValueError(f"not replica facts: {sorted(unknown)}")
        if "launch_state" in facts:
            facts["launch_state"] = str(LaunchState(facts["launch_state"]))
        if facts.get("teardown_state") is not None:
            facts["teardown_state"] = str(TeardownState(facts["teardown_state"]))
        if facts:
            cols = ", ".join(f"{k} = ?" for k in facts)
            self._execute(
                f"UPDATE replicas SET {cols}, updated_at = ? WHERE id = ?",
                (*facts.values(), time.time(), replica_id),
            )
        return self.replica(replica_id)

    # Named transitions: each a fact the controller records before it acts on it.

    def mark_launch(
        self,
        replica_id: int,
        state: LaunchState,
        *,
        failure: str | None = None,
        files_version: int | None = None,
    ) -> None:
        """The launch moved on (RUNNING when its job starts, with ``files_version``: the
        version whose files it runs in; SUCCEEDED, CANCELLED, or FAILED with ``failure``)."""
        facts: dict[str, Any] = {"launch_state": state}
        if failure is not None:
            facts["failure"] = failure
        if files_version is not None:
            facts["files_version"] = files_version
        self.update_replica(replica_id, **facts)

    def mark_relaunch(self, replica_id: int, *, forget_handle: bool = True) -> None:
        """Back to PENDING: the launch was interrupted and nothing of it runs."""
        if forget_handle:
            self.update_replica(
                replica_id, launch_state=LaunchState.PENDING, handle=None, endpoint=None
            )
        else:
            self.update_replica(replica_id, launch_state=LaunchState.PENDING)

    def record_handle(
        self, replica_id: int, handle: dict[str, Any], endpoint: str, launched_at: float
    ) -> None:
        """Something exists on the backend: how to find it, stored before it is used."""
        self.update_replica(replica_id, handle=handle, endpoint=endpoint, launched_at=launched_at)

    def mark_ready(self, replica_id: int, first_ready_at: float) -> None:
        self.update_replica(replica_id, ready=1, first_ready_at=first_ready_at)

    def mark_not_ready(self, replica_id: int) -> None:
        self.update_replica(replica_id, ready=0)

    def mark_failed(
        self, replica_id: int, kind: FailureKind, failure: str, *, exit_code: int | None = None
    ) -> None:
        """The replica failed (out of the ready set); ``kind`` is the fact its status shows."""
        facts: dict[str, Any] = {"ready": 0, "failure": failure, kind.value: 1}
        if kind is FailureKind.APP:
            facts["exit_code"] = exit_code
        self.update_replica(replica_id, **facts)

    def mark_scale_down(self, replica_id: int) -> ReplicaRow | None:
        """Chosen to go (scale down, or terminated on request): no longer counts as live."""
        return self.update_replica(replica_id, scale_down=1)

    def mark_teardown(
        self,
        replica_id: int,
        state: TeardownState | None,
        *,
        failure: str | EllipsisType | None = ...,
        attempts: int | None = None,
    ) -> ReplicaRow | None:
        """The teardown moved on: PENDING (draining; out of the ready set), RUNNING, SUCCEEDED
        or FAILED (with ``attempts`` so far); None when an interrupted one starts over.
        ``failure`` replaces the row's failure text when given (None clears it)."""
        facts: dict[str, Any] = {"teardown_state": state}
        if state is TeardownState.PENDING:
            facts["ready"] = 0
        if not isinstance(failure, EllipsisType):
            facts["failure"] = failure
        if attempts is not None:
            facts["teardown_attempts"] = attempts
        return self.update_replica(replica_id, **facts)

    def delete_replica(self, replica_id: int) -> None:
        self._execute("DELETE FROM replicas WHERE id = ?", (replica_id,))

    def forget_replica(
        self, service: str, replica_id: int, action: str | None, reason: str | None = None
    ) -> None:
        """Delete a replica's row and write its last event (``action``: ``replica.terminated``,
        ``replica.removed``, ``replica.purge``; none for an old failure let go) in one
        transaction. As two writes, the event first (so that no row went without a word), a
        daemon killed between them kept the row, the next daemon repeated its end, and the
        event log told it twice."""

        def forget(db: sqlite3.Connection) -> None:
            if action is not None:
                db.execute(
                    "INSERT INTO events (ts, service, replica_id, replica, actor, action, reason)"
                    " SELECT ?, ?, id, seq, 'controller', ?, ? FROM replicas WHERE id = ?",
                    (time.time(), service, action, reason, replica_id),
                )
            db.execute("DELETE FROM replicas WHERE id = ?", (replica_id,))

        self._transaction(forget)

    # -- placements (corral.capacity) ---------------------------------------------------------

    def held_claims(self) -> list[HeldClaim]:
        """Every claim of a replica whose teardown has not succeeded."""
        return [_held_claim(r) for r in self._query(_HELD_CLAIMS)]

    def claim(
        self,
        replica_id: int,
        choose: Callable[[list[HeldClaim]], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """The replica's claim: the one stored, else ``choose(held claims)`` stored in the same
        transaction (so two replicas can never be given the same free device); None when
        ``choose`` finds nothing."""

        def claim(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT p.claim_json, r.service FROM placements p JOIN replicas r"
                " ON r.id = p.replica_id WHERE p.replica_id = ?",
                (replica_id,),
            ).fetchone()
            if row is not None:
                return dict(json.loads(row[0]))
            service = db.execute("SELECT service FROM replicas WHERE id = ?", (replica_id,))
            found = service.fetchone()
            if found is None:
                return None
            held = [_held_claim(r) for r in db.execute(_HELD_CLAIMS).fetchall()]
            chosen = choose(held)
            if chosen is not None:
                db.execute(
                    "INSERT INTO placements (replica_id, service, claim_json, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (replica_id, found[0], json.dumps(chosen), time.time()),
                )
            return chosen

        return self._transaction(claim)

    # -- events -------------------------------------------------------------------------------

    def event(
        self,
        service: str,
        action: str,
        reason: str | None = None,
        *,
        replica_id: int | None = None,
        actor: str = "controller",
    ) -> None:
        self._execute(
            "INSERT INTO events (ts, service, replica_id, replica, actor, action, reason)"
            " VALUES (?, ?, ?, (SELECT seq FROM replicas WHERE id = ?), ?, ?, ?)",
            (time.time(), service, replica_id, replica_id, actor, action, reason),
        )

    def events(self, service: str, *, after: int = 0, limit: int = 200) -> list[EventRow]:
        """The events of the service of this name now: an earlier service of the same name
        (taken down, then up again) is another service, and its events stay in the file."""
        rows = self._query(
            "SELECT * FROM (SELECT * FROM events WHERE service = ? AND id > ? AND id >="
            " (SELECT COALESCE(MAX(id), 0) FROM events WHERE service = ?"
            " AND action = 'service.create') ORDER BY id DESC LIMIT ?) ORDER BY id",
            (service, after, service, limit),
        )
        return [_row(EventRow, r) for r in rows]

    # -- balancer workers ---------------------------------------------------------------------

    def workers(self) -> list[WorkerRow]:
        return [
            _row(WorkerRow, r) for r in self._query("SELECT * FROM balancer_workers ORDER BY slot")
        ]

    def set_worker(self, slot: int, pid: int, created: float) -> None:
        self._execute(
            "INSERT OR REPLACE INTO balancer_workers (slot, pid, created, started_at)"
            " VALUES (?, ?, ?, ?)",
            (slot, pid, created, time.time()),
        )

    def delete_worker(self, slot: int) -> None:
        self._execute("DELETE FROM balancer_workers WHERE slot = ?", (slot,))


# (service, replica id, the replica's number within its service, claim)
HeldClaim = tuple[str, int, int, dict[str, Any]]


def _held_claim(row: sqlite3.Row) -> HeldClaim:
    rid = int(row["replica_id"])
    return row["service"], rid, int(row["seq"] or rid), json.loads(row["claim_json"])


_HELD_CLAIMS = (
    "SELECT p.replica_id, r.service, r.seq, p.claim_json FROM placements p JOIN replicas r"
    " ON r.id = p.replica_id WHERE r.teardown_state IS NULL OR r.teardown_state != 'succeeded'"
    " ORDER BY p.replica_id"
)


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip() and not _only_comments(s)]


def _only_comments(statement: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in statement.splitlines())
