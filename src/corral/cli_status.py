"""`corral status`, and choosing services by name or glob (`status`, `down`).

Kept apart from :mod:`corral.cli` so the command run most often imports least: the tables
(rich) only when there is a service to draw, the spec layer never. With no daemon running,
a home with no services answers as `sky serve status` does (no services, exit code 0)
without starting a daemon only to say so.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from corral.cli_common import client_error_text, client_of, console, err, fail, home_of, out
from corral.cli_nodaemon import home_services
from corral.client import ENV_API_URL, ClientError, DaemonUnreachable, UntrustedDaemon

if TYPE_CHECKING:
    from corral.client import Client

# Tables are laid out this wide at most, whatever the terminal (rows are never cut).
WIDE = 400


def matching(client: Client, patterns: tuple[str, ...]) -> list[dict[str, Any]]:
    """The services named by ``patterns``: names, or globs as SkyServe takes them
    (`'svc-*'`). A plain name that does not exist is an error; so is a glob matching none."""
    services = client.services()
    chosen: dict[str, dict[str, Any]] = {}
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            match = [s for s in services if s["name"] == pattern]
            if not match:
                match = [client.service(pattern)]  # the daemon's 404 (or 400) says why
        else:
            match = [s for s in services if fnmatch.fnmatchcase(s["name"], pattern)]
            if not match:
                # Raised, not printed: `status --json` answers it as JSON, as a missing name.
                raise ClientError(f"no service matches {pattern!r} (see `corral status`)")
        for s in match:
            chosen.setdefault(s["name"], s)
    return list(chosen.values())


def serviceless(client: Client) -> bool:
    """No daemon answers (none came back from a crash either) and the home holds no service:
    nothing runs that a daemon would have to be asked about. A daemon that answers but cannot
    prove it is this home's is not "none": the request says why; nor is a remote API
    ($CORRAL_API_URL) that does not answer: the home here says nothing about its services."""
    if client.answered if client.answered is not None else client.health():
        return False
    if isinstance(client.last_error, UntrustedDaemon) or os.environ.get(ENV_API_URL):
        return False
    return home_services(client.home) == []


@click.command()
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable).")
@click.option("--endpoint", is_flag=True, help="Print only the service's endpoint.")
@click.option("-v", "--verbose", is_flag=True, help="Every replica, with why it failed.")
@click.pass_context
def status(
    ctx: click.Context, names: tuple[str, ...], as_json: bool, endpoint: bool, verbose: bool
) -> None:
    """Show services, their endpoints and replicas (NAMES may be globs)."""
    client = client_of(ctx, start=False)
    if serviceless(client):
        if names:
            _no_match(
                f"no service matches {' '.join(names)}: {home_of(ctx)} has no services", as_json
            )
        services: list[dict[str, Any]] = []
    else:
        services = _fetch(client, names, as_json)
    if as_json:
        click.echo(json.dumps({"services": services}, indent=2, default=str))
        return
    if endpoint:
        _print_endpoint(services, names)
        return
    if not services:
        click.echo("no services")  # plain text: rich is not even imported for it
        return
    _print_tables(services, verbose)


def _no_match(message: str, as_json: bool) -> NoReturn:
    """Services named but none there: with --json still a JSON document (a script parses
    stdout whatever happened), with the error in it, and exit code 1."""
    if as_json:
        click.echo(json.dumps({"services": [], "error": message}, indent=2))
        sys.exit(1)
    fail(message)


def _fetch(client: Client, names: tuple[str, ...], as_json: bool) -> list[dict[str, Any]]:
    try:
        return matching(client, names) if names else client.services()
    except DaemonUnreachable as exc:
        if as_json and not names:
            # Nothing answers, so no service is known to be running (the balancers may
            # still serve: `corral daemon start` brings them under control again).
            err.print(f"note: {exc}", soft_wrap=True, markup=False)
            return []
        if as_json:
            # Services asked for by name cannot be looked up: an empty list with exit 0 would
            # tell a script they do not exist while their replicas and balancers still serve.
            click.echo(json.dumps({"services": [], "error": str(exc)}, indent=2))
            sys.exit(1)
        fail(str(exc))
    except ClientError as exc:
        if as_json:
            click.echo(json.dumps({"services": [], "error": str(exc)}, indent=2))
            sys.exit(1)
        fail(client_error_text(exc))


def _print_tables(services: list[dict[str, Any]], verbose: bool) -> None:
    from corral import cliview  # rich's tables: only when there is something to draw

    # As wide as the rows need (a narrow terminal wraps them): nothing is cut or dropped.
    wide = console(WIDE)
    wide.print(cliview.services_table(services), crop=False)
    table, folded = cliview.replicas_table(services, verbose)
    wide.print()
    wide.print(table, crop=False)
    for line in folded:
        out.print(line, soft_wrap=True)
    for s in services:
        for text in cliview.llm_lines(s, verbose):
            out.print(text, soft_wrap=True, markup=False)
        for style, text in cliview.service_notes(s):
            out.print(text, style=style or None, soft_wrap=True, markup=False)


def _print_endpoint(services: list[dict[str, Any]], names: tuple[str, ...]) -> None:
    """`status --endpoint`: the endpoint alone, for scripts (`curl $(corral status --endpoint
    svc)/...`); one service, as SkyServe wants it."""
    if len(services) != 1:
        count = "no" if not services else str(len(services))
        verb = "match" if names else "exist"
        fail(f"{count} services {verb}; name one: `corral status NAME --endpoint`")
    service = services[0]
    if not service.get("endpoint"):
        fail(f"service {service['name']} has no endpoint yet (status {service['status']})")
    click.echo(service["endpoint"])
