"""Reading a spec: file or text in, a validated :class:`ServiceSpec` or one SpecError out."""

import difflib
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from yaml.nodes import Node

from corral.spec.behind import spec_behind
from corral.spec.errors import SpecError, SpecIssue
from corral.spec.locate import child_node, keep_text_as_written, locate
from corral.spec.messages import MAX_ISSUES, explain, make_issue, sorted_issues
from corral.spec.model import ServiceSpec
from corral.spec.reader import MAX_SPEC_BYTES, read_yaml
from corral.spec.resources import Resources
from corral.spec.values import format_range, show


def _cross_section_issues(spec: ServiceSpec) -> list[tuple[tuple[str, ...], str]]:
    """Checks that span sections, run once every section is valid on its own."""
    problems: list[tuple[tuple[str, ...], str]] = []
    opened = spec.resources.ports
    shown = ", ".join(format_range(r) for r in opened)
    chosen = spec.service.ports
    if chosen is not None and opened and not any(a <= chosen <= b for a, b in opened):
        field = "ports" if spec.service.port is None else "port"
        problems.append(
            (
                ("service", field),
                f"{chosen} is not among the ports opened in resources.ports ({shown}): "
                "the replica port must be one of them",
            )
        )
    if chosen is None and spec.replica_port() is None and spec.resources.port_numbers()[1:]:
        problems.append(
            (
                ("resources", "ports"),
                f"opens several ports ({shown}): set service.ports to the one the replicas "
                "serve on, so the load balancer and the probe know where to go",
            )
        )
    return problems + _instance_aware_issues(spec)


POLICY_FIELD = ("service", "load_balancing_policy")
QPS_FIELD = ("service", "replica_policy", "target_qps_per_replica")


def _instance_aware_issues(spec: ServiceSpec) -> list[tuple[tuple[str, ...], str]]:
    """SkyServe's pair: a per-accelerator target QPS goes with instance_aware_least_load and
    the policy with the mapping; each key names an accelerator the spec asks for."""
    targets = spec.service.replica_policy.target_qps_per_accelerator
    aware = spec.service.load_balancing_policy == "instance_aware_least_load"
    if aware and targets is None:
        return [
            (
                POLICY_FIELD,
                "instance_aware_least_load needs replica_policy.target_qps_per_replica as a "
                "mapping of accelerator to requests per second, like {H100: 10, A100: 5}",
            )
        ]
    if targets is None:
        return []
    mixed = sorted(spec.service.replica_policy.engine_targets)
    if mixed:
        return [
            (
                QPS_FIELD,
                f"a mapping of accelerator to QPS cannot be combined with {', '.join(mixed)}: "
                "scale a mixed fleet on its request rate, or give one number",
            )
        ]
    if not aware:
        return [
            (
                QPS_FIELD,
                "a mapping of accelerator to QPS goes with load_balancing_policy: "
                "instance_aware_least_load (SkyServe's rule); give that policy, or one number",
            )
        ]
    asked = _accelerators_asked(spec)
    if not asked:
        return [
            (
                QPS_FIELD,
                "names accelerators but resources.accelerators (or resources.any_of) asks for "
                "none: say which the replicas run on",
            )
        ]
    return [
        (
            (*QPS_FIELD, key),
            f"{key!r} is not an accelerator the spec asks for: resources ask "
            f"{', '.join(sorted(asked.values()))}",
        )
        for key in targets
        if key.partition(":")[0].strip().lower() not in asked
    ]


def _accelerators_asked(spec: ServiceSpec) -> dict[str, str]:
    """The accelerator names in resources.accelerators and resources.any_of, lower-cased ->
    as written."""
    texts = list(spec.resources.accelerators)
    for option in spec.resources.any_of if isinstance(spec.resources.any_of, list) else ():
        if isinstance(option, dict) and option.get("accelerators") is not None:
            try:
                texts += Resources(accelerators=option["accelerators"]).accelerators
            except ValueError:
                continue  # kept, not used: its own placement note covers it
    return {text.partition(":")[0].lower(): text.partition(":")[0] for text in texts}


# `$NAME` or `${NAME}`, NAME as a shell variable's name.
_ENV_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")

# The fields SkyPilot fills `envs` into (Task.from_yaml_config's _fill_in_env_vars).
ENV_FILLED_FIELDS = ("service", "workdir", "file_mounts")


def _fill_in_envs(value: Any, envs: dict[str, str]) -> Any:
    """``value`` with every ``$NAME``/``${NAME}`` of a name ``envs`` gives replaced by its value,
    in text, keys and nested values alike; other references stay as written.

    Why: SkyPilot does this for ``service``, ``workdir`` and ``file_mounts``, and SkyServe's LLM
    examples rely on it (``post_data: {model: $MODEL_NAME}``): read as written, such a probe asks
    the engine for a model named "$MODEL_NAME", and no replica ever becomes READY."""
    if isinstance(value, str):
        return _ENV_REFERENCE.sub(lambda m: envs.get(m[1] or m[2], m[0]), value)
    if isinstance(value, dict):
        return {_fill_in_envs(k, envs): _fill_in_envs(v, envs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_in_envs(item, envs) for item in value]
    return value


def _run_required(error: Any) -> bool:
    """Whether pydantic's ``error`` is ServiceSpec's "run: is required"."""
    return tuple(error["loc"]) == ("run",) and "is required" in str(error["msg"])


def _validate(
    data: Any, root: Node, source: str, name_given: bool, given: Mapping[str, str]
) -> ServiceSpec:
    issues: list[SpecIssue] = []
    if not isinstance(data, dict):
        raise SpecError(
            [
                SpecIssue(
                    "",
                    f"expected a mapping of fields (run:, service:, resources:, ...) at the top "
                    f"level, got {show(data)}",
                    root.start_mark.line + 1,
                )
            ],
            source,
        )
    keep_text_as_written(child_node(root, "envs"), data.get("envs"))
    envs = data.get("envs")
    if isinstance(envs, dict) or given:
        # The spec's values, then those given at `up`/`update` over them, as SkyPilot merges
        # `--env` before it fills.
        spec_envs = envs.items() if isinstance(envs, dict) else ()
        values = {str(k): str(v) for k, v in spec_envs if v is not None} | dict(given)
        data.update({k: _fill_in_envs(data[k], values) for k in ENV_FILLED_FIELDS if k in data})
    service = data.get("service")
    if isinstance(service, dict) and isinstance(service.get("readiness_probe"), dict):
        probe = child_node(child_node(root, "service"), "readiness_probe")
        probe_node = child_node(probe, "headers")
        keep_text_as_written(probe_node, service["readiness_probe"].get("headers"))
    try:
        spec = ServiceSpec.model_validate(data)
    except ValidationError as exc:
        # Only what can be shown is located and explained (each costs a walk of the tree).
        errors = exc.errors(include_url=False)
        behind = spec_behind(data, errors)
        if any(tuple(e["loc"])[:1] == ("model",) for e in errors):
            # A model that failed its own check is missing to `run`'s check, which then says
            # "run: is required": the writer gave `model:`, and the problem is its value.
            errors = [e for e in errors if not _run_required(e)]
        for error in errors[: MAX_ISSUES + 1]:
            # The per-accelerator mapping is read from target_qps_per_replica.
            loc = tuple(
                QPS_FIELD[2] if p == "target_qps_per_accelerator" else p for p in error["loc"]
            )
            dotted, line = locate(root, loc)
            if name_given and loc[:1] == ("name",):
                line = None  # the override did not come from the file
            issues.append(make_issue(dotted, explain(error, loc), line))
        raise SpecError(issues, source, behind and _with_lines(behind, root, data)) from None
    spec = _with_lines(spec, root, data)
    for loc, message in _cross_section_issues(spec):
        dotted, line = locate(root, loc)
        issues.append(make_issue(dotted, message, line))
    if issues:
        raise SpecError(issues, source, spec)
    return spec


# Fields the checks after parsing name (a TLS file, a resource this machine lacks), with the
# ways a spec may write them: their own line, not the line of their section, is where to fix.
_NESTED_LINES = {
    "service.tls.keyfile": (("service", "tls", "keyfile"), ("service", "https", "key")),
    "service.tls.certfile": (("service", "tls", "certfile"), ("service", "https", "cert")),
    "resources.accelerators": (("resources", "accelerators"),),
    "resources.memory": (("resources", "memory"),),
    "resources.cpus": (("resources", "cpus"),),
}


def _written(root: Node, path: tuple[str, ...]) -> bool:
    """Whether the file writes ``path`` (each key present), not only a parent of it."""
    node: Node | None = root
    for key in path:
        node = child_node(node, key)
    return node is not None


def _with_lines(spec: ServiceSpec, root: Node, data: dict[Any, Any]) -> ServiceSpec:
    """``spec`` knowing the lines of its top-level fields and of its keys left without a
    value, for the problems found after parsing."""
    # Fields only: behind errors, ``data`` may still hold thousands of unknown keys, and
    # locating each walks every key (seconds for a generated file, on the daemon's loop).
    spec._lines = {k: locate(root, (k,))[1] for k in data if k in ServiceSpec.model_fields}
    for field, spellings in _NESTED_LINES.items():
        written = next((path for path in spellings if _written(root, path)), None)
        if written is not None:
            spec._lines[field] = locate(root, written)[1]
    spec._unset = {field: locate(root, field.split(".", 1))[1] for field in spec._unset}
    return spec


# A YAML without `service:` is a SkyPilot task, not a service: `sky serve up` refuses it.
MISSING_SERVICE = (
    "a service needs a `service:` section with at least a readiness_probe "
    "(`service:` then `  readiness_probe: /health`), as in SkyServe; without one this is a "
    "SkyPilot task, not a service"
)


def _no_service(data: Any) -> bool:
    """No `service:` (or an empty one), and no misspelling of it either: a `servce:` is
    already reported with "did you mean 'service'?", and saying it is missing would mislead."""
    if not isinstance(data, dict) or data.get("service") is not None:
        return False
    if data.get("model") and not data.get("run"):
        return False  # SkyServe's minimal model-first spec: a service whatever it omits
    keys = [k for k in data if isinstance(k, str) and k != "service"]
    return not difflib.get_close_matches("service", keys, n=1, cutoff=0.75)


def parse_spec(
    text: str,
    source: str = "<string>",
    name: str | None = None,
    *,
    require_service: bool = False,
    envs: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Parse and validate a spec; ``name`` (e.g. from the command line) overrides ``name:``;
    ``envs``, the values given at `up`/`update` (``--env``), override the spec's own where
    they are filled into ``service``, ``workdir`` and ``file_mounts``.

    ``require_service``: refuse a spec without a ``service:`` section, as SkyServe does. Asked
    for what a person submits (`corral validate`, `up`, `update`); not for a spec already
    stored, which an older corral accepted without one (one replica, probe ``GET /``).

    Raises SpecError listing every problem found, and nothing else, whatever ``text`` holds.
    """
    try:
        if not isinstance(text, str):
            raise SpecError([SpecIssue("", f"expected YAML text, got {show(text)}")], source)
        data, root, issues = read_yaml(text, source)
        if require_service and _no_service(data):
            issues = [*issues, SpecIssue("service", MISSING_SERVICE, locate(root, ("service",))[1])]
        if name is not None and isinstance(data, dict):
            data = {**data, "name": name}
        try:
            spec = _validate(data, root, source, name is not None, envs or {})
        except SpecError as exc:
            raise SpecError(sorted_issues([*issues, *exc.issues]), source, exc.behind) from None
        if issues:
            raise SpecError(sorted_issues(issues), source, spec)
        return spec
    except SpecError:
        raise
    except Exception as exc:  # the promise is "only SpecError"; a bug here must not crash callers
        message = (
            f"internal error while checking the spec ({type(exc).__name__}: {exc}); "
            "please report it"
        )
        raise SpecError([SpecIssue("", message)], source) from exc


def load_spec(
    path: str | os.PathLike[str],
    name: str | None = None,
    *,
    require_service: bool = False,
    envs: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Read a spec file and parse it (see :func:`parse_spec`, ``envs`` as there); unreadable
    files are SpecErrors like any other problem."""
    source = os.fspath(path) if isinstance(path, str | os.PathLike) else str(path)

    def fail(message: str, line: int | None = None) -> SpecError:
        return SpecError([SpecIssue("", message, line)], source)

    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise fail("no such file") from None
    except IsADirectoryError:
        raise fail("is a directory; give the path of a spec file") from None
    except PermissionError:
        raise fail("cannot read the file: permission denied") from None
    except (OSError, ValueError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise fail(f"cannot read the file: {reason}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise fail(f"is larger than {MAX_SPEC_BYTES} bytes; a service spec is a short YAML file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise fail("is not UTF-8 text (is it a binary file?)", line) from None
    return parse_spec(text, source=source, name=name, require_service=require_service, envs=envs)
