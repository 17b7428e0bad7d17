"""`corral daemon ...`: run, start, stop, restart-workers, restore and status of a home's daemon."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from corral.cli_common import client_of, fail, home_of, out
from corral.client import Client, UntrustedDaemon
from corral.figures import gib
from corral.home import EXIT_BAD_HOME, EXIT_DAEMON_RUNNING, home_problem, is_loopback

if TYPE_CHECKING:
    import psutil


@click.group()
def daemon() -> None:
    """Run, inspect or stop the daemon of this home."""


@daemon.command("run")
@click.option(
    "--home",
    "home_opt",
    type=click.Path(path_type=Path),  # checked by home_problem, as `corral --home` is
    default=None,
    help="corral home (as `corral --home`; default: $CORRAL_HOME or ~/.corral).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="API address.")
@click.option(
    "--port",
    default=0,
    type=int,
    help="API and dashboard port (default: the one this home used last, else a free one).",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PEM certificate (chain) for HTTPS; required with a --host that is not loopback.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PEM private key of --tls-cert.",
)
@click.option(
    "--gpus",
    default=None,
    help="GPUs corral may give replicas: indices or UUIDs (0,1,4), or 'none' "
    "(sets CORRAL_GPUS; see docs/gpus.md).",
)
@click.pass_context
def daemon_run(
    ctx: click.Context,
    home_opt: Path | None,
    host: str,
    port: int,
    tls_cert: Path | None,
    tls_key: Path | None,
    gpus: str | None,
) -> None:
    """Run the daemon in the foreground.

    The API listens on 127.0.0.1. Any other address is reachable from elsewhere, so it needs
    HTTPS (--tls-cert and --tls-key): the bearer token must not cross a network in clear.
    """
    from corral.capture import hold_standard_fds

    hold_standard_fds()  # before anything opens a file that would take a closed 1 or 2
    if home_opt is not None:  # the group's --home was checked; this one bypassed it
        problem = home_problem(home_opt.expanduser())
        if problem:
            fail(problem, code=EXIT_BAD_HOME)
    home = (home_opt or home_of(ctx)).expanduser().resolve()
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together: give both, or neither")
    if tls_cert is None and not is_loopback(host):
        fail(
            f"the API would listen on {host}, which is not loopback, in plain HTTP: the token "
            "would cross the network in clear. Pass --tls-cert FILE --tls-key FILE (clients "
            "verify that certificate), or keep the default --host 127.0.0.1."
        )
    if gpus is not None:
        os.environ["CORRAL_GPUS"] = gpus  # read with the rest of the inventory at start
    import asyncio  # the daemon's own imports: not paid by every other command

    from corral.bootstrap import (  # heavy: imported only here
        DaemonError,
        DaemonRunning,
        serve,
        server_tls_context,
    )

    try:
        context = None
        if tls_cert is not None and tls_key is not None:
            tls_cert = tls_cert.expanduser().resolve()
            context = server_tls_context(tls_cert, tls_key.expanduser().resolve())
        asyncio.run(serve(home, host=host, port=port, ssl_context=context, tls_cert=tls_cert))
    except DaemonRunning as exc:
        fail(str(exc), code=EXIT_DAEMON_RUNNING)
    except DaemonError as exc:
        fail(str(exc))


@daemon.command("start")
@click.pass_context
def daemon_start(ctx: click.Context) -> None:
    """Start the daemon in the background (if none runs) and wait until it answers."""
    already = Client(home_of(ctx)).health()
    client = client_of(ctx, start=True)
    info = client.request("GET", "/v1/daemon")
    how = "already running" if already else "started"
    out.print(f"daemon {how}: pid {info.get('pid')} serving {home_of(ctx)}")


@daemon.command("stop")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Stop the balancer workers too: every service's endpoint stops answering.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to wait for the daemon to exit; past them the command fails (exit 1).",
)
@click.pass_context
def daemon_stop(ctx: click.Context, everything: bool, timeout: float) -> None:
    """Stop the control plane. Services keep serving: the balancer workers and the replicas
    keep running, and the next daemon adopts them (`daemon start`, `up`, `update`, `down`
    and `dashboard` start one; `status` and `logs` do not). With no service left, the
    balancer workers stop too. Returns once the daemon has exited, or fails if it has not
    within ``--timeout``: a script going on from there would race a daemon still ending its
    controllers with its lock held."""
    home = home_of(ctx)
    client = Client(home)
    if not client.health():
        if isinstance(client.last_error, UntrustedDaemon):
            fail(str(client.last_error))
        _stop_silent_daemon(home, timeout)
        if everything:
            _stop_orphan_workers(home)
        return
    process = _daemon_process(home)
    workers = client.stop_daemon(workers=everything)
    deadline = time.monotonic() + timeout
    while client.health() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _wait_for_exit(process, deadline) or client.health():
        who = f"the daemon (pid {process.pid})" if process is not None else "the daemon"
        fail(
            f"{who} has not exited within {timeout:g} s of the stop request; it is still "
            f"shutting down (its log: {home / 'daemon.log'}). Run `corral daemon stop` again "
            "to wait for it."
        )
    if workers:
        _stop_orphan_workers(home)  # any the daemon could not reach
        if everything:
            out.print("daemon and balancer workers stopped: service endpoints no longer answer")
        else:
            out.print("daemon and balancer workers stopped (no service was left to serve)")
    else:
        out.print(
            "daemon stopped; services keep serving (balancer workers and replicas still run). "
            "`corral daemon start` brings the control plane back; "
            "`corral daemon stop --all` stops the balancer workers too."
        )


def _stop_silent_daemon(home: Path, timeout: float) -> None:
    """No daemon answers. "No daemon running" unless one holds the home's lock all the same:
    one ending after an earlier stop (its API closes first), which this waits for as a stop
    would, or one that hangs, which a stop cannot reach and which must not pass for gone
    (a script would then delete the home or start a second daemon beside it)."""
    from corral.dataplane.locks import daemon_holds_lock
    from corral.procfs import running

    process = _daemon_process(home)
    if process is None or not daemon_holds_lock(home) or not running(process):
        out.print("no daemon running")
        return
    if not _wait_for_exit(process, time.monotonic() + timeout):
        fail(
            f"the daemon (pid {process.pid}) holds this home but neither answers nor exits "
            f"within {timeout:g} s; it is stuck (its log: {home / 'daemon.log'}). End it with "
            f"`kill {process.pid}`: its services keep serving and the next daemon adopts them."
        )
    out.print(f"daemon stopped (pid {process.pid} did not answer; it has exited)")


def _daemon_process(home: Path) -> psutil.Process | None:
    """The home's daemon process, as its daemon.json names it; None when it runs elsewhere
    (``$CORRAL_API_URL``) or cannot be told. Taken while it still runs, so that psutil knows
    it by its start time too and a recycled pid is never mistaken for it."""
    import psutil  # here: `corral status` imports this module and must stay light

    from corral.apiconn import ENV_API_URL
    from corral.home import read_info

    pid = (read_info(home) or {}).get("pid")
    if os.environ.get(ENV_API_URL) or not isinstance(pid, int):
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _wait_for_exit(process: psutil.Process | None, deadline: float) -> bool:
    """Wait (until ``deadline``) for the daemon to exit; False if it still runs then. Its API
    closes first: a stop that returned then left the daemon still ending its controllers and
    workers and removing its replicas' scratch directory (with its lock held) while the
    caller went on: deleting the home, starting another daemon, checking what was left."""
    from corral.procfs import running

    while process is not None and running(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@daemon.command("restore")
@click.option(
    "--from",
    "source",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="A state file to restore (default: the home's latest backup, state.db.backup).",
)
@click.pass_context
def daemon_restore(ctx: click.Context, source: Path | None) -> None:
    """Put a backup of the state file back (no daemon may run). The file it replaces is kept
    as state.db.broken-TIME; replicas still running are adopted by the next daemon."""
    from corral.backup import StateFileRefused, restore
    from corral.dataplane.locks import take_daemon_lock

    home = home_of(ctx)
    lock = take_daemon_lock(home)
    if lock is None:
        fail("a daemon runs on this home: stop it first (`corral daemon stop`)")
    with lock:
        try:
            out.print(restore(home, source))
        except StateFileRefused as exc:
            fail(str(exc))
    out.print("`corral daemon start` brings the services back")


@daemon.command("restart-workers")
@click.pass_context
def daemon_restart_workers(ctx: click.Context) -> None:
    """Replace each balancer worker by a new process (new one first, so every port keeps a
    listener): after upgrading corral, this moves traffic to the new code."""
    client = client_of(ctx, start=True)
    # One slot at a time, each up to 15 s to take over and 61 s for the old one's streams.
    client.timeout = 600.0
    answer = client.request("POST", "/v1/daemon/restart-workers")
    for item in answer.get("restarted", []):
        out.print(f"worker {item['slot']}: pid {item['old_pid']} -> {item['new_pid']}")


def _stop_orphan_workers(home: Path) -> None:
    from corral.dataplane.processes import stop_recorded_workers  # not the data plane's weight

    stopped = stop_recorded_workers(home)
    if stopped:
        out.print(f"stopped {len(stopped)} balancer worker(s): pid {', '.join(map(str, stopped))}")


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True, help="The API's whole document (stable).")
@click.pass_context
def daemon_status(ctx: click.Context, as_json: bool) -> None:
    """Show whether the daemon runs: its pid, jobs, balancer workers and inventory."""
    client = Client(home_of(ctx))
    if not client.health():
        if isinstance(client.last_error, UntrustedDaemon):
            fail(str(client.last_error))
        if as_json:  # a script parsing --json gets JSON here too, and the same exit code
            click.echo(json.dumps({"running": False, "home": str(home_of(ctx))}))
        else:
            out.print(f"no daemon running on {home_of(ctx)}")
        sys.exit(1)
    info = client.request("GET", "/v1/daemon")
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for label, text in daemon_rows(info, time.time()):
        click.echo(f"{label:<18}{text}")


def _lane_text(kind: str, lane: Any) -> str:
    """One job lane in words ("launch: 3 running of 16, 2 queued"); it was a Python dict."""
    if not isinstance(lane, dict):
        return f"{kind}: {lane}"
    busy = int(lane.get("workers", 0)) - int(lane.get("idle", 0))
    text = f"{kind}: {busy} running of {lane.get('limit', '?')}"
    extras = [
        (lane.get("guests"), "past the limit (a service with nothing else running)"),
        (lane.get("queued"), "queued"),
        (lane.get("abandoned"), "abandoned (stuck in a backend call)"),
    ]
    return text + "".join(f", {n} {what}" for n, what in extras if n)


def daemon_rows(info: dict[str, Any], now: float) -> list[tuple[str, str]]:
    """`corral daemon status` for a person: one labelled line per part (``--json`` has all)."""
    from corral.cliview import age

    started = info.get("started_at")
    up = f", up {age(now - float(started))}" if started else ""
    rows = [("daemon", f"pid {info.get('pid')}{up}, serving {info.get('home')}")]
    rows.append(("services", str(info.get("services", "?"))))
    jobs = info.get("jobs") or {}
    rows.append(("jobs", "; ".join(_lane_text(k, v) for k, v in jobs.items()) or "none"))
    for w in info.get("balancer_workers") or ():
        link = "connected" if w.get("connected") else "not connected"
        state = w.get("state") if w.get("alive") else "gone"
        text = f"slot {w.get('slot')}: pid {w.get('pid')} {state}, {link}"
        if w.get("accelerated"):
            text += f", fast path {w['accelerated']}"
        rows.append(("balancer workers" if len(rows) == 3 else "", text))
    confinement = info.get("confinement") or {}
    if confinement:
        rows.append(("confinement", str(confinement.get("detail", ""))))
    inventory = info.get("inventory") or {}
    if inventory:
        rows += _inventory_rows(inventory)
    files = info.get("open_files") or {}
    if files:
        rows.append(("open files", f"{files.get('in_use')} of {files.get('limit')}"))
    return rows


def _inventory_rows(inventory: dict[str, Any]) -> list[tuple[str, str]]:
    """The machine, who holds each GPU, what is held, and why each waiting replica waits:
    the table once said only "2 GPUs", while docs/troubleshooting.md sends a user whose
    replica is PENDING here to see who holds them (``--json`` had it all)."""
    gpus = inventory.get("gpus") or []
    memory = gib(float(inventory.get("memory") or 0))
    rows = [("inventory", str(inventory.get("source", "")))]
    rows.append(("", f"{inventory.get('cpus')} CPUs, {memory}, {len(gpus)} GPUs"))
    for gpu in gpus:
        held = ", ".join(
            f"{h.get('service')} replica {h.get('replica')}"
            + (f" ({h['share']:g})" if h.get("share") not in (None, 1) else "")
            for h in gpu.get("held_by") or ()
        )
        rows.append(("", f"GPU {gpu.get('index')} ({gpu.get('name')}): {held or 'free'}"))
    if inventory.get("cpus_held") or inventory.get("cpus_asked") or inventory.get("memory_asked"):
        own, shared = inventory.get("cpus_held") or 0, inventory.get("cpus_asked") or 0
        asked = gib(float(inventory.get("memory_asked") or 0))
        rows.append(("", f"replicas hold {own:g} CPUs of their own, ask {shared:g} and {asked}"))
    for warning in inventory.get("warnings") or ():
        rows.append(("", f"warning: {warning}"))
    for w in inventory.get("waiting") or ():
        who = f"{w.get('service')} replica {w.get('replica')}"
        rows.append(("waiting", f"{who} waits: {w.get('reason')}"))
    return rows
