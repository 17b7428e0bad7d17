"""Reading and checking a spec file on the client side: `corral validate`, and the checks `up`
and `update` make before anything is sent to the daemon.

Kept apart from :mod:`corral.cli` so the verbs that talk to the daemon and the checks that
need no daemon (``validate`` never touches the home) can be read alone. The spec layer
(pydantic, YAML: 0.15 s of imports on an idle machine, more on a busy one) is imported inside
the functions that read a spec, so `corral status` and the other verbs never pay for it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from corral.cli_common import err, fail, out

if TYPE_CHECKING:
    from corral.spec import ServiceSpec, SpecIssue


@click.command()
# Not dir_okay=False: click's usage error is not the JSON `--json` promises; the spec loader
# says "is a directory" as an error of the file.
@click.argument("file", type=click.Path(path_type=Path))
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
    from corral.spec import SpecError, load_spec, sorted_issues

    spec = None
    engine = None  # the command corral would start for a model-first spec, on this machine
    notes: list[str] = []
    used = None  # the inventory the resources were checked against (this shell's)
    try:
        spec = load_spec(file, name=name, require_service=True)
        issues, notes, used, engine = checks_here(spec)
    except SpecError as exc:
        issues, checked = exc.issues, exc.behind
        if checked is not None:
            # Every problem at once: what the parse refused, and what the checks after it
            # find in the rest of the spec (its warnings too), not one round at a time.
            later, notes, used, _ = checks_here(checked)
            named = {issue.loc for issue in issues}
            # Nor one speaking of a refused field: checked without it, the model check said
            # "the spec asks none (resources.accelerators)" of a mistyped accelerator.
            later = [i for i in later if i.loc not in named and _not_about([i.message], issues)]
            issues = issues + later
            notes = _not_about(checked.warnings + notes, exc.issues)
        issues = sorted_issues(issues)
    source = str(file)
    warnings = (list(spec.warnings) if spec is not None else []) + notes
    if as_json:
        document = {
            "valid": not issues,
            "spec": spec.summary() if spec is not None else None,
            "warnings": warnings,
            "errors": [issue.as_json() for issue in issues],
            "inventory": used,
            "engine_command": engine,
        }
        click.echo(json.dumps(document, indent=2, default=str))
        if issues:
            sys.exit(1)
        return
    for warning in warnings:
        err.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    if used:
        err.print(f"resources checked against {used}", soft_wrap=True, markup=False)
    if issues:
        err.print(str(SpecError(issues, source)), soft_wrap=True, markup=False)
        err.print(f"[red]{file}: {len(issues)} problem(s)[/red]")
        sys.exit(1)
    assert spec is not None
    out.print(f"[green]{file}: valid[/green]")
    for key, value in spec.summary().items():
        out.print(f"  {key}: {json.dumps(value, default=str)}", soft_wrap=True)
    if engine is not None:
        out.print(f"  engine (on this machine): {engine}", soft_wrap=True, markup=False)


def _not_about(warnings: list[str], issues: list[SpecIssue]) -> list[str]:
    """The warnings of a spec checked without the fields ``issues`` refuse, but those that
    name one of them: `max_replicas: 2` below `replicas: 3` is refused, and the spec without
    it warned "has no effect without service.max_replicas", which the file does have."""
    fields = [issue.loc for issue in issues if issue.loc]
    return [
        warning
        for warning in warnings
        if not any(
            re.search(rf"(?<![\w.]){re.escape(field)}(?![\w.\[])", warning)
            for field in fields
            if "." in field or warning.startswith(f"{field}:")
        )
    ]


def checks_here(
    spec: ServiceSpec,
) -> tuple[list[SpecIssue], list[str], str | None, str | None]:
    """What `validate` checks of a parsed spec beyond its text, on this machine: the problems
    (paths, `run` and $PORT, resources, a model), the resources' notes, the inventory used
    and a model-first spec's engine command."""
    from corral.spec import sorted_issues

    issues = deploy_issues(spec)
    fit, notes, used = placement_here(spec)
    unrunnable, engine = model_check(spec)
    return sorted_issues(issues + fit + unrunnable), notes, used, engine


def deploy_issues(spec: ServiceSpec) -> list[SpecIssue]:
    """What stops a parsed spec from being deployed from here: its paths, and this backend."""
    from corral.infra.local_rules import local_mount_issues, local_port_problem
    from corral.spec import SpecIssue, path_issues

    issues = path_issues(spec, os.getcwd()) + local_mount_issues(spec, os.getcwd())
    problem = local_port_problem(spec) if spec.infra == "local" else None
    if problem:
        issues.append(SpecIssue("run", problem, spec.line_of("run")))
    return issues


def model_check(spec: ServiceSpec) -> tuple[list[SpecIssue], str | None]:
    """A model-first spec on this shell's machine: why it cannot run here, or the command its
    replicas would run (the daemon picks on its own machine). Nothing for a `run:` spec."""
    if not spec.model or spec.run:
        return [], None
    from corral.model_engines import ModelUnavailable, engine_command
    from corral.spec import SpecIssue

    try:
        return [], engine_command(spec, os.getcwd())
    except ModelUnavailable as exc:
        # Under the field's name: "model: ORG/NAME cannot run here", not "model: model ...".
        issue = SpecIssue("model", str(exc).removeprefix("model "), spec.line_of("model"))
        return [issue], None


def refuse_model_before_starting(home: Path, file: Path, spec: ServiceSpec) -> None:
    """`up` only: a model-first spec that no engine of this machine can run is refused before
    a daemon is started for it. The daemon `up` would start runs this shell's Python in this
    shell's environment, so this shell's verdict is the one it would give; a daemon that
    already runs judges for itself (its environment may differ)."""
    if not spec.model or spec.run:
        return
    from corral.client import ENV_API_URL, Client

    if os.environ.get(ENV_API_URL) or Client(home).health():
        return
    issues, _ = model_check(spec)
    if issues:
        from corral.spec import SpecError, sorted_issues

        # All that this machine lacks, as `validate` says it (an H100 too), not only the
        # engine: fixing one should not reveal the next at the following `up`.
        fit, _, _ = placement_here(spec)
        issues = sorted_issues(issues + fit)
        err.print(str(SpecError(issues, str(file))), soft_wrap=True, markup=False)
        err.print("no daemon was started for it", soft_wrap=True, markup=False)
        sys.exit(1)


def check_deployable(
    file: Path, spec: ServiceSpec, envs: dict[str, str], secrets: dict[str, str]
) -> None:
    """Every problem of the spec with these values, before anything is sent."""
    from corral.deploy import check
    from corral.spec import SpecError

    issues = deploy_issues(spec)
    try:
        check(spec, source=str(file), base_dir=os.getcwd(), envs=envs, secrets=secrets)
    except SpecError as exc:
        issues += [i for i in exc.issues if i not in issues]
    if issues:
        err.print(str(SpecError(issues, str(file))), soft_wrap=True, markup=False)
        sys.exit(1)


def placement_here(spec: ServiceSpec) -> tuple[list[SpecIssue], list[str], str | None]:
    """``validate``: whether the spec's resources can ever fit on the machine as this shell
    reads it (NVML, CORRAL_INVENTORY, CORRAL_GPUS), what its replicas would get less of than they
    ask, and which inventory that was. ``up`` and ``update`` leave placement to the daemon: its
    inventory, not this shell's, is the one that counts, and it refuses what never fits (400).
    Except when ``up`` refuses a model-first spec before it starts a daemon: that daemon would
    run here, so this shell's verdict is its verdict too."""
    from corral.capacity import fit_problems, fit_warnings  # psutil, pynvml: only here
    from corral.infra.inventory import InventoryError, load_inventory
    from corral.spec import SpecIssue

    if spec.infra != "local":
        return [], [], None
    line = spec.line_of("resources")
    try:
        inventory = load_inventory()
    except InventoryError as exc:
        why = f"the machine's inventory cannot be read: {exc}"
        return [SpecIssue("resources", why, line)], [], None
    resources = spec.resources.model_dump(exclude_none=True)
    used = f"this shell's inventory, {inventory.source} (a daemon uses its own)"
    problems = fit_problems(resources, inventory)
    if problems:
        # Each under its own field (it was "resources: resources.memory: needs ..."), at its
        # line (that of `resources:` when the field is not written, as from `any_of`).
        return (
            [
                SpecIssue(p.field, str(p).removeprefix(f"{p.field}: "), spec.line_of(p.field))
                for p in problems
            ],
            [],
            used,
        )
    replicas = spec.service.replica_policy.max_replicas
    return [], fit_warnings(resources, replicas, inventory), used


def load_or_exit(
    file: Path, name: str | None, *, need_name: bool = True, envs: dict[str, str] | None = None
) -> ServiceSpec:
    """The spec of `up`/`update`, its ``envs`` (the --env values) filled in as the daemon
    fills them: checked with the spec's own, a `workdir: $DIR` given by --env was refused."""
    from corral.spec import SpecError, load_spec, sorted_issues

    try:
        spec = load_spec(file, name=name, require_service=True, envs=envs)
    except SpecError as exc:
        issues = exc.issues
        if exc.behind is not None:
            # The paths and the port behind the refused fields too, as `validate` says them:
            # otherwise each `up` names one more problem.
            named = {issue.loc for issue in issues}
            issues += [i for i in deploy_issues(exc.behind) if i.loc not in named]
        err.print(str(SpecError(sorted_issues(issues), exc.source)), soft_wrap=True, markup=False)
        sys.exit(1)
    if need_name and not spec.name:
        fail(f"{file}: the service needs a name: set `name:` in the spec or pass -n NAME")
    return spec


def say_warnings(spec: ServiceSpec) -> None:
    """`up`/`update`: the spec's warnings, as `validate` prints them. A SkyServe user runs
    `up` as they ran `sky serve up`, never `validate`: without this, `use_spot`, zones or a
    scaling target with no max_replicas were dropped in silence. The notes on an `envs:` key
    left empty are not repeated: `up` refuses a key no --env gave, and one given is fine."""
    unset = tuple(f"{field}:" for field in spec.unset_values())
    for warning in spec.warnings:
        if not warning.startswith(unset):
            err.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
