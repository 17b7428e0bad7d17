"""The ``corral`` command line: SkyServe's verbs and flags over the daemon's API."""

from __future__ import annotations

# First: Ctrl-C during the imports below ends corral with one line (see cli_start).
from corral import cli_start  # noqa: F401  (installs the handler)

# isort: split
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from corral import __version__, cli_resend
from corral.apiconn import ENV_API_URL
from corral.cli_common import (
    SECONDS,
    CorralGroup,
    client_error_text,
    client_of,
    fail,
    home_of,
    interrupted,
    out,
    say,
    stuck_replicas,
)
from corral.cli_daemon import daemon
from corral.cli_doctor import doctor
from corral.cli_spec import (
    check_deployable,
    load_or_exit,
    refuse_model_before_starting,
    say_warnings,
    validate,
)
from corral.cli_status import matching, serviceless, status
from corral.client import Client, ClientError
from corral.envflags import given_values, values_options
from corral.home import EXIT_BAD_HOME, default_home, home_problem

# What `down -a` says when there is nothing to take down (`sky serve down -a` says the same).
NO_SERVICES = "No existing services."
# Commands that never touch the home (doctor looks at every home of the machine).
HOMELESS = {"validate", "doctor"}

_home = home_of
_fail = fail
_client = client_of
_client_error_text = client_error_text


def _yes_option(what: str) -> Callable[[Any], Any]:
    return click.option("-y", "--yes", is_flag=True, help=f"Do not ask before {what}.")


@click.group(cls=CorralGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="corral")
@click.option(
    "--home",
    type=click.Path(path_type=Path),  # checked by home_problem, with a message that says why
    default=None,
    help="corral home (default: $CORRAL_HOME or ~/.corral).",
)
@click.pass_context
def main(ctx: click.Context, home: Path | None) -> None:
    """Keep N replicas of a service running behind a load balancer."""
    ctx.ensure_object(dict)
    given = (home or default_home()).expanduser()
    if ctx.invoked_subcommand not in HOMELESS:
        problem = home_problem(given)
        if problem:
            fail(problem, code=EXIT_BAD_HOME)
    ctx.obj["home"] = str(given.resolve())


main.add_command(daemon)
main.add_command(doctor)
main.add_command(status)
main.add_command(validate)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the spec's `name`, else a new one).")
@click.option("-d", "--detach", is_flag=True, help="Return once the service is accepted.")
@click.option("--timeout", type=SECONDS, default=None, help="Give up waiting after this many s.")
@_yes_option("starting (corral does not ask: accepted as `sky serve up -y` is)")
@values_options
@click.pass_context
def up(
    ctx: click.Context,
    file: Path,
    name: str | None,
    detach: bool,
    timeout: float | None,
    yes: bool,
    env: tuple[str, ...],
    env_file: tuple[Path, ...],
    secret: tuple[str, ...],
) -> None:
    """Start a service from FILE and wait until its first replica is READY.

    Relative paths in FILE (workdir) are taken from the current directory, as in SkyPilot;
    the workdir is copied now, so later edits reach the service only with `corral update`."""
    envs, secrets = given_values(env, env_file, secret)
    spec = load_or_exit(file, name, need_name=False, envs=envs)
    check_deployable(file, spec, envs, secrets)
    say_warnings(spec)
    refuse_model_before_starting(home_of(ctx), file, spec)
    try:
        client = _client(ctx, start=True)
    except KeyboardInterrupt:
        interrupted(
            "while the daemon was starting: it may keep starting in the "
            "background (`corral daemon status`); no service was created"
        )
    service = _create(client, file, spec.name, name, envs, secrets)
    from corral.cli_wait import keeps_running, wait_ready

    svc_name = service["name"]
    try:  # from here on a Ctrl-C says what keeps running, even between these lines
        out.print(f"service [bold]{svc_name}[/bold] accepted; endpoint {service['endpoint']}")
        if detach:
            return
        wait_ready(client, svc_name, timeout)
    except KeyboardInterrupt:
        interrupted(keeps_running(client, svc_name, "its replicas keep starting"))


def _create(
    client: Client,
    file: Path,
    spec_name: str | None,
    name: str | None,
    envs: dict[str, str],
    secrets: dict[str, str],
) -> dict[str, Any]:
    """Send the spec; without a name, under a generated one (another, if that one is taken)."""
    generated = name is None and not spec_name
    for _attempt in range(5):
        if generated:
            from corral.spec import generated_name

            name = generated_name()
            out.print(f"service name: [bold]{name}[/bold] (generated; pass -n NAME to choose)")
        send = functools.partial(
            client.create,
            file.read_text(),
            name=name,
            source=str(file.resolve()),
            base_dir=os.getcwd(),
            envs=envs,
            secrets=secrets,
        )
        try:  # sent again when the daemon's crash cut it before it was stored
            return cli_resend.deploy(client, str(name or spec_name), send, create=True)
        except ClientError as exc:
            if not (generated and exc.status == 409):
                _fail(_client_error_text(exc) + _update_hint(exc, name or spec_name, file))
        except KeyboardInterrupt:
            interrupted(
                f"before the daemon answered: `corral status {name or spec_name}` "
                "shows whether the service was created"
            )
    _fail("five generated names were all taken; pass -n NAME")


def _check_update_source(name: str, file: Path | None, to_version: int | None) -> None:
    """FILE or --to-version, one of them, in the flags' words (not the API's fields)."""
    if file is not None and to_version is not None:
        _fail("give the new spec FILE or --to-version N to roll back, not both")
    if file is None and to_version is None:
        _fail("give the new spec FILE, or --to-version N to roll back")
    if to_version is not None and to_version < 1:
        _fail(f"--to-version: versions count from 1, not {to_version} (`corral status {name}`)")


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
@click.option("--timeout", type=SECONDS, default=None, help="Give up waiting after this many s.")
@_yes_option("updating (corral does not ask: accepted as `sky serve update -y` is)")
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
    yes: bool,
    env: tuple[str, ...],
    env_file: tuple[Path, ...],
    secret: tuple[str, ...],
) -> None:
    """Roll out a new version of service NAME from FILE (or --to-version N).

    The workdir is copied again now: this is how edits to it reach the service."""
    _check_update_source(name, file, to_version)
    text = source = base_dir = None
    envs, secrets = given_values(env, env_file, secret)
    if file is not None:
        spec = load_or_exit(file, name, envs=envs)
        check_deployable(file, spec, envs, secrets)
        say_warnings(spec)
        text, source, base_dir = file.read_text(), str(file.resolve()), os.getcwd()
    elif envs or secrets:
        _fail("--to-version reuses that version's env and secret values: no --env/--secret")
    client = _daemon_for_services(ctx, _client(ctx, start=False))
    send = functools.partial(
        client.update,
        name,
        text,
        mode=mode,
        source=source,
        base_dir=base_dir,
        from_version=to_version,
        envs=envs,
        secrets=secrets,
    )
    try:  # sent again when the daemon's crash cut it before it was stored
        service = cli_resend.deploy(client, name, send, create=False)
    except ClientError as exc:
        _fail(_client_error_text(exc) + _up_hint(exc, name, file))
    except KeyboardInterrupt:
        interrupted(
            f"before the daemon answered: `corral status {name}` shows whether "
            "the new version was stored"
        )
    from corral.cli_wait import keeps_running, wait_rollout

    version = service["version"]
    try:  # from here on a Ctrl-C says what keeps running, even between these lines
        out.print(f"service [bold]{name}[/bold]: version {version} accepted ({mode})")
        if detach:
            return
        wait_rollout(client, name, version, timeout)
    except KeyboardInterrupt:
        interrupted(
            keeps_running(client, name, f"the rollout of version {version} goes on")
            + f" `corral update {name} --to-version N` rolls back."
        )


@main.command()
@click.argument("name")
@click.argument("replica", required=False, type=int)
@click.option("--launch", is_flag=True, help="The replica's launch/teardown log.")
@click.option("--controller", is_flag=True, help="The service controller's log.")
@click.option(
    "--load-balancer",
    "load_balancer",
    is_flag=True,
    help="The load balancer's lines about this service (from every balancer worker).",
)
@click.option(
    "--follow/--no-follow",
    default=None,
    help="Keep printing new output [default: follow, but not with --tail].",
)
@click.option("--tail", type=click.IntRange(min=0), default=None, help="Only the last N lines.")
@click.pass_context
def logs(
    ctx: click.Context,
    name: str,
    replica: int | None,
    launch: bool,
    controller: bool,
    load_balancer: bool,
    follow: bool | None,
    tail: int | None,
) -> None:
    """Print a replica's output (or its launch log, the controller's or the load balancer's).

    As `sky serve logs`: follows by default; --tail N prints the last N lines and exits
    (add --follow to keep following after them)."""
    if controller and load_balancer:
        _fail("choose one of --controller and --load-balancer")
    if (controller or load_balancer) and (launch or replica is not None):
        flag = "--controller" if controller else "--load-balancer"
        _fail(f"{flag} takes no replica id and no --launch")
    if not (controller or load_balancer) and replica is None:
        _fail("give a replica id (see `corral status`), or --controller, or --load-balancer")
    kind = (
        "controller"
        if controller
        else "load_balancer"
        if load_balancer
        else "launch"
        if launch
        else "replica"
    )
    if follow is None:
        follow = tail is None
    client = _client(ctx, start=False)
    if not client.answered and not os.environ.get(ENV_API_URL):  # a remote daemon: not here
        _logs_on_disk(ctx, name, kind, replica, tail)
        return
    try:
        for chunk in client.logs(name, kind=kind, replica=replica, follow=follow, tail=tail):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    except ClientError as exc:
        _fail(_client_error_text(exc))
    except KeyboardInterrupt:
        pass


def _logs_on_disk(
    ctx: click.Context, name: str, kind: str, replica: int | None, tail: int | None
) -> None:
    """No daemon answers (`status` and `down` work then too): the log as its file holds it."""
    from corral.cli_nodaemon import log_on_disk

    home = home_of(ctx)
    chunks = log_on_disk(home, name, kind, replica, tail)
    if chunks is None:
        _fail(
            f"no corral daemon runs on {home} (start one with `corral daemon start`), and no "
            f"such log of {name!r} is on disk"
        )
    for chunk in chunks:
        sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
    say(
        f"(no corral daemon runs on {home}: the log as it is on disk; "
        "`corral daemon start` to follow it)"
    )


@main.command()
@click.argument("names", nargs=-1)
@click.option("-a", "--all", "all_", is_flag=True, help="Take down every service.")
@click.option(
    "-p",
    "--purge",
    is_flag=True,
    help="Also forget replicas whose teardown failed (with --replica-id: a failed replica).",
)
@click.option(
    "--replica-id",
    type=int,
    default=None,
    help="Tear down only this replica of the one service named; it is replaced.",
)
@_yes_option("tearing down")
@click.option("--wait/--no-wait", default=True, help="Wait until everything is torn down.")
@click.option(
    "--timeout",
    type=SECONDS,
    default=120.0,
    show_default=True,
    help="Give up waiting after this many s (exit 1; the teardown goes on in the daemon).",
)
@click.pass_context
def down(
    ctx: click.Context,
    names: tuple[str, ...],
    all_: bool,
    purge: bool,
    replica_id: int | None,
    yes: bool,
    wait: bool,
    timeout: float,
) -> None:
    """Tear services down: drain, stop every replica, forget the service.

    NAMES may be globs ('svc-*'). With --replica-id, only that replica goes, and the service
    replaces it (SkyServe's semantics)."""
    if not names and not all_:
        _fail("name the services to take down (globs allowed), or -a/--all for every one")
    if names and all_:
        _fail("name services or give -a/--all, not both")
    if replica_id is not None and (all_ or len(names) != 1):
        _fail("--replica-id takes exactly one service name (and no --all)")
    client = _client(ctx, start=False)
    if serviceless(client):
        if all_:
            out.print(NO_SERVICES)  # as `sky serve down -a`, and no daemon started for it
            return
        _fail(f"no service matches {' '.join(names)}: {_home(ctx)} has no services")
    client = _daemon_for_services(ctx, client)
    if replica_id is not None:
        _down_replica(client, names[0], replica_id, purge=purge, yes=yes)
        return
    try:
        chosen = client.services() if all_ else matching(client, names)
    except ClientError as exc:
        _fail(_client_error_text(exc))
    targets = [s["name"] for s in chosen]
    # What a purge will forget (it does at once): said once the service is gone.
    stuck = {s["name"]: stuck_replicas(s) for s in chosen} if purge else None
    if not targets:
        out.print(NO_SERVICES)
        return
    _confirm(yes, f"Tear down {'all services: ' if all_ else ''}{', '.join(targets)}?")
    try:
        for n in targets:
            cli_resend.down(client, n, purge=purge)  # again, if the daemon's crash cut it
            out.print(f"service {n}: shutting down")
    except ClientError as exc:
        _fail(_client_error_text(exc))
    if wait:
        from corral.cli_wait import wait_down

        try:
            wait_down(client, targets, purge=purge, timeout=timeout, stuck=stuck)
        except KeyboardInterrupt:
            interrupted(
                f"{', '.join(targets)} keep shutting down in the daemon; `corral status` shows "
                "what is left"
            )


def _update_hint(exc: ClientError, name: str | None, file: Path) -> str:
    """`up` of a name that exists: SkyServe's way to change a running service is `update`;
    of one still going down, `update` is refused too: the name is free once it is gone."""
    if exc.status != 409 or not name:
        return ""
    if str(exc).endswith("is shutting down"):
        return f"; `corral up {file}` again once `corral status {name}` no longer lists it"
    return f"; to roll out {file} as its next version: `corral update {name} {file}`"


def _up_hint(exc: ClientError, name: str, file: Path | None) -> str:
    """`update` of a name that does not exist: a new service starts with `up`."""
    if exc.status != 404 or file is None:
        return ""
    return f"; to start {file} as a new service: `corral up {file} -n {name}`"


def _daemon_for_services(ctx: click.Context, client: Client) -> Client:
    """The daemon a command that changes services talks to: started when none answers (the
    home holds services, and only a daemon changes them), as `up` starts one. `update` and
    `down --replica-id` once failed with "start one with `corral daemon start`" after a
    `corral daemon stop`, which says the next command starts one. A home without services
    starts none: the request then says how to start one."""
    if client.answered or serviceless(client):
        return client
    return _client(ctx, start=True)


def _confirm(yes: bool, question: str) -> None:
    """Ask, as `sky serve down` does, but only a person at a terminal: a script (no tty on
    stdin) is not stopped by a question it cannot answer."""
    if yes or not sys.stdin.isatty():
        return
    click.confirm(question, default=True, abort=True)


def _down_replica(client: Client, name: str, replica: int, *, purge: bool, yes: bool) -> None:
    _confirm(yes, f"Tear down replica {replica} of {name}?")
    try:
        out.print(cli_resend.terminate_replica(client, name, replica, purge=purge), soft_wrap=True)
    except ClientError as exc:
        _fail(_client_error_text(exc))


@main.command()
@click.option("--open", "open_browser", is_flag=True, help="Open the link in a web browser.")
@click.pass_context
def dashboard(ctx: click.Context, open_browser: bool) -> None:
    """Print a link that signs a browser in to the web dashboard (once, within 2 minutes)."""
    from corral.dashboard.cli import login_link  # the command's body lives with the dashboard

    client = _client(ctx, start=True)
    try:
        url = login_link(client)
    except ClientError as exc:
        _fail(_client_error_text(exc))
        return
    click.echo(url)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
