"""What must hold in a corral home once it has settled: a reusable checker for chaos tests.

A chaos test breaks something (kills the daemon, a backend, a disk), lets corral recover, and
then asks one question: is the home consistent? That question is the architecture's invariants,
read from the two sources of truth there are, the state file (``state.db``, read-only here) and
the process table (every process a backend started carries ``CORRAL_HOME_MARKER`` and
``CORRAL_REPLICA_KEY`` in its environment, see ``corral.infra.local``):

1. **no dangling row**: every replica row that counts as running (launched, not being torn down,
   not failed) has a handle whose process is alive, is the same process (start time, not the pid
   alone) and carries this home's marker and the row's replica key;
2. **no orphan**: every process carrying this home's marker belongs to a replica row that still
   exists, is of the same service and is not finished (torn down, cancelled), and runs in the
   process group that row recorded;
3. **no duplicate**: no replica key is running in two process groups, no two rows name the same
   process, and no service runs more replicas of a version than it was asked for;
4. **intended state**: each service is what the test asked for (running at version V with N READY
   replicas and nothing else, old versions gone; or removed: no row, no replica, no process);
5. **the event log says what happened**: given a picture of the state taken while the daemon was
   dead (:func:`read_state`), every replica that picture shows unfinished has an event written
   after the restart (adopted, relaunched, torn down, launched), and every replica that is gone
   since has an event saying it went (terminated or removed).

Call :func:`check_home` only once the home has settled (:func:`settled` says when): during a
launch a setup process legitimately has no recorded handle yet, and during a teardown a row
legitimately points at a process that is on its way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
from conftest import ENV_HOME_MARKER, CorralHome

ENV_REPLICA_KEY = "CORRAL_REPLICA_KEY"  # corral.infra.local.ENV_REPLICA_KEY

# Two readings of one process's start time differ by float rounding at most (corral's own
# tolerance is 1 ms; a little slack here, since a recycled pid starts far later than that).
_CREATE_TIME_TOLERANCE = 0.01

# Row facts whose replica is finished: nothing of it may run any more.
_FINISHED_LAUNCH = {"cancelled", "failed"}


@dataclass(frozen=True)
class Intent:
    """A service that must be running ``replicas`` READY replicas of ``version``.

    ``failed``: ids of replicas the test made fail (killed them): they must be kept visible as
    failed and torn down, not running and not gone without a trace.
    """

    replicas: int
    version: int
    failed: frozenset[int] = frozenset()


# None: the service must be gone.
Intended = Mapping[str, Intent | None]


@dataclass(frozen=True)
class HomeState:
    """One read of ``state.db``: services, replica rows (as dicts of their columns), events."""

    services: dict[str, dict[str, Any]]
    replicas: dict[int, dict[str, Any]]
    events: list[dict[str, Any]]

    @property
    def last_event_id(self) -> int:
        return max((e["id"] for e in self.events), default=0)

    def events_of(self, replica_id: int, *, after: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["replica_id"] == replica_id and e["id"] > after]


@dataclass(frozen=True)
class MarkedProcess:
    pid: int
    pgid: int
    key: str | None
    create_time: float
    cmdline: str


@dataclass
class Findings:
    """What :func:`check_home` found wrong, by invariant. Empty lists: the home is consistent."""

    dangling: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    missing_events: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        for label, items in (
            ("dangling row", self.dangling),
            ("orphan process", self.orphans),
            ("duplicate", self.duplicates),
            ("not the intended state", self.mismatched),
            ("event log", self.missing_events),
        ):
            out.extend(f"{label}: {item}" for item in items)
        return out

    def __bool__(self) -> bool:
        return bool(self.problems())

    def __str__(self) -> str:
        return "\n".join(self.problems()) or "consistent"


# -- reading ------------------------------------------------------------------------------------


def read_state(home: CorralHome) -> HomeState:
    """Read the home's state file (read-only, WAL: safe while a daemon writes it)."""
    db = sqlite3.connect(f"file:{home.path / 'state.db'}?mode=ro", uri=True, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        services = {r["name"]: dict(r) for r in db.execute("SELECT * FROM services")}
        replicas = {r["id"]: dict(r) for r in db.execute("SELECT * FROM replicas ORDER BY id")}
        events = [dict(r) for r in db.execute("SELECT * FROM events ORDER BY id")]
    finally:
        db.close()
    return HomeState(services, replicas, events)


def marked_processes(home: CorralHome) -> list[MarkedProcess]:
    """Every live (non-zombie) process whose environment carries this home's marker."""
    marker = home.marker
    if marker is None:
        return []
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            if env.get(ENV_HOME_MARKER) != marker:
                continue
            found.append(
                MarkedProcess(
                    pid=proc.pid,
                    pgid=os.getpgid(proc.pid),
                    key=env.get(ENV_REPLICA_KEY),
                    create_time=proc.create_time(),
                    cmdline=" ".join(proc.cmdline())[:160],
                )
            )
    return found


def _handle(row: Mapping[str, Any]) -> dict[str, Any] | None:
    raw = row.get("handle_json")
    if not raw:
        return None
    data = json.loads(raw).get("data")
    return dict(data) if isinstance(data, dict) else None


def _status(row: Mapping[str, Any]) -> str:
    """A short description of a row's facts for messages (not corral's status function)."""
    bits = [f"launch={row['launch_state']}"]
    if row["teardown_state"]:
        bits.append(f"teardown={row['teardown_state']}")
    if row["ready"]:
        bits.append("ready")
    if row["failure"]:
        bits.append(f"failure={row['failure'][:80]!r}")
    return f"replica {row['id']} of {row['service']} v{row['version']} ({', '.join(bits)})"


def _failed(row: Mapping[str, Any]) -> bool:
    return bool(
        row["app_failed"]
        or row["preempted"]
        or row["probe_failed"]
        or row["initial_delay_failed"]
        or row["launch_state"] == "failed"
    )


def _running(row: Mapping[str, Any]) -> bool:
    """The row claims a process that must be alive: launched, not leaving, not failed."""
    return (
        row["launch_state"] == "succeeded"
        and row["teardown_state"] is None
        and not row["scale_down"]
        and not _failed(row)
    )


def _finished(row: Mapping[str, Any]) -> bool:
    return row["teardown_state"] == "succeeded" or row["launch_state"] in _FINISHED_LAUNCH


def _same_process(handle: Mapping[str, Any], proc: psutil.Process) -> bool:
    return abs(proc.create_time() - float(handle["create_time"])) <= _CREATE_TIME_TOLERANCE


# -- the checks ---------------------------------------------------------------------------------


def settled(home: CorralHome, intended: Intended) -> bool:
    """The state file shows every service as intended, with nothing in flight (cheap: no
    process scan). Poll this with a deadline, then call :func:`check_home`."""
    state = read_state(home)
    return not _intent_problems(state, intended)


def check_home(
    home: CorralHome,
    intended: Intended | None = None,
    *,
    before_restart: HomeState | None = None,
) -> Findings:
    """Check the invariants of the module docstring; see there for what each one means.

    ``intended`` (service name -> :class:`Intent`, or None for "must be gone") enables check 4
    and the per-version count of check 3; services it does not name must not exist.
    ``before_restart``, a :func:`read_state` taken while the daemon was dead, enables check 5.
    """
    state = read_state(home)
    procs = marked_processes(home)
    findings = Findings()
    _check_rows(home, state, findings)
    _check_processes(state, procs, findings)
    _check_duplicates(state, procs, intended, findings)
    if intended is not None:
        findings.mismatched.extend(_intent_problems(state, intended))
        gone = {name for name, intent in intended.items() if intent is None}
        for p in procs:
            service = _service_of_key(p.key)
            if service in gone:
                findings.orphans.append(f"pid {p.pid} of removed service {service}: {p.cmdline}")
    if before_restart is not None:
        findings.missing_events.extend(_event_problems(before_restart, state))
    return findings


def _check_rows(home: CorralHome, state: HomeState, findings: Findings) -> None:
    """Invariant 1: a running row points at a live process of this home and this replica."""
    marker = home.marker
    for row in state.replicas.values():
        if row["service"] not in state.services:
            findings.dangling.append(f"{_status(row)}: its service row is gone")
        if not _running(row):
            continue
        handle = _handle(row)
        if handle is None:
            findings.dangling.append(f"{_status(row)}: launched but no handle recorded")
            continue
        pid = int(handle["pid"])
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                raise psutil.NoSuchProcess(pid)
            if not _same_process(handle, proc):
                findings.dangling.append(f"{_status(row)}: pid {pid} is now another process")
                continue
            env = proc.environ()
        except psutil.Error as exc:
            findings.dangling.append(f"{_status(row)}: pid {pid} is gone ({exc!r})")
            continue
        key = f"{marker}/{row['service']}/{row['id']}"
        if env.get(ENV_HOME_MARKER) != marker or env.get(ENV_REPLICA_KEY) != key:
            findings.dangling.append(
                f"{_status(row)}: pid {pid} does not carry this home's marker and key {key}"
            )


def _replica_of_key(key: str | None) -> int | None:
    if key is None:
        return None
    with contextlib.suppress(ValueError):
        return int(key.rsplit("/", 1)[1])
    return None


def _service_of_key(key: str | None) -> str | None:
    parts = (key or "").split("/")
    return parts[1] if len(parts) == 3 else None


def _check_processes(state: HomeState, procs: Iterable[MarkedProcess], findings: Findings) -> None:
    """Invariant 2: every process of this home belongs to an unfinished row, in its group."""
    for p in procs:
        what = f"pid {p.pid} (group {p.pgid}, key {p.key}): {p.cmdline}"
        rid = _replica_of_key(p.key)
        row = state.replicas.get(rid) if rid is not None else None
        if row is None:
            findings.orphans.append(f"{what}: no replica row")
            continue
        if row["service"] != _service_of_key(p.key):
            findings.orphans.append(f"{what}: row {rid} is of service {row['service']}")
            continue
        if _finished(row):
            findings.orphans.append(f"{what}: {_status(row)} is finished")
            continue
        handle = _handle(row)
        if handle is None:
            if row["launch_state"] != "running":
                findings.orphans.append(f"{what}: {_status(row)} records no process")
            continue  # a setup of a launch in flight (never the case once settled)
        if int(handle.get("pgid", handle["pid"])) != p.pgid:
            findings.orphans.append(
                f"{what}: {_status(row)} recorded process group {handle.get('pgid')}"
            )


def _check_duplicates(
    state: HomeState,
    procs: Iterable[MarkedProcess],
    intended: Intended | None,
    findings: Findings,
) -> None:
    """Invariant 3: one process group per replica key, one row per process, no extra replica."""
    groups: dict[str, set[int]] = defaultdict(set)
    for p in procs:
        if p.key is not None:
            groups[p.key].add(p.pgid)
    for key, pgids in sorted(groups.items()):
        if len(pgids) > 1:
            findings.duplicates.append(f"replica key {key} runs in process groups {sorted(pgids)}")
    owners: dict[int, list[int]] = defaultdict(list)
    for row in state.replicas.values():
        handle = _handle(row)
        if handle is not None and not _finished(row):
            owners[int(handle["pid"])].append(row["id"])
    for pid, rows in sorted(owners.items()):
        if len(rows) > 1:
            findings.duplicates.append(f"pid {pid} is recorded by replica rows {rows}")
    if intended is None:
        return
    for name, intent in intended.items():
        if intent is None:
            continue
        running = [
            r
            for r in state.replicas.values()
            if r["service"] == name and r["version"] == intent.version and _running(r)
        ]
        if len(running) > intent.replicas:
            findings.duplicates.append(
                f"service {name} runs {len(running)} replicas of version {intent.version}, "
                f"asked for {intent.replicas}: {[r['id'] for r in running]}"
            )


def _intent_problems(state: HomeState, intended: Intended) -> list[str]:
    """Invariant 4, from the state file alone."""
    problems = []
    for name in sorted(set(state.services) - set(intended)):
        problems.append(f"service {name} exists but was never asked for")
    for name, intent in sorted(intended.items()):
        svc = state.services.get(name)
        rows = [r for r in state.replicas.values() if r["service"] == name]
        if intent is None:
            if svc is not None:
                problems.append(f"service {name} should be gone: intent {svc['intent']}")
            problems.extend(f"{_status(r)}: its service should be gone" for r in rows)
            continue
        if svc is None:
            problems.append(f"service {name} is missing")
            continue
        if svc["intent"] != "running" or svc["current_version"] != intent.version:
            problems.append(
                f"service {name} is {svc['intent']} at version {svc['current_version']}, "
                f"should be running at version {intent.version}"
            )
        ready = [r for r in rows if _running(r) and r["ready"] and r["version"] == intent.version]
        if len(ready) != intent.replicas:
            problems.append(
                f"service {name} has {len(ready)} READY replicas of version {intent.version}, "
                f"should have {intent.replicas}"
            )
        for rid in sorted(intent.failed):
            row = state.replicas.get(rid)
            if row is None or not (_failed(row) and row["teardown_state"] == "succeeded"):
                shown = _status(row) if row else f"replica {rid} (no row)"
                problems.append(f"{shown}: should be failed, torn down and kept visible")
        # Anything else is either in flight (not settled yet) or a leftover; failed replicas
        # kept for display count too: a daemon restart must never fail a healthy replica.
        problems.extend(
            f"{_status(r)}: not a READY replica of version {intent.version}"
            for r in rows
            if r not in ready and r["id"] not in intent.failed
        )
    return problems


def _event_problems(before: HomeState, after: HomeState) -> list[str]:
    """Invariant 5: the restart left a trace for every replica it found unfinished."""
    problems = []
    since = before.last_event_id
    for rid, row in before.replicas.items():
        if _finished(row):
            continue
        new = [e["action"] for e in after.events_of(rid, after=since)]
        if not new:
            problems.append(f"{_status(row)} was unfinished at the kill; no event since")
            continue
        if (
            _running(row)
            and _handle(row) is not None
            and not {"replica.adopt", "replica.failed"} & set(new)
        ):
            # A running replica survives a daemon kill (its own session); the restart adopts it
            # (or finds it died meanwhile) before anything else may happen to it.
            problems.append(f"{_status(row)} was running at the kill; events since: {new}")
        if rid not in after.replicas:
            ever = [e["action"] for e in after.events_of(rid)]
            if not {"replica.terminated", "replica.removed"} & set(ever):
                problems.append(f"{_status(row)} is gone without a terminated/removed event")
    return problems
