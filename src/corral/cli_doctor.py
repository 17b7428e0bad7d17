"""`corral doctor`: every corral process of this machine, its home, and whether that home
still exists; with ``--end-orphans``, the processes of deleted homes are ended.

Why: a home is normally torn down by its daemon, and the daemon and the balancer workers
watch their home and end what it owns when it is deleted. That fails when they were killed
first, were of an older corral, or a replica left its group: then a deleted home leaves
processes that hold memory and ports for no one, and nothing names them. The machine-wide
registry (corral.ownership) still knows each home id's path, so this command can say, for
every process carrying a home id, whose it is and whether that home is gone.

Safety rules, because this command kills: a process of a home that exists is never touched;
one whose home cannot be told (no registration, an unreadable path) is only reported, unless
``--include-unknown`` is given; processes are found by their home id (a worker's command
line, a replica's environment, a daemon's registration) and signalled by pid through psutil
objects, which refuse a recycled pid. Never by name.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from corral.cli_common import err, out

if TYPE_CHECKING:
    import psutil

    from corral.ownership import Registration

# How long an ended process is given between SIGTERM and SIGKILL.
REPLICA_GRACE = 5.0
PROCESS_GRACE = 10.0
DAEMON, WORKER, REPLICA = "daemon", "worker", "replica"
# What a replica's detail ends with when a Ray actor on this machine runs it (its environment
# carries the Ray backend's marker, not the local one's).
ON_RAY = " (ray)"


@dataclass(frozen=True)
class Found:
    """One corral process and the home id it belongs to."""

    kind: str
    pid: int
    home_id: str
    detail: str  # the worker's slot, or the replica as service/id
    created: float
    proc: psutil.Process


@dataclass(frozen=True)
class Home:
    """A home id as the registry knows it. ``exists`` is None when it cannot be told: no
    registration names the id, or its path cannot be read (a guess never ends a process)."""

    home_id: str
    path: str | None
    exists: bool | None
    daemon_pid: int | None

    @property
    def deleted(self) -> bool:
        return self.exists is False


def home_state(reg: Registration) -> bool | None:
    """True while the registered path still holds this home id; False when it is shown gone
    (deleted, or another home in its place); None when it cannot be read (a permission or an
    I/O error), which must not count as deleted."""
    from corral.ownership import HOME_ID_FILE

    if reg.home_exists():
        return True
    try:
        (reg.home / HOME_ID_FILE).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    return False  # the file is there with another id (or none): the home was replaced


def _daemons(regs: dict[str, Registration]) -> list[Found]:
    """The registered daemons still running (pid and creation time both match)."""
    from corral.dataplane.processes import find_process

    found = []
    for reg in regs.values():
        if reg.daemon_pid is None or reg.daemon_created is None:
            continue
        proc = find_process(reg.daemon_pid, reg.daemon_created)
        if proc is not None and proc.pid != os.getpid():
            found.append(Found(DAEMON, proc.pid, reg.home_id, "", reg.daemon_created, proc))
    return found


def _classify(proc: psutil.Process, info: dict[str, Any]) -> Found | None:
    """A balancer worker (by its command line) or a replica (by the home marker in its
    environment), or None."""
    from corral.infra._ray_actor import ENV_HOME_MARKER as RAY_HOME_MARKER
    from corral.infra.local_ident import ENV_HOME_MARKER, ENV_REPLICA_KEY
    from corral.infra.local_scan import environ
    from corral.ownership import worker_home_id

    created = float(info.get("create_time") or 0.0)
    worker = worker_home_id(info.get("cmdline") or [])
    if worker is not None:
        return Found(WORKER, proc.pid, worker[0], str(worker[1]), created, proc)
    env = environ(proc)
    if env is None:
        return None
    marker = env.get(ENV_HOME_MARKER) or env.get(RAY_HOME_MARKER)
    if not marker:
        return None
    service, replica = env.get("CORRAL_SERVICE"), env.get("CORRAL_REPLICA_ID")
    if service and replica:
        detail = f"{service}/{replica}"
    else:  # the key is "<home id>/<service>/<id>"
        detail = env.get(ENV_REPLICA_KEY, "").partition("/")[2]
    if not env.get(ENV_HOME_MARKER):
        detail += ON_RAY
    return Found(REPLICA, proc.pid, marker, detail, created, proc)


def _scan_table() -> list[Found]:
    """Workers and replicas of this user: one pass over the process table. Another user's
    processes are theirs to look after (their registry is their own, and they cannot be
    signalled anyway)."""
    import psutil

    from corral.procfs import running

    me, uid = os.getpid(), os.getuid()
    found = []
    for proc in psutil.process_iter(["cmdline", "uids", "create_time"]):
        info = proc.info
        uids = info.get("uids")
        if proc.pid == me or uids is None or uids.real != uid:
            continue
        item = _classify(proc, info)
        if item is not None and running(proc):
            found.append(item)
    return found


def scan() -> tuple[list[Found], dict[str, Home]]:
    """Every corral process this user may see, and every home id they or the registry name."""
    from corral.ownership import registrations

    regs = registrations()
    procs = _daemons(regs) + _scan_table()
    homes: dict[str, Home] = {}
    for reg in regs.values():
        homes[reg.home_id] = Home(reg.home_id, str(reg.home), home_state(reg), reg.daemon_pid)
    for item in procs:
        homes.setdefault(item.home_id, Home(item.home_id, None, None, None))
    order = {DAEMON: 0, WORKER: 1, REPLICA: 2}
    procs.sort(key=lambda f: (homes[f.home_id].path or "~", f.home_id, order[f.kind], f.pid))
    return procs, homes


def _exists_text(exists: bool | None) -> str:
    return {True: "yes", False: "[red]no[/red]", None: "unknown"}[exists]


def _age(created: float) -> str:
    from corral.cliview import age

    return age(max(0.0, time.time() - created)) if created else "-"


def _print_table(procs: list[Found], homes: dict[str, Home]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("HOME", "EXISTS", "KIND", "PID", "SLOT/REPLICA", "AGE"):
        table.add_column(column, overflow="fold")
    for item in procs:
        home = homes[item.home_id]
        table.add_row(
            home.path or f"unknown (id {item.home_id})",
            _exists_text(home.exists),
            item.kind,
            str(item.pid),
            item.detail or "-",
            _age(item.created),
        )
    Console(highlight=False, width=max(out.width, 200)).print(table, crop=False)


def _as_json(procs: list[Found], homes: dict[str, Home]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for item in procs:
        counts[item.home_id] = counts.get(item.home_id, 0) + 1
    return {
        "processes": [
            {
                "kind": item.kind,
                "pid": item.pid,
                "home_id": item.home_id,
                "home": homes[item.home_id].path,
                "exists": homes[item.home_id].exists,
                "slot": int(item.detail) if item.kind == WORKER else None,
                "replica": item.detail if item.kind == REPLICA else None,
                "created": item.created,
            }
            for item in procs
        ],
        "homes": [
            {
                "home_id": home.home_id,
                "home": home.path,
                "exists": home.exists,
                "daemon_pid": home.daemon_pid,
                "processes": counts.get(home.home_id, 0),
            }
            for home in sorted(homes.values(), key=lambda h: (h.path or "~", h.home_id))
        ],
    }


def _summary(procs: list[Found], homes: dict[str, Home]) -> list[str]:
    orphans = [p for p in procs if homes[p.home_id].deleted]
    deleted = {p.home_id for p in orphans}
    lines = [
        f"{len(orphans)} orphan process(es) of {len(deleted)} deleted home(s)"
        + (": `corral doctor --end-orphans` ends them" if orphans else "")
    ]
    owned = {p.home_id for p in procs}
    empty = [h for h in homes.values() if h.deleted and h.home_id not in owned]
    if empty:
        lines.append(
            f"{len(empty)} deleted home(s) registered with no process left: "
            "`corral doctor --end-orphans` forgets them"
        )
    unknown = [p for p in procs if homes[p.home_id].exists is None]
    if unknown:
        lines.append(
            f"{len(unknown)} process(es) of home(s) that cannot be told (no registration, or "
            "an unreadable path): left alone unless `--end-orphans --include-unknown`"
        )
    return lines


def end_home(home_id: str, procs: list[Found]) -> tuple[list[str], list[str]]:
    """End every process of one deleted home: (what was ended, what could not be).

    The daemon and the workers go first, so no daemon is left to replace the replicas that
    are ended next; the replicas go by their home marker (their process groups, then their
    cgroups: also what left the group), as a daemon tears down."""
    from corral.infra import local_scan
    from corral.procfs import running, terminate_all

    ended: list[str] = []
    failed: list[str] = []
    owners = [p for p in procs if p.kind in (DAEMON, WORKER)]
    # A zombie is dead (only its reaping is late, e.g. under a PID 1 that does not reap).
    left = {p.pid for p in terminate_all([p.proc for p in owners], PROCESS_GRACE) if running(p)}
    for item in owners:
        what = f"{item.kind} pid {item.pid} of home id {home_id}"
        if item.pid in left:
            failed.append(f"could not end {what}: alive after SIGKILL")
        else:
            ended.append(f"ended {what}")
    for line in local_scan.end_home(home_id, grace=REPLICA_GRACE):
        (failed if line.startswith("could not") else ended).append(line)
    on_ray = [p for p in procs if p.kind == REPLICA and p.detail.endswith(ON_RAY)]
    left = {p.pid for p in terminate_all([p.proc for p in on_ray], REPLICA_GRACE) if running(p)}
    for item in on_ray:
        what = f"Ray replica {item.detail.removesuffix(ON_RAY)} pid {item.pid} of home id {home_id}"
        if item.pid in left:
            failed.append(f"could not end {what}: alive after SIGKILL")
        else:  # its actor is the cluster's to remove: this command has no Ray connection
            ended.append(f"ended {what} (its Ray actor corral-{home_id}-... stays on the cluster)")
    return ended, failed


def end_orphan_homes(
    procs: list[Found], homes: dict[str, Home], include_unknown: bool
) -> tuple[list[str], list[str]]:
    """End the processes of every deleted home (and, with ``include_unknown``, of every home
    that cannot be told), then forget the registrations of deleted homes that have nothing
    left. A registration whose processes could not all be ended is kept, so that the next
    `corral doctor` still names the home."""
    from corral.infra.base import leave_scratch, scratch_root
    from corral.ownership import unregister

    ended: list[str] = []
    failed: list[str] = []
    for home in homes.values():
        if home.exists is True or (home.exists is None and not include_unknown):
            continue
        # A Ray replica on this machine may be of a home of another machine (a daemon there
        # uses this node): unknown here is no reason to end it.
        mine = [
            p
            for p in procs
            if p.home_id == home.home_id and (home.deleted or not p.detail.endswith(ON_RAY))
        ]
        done, bad = end_home(home.home_id, mine) if mine else ([], [])
        ended += done
        failed += bad
        if home.deleted and not bad:
            unregister(home.home_id)
            ended.append(f"forgot deleted home {home.path} (id {home.home_id})")
            # Its replicas' working directories: no daemon will run there again.
            scratch = scratch_root(home.home_id)
            if scratch.exists():
                leave_scratch(home.home_id, lost=True)
                ended.append(f"removed its replicas' scratch directory {scratch}")
    return ended, failed


def _confirm(yes: bool, question: str) -> None:
    """Ask only a person at a terminal: a script (no tty on stdin) asked for it with the flag."""
    if yes or not sys.stdin.isatty():
        return
    click.confirm(question, default=False, abort=True, err=True)


def _end(
    procs: list[Found], homes: dict[str, Home], include_unknown: bool, yes: bool, quiet: bool
) -> tuple[list[str], list[str]]:
    """--end-orphans: ask (a person at a terminal only), end, and say what was ended."""
    victims = [
        p
        for p in procs
        if homes[p.home_id].deleted or (include_unknown and homes[p.home_id].exists is None)
    ]
    if victims:
        _confirm(yes, f"End {len(victims)} process(es) of deleted or unknown homes?")
    ended, failed = end_orphan_homes(procs, homes, include_unknown)
    if not quiet:
        for line in ended:
            out.print(line, soft_wrap=True, markup=False)
        for line in failed:
            err.print(line, soft_wrap=True, markup=False, style="red")
    return ended, failed


@click.command()
@click.option("--end-orphans", is_flag=True, help="End the processes of deleted homes.")
@click.option(
    "--include-unknown",
    is_flag=True,
    help="With --end-orphans: also end processes whose home cannot be told (no registration).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before ending processes.")
def doctor(end_orphans: bool, include_unknown: bool, as_json: bool, yes: bool) -> None:
    """Every corral process of this machine's homes, its home, whether the home still exists.

    A process whose home was deleted (an orphan) serves no one; --end-orphans ends those
    (SIGTERM, then SIGKILL), forgets their homes and removes their replicas' scratch
    directories. Processes of homes that exist are never touched. Exits 1 when something could
    not be ended."""
    if include_unknown and not end_orphans:
        raise click.UsageError("--include-unknown goes with --end-orphans")
    procs, homes = scan()
    report = _as_json(procs, homes)
    if not as_json:
        if procs:
            _print_table(procs, homes)
        else:
            out.print("no corral processes")
        for line in _summary(procs, homes):
            out.print(line, soft_wrap=True, markup=False)
    failed: list[str] = []
    if end_orphans:
        ended, failed = _end(procs, homes, include_unknown, yes, quiet=as_json)
        report.update(ended=ended, failed=failed)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    if failed:
        sys.exit(1)
