"""Whether this daemon takes a service spec: valid, runnable here, its inputs readable.

Why apart from the daemon: these are rules over a spec and what the machine has (backends,
capacity), with no service state; the daemon calls them before it writes anything, so a refused
request leaves no trace. The API is the trust boundary: a client that skips the CLI's own check
gets the same refusals here.
"""

from __future__ import annotations

from collections.abc import Mapping

from corral import deploy
from corral.capacity import Capacity, fit_problem
from corral.errors import BadSpec, InvalidRequest, NoRoom, Unrunnable
from corral.infra.base import Infra
from corral.infra.local_rules import claim_resources, local_port_problem
from corral.model_engines import ModelUnavailable, engine_command
from corral.spec import ServiceSpec, SpecError, parse_spec


def spec_refused(exc: SpecError) -> BadSpec:
    return BadSpec(
        "invalid service spec",
        issues=[i.as_json() | {"loc": i.loc} for i in exc.issues],
        text=str(exc),
    )


def check_spec(
    spec_text: str,
    *,
    source: str | None,
    name: str | None,
    infras: Mapping[str, Infra],
    capacity: Capacity | None,
    base_dir: str | None = None,
    envs: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """The spec as this daemon will run it, with ``envs`` (the ``--env`` values) filled in
    where the spec's own are. Takes up to a second on the largest spec the parser accepts:
    call it off the event loop."""
    try:
        spec = parse_spec(spec_text, source=source or "<request>", name=name, envs=envs)
    except SpecError as exc:
        raise spec_refused(exc) from None
    if not spec.name:
        raise InvalidRequest("the service needs a name: set `name:` in the spec or pass -n")
    if spec.infra not in infras:
        hint = (
            ": start the daemon with RAY_ADDRESS in its environment and Ray "
            "installed (docs/troubleshooting.md)"
            if spec.infra == "ray"
            else ""
        )
        raise Unrunnable(
            f"infra {spec.infra!r} is not available in this daemon "
            f"(available: {', '.join(sorted(infras))}){hint}"
        )
    # Every reason at once, as `corral validate` gives them: one at a time, each `up` showed
    # the next only once the last was fixed.
    problems = []
    if spec.model and not spec.run:
        try:
            engine_command(spec, base_dir)  # an engine and weights this machine has, or why not
        except ModelUnavailable as exc:
            problems.append(str(exc))
    if spec.infra == "local":
        port = local_port_problem(spec)
        if port:
            problems.append(f"run: {port}")
        if capacity is not None:
            fit = fit_problem(spec.resources.model_dump(exclude_none=True), capacity.inventory)
            if fit:
                problems.append(fit)
    if problems:
        raise Unrunnable("; ".join(problems))
    return spec


def check_inputs(
    spec: ServiceSpec,
    *,
    source: str | None,
    base_dir: str | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
) -> None:
    """The files and values the spec names exist and fit (see :func:`corral.deploy.check`)."""
    try:
        deploy.check(
            spec, source=source or "<request>", base_dir=base_dir, envs=envs, secrets=secrets
        )
    except SpecError as exc:
        raise spec_refused(exc) from None


def check_same_infra(current: ServiceSpec, spec: ServiceSpec) -> None:
    """An update stays on its service's backend: its replicas, rows and balancer are that
    backend's, and nothing moves them."""
    if spec.infra != current.infra:
        raise InvalidRequest(
            f"an update cannot move a service from infra "
            f"{current.infra!r} to {spec.infra!r}; bring up a new service",
        )


def check_update_room(name: str, mode: str, spec: ServiceSpec, capacity: Capacity | None) -> None:
    """Refuse an update that could never finish on this machine (docs/gpus.md), at once and
    before anything changes, instead of leaving new replicas waiting for ever.

    Blue-green keeps the old replicas' devices until ``min_replicas`` new ones are READY, so
    they must fit beside everything held now. Rolling replaces one old replica at a time when
    there is no spare room (retire one, then launch its successor on what it held): each of
    the new version's ``min_replicas`` must fit that way."""
    if spec.infra != "local" or capacity is None:
        return
    needed = max(1, spec.service.replica_policy.min_replicas)
    resources = claim_resources(spec)
    if mode == "blue_green":
        problem = capacity.room_beside(resources, needed)
        if problem:
            raise NoRoom(
                f"a blue-green update of {name!r} needs room for {needed} replica(s) of the "
                f"new version beside the old ones, and this machine has none: {problem}. Use "
                "--mode rolling, which replaces one replica at a time on a full machine"
            )
        return
    problem = capacity.room_in_turn(name, resources, needed)
    if problem:
        raise NoRoom(
            f"a rolling update of {name!r} could never place its new version on this machine, "
            f"even retiring one old replica before each new one starts: {problem}. Nothing "
            "was changed: ask for what one replica of the running version holds, or free "
            "what the others hold"
        )
