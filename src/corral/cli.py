"""The ``corral`` command line: SkyServe's verbs over the daemon's API."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from corral.client import Client, ClientError, UntrustedDaemon, ensure_daemon
from corral.deploy import check
from corral.envflags import given_values, values_options
from corral.home import EXIT_DAEMON_RUNNING, default_home, is_loopback
from corral.spec import (
    ServiceSpec,
    SpecError,
    SpecIssue,
    generated_name,
    load_spec,
    local_port_problem,
    path_issues,
)

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

FAILED_SERVICE = {"FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP"}
LIVE = {"PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY"}


def _home(ctx: click.Context) -> Path:
    return Path(ctx.obj["home"])


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}", markup=True, soft_wrap=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="corral home (default: $CORRAL_HOME or ~/.corral).",
)
@click.pass_context
def main(ctx: click.Context, home: Path | None) -> None:
    """Keep N replicas of a service running behind a load balancer."""
    ctx.ensure_object(dict)
    ctx.obj["home"] = str((home or default_home()).expanduser().resolve())


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the spec's `name`, else a new one).")
@click.option("-d", "--detach", is_flag=True, help="Return once the service is accepted.")
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many s.")
@values_options
@click.pass_context
def up(
    ctx: click.Context,
    file: Path,
    name: str | None,
    detach: bool,
    timeout: float | None,
    env: tuple[str, ...],
    env_file: tuple[Path, ...],
    secret: tuple[str, ...],
) -> None:
    """Start a service from FILE and wait until its first replica is READY.

    Relative paths in FILE (workdir) are taken from the current directory, as in SkyPilot;
    the workdir is copied now, so later edits reach the service only with `corral update`."""
    spec = _load(file, name, need_name=False)
    envs, secrets = given_values(env, env_file, secret)
    _check_deployable(file, spec, envs, secrets)
    client = _client(ctx, start=True)
    generated = name is None and not spec.name
    for _attempt in range(5):
        if generated:
            name = generated_name()
            out.print(f"service name: [bold]{name}[/bold] (generated; pass -n NAME to choose)")
        try:
            service = client.create(
                file.read_text(),
                name=name,
                source=str(file.resolve()),
                base_dir=os.getcwd(),
                envs=envs,
                secrets=secrets,
            )
            break
        except ClientError as exc:
            if not (generated and exc.status == 409):
                _fail(_client_error_text(exc))
                return
    else:
        _fail("five generated names were all taken; pass -n NAME")
        return
    svc_name = service["name"]
    out.print(f"service [bold]{svc_name}[/bold] accepted; endpoint {service['endpoint']}")
    if detach:
        return
    _wait_ready(client, svc_name, timeout)


def _polled(
    client: Client, name: str, timeout: float | None, late: Callable[[dict[str, Any]], str]
) -> Iterator[dict[str, Any]]:
    """Service ``name`` as the daemon shows it, every 0.25 s, until the caller stops asking.
    A client error, or the deadline passing (``late`` says what was still awaited), ends the
    command with an error; the service itself keeps going either way."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            service = client.service(name)
        except ClientError as exc:
            _fail(_client_error_text(exc))
            return
        yield service
        if deadline is not None and time.monotonic() > deadline:
            _fail(late(service))
        time.sleep(0.25)


def _wait_ready(client: Client, name: str, timeout: float | None) -> None:
    seen: dict[int, str] = {}

    def late(service: dict[str, Any]) -> str:
        status = service["status"]
        return f"service {name} not READY after {timeout:g}s (status {status}); it keeps trying"

    for service in _polled(client, name, timeout, late):
        for r in service["replicas"]:
            if seen.get(r["id"]) != r["status"]:
                seen[r["id"]] = r["status"]
                detail = f" ({r['failure']})" if r.get("failure") else ""
                out.print(f"  replica {r['id']}: {r['status']}{detail}", soft_wrap=True)
        status = service["status"]
        if status == "READY":
            out.print(f"[green]service {name} is READY[/green] at {service['endpoint']}")
            return
        if status in FAILED_SERVICE:
            failed = [r for r in service["replicas"] if r.get("failure")]
            hint = ""
            if failed:
                # The app's own output tells why it exited; the launch log, why it never started.
                last = failed[-1]
                launch = " --launch" if last["status"] == "FAILED_PROVISION" else ""
                hint = f"; see `corral logs {name} {last['id']}{launch}`"
            _fail(f"service {name} is {status}: {service.get('failure') or ''}{hint}")


@main.command()
@click.argument("name")
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--mode",
    type=click.Choice(["rolling", "blue_green"]),
    default="rolling",
    show_default=True,
    help="rolling: replace replicas as new ones become READY; blue_green: switch traffic once "
    "the new version has min_replicas READY.",
)
@click.option("--to-version", type=int, help="Roll back: deploy a stored version's spec again.")
@click.option("-d", "--detach", is_flag=True, help="Return once the new version is accepted.")
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many s.")
@values_options
@click.pass_context
def update(
    ctx: click.Context,
    name: str,
    file: Path | None,
    mode: str,
    to_version: int | None,
    detach: bool,
    timeout: float | None,
    env: tuple[str, ...],
    env_file: tuple[Path, ...],
    secret: tuple[str, ...],
) -> None:
    """Roll out a new version of service NAME from FILE (or --to-version N).

    The workdir is copied again now: this is how edits to it reach the service."""
    if (file is None) == (to_version is None):
        _fail("give the new spec FILE, or --to-version N to roll back")
    text = source = base_dir = None
    envs, secrets = given_values(env, env_file, secret)
    if file is not None:
        spec = _load(file, name)
        _check_deployable(file, spec, envs, secrets)
        text, source, base_dir = file.read_text(), str(file.resolve()), os.getcwd()
    elif envs or secrets:
        _fail("--to-version reuses that version's env and secret values: no --env/--secret")
    client = _client(ctx, start=False)
    try:
        service = client.update(
            name,
            text,
            mode=mode,
            source=source,
            base_dir=base_dir,
            from_version=to_version,
            envs=envs,
            secrets=secrets,
        )
    except ClientError as exc:
        _fail(_client_error_text(exc))
        return
    version = service["version"]
    out.print(f"service [bold]{name}[/bold]: version {version} accepted ({mode})")
    if not detach:
        _wait_rollout(client, name, version, timeout)


def _wait_rollout(client: Client, name: str, version: int, timeout: float | None) -> None:
    """Wait until only the new version runs, at its target, or it is refused."""

    def late(service: dict[str, Any]) -> str:
        return f"version {version} not fully rolled out after {timeout:g}s; it keeps going"

    for service in _polled(client, name, timeout, late):
        live = [r for r in service["replicas"] if r["status"] in LIVE]
        ready_new = [r for r in live if r["version"] == version and r["status"] == "READY"]
        others = [r for r in live if r["version"] != version]
        failure = service.get("failure") or ""
        if f"version {version} never became ready" in failure:
            serving = sorted({r["version"] for r in live if r["status"] == "READY"})
            on = f"; traffic stays on version {serving}" if serving else ""
            _fail(f"version {version} not promoted: {failure}{on}")
        target = service.get("target")
        if target is not None and not others and len(ready_new) >= target:
            out.print(f"[green]service {name}: version {version} serves all traffic[/green]")
            return


@main.command()
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable).")
@click.pass_context
def status(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Show services, their endpoints and replicas."""
    client = _client(ctx, start=False)
    try:
        services = [client.service(n) for n in names] if names else client.services()
    except ClientError as exc:
        _fail(_client_error_text(exc))
        return
    if as_json:
        click.echo(json.dumps({"services": services}, indent=2, default=str))
        return
    if not services:
        out.print("no services")
        return
    table = Table("SERVICE", "STATUS", "ENDPOINT", "VERSION", "READY", box=None)
    for s in services:
        ready = sum(1 for r in s["replicas"] if r["status"] == "READY")
        table.add_row(
            s["name"],
            s["status"],
            s["endpoint"] or "-",
            str(s["version"]),
            f"{ready}/{s['target']}",
        )
    out.print(table)
    replicas = Table("SERVICE", "ID", "VERSION", "STATUS", "ENDPOINT", "AGE", "PID", box=None)
    for s in services:
        for r in s["replicas"]:
            replicas.add_row(
                s["name"],
                str(r["id"]),
                str(r["version"]),
                r["status"],
                r["endpoint"] or "-",
                _age(r["age_seconds"]),
                str(r["pid"] or "-"),
            )
    out.print()
    out.print(replicas)
    for s in services:
        scaler = s.get("autoscaler")
        if scaler:
            out.print(
                f"{s['name']}: target {s['target']} at {scaler['qps']:g} QPS: {scaler['reason']}",
                soft_wrap=True,
            )
    for s in services:
        if s.get("failure"):
            out.print(f"[red]{s['name']}:[/red] {s['failure']}", soft_wrap=True)
        for problem in s.get("balancer_errors") or ():
            # The endpoint is kept, not moved: whoever holds the port must let it go.
            out.print(f"[red]{s['name']}: endpoint not served:[/red] {problem}", soft_wrap=True)


@main.command()
@click.argument("name")
@click.argument("replica", required=False, type=int)
@click.option("--launch", is_flag=True, help="The replica's launch/teardown log.")
@click.option("--controller", is_flag=True, help="The service controller's log.")
@click.option("--follow/--no-follow", default=True, help="Keep printing new output.")
@click.pass_context
def logs(
    ctx: click.Context, name: str, replica: int | None, launch: bool, controller: bool, follow: bool
) -> None:
    """Print a replica's output (or its launch log, or the controller's log)."""
    if controller and (launch or replica is not None):
        _fail("--controller takes no replica and no --launch")
    if not controller and replica is None:
        _fail("give a replica id (see `corral status`), or --controller")
    kind = "controller" if controller else "launch" if launch else "replica"
    client = _client(ctx, start=False)
    try:
        for chunk in client.logs(name, kind=kind, replica=replica, follow=follow):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    except ClientError as exc:
        _fail(_client_error_text(exc))
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Take down every service.")
@click.option("--purge", is_flag=True, help="Also forget replicas whose teardown failed.")
@click.option("--wait/--no-wait", default=True, help="Wait until everything is torn down.")
@click.option("--timeout", type=float, default=120.0, show_default=True)
@click.pass_context
def down(
    ctx: click.Context, names: tuple[str, ...], all_: bool, purge: bool, wait: bool, timeout: float
) -> None:
    """Tear services down: drain, stop every replica, forget the service."""
    if not names and not all_:
        _fail("name services to take down, or --all")
    client = _client(ctx, start=False)
    try:
        targets = [s["name"] for s in client.services()] if all_ else list(names)
        for n in targets:
            client.down(n, purge=purge)
            out.print(f"service {n}: shutting down")
    except ClientError as exc:
        _fail(_client_error_text(exc))
        return
    if not wait:
        return
    deadline = time.monotonic() + timeout
    pending = set(targets)
    while pending and time.monotonic() < deadline:
        for n in list(pending):
            try:
                s = client.service(n)
            except ClientError as exc:
                if exc.status == 404:
                    pending.discard(n)
                    out.print(f"service {n}: down")
                    continue
                _fail(_client_error_text(exc))
            else:
                if s["status"] == "FAILED_CLEANUP" and not purge:
                    pending.discard(n)
                    _fail(
                        f"service {n}: teardown failed for some replicas: {s.get('failure')}; "
                        "see `corral status`, or `corral down --purge` to forget them"
                    )
        time.sleep(0.2)
    if pending:
        _fail(f"still shutting down after {timeout:g}s: {', '.join(sorted(pending))}")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (overrides the spec's `name`).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='JSON, also for a bad spec: {"valid", "spec", "warnings", "errors": [{field, line, '
    "message, hint}]}.",
)
def validate(file: Path, name: str | None, as_json: bool) -> None:
    """Check a service spec: every problem at once, or its normalised form.

    No name is needed (`up` makes one up). Relative paths are taken from the current
    directory, as `up` takes them."""
    spec = None
    try:
        spec = load_spec(file, name=name)
        issues = _deploy_issues(spec)
    except SpecError as exc:
        issues = exc.issues
    source = str(file)
    if as_json:
        document = {
            "valid": not issues,
            "spec": spec.summary() if spec is not None else None,
            "warnings": list(spec.warnings) if spec is not None else [],
            "errors": [issue.as_json() for issue in issues],
        }
        click.echo(json.dumps(document, indent=2, default=str))
        if issues:
            sys.exit(1)
        return
    if spec is not None:
        for warning in spec.warnings:
            err.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    if issues:
        err.print(str(SpecError(issues, source)), soft_wrap=True, markup=False)
        err.print(f"[red]{file}: {len(issues)} problem(s)[/red]")
        sys.exit(1)
    assert spec is not None
    out.print(f"[green]{file}: valid[/green]")
    for key, value in spec.summary().items():
        out.print(f"  {key}: {json.dumps(value, default=str)}", soft_wrap=True)


def _deploy_issues(spec: ServiceSpec) -> list[SpecIssue]:
    """What stops a parsed spec from being deployed from here: its paths, and this backend."""
    issues = path_issues(spec, os.getcwd())
    problem = local_port_problem(spec) if spec.infra == "local" else None
    if problem:
        issues.append(SpecIssue("run", problem, spec.line_of("run")))
    return issues


def _check_deployable(
    file: Path, spec: ServiceSpec, envs: dict[str, str], secrets: dict[str, str]
) -> None:
    """Every problem of the spec with these values, before anything is sent."""
    issues = _deploy_issues(spec)
    try:
        check(spec, source=str(file), base_dir=os.getcwd(), envs=envs, secrets=secrets)
    except SpecError as exc:
        issues += [i for i in exc.issues if i not in issues]
    if issues:
        err.print(str(SpecError(issues, str(file))), soft_wrap=True, markup=False)
        sys.exit(1)


@main.group()
def daemon() -> None:
    """Run, inspect or stop the daemon of this home."""


@daemon.command("run")
@click.option("--home", "home_opt", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--host", default="127.0.0.1", show_default=True, help="API address.")
@click.option("--port", default=0, type=int, help="API port (default: a free one).")
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
@click.pass_context
def daemon_run(
    ctx: click.Context,
    home_opt: Path | None,
    host: str,
    port: int,
    tls_cert: Path | None,
    tls_key: Path | None,
) -> None:
    """Run the daemon in the foreground.

    The API listens on 127.0.0.1. Any other address is reachable from elsewhere, so it needs
    HTTPS (--tls-cert and --tls-key): the bearer token must not cross a network in clear.
    """
    home = (home_opt or _home(ctx)).expanduser().resolve()
    if (tls_cert is None) != (tls_key is None):
        _fail("--tls-cert and --tls-key go together: give both, or neither")
    if tls_cert is None and not is_loopback(host):
        _fail(
            f"the API would listen on {host}, which is not loopback, in plain HTTP: the token "
            "would cross the network in clear. Pass --tls-cert FILE --tls-key FILE (clients "
            "verify that certificate), or keep the default --host 127.0.0.1."
        )
    from corral.daemon import (  # heavy: imported only here
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
        _fail(str(exc), code=EXIT_DAEMON_RUNNING)
    except DaemonError as exc:
        _fail(str(exc))


@daemon.command("start")
@click.pass_context
def daemon_start(ctx: click.Context) -> None:
    """Start the daemon in the background (if none runs) and wait until it answers."""
    client = _client(ctx, start=True)
    info = client.request("GET", "/v1/daemon")
    out.print(f"daemon pid {info.get('pid')} serving {_home(ctx)}")


@daemon.command("stop")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Stop the balancer workers too: every service's endpoint stops answering.",
)
@click.pass_context
def daemon_stop(ctx: click.Context, everything: bool) -> None:
    """Stop the control plane. Services keep serving: the balancer workers and the replicas
    keep running, and the next daemon (any corral command starts one) adopts them."""
    home = _home(ctx)
    client = Client(home)
    if not client.health():
        if isinstance(client.last_error, UntrustedDaemon):
            _fail(str(client.last_error))
        out.print("no daemon running")
        if everything:
            _stop_orphan_workers(home)
        return
    client.stop_daemon(workers=everything)
    deadline = time.monotonic() + 30
    while client.health() and time.monotonic() < deadline:
        time.sleep(0.1)
    if everything:
        _stop_orphan_workers(home)  # any the daemon could not reach
        out.print("daemon and balancer workers stopped: service endpoints no longer answer")
    else:
        out.print(
            "daemon stopped; services keep serving (balancer workers and replicas still run). "
            "`corral daemon start` brings the control plane back; "
            "`corral daemon stop --all` stops the balancer workers too."
        )


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
    import fcntl

    from corral.backup import StateFileRefused, restore

    home = _home(ctx)
    with open(home / "daemon.lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _fail("a daemon runs on this home: stop it first (`corral daemon stop`)")
        try:
            out.print(restore(home, source))
        except StateFileRefused as exc:
            _fail(str(exc))
    out.print("`corral daemon start` brings the services back")


@daemon.command("restart-workers")
@click.pass_context
def daemon_restart_workers(ctx: click.Context) -> None:
    """Replace each balancer worker by a new process (new one first, so every port keeps a
    listener): after upgrading corral, this moves traffic to the new code."""
    client = _client(ctx, start=True)
    client.timeout = 120.0  # one slot at a time, each up to 15 s
    answer = client.request("POST", "/v1/daemon/restart-workers")
    for item in answer.get("restarted", []):
        out.print(f"worker {item['slot']}: pid {item['old_pid']} -> {item['new_pid']}")


def _stop_orphan_workers(home: Path) -> None:
    from corral.dataplane.plane import stop_recorded_workers

    stopped = stop_recorded_workers(home)
    if stopped:
        out.print(f"stopped {len(stopped)} balancer worker(s): pid {', '.join(map(str, stopped))}")


@daemon.command("status")
@click.pass_context
def daemon_status(ctx: click.Context) -> None:
    """Show whether the daemon runs, and its pid and jobs."""
    client = Client(_home(ctx))
    if not client.health():
        if isinstance(client.last_error, UntrustedDaemon):
            _fail(str(client.last_error))
        out.print(f"no daemon running on {_home(ctx)}")
        sys.exit(1)
    click.echo(json.dumps(client.request("GET", "/v1/daemon"), indent=2))


def _load(file: Path, name: str | None, *, need_name: bool = True) -> ServiceSpec:
    try:
        spec = load_spec(file, name=name)
    except SpecError as exc:
        err.print(str(exc), soft_wrap=True, markup=False)
        sys.exit(1)
    if need_name and not spec.name:
        _fail(f"{file}: the service needs a name: set `name:` in the spec or pass -n NAME")
    return spec


def _client(ctx: click.Context, *, start: bool) -> Client:
    home = _home(ctx)
    if start:
        try:
            return ensure_daemon(home)
        except ClientError as exc:
            _fail(str(exc))
    return Client(home)


def _client_error_text(exc: ClientError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    if body.get("text"):
        return f"{exc}:\n{body['text']}"
    return str(exc)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
