"""Reading and checking a spec file on the client side: `corral validate`, and the checks `up`
and `update` make before anything is sent to the daemon.

Kept apart from :mod:`corral.cli` so the verbs that talk to the daemon and the checks that
need no daemon (``validate`` never touches the home) can be read alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from corral.cli_common import err, fail, out
from corral.deploy import check
from corral.infra.local_rules import local_mount_issues, local_port_problem
from corral.spec import (
    ServiceSpec,
    SpecError,
    SpecIssue,
    load_spec,
    path_issues,
)


@click.command()
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
        issues = deploy_issues(spec)
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


def deploy_issues(spec: ServiceSpec) -> list[SpecIssue]:
    """What stops a parsed spec from being deployed from here: its paths, and this backend."""
    issues = path_issues(spec, os.getcwd()) + local_mount_issues(spec, os.getcwd())
    problem = local_port_problem(spec) if spec.infra == "local" else None
    if problem:
        issues.append(SpecIssue("run", problem, spec.line_of("run")))
    fit = fit_problem_here(spec) if spec.infra == "local" else None
    if fit:
        issues.append(SpecIssue("resources", fit, spec.line_of("resources")))
    return issues


def check_deployable(
    file: Path, spec: ServiceSpec, envs: dict[str, str], secrets: dict[str, str]
) -> None:
    """Every problem of the spec with these values, before anything is sent."""
    issues = deploy_issues(spec)
    try:
        check(spec, source=str(file), base_dir=os.getcwd(), envs=envs, secrets=secrets)
    except SpecError as exc:
        issues += [i for i in exc.issues if i not in issues]
    if issues:
        err.print(str(SpecError(issues, str(file))), soft_wrap=True, markup=False)
        sys.exit(1)


def fit_problem_here(spec: Any) -> str | None:
    """Whether the spec's resources can ever fit on this machine, read the way the daemon
    reads it (NVML, CORRAL_INVENTORY, CORRAL_GPUS): no daemon needed."""
    from corral.capacity import fit_problem  # psutil, pynvml: only when validating
    from corral.infra.inventory import InventoryError, load_inventory

    try:
        inventory = load_inventory()
    except InventoryError as exc:
        return f"the machine's inventory cannot be read: {exc}"
    return fit_problem(spec.resources.model_dump(exclude_none=True), inventory)


def load_or_exit(file: Path, name: str | None, *, need_name: bool = True) -> ServiceSpec:
    try:
        spec = load_spec(file, name=name)
    except SpecError as exc:
        err.print(str(exc), soft_wrap=True, markup=False)
        sys.exit(1)
    if need_name and not spec.name:
        fail(f"{file}: the service needs a name: set `name:` in the spec or pass -n NAME")
    return spec
