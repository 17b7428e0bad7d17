"""The service spec: SkyServe-shaped YAML, checked into pydantic models.

A spec is the one thing a user writes by hand, so this module spends its effort on error
messages: every problem names the dotted field path, the file and the line of that field, says
what was expected and what was found, and all problems of a file are reported together (a
compiler, not a game of whack-a-mole). Nothing but :class:`SpecError` leaves
:func:`parse_spec` / :func:`load_spec`, whatever the input, because the CLI and the daemon show
that error to the user as is.

SkyServe specs are accepted unchanged where corral can honour them. Fields that only say *where*
to run (clouds, regions, spot placement, SkyServe's own controller placement) are kept on the
model, for backends that may use them one day, and listed in ``ServiceSpec.warnings``. Fields that
would change how the service behaves and that corral cannot honour (an LB auth key, SkyServe's
model-only specs, ...) are errors: silently ignoring them would run something the user did not
ask for.

Choices that differ from SkyServe, and why:

* ``readiness_probe`` may be left out: it defaults to ``GET /``. SkyServe does the same in its
  parser (``config.get('readiness_probe', '/')``); a service with no probe at all could never
  become READY, so a default is kinder than an error.
* The whole ``service:`` section may be left out (one replica, default probe): every corral spec
  is a service, so the section carries no information by its mere presence.
* ``replicas: N`` is normalised to ``replica_policy`` with ``min == max == N`` so consumers read
  one shape; SkyServe keeps ``max_replicas = None`` instead.
* A YAML null (``key:`` with nothing after it) means "not given", as in SkyServe, except in
  ``envs`` where it means "no value": the variable is set to "" and a warning says so.
* Durations are capped at 7 days and replica counts at 10000: bigger values are almost surely a
  unit slip (milliseconds) and would overflow timers further down.
* Unknown fields are errors (SkyServe's schema says the same), with a "did you mean" or "belongs
  under" hint. Old SkyServe placement fields seen in its examples (``spot_policy``,
  ``spot_zones``, ``on_demand_zones``, ``controller_resources``, ``route53_hosted_zone``,
  ``external_load_balancers``) are kept with a warning like the current ones; near-misspellings
  of current fields (``base_on_demand_fallback_replicas``) stay errors, because the writer meant
  the current field and a backend with spot capacity would silently ignore the typo.
* Two old SkyServe spellings that change behaviour are still read, with a warning:
  ``service.port`` (now ``ports``) and ``service.https: {key, cert}`` (now ``tls``). SkyServe's
  later probe names ``endpoint_probe_interval_seconds`` and
  ``consecutive_failure_threshold_timeout`` are read as corral's ``period_seconds`` and
  ``failure_timeout_seconds``.
* Env and header values keep the text as written: ``PYTHON: 3.10`` is "3.10", not "3.1".
* Duplicate keys are errors (YAML itself would keep the last one without a word).

Lines: an issue carries the line of its field's key; a field that is absent gets the line of the
nearest section present, and one absent at the top level gets none.
"""

import datetime
import difflib
import json
import math
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

__all__ = [
    "DEFAULT_DOWNSCALE_DELAY_SECONDS",
    "DEFAULT_FAILURE_TIMEOUT_SECONDS",
    "DEFAULT_HEADER_TIMEOUT_SECONDS",
    "DEFAULT_INITIAL_DELAY_SECONDS",
    "DEFAULT_LOAD_BALANCING_POLICY",
    "DEFAULT_PERIOD_SECONDS",
    "DEFAULT_READINESS_PATH",
    "DEFAULT_STREAM_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "DEFAULT_UPSCALE_DELAY_SECONDS",
    "MAX_REPLICAS",
    "MAX_SECONDS",
    "NAME_RULE",
    "InfraName",
    "LoadBalancerSettings",
    "LoadBalancingPolicy",
    "ReadinessProbe",
    "ReplicaPolicy",
    "Resources",
    "ServiceSection",
    "ServiceSpec",
    "SpecError",
    "SpecIssue",
    "TlsSettings",
    "generated_name",
    "load_spec",
    "local_mounts",
    "local_port_problem",
    "missing_values",
    "parse_spec",
    "path_issues",
    "redact_secrets",
    "validate_name",
    "value_flag",
]

DEFAULT_READINESS_PATH = "/"
DEFAULT_INITIAL_DELAY_SECONDS = 1200.0
DEFAULT_TIMEOUT_SECONDS = 15.0
DEFAULT_PERIOD_SECONDS = 5.0
DEFAULT_FAILURE_TIMEOUT_SECONDS = 180.0
DEFAULT_UPSCALE_DELAY_SECONDS = 300.0
DEFAULT_DOWNSCALE_DELAY_SECONDS = 1200.0
DEFAULT_STREAM_TIMEOUT_SECONDS = 120.0
DEFAULT_HEADER_TIMEOUT_SECONDS = 30.0

MAX_SECONDS = 7 * 24 * 3600
MAX_REPLICAS = 10_000
# A spec is a page of YAML (the biggest SkyServe example: 2 KB, 55 values); these bounds keep a
# hostile or broken file (a "billion laughs" of aliases, a log pasted by mistake, 100000 copies of
# one key) from costing more than a moment. They matter because the daemon validates every spec
# posted to its API on its one event loop: PyYAML's pure-Python parser needs ~1 s per MB on a
# loaded machine and ~30 us per value, so text size and value count are capped while parsing,
# before the work is done, not after. The bounds are far above any real spec.
MAX_SPEC_BYTES = 256 * 1024
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 64
# At most this many problems are reported (the last one says how many more there were): a
# generated file with thousands of bad keys must not produce megabytes of error text.
MAX_ISSUES = 100

NAME_RULE = (
    "a service name uses lowercase letters, digits and '-', starts with a letter, "
    "ends with a letter or digit, and is at most 63 characters"
)
_NAME_RE = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PORT_RANGE_RE = re.compile(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?")
_CPUS_RE = re.compile(r"\d+(?:\.\d+)?\+?")
_MEMORY_RE = re.compile(r"\d+(?:\.\d+)?\s*(?:[KMGTP]i?B?|B)?\+?", re.IGNORECASE)
_ACCEL_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)(?::(\d+(?:\.\d+)?))?")
# $PORT or ${PORT...}: anything that hands the assigned port to the command.
_PORT_REF_RE = re.compile(r"\$\{?PORT(?![A-Za-z0-9_])")

LoadBalancingPolicy = Literal["round_robin", "least_load", "power_of_two"]
InfraName = Literal["local", "ray", "kubernetes"]
DEFAULT_LOAD_BALANCING_POLICY: LoadBalancingPolicy = "least_load"


# --------------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec, pinned to a field so an editor or a human can jump to it."""

    loc: str
    message: str
    line: int | None = None
    # What to do about it, when there is one clear fix ("did you mean 'min_replicas'?").
    hint: str | None = None

    def format(self, source: str) -> str:
        """Render as ``FILE:LINE: loc: message``, the shape compilers use and editors parse."""
        where = source
        if self.line is not None:
            where = f"{source}:{self.line}" if source else f"line {self.line}"
        parts = [p for p in (where, self.loc, self.message) if p]
        text = ": ".join(parts)
        return f"{text}; {self.hint}" if self.hint else text

    def as_json(self) -> dict[str, Any]:
        """The shape of ``corral validate --json`` and of the API's error issues."""
        return {"field": self.loc, "line": self.line, "message": self.message, "hint": self.hint}


class SpecError(ValueError):
    """Every problem found in one spec; raised once with all of them, never one at a time."""

    def __init__(self, issues: Iterable[SpecIssue], source: str = "<string>") -> None:
        self.issues: list[SpecIssue] = list(issues)
        self.source: str = source
        super().__init__(str(self))

    def __str__(self) -> str:
        if not self.issues:
            return SpecIssue("", "invalid service spec").format(self.source)
        return "\n".join(issue.format(self.source) for issue in self.issues)

    def __reduce__(self) -> tuple[type["SpecError"], tuple[list[SpecIssue], str]]:
        # Exceptions pickle through their args; ours are built from (issues, source), so say so
        # or the error breaks when it crosses a process boundary.
        return (type(self), (self.issues, self.source))


# --------------------------------------------------------------------------------------------
# Small value checks shared by the models (each raises ValueError with a full sentence, which
# the error translation below shows as is).


def _show(value: Any) -> str:
    """How a received value is quoted back: short, and in YAML's words rather than Python's."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, int) and value.bit_length() > 200:
        return f"a whole number of {len(str(abs(value)))} digits"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return repr(text)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a value of type {type(value).__name__}"


def _plain(value: Any) -> Any:
    """``value`` as JSON types: the shape of fields corral keeps but does not interpret."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _name_problem(name: object) -> str | None:
    """Why ``name`` is not a service name, or None: names end up in paths, URLs and shells."""
    if not isinstance(name, str):
        return f"expected text, got {_show(name)}; {NAME_RULE}"
    if _NAME_RE.fullmatch(name):
        return None
    reasons: list[str] = []
    if not name:
        reasons.append("it is empty")
    elif len(name) > 63:
        reasons.append(f"it is {len(name)} characters long")
    bad = sorted(
        {c for c in name if not (c.isascii() and (c.islower() or c.isdigit() or c == "-"))}
    )
    uppers = [c for c in bad if c.isascii() and c.isupper()]
    others = [c for c in bad if c not in uppers]
    if uppers:
        reasons.append("it has uppercase letters")
    if others:
        shown = ", ".join(repr(c) for c in others[:8])
        reasons.append(f"it contains {shown}")
    if name and not ("a" <= name[0] <= "z"):
        reasons.append("it does not start with a lowercase letter")
    if name and name[-1] == "-":
        reasons.append("it ends with '-'")
    why = "; ".join(reasons) if reasons else "it does not match the rule"
    return f"{_show(name)} is not a valid service name ({why}): {NAME_RULE}"


def _positive_number(value: Any) -> bool:
    """A YAML number above 0 and finite: ``.inf`` is a number to YAML, never a size or count
    (found by fuzzing: ``cpus: .inf`` was accepted as the text "inf")."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value > 0  # math.isfinite() of an int beyond float range raises OverflowError
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _scalar_to_text(value: Any) -> Any:
    """Environment variables and headers are text; YAML turns ``7`` or ``true`` into numbers."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"expected text or a number, got {_show(value)}; quote it if it is text")


def _check_env_name(name: str) -> str:
    if not _ENV_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{_show(name)} is not a valid environment variable name: use letters, digits "
            "and '_', not starting with a digit"
        )
    return name


def _check_header_name(name: str) -> str:
    if not _HEADER_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{_show(name)} is not a valid HTTP header name: no spaces, ':' or other separators"
        )
    return name


def _check_header_value(value: str) -> str:
    # A newline in a header value would let the spec inject extra headers or a second request.
    if any(c in value for c in "\r\n\0"):
        raise ValueError("a header value cannot contain a line break or NUL")
    return value


def _parse_port_range(value: Any) -> Any:
    """One ``ports`` item as SkyPilot writes it (8080, "8080", "8000-8010") -> (first, last)."""
    problem = f"expected a port number like 8080 or a range like '8000-8010', got {_show(value)}"
    if isinstance(value, bool):
        raise ValueError(problem)
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str) and (match := _PORT_RANGE_RE.fullmatch(value.strip())):
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
    else:
        raise ValueError(problem)
    if not (1 <= first <= 65535 and 1 <= last <= 65535):
        raise ValueError(f"ports must be between 1 and 65535, got {_show(value)}")
    if last < first:
        raise ValueError(f"a port range must go from low to high, got {_show(value)}")
    return (first, last)


def _format_range(port_range: tuple[int, int]) -> str:
    first, last = port_range
    return str(first) if first == last else f"{first}-{last}"


PortRange = Annotated[tuple[int, int], BeforeValidator(_parse_port_range)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
EnvValue = Annotated[str, BeforeValidator(_scalar_to_text)]
HeaderName = Annotated[str, AfterValidator(_check_header_name)]
HeaderValue = Annotated[str, BeforeValidator(_scalar_to_text), AfterValidator(_check_header_value)]


# --------------------------------------------------------------------------------------------
# Models


class _Section(BaseModel):
    """Shared config: strict types (YAML already typed the values; "2" is not 2) and no extras."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # Fields kept only for backends that may honour them; reported as warnings.
    _PLACEMENT: ClassVar[tuple[str, ...]] = ()
    # Old SkyServe spellings still read, with a warning; never suggested in "did you mean".
    _LEGACY: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        # ``key:`` with nothing after it is YAML null. Users write it to mean "default" (SkyServe
        # reads it that way), so drop it rather than fail with "expected a number, got null".
        if isinstance(data, dict):
            # Kept-only fields are stored as plain JSON values (a YAML date becomes its text),
            # so model_dump() of any section can go into the API's JSON as is.
            return {
                k: _plain(v) if k in cls._PLACEMENT else v for k, v in data.items() if v is not None
            }
        return data

    def _placement_set(self, prefix: str) -> list[str]:
        return [f"{prefix}{name}" for name in self._PLACEMENT if getattr(self, name) is not None]


class Resources(_Section):
    """What one replica needs. Only ``ports`` matters locally; the rest waits for other infra."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "cloud",
        "region",
        "zone",
        "infra",
        "instance_type",
        "use_spot",
        "disk_size",
        "disk_tier",
        "network_tier",
        "local_disk",
        "image_id",
        "any_of",
        "ordered",
        "labels",
        "autostop",
        "job_recovery",
        "spot_recovery",
        "volumes",
        "max_hourly_cost",
        "accelerator_args",
        "priority",
        "priority_class",
        "ephemeral_storage",
    )

    ports: list[PortRange] = Field(default_factory=list)
    cpus: str | None = None
    memory: str | None = None
    accelerators: list[str] = Field(default_factory=list)

    cloud: Any = None
    region: Any = None
    zone: Any = None
    infra: Any = None
    instance_type: Any = None
    use_spot: Any = None
    disk_size: Any = None
    disk_tier: Any = None
    network_tier: Any = None
    local_disk: Any = None
    image_id: Any = None
    any_of: Any = None
    ordered: Any = None
    labels: Any = None
    autostop: Any = None
    job_recovery: Any = None
    spot_recovery: Any = None
    volumes: Any = None
    max_hourly_cost: Any = None
    accelerator_args: Any = None
    priority: Any = None
    priority_class: Any = None
    ephemeral_storage: Any = None

    @field_validator("ports", mode="before")
    @classmethod
    def _one_port_is_a_list(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus_text(cls, value: Any) -> Any:
        # SkyPilot writes "2+" for "at least 2"; keep that form so a backend can honour it.
        if _positive_number(value):
            return str(value)
        if isinstance(value, str) and _CPUS_RE.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(
            f"expected a CPU count like 2, 0.5 or '4+' (at least 4), got {_show(value)}"
        )

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_text(cls, value: Any) -> Any:
        if _positive_number(value):
            return str(value)
        if isinstance(value, str) and _MEMORY_RE.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(
            "expected a memory size in GB like 16, '32+' (at least 32) or '16GB', "
            f"got {_show(value)}"
        )

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerator_options(cls, value: Any) -> Any:
        """Every SkyPilot form ("A100:1", {A100: 1}, a set, a list) -> ["NAME:COUNT", ...].

        A list keeps all options; a dict would lose SkyPilot's ``{A100:4, A100:8}`` choices.
        """
        items: list[tuple[Any, Any]]
        if isinstance(value, str):
            text = value.strip()
            shared = None  # "{L4, A10G}:1": one count for every model of the set
            grouped = re.fullmatch(r"([{\[].*[}\]])\s*:\s*([^\s:]+)", text)
            if grouped:
                text, shared = grouped.group(1), grouped.group(2)
            if text[:1] in "{[" and text[-1:] in "}]":
                text = text[1:-1]
            items = [(part.strip().strip("'\""), None) for part in text.split(",") if part.strip()]
            if shared is not None:
                items = [(f"{name}:{shared}", None) for name, _ in items]
        elif isinstance(value, list):
            items = [(item, None) for item in value]
        elif isinstance(value, dict):
            items = list(value.items())
        else:
            raise ValueError(
                "expected an accelerator like 'A100:1', a list or a mapping of them, "
                f"got {_show(value)}"
            )
        options: list[str] = []
        for name, count in items:
            match = _ACCEL_RE.fullmatch(name) if isinstance(name, str) else None
            if match is None:
                raise ValueError(
                    f"expected an accelerator like 'A100' or 'A100:2', got {_show(name)}"
                )
            given = match.group(2)
            if count is not None and given is not None:
                raise ValueError(f"{_show(name)} already has a count; got a second one")
            number: float
            if count is None:
                number = float(given) if given is not None else 1.0
            elif _positive_number(count) and count < 1e300:
                number = float(count)
            else:
                raise ValueError(f"accelerator counts are positive numbers, got {_show(count)}")
            if not (0 < number < math.inf):  # "A100:" + 400 digits reads as inf
                raise ValueError(f"accelerator counts are positive numbers, got {_show(name)}")
            shown = str(int(number)) if number.is_integer() else str(number)
            options.append(f"{match.group(1)}:{shown}")
        return options

    def port_numbers(self) -> list[int]:
        """Every port opened, ranges expanded, in the order given (duplicates dropped)."""
        seen: dict[int, None] = {}
        for first, last in self.ports:
            for port in range(first, last + 1):
                seen.setdefault(port, None)
        return list(seen)


class ReadinessProbe(_Section):
    """How corral decides that a replica serves. Also written ``readiness_probe: /path``."""

    path: str = DEFAULT_READINESS_PATH
    post_data: dict[str, Any] | None = None
    initial_delay_seconds: float = Field(DEFAULT_INITIAL_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    timeout_seconds: float = Field(DEFAULT_TIMEOUT_SECONDS, gt=0, le=MAX_SECONDS)
    # corral's names first; SkyServe's later names for the same two settings are also read.
    period_seconds: float = Field(
        DEFAULT_PERIOD_SECONDS,
        gt=0,
        le=MAX_SECONDS,
        validation_alias=AliasChoices("period_seconds", "endpoint_probe_interval_seconds"),
    )
    failure_timeout_seconds: float = Field(
        DEFAULT_FAILURE_TIMEOUT_SECONDS,
        ge=0,
        le=MAX_SECONDS,
        validation_alias=AliasChoices(
            "failure_timeout_seconds", "consecutive_failure_threshold_timeout"
        ),
    )
    headers: dict[HeaderName, HeaderValue] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must start with '/', like '/health'; got {_show(value)}")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"must not contain spaces or control characters; got {_show(value)}")
        return value

    @field_validator("post_data", mode="before")
    @classmethod
    def _json_body(cls, value: Any) -> Any:
        # SkyServe takes an object or a JSON string. Both become a plain JSON object here, so the
        # prober can send it and `corral validate` can print it without surprises.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"is not valid JSON ({exc.msg} at character {exc.pos}); "
                    'give a mapping or a JSON object string like \'{"prompt": "hi"}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object (a mapping), got {_show(value)}")
        try:
            return json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot be sent as JSON: {exc}") from None


class ReplicaPolicy(_Section):
    """How many replicas: fixed (``min == max``) or request-rate autoscaled between them.

    Both ``replicas: N`` and ``replica_policy:`` end up here, so consumers read one shape.
    """

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "base_ondemand_fallback_replicas",
        "dynamic_ondemand_fallback",
        "spot_placer",
        "spot_policy",
        "spot_zones",
        "on_demand_zones",
    )

    min_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    # Declared before max_replicas: max_replicas' check needs it.
    target_qps_per_replica: float | None = Field(default=None, gt=0)
    max_replicas: int = Field(default=None, ge=0, le=MAX_REPLICAS, validate_default=True)
    upscale_delay_seconds: float = Field(DEFAULT_UPSCALE_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    downscale_delay_seconds: float = Field(DEFAULT_DOWNSCALE_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    num_overprovision: int = Field(0, ge=0, le=MAX_REPLICAS)

    base_ondemand_fallback_replicas: Any = None
    dynamic_ondemand_fallback: Any = None
    spot_placer: Any = None
    spot_policy: Any = None
    spot_zones: Any = None
    on_demand_zones: Any = None

    @field_validator("max_replicas", mode="before")
    @classmethod
    def _max_defaults_to_min(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            return value
        if info.data.get("target_qps_per_replica") is not None:
            raise ValueError(
                "is required when target_qps_per_replica is set: it caps how far autoscaling may go"
            )
        # Without autoscaling the policy is fixed at min_replicas. If min_replicas itself was
        # invalid its own error is reported; 0 only keeps this field quiet.
        return info.data.get("min_replicas", 0)

    @field_validator("max_replicas")
    @classmethod
    def _max_fits_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")
        if low is None:
            return value
        if value < low:
            raise ValueError(f"must be at least min_replicas ({low}), got {value}")
        if (
            "target_qps_per_replica" in info.data
            and info.data["target_qps_per_replica"] is None
            and value != low
        ):
            raise ValueError(
                f"is {value} but min_replicas is {low} and target_qps_per_replica is not set: "
                "set target_qps_per_replica to autoscale between them, or make max_replicas "
                "equal to min_replicas (or leave it out) for a fixed size"
            )
        return value

    @property
    def autoscaling(self) -> bool:
        """True when the replica count follows the request rate rather than staying fixed."""
        return self.target_qps_per_replica is not None and self.max_replicas > self.min_replicas


class TlsSettings(_Section):
    """Key and certificate with which the load balancer serves HTTPS."""

    keyfile: str
    certfile: str

    @field_validator("keyfile", "certfile")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a file path, got an empty text")
        return value


class _LegacyHttps(_Section):
    """SkyServe's old ``https: {key, cert}`` spelling of ``tls``; read so old specs still run."""

    key: str
    cert: str


class LoadBalancerSettings(_Section):
    """SkyServe's ``load_balancer:`` knobs (its stream timeout), plus corral's own.

    ``stream_timeout_seconds`` is SkyServe's: the longest a replica may stay silent, before its
    response headers (unless ``first_byte_timeout_seconds`` says otherwise) and between chunks.
    The rest are corral extensions: connecting to a replica, the largest request body and
    header line accepted, how long a client may take to send a request's headers, and how long a
    leaving replica may finish its in-flight requests.
    """

    stream_timeout_seconds: float = Field(DEFAULT_STREAM_TIMEOUT_SECONDS, gt=0, le=MAX_SECONDS)
    connect_timeout_seconds: float = Field(5.0, gt=0, le=MAX_SECONDS)
    first_byte_timeout_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    max_body_bytes: int | None = Field(None, gt=0)
    max_header_bytes: int = Field(8190, ge=1024, le=1 << 20)
    # A client has this long to send a request's line and headers (and a keep-alive connection
    # may idle this long): slowloris clients are cut off instead of holding sockets for hours.
    header_timeout_seconds: float = Field(DEFAULT_HEADER_TIMEOUT_SECONDS, gt=0, le=3600)
    drain_timeout_seconds: float = Field(30.0, ge=0, le=MAX_SECONDS)
    # Client connections each balancer worker keeps open for this service; one more gets a
    # 503. None: a quarter of the worker's open-file limit, so no service can use up the
    # descriptors every other service (and the worker's own upstream connections) need.
    max_connections: int | None = Field(None, ge=1, le=1 << 22)


# Long enough for a model download in `setup`; a hung setup fails the launch after it.
DEFAULT_SETUP_TIMEOUT = 1800.0


class ServiceSection(_Section):
    """The ``service:`` section: probing, sizing and load balancing of the replicas."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "controller_resources",
        "route53_hosted_zone",
        "external_load_balancers",
    )
    _LEGACY: ClassVar[tuple[str, ...]] = ("port", "https")

    readiness_probe: ReadinessProbe = Field(default_factory=ReadinessProbe)
    replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    # Always set after validation (from replica_policy:, replicas: or the default of 1).
    replica_policy: ReplicaPolicy = Field(default=None, validate_default=True)
    load_balancing_policy: LoadBalancingPolicy = DEFAULT_LOAD_BALANCING_POLICY
    port: int | None = Field(default=None, ge=1, le=65535)
    ports: int | None = Field(default=None, ge=1, le=65535, validate_default=True)
    https: _LegacyHttps | None = None
    tls: TlsSettings | None = Field(default=None, validate_default=True)
    load_balancer: LoadBalancerSettings = Field(default_factory=LoadBalancerSettings)
    # corral's own: how long a replica's `setup` may run before its launch fails. A setup that
    # hangs would otherwise hold a launch slot forever (and, 16 of them, every service's).
    setup_timeout_seconds: float = Field(default=DEFAULT_SETUP_TIMEOUT, gt=0, le=7 * 24 * 3600)

    controller_resources: Any = None
    route53_hosted_zone: Any = None
    external_load_balancers: Any = None

    @field_validator("readiness_probe", mode="before")
    @classmethod
    def _path_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        if isinstance(value, dict | ReadinessProbe):
            return value
        raise ValueError(
            f"expected a path like /health, or a mapping with path:, got {_show(value)}"
        )

    @field_validator("replica_policy", mode="before")
    @classmethod
    def _one_sizing_form(cls, value: Any, info: ValidationInfo) -> Any:
        replicas = info.data.get("replicas")
        if value is None:
            count = 1 if replicas is None else replicas
            return {"min_replicas": count, "max_replicas": count}
        if replicas is not None:
            raise ValueError(
                "cannot be combined with replicas: use replicas for a fixed size, or "
                "replica_policy (min_replicas, max_replicas, target_qps_per_replica), not both"
            )
        return value

    @field_validator("load_balancing_policy", mode="before")
    @classmethod
    def _policy_case(cls, value: Any) -> Any:
        # SkyServe matches policy names case-insensitively.
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("ports", mode="before")
    @classmethod
    def _legacy_port(cls, value: Any, info: ValidationInfo) -> Any:
        old = info.data.get("port")
        if value is None:
            return old
        if old is not None:
            raise ValueError("port is the old name of ports: give only ports")
        return value

    @field_validator("tls", mode="before")
    @classmethod
    def _legacy_https(cls, value: Any, info: ValidationInfo) -> Any:
        old = info.data.get("https")
        if value is None:
            if old is None:
                return None
            return TlsSettings(keyfile=old.key, certfile=old.cert)
        if old is not None:
            raise ValueError("https is the old form of tls: give only tls (keyfile, certfile)")
        return value

    def _notes(self, meaningless: str) -> list[str]:
        paths = self._placement_set("service.")
        paths += self.replica_policy._placement_set("service.replica_policy.")
        notes = [f"{path}: {meaningless}" for path in paths]
        if self.port is not None:
            notes.append("service.port: SkyServe's old name of service.ports; read as ports")
        if self.https is not None:
            notes.append(
                "service.https: SkyServe's old form of service.tls; read as tls "
                "(keyfile = key, certfile = cert)"
            )
        return notes


class ServiceSpec(_Section):
    """A whole service spec, validated and normalised; see the module docstring for defaults."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = ("file_mounts", "volumes", "config")

    name: str | None = None
    run: str | None = Field(default=None, validate_default=True)
    setup: str | None = None
    envs: dict[EnvName, EnvValue] = Field(default_factory=dict)
    # SkyPilot's secrets: env vars whose values never show (state, status, logs, events).
    secrets: dict[EnvName, EnvValue] = Field(default_factory=dict)
    workdir: str | None = None
    infra: InfraName = "local"
    num_nodes: int = 1
    resources: Resources = Field(default_factory=Resources)
    service: ServiceSection = Field(default_factory=ServiceSection)

    file_mounts: Any = None
    volumes: Any = None
    config: Any = None

    # "envs.NAME" / "secrets.NAME" of keys written without a value -> their line in the file.
    _unset: dict[str, int | None] = PrivateAttr(default_factory=dict)
    # Lines of the top-level keys, for problems found after parsing (a missing workdir).
    _lines: dict[str, int | None] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_unset(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        # ``HF_TOKEN:`` with no value is how SkyPilot says "give it at launch" (``--env``,
        # ``--secret``): such keys are left out here and must be given at up/update.
        unset: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            for section in ("envs", "secrets"):
                values = data.get(section)
                if isinstance(values, dict):
                    unset += [f"{section}.{k}" for k, v in values.items() if v is None]
                    data[section] = {k: v for k, v in values.items() if v is not None}
        spec = handler(data)
        spec._unset = dict.fromkeys(unset)
        return spec

    @model_validator(mode="after")
    def _secrets_apart(self) -> Self:
        both = sorted(set(self.envs) & set(self.secrets))
        if both:
            raise ValueError(
                f"{', '.join(both)} given in both envs and secrets: a name is one or the other"
            )
        return self

    def unset_values(self) -> dict[str, int | None]:
        """``envs.NAME``/``secrets.NAME`` left without a value in the file, with their line."""
        return dict(self._unset)

    def line_of(self, key: str) -> int | None:
        """The line of top-level field ``key`` in the file it was read from, if known."""
        return self._lines.get(key)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        problem = _name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("run")
    @classmethod
    def _has_command(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            raise ValueError(
                "is required: the shell command that starts one replica, "
                "e.g. `python3 -m http.server $PORT`"
            )
        return value

    @field_validator("workdir", mode="before")
    @classmethod
    def _local_workdir(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError("a git workdir (url, ref) is not supported: give a local directory")
        return value

    @field_validator("infra", mode="before")
    @classmethod
    def _infra_case(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("num_nodes")
    @classmethod
    def _single_node(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"must be 1, got {value}: corral runs each replica on one node; "
                "multi-node replicas are not supported"
            )
        return value

    @property
    def warnings(self) -> list[str]:
        """Fields kept but without effect here, old spellings read, values filled in."""
        meaningless = f"has no meaning on infra {self.infra}; kept but not used"
        # On local, file_mounts is honoured (relative destinations) or an error, not a note.
        top = [
            p for p in self._placement_set("") if not (p == "file_mounts" and self.infra == "local")
        ]
        notes = [f"{path}: {meaningless}" for path in top]
        notes += [f"{path}: {meaningless}" for path in self.resources._placement_set("resources.")]
        notes += self.service._notes(meaningless)
        notes += [
            f"{field}: has no value in the spec: give it at `corral up`/`update` with "
            f"{value_flag(field)} {field.split('.', 1)[1]}=VALUE"
            for field in self._unset
        ]
        return notes

    def replica_port(self) -> int | None:
        """The port a replica serves on: ``service.ports``, else the one ``resources`` port."""
        if self.service.ports is not None:
            return self.service.ports
        ranges = self.resources.ports
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return ranges[0][0]
        return None

    def summary(self) -> dict[str, Any]:
        """A JSON-able, normalised view for ``corral validate``.

        Env values and probe header values are left out (names only): they are where tokens
        live, and this view is printed to terminals and logs.
        """
        probe = self.service.readiness_probe
        policy = self.service.replica_policy
        tls = self.service.tls
        return {
            "name": self.name,
            "infra": self.infra,
            "run": self.run,
            "setup": self.setup,
            "workdir": self.workdir,
            "envs": sorted(self.envs),
            "secrets": sorted(self.secrets),
            "unset": sorted(self._unset),
            "resources": {
                "ports": [_format_range(r) for r in self.resources.ports],
                "cpus": self.resources.cpus,
                "memory": self.resources.memory,
                "accelerators": list(self.resources.accelerators),
            },
            "service": {
                "replica_port": self.replica_port(),
                "readiness_probe": {
                    "method": "GET" if probe.post_data is None else "POST",
                    "path": probe.path,
                    "post_data": probe.post_data,
                    "headers": sorted(probe.headers),
                    "initial_delay_seconds": probe.initial_delay_seconds,
                    "timeout_seconds": probe.timeout_seconds,
                    "period_seconds": probe.period_seconds,
                    "failure_timeout_seconds": probe.failure_timeout_seconds,
                },
                "replica_policy": {
                    "min_replicas": policy.min_replicas,
                    "max_replicas": policy.max_replicas,
                    "target_qps_per_replica": policy.target_qps_per_replica,
                    "autoscaling": policy.autoscaling,
                    "upscale_delay_seconds": policy.upscale_delay_seconds,
                    "downscale_delay_seconds": policy.downscale_delay_seconds,
                    "num_overprovision": policy.num_overprovision,
                },
                "load_balancing_policy": self.service.load_balancing_policy,
                "tls": None if tls is None else {"keyfile": tls.keyfile, "certfile": tls.certfile},
                "stream_timeout_seconds": self.service.load_balancer.stream_timeout_seconds,
            },
            "warnings": self.warnings,
        }


def local_port_problem(spec: ServiceSpec) -> str | None:
    """Why this spec cannot run several replicas on one machine, or None if it can.

    Each local replica is given a free port in ``$PORT``. A ``run`` that binds a fixed port
    works for one replica and fails for the second (address in use), which otherwise shows up
    only later as a crash loop. A ``run`` that mentions ``$PORT`` is taken as using it. Only the
    local infra is checked: other infra give each replica its own host or pod.
    """
    if spec.infra != "local":
        return None
    port = spec.replica_port()
    policy = spec.service.replica_policy
    most = policy.max_replicas + policy.num_overprovision
    if port is None or most <= 1 or _PORT_REF_RE.search(spec.run or ""):
        return None
    return (
        f"the replicas serve on port {port} and this service may run up to {most} replicas on "
        f"this machine, but `run` never uses $PORT, so every replica would try to bind port "
        f"{port}. corral gives each local replica a free port in $PORT: start the server on it "
        "(e.g. `--port $PORT`). If the program already reads the PORT environment variable, "
        "say so in run (e.g. `PORT=$PORT python3 server.py`)."
    )


def generated_name() -> str:
    """A name for a service started without one, shaped as SkyServe makes them
    (``sky-service-`` and 4 hex digits there): ``corral-service-`` and 4 random hex digits."""
    return f"corral-service-{secrets.token_hex(2)}"


def value_flag(field: str) -> str:
    """The flag that gives a value to ``envs.NAME`` (``--env``) or ``secrets.NAME``."""
    return "--secret" if field.startswith("secrets.") else "--env"


def missing_values(
    spec: ServiceSpec, envs: Iterable[str] = (), secrets: Iterable[str] = ()
) -> list[SpecIssue]:
    """Keys the spec leaves without a value that ``envs``/``secrets`` (the names given on the
    command line) do not give either: each is an error at up/update, naming the flag."""
    given = {f"envs.{k}" for k in envs} | {f"secrets.{k}" for k in secrets}
    issues = []
    for field, line in spec.unset_values().items():
        if field in given:
            continue
        flag, key = value_flag(field), field.split(".", 1)[1]
        issues.append(
            SpecIssue(
                field,
                "has no value in the spec and none was given",
                line,
                f"pass {flag} {key}=VALUE (or {flag} {key} to take it from your environment)",
            )
        )
    return issues


def redact_secrets(text: str) -> str:
    """``text`` with the value of every ``secrets:`` key replaced: what is stored and shown of a
    spec. Only the value's characters change, so every line keeps its number."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text
    section = _child(root, "secrets")
    if not isinstance(section, MappingNode):
        return text
    spans = [
        (value.start_mark.index, value.end_mark.index)
        for _, value in section.value
        if not (isinstance(value, ScalarNode) and value.tag == "tag:yaml.org,2002:null")
    ]
    for start, end in sorted(spans, reverse=True):
        # A block scalar's span takes its lines (and the line break after it): keep as many
        # breaks, so the YAML stays valid and every later line keeps its number.
        text = text[:start] + REDACTED + "\n" * text.count("\n", start, end) + text[end:]
    return text


REDACTED = "'<redacted>'"


def path_issues(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> list[SpecIssue]:
    """Local paths of the spec that do not exist, relative ones taken from ``base_dir`` (the
    directory corral was called from, as SkyPilot does); and ``file_mounts`` this backend
    cannot honour."""
    issues = []
    if spec.workdir:
        where = Path(base_dir, Path(spec.workdir).expanduser())
        if not where.is_dir():
            what = "is not a directory" if where.exists() else "does not exist"
            issues.append(
                SpecIssue(
                    "workdir",
                    f"{where} {what} (a relative workdir is taken from the directory corral "
                    f"is run in, {base_dir}, as in SkyPilot)",
                    spec.line_of("workdir"),
                    "run corral from the directory the path is relative to, or give an "
                    "absolute path",
                )
            )
    if spec.file_mounts and spec.infra == "local":
        issues += _local_mount_issues(spec, Path(base_dir))
    return issues


def local_mounts(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``file_mounts`` as the local backend honours them: a destination relative to the
    replica's working directory -> an absolute local path (copied with the version)."""
    mounts = spec.file_mounts if isinstance(spec.file_mounts, dict) else {}
    return {
        str(dest): Path(base_dir, Path(str(src)).expanduser()).resolve()
        for dest, src in mounts.items()
    }


def _local_mount_issues(spec: ServiceSpec, base_dir: Path) -> list[SpecIssue]:
    line = spec.line_of("file_mounts")
    if not isinstance(spec.file_mounts, dict):
        return [SpecIssue("file_mounts", "expected a mapping of destination: source", line)]
    issues = []
    for dest, src in spec.file_mounts.items():
        field = f"file_mounts.{_key_text(dest)}"
        dest_text = str(dest)
        if not isinstance(src, str) or "://" in src:
            issues.append(
                SpecIssue(
                    field,
                    "only a local path can be mounted on infra local (not a bucket or a "
                    "storage mapping)",
                    line,
                    "download it in `setup` instead",
                )
            )
        elif dest_text.startswith(("/", "~")) or ".." in Path(dest_text).parts:
            issues.append(
                SpecIssue(
                    field,
                    f"cannot be honoured on infra local: {dest_text} would be one path of this "
                    "machine for every replica and version",
                    line,
                    "give a relative destination (placed in the replica's working directory, "
                    "copied with each version), or put the files in workdir",
                )
            )
        elif not Path(base_dir, Path(src).expanduser()).exists():
            issues.append(
                SpecIssue(
                    field,
                    f"{Path(base_dir, src)} does not exist (relative paths are taken from the "
                    "directory corral is run in)",
                    line,
                )
            )
    return issues


def validate_name(name: str) -> None:
    """Check a service name (from a spec or the command line) before it reaches paths or URLs."""
    problem = _name_problem(name)
    if problem:
        raise SpecError([SpecIssue("name", problem, None)], source="")


# --------------------------------------------------------------------------------------------
# Reading YAML and turning pydantic's errors into located, plain-worded issues


# Where each section model lives, so an unknown field can be matched against what is allowed
# there ("did you mean") and elsewhere ("belongs under").
_SECTIONS: dict[tuple[str, ...], type[_Section]] = {
    (): ServiceSpec,
    ("resources",): Resources,
    ("service",): ServiceSection,
    ("service", "readiness_probe"): ReadinessProbe,
    ("service", "replica_policy"): ReplicaPolicy,
    ("service", "tls"): TlsSettings,
    ("service", "https"): _LegacyHttps,
    ("service", "load_balancer"): LoadBalancerSettings,
}
_LEGACY_SECTIONS = {("service", "https")}

# Names that are not typos but features corral does not have: say so instead of guessing.
_UNSUPPORTED = {
    "auth_key": (
        "corral's load balancer does not check an auth key; remove it and check credentials "
        "in the service itself"
    ),
    "model": (
        "SkyServe's model-only specs are not supported; give the `run` command that starts "
        "the server"
    ),
    "autoscaling": (
        "autoscaling is set in service.replica_policy (min_replicas, max_replicas, "
        "target_qps_per_replica)"
    ),
    "pool": "SkyPilot worker pools are not supported; size a service with replicas",
    "workers": "SkyPilot worker pools are not supported; size a service with replicas",
}
_LITERAL_ALIASES = {"k8s": "kubernetes", "rr": "round_robin", "least_loaded": "least_load"}


def _accepted_keys(model: type[_Section]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            keys.extend(str(choice) for choice in alias.choices)
        else:
            keys.append(name)
    return keys


def _main_keys(model: type[_Section]) -> list[str]:
    """Fields worth suggesting: not kept-only placement fields, not old spellings."""
    hidden = set(model._PLACEMENT) | set(model._LEGACY)
    return [name for name in model.model_fields if name not in hidden]


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path) if path else "the top level"


def _unknown_field_message(loc: tuple[int | str, ...]) -> str:
    key = str(loc[-1])
    parent = tuple(str(p) for p in loc[:-1])
    text = f"unknown field '{key if len(key) <= 60 else key[:57] + '...'}'"
    model = _SECTIONS.get(parent)
    if model is None:
        return text
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices) and key in alias.choices:
            others = [str(c) for c in alias.choices if c != key]
            return f"'{key}' and '{others[0]}' name the same setting ({name}): give only one"
    if key in _UNSUPPORTED:
        return f"{text}: {_UNSUPPORTED[key]}"
    homes = [
        _dotted(path)
        for path, other in _SECTIONS.items()
        if path != parent
        and path not in _LEGACY_SECTIONS
        and key in _accepted_keys(other)
        and key not in other._LEGACY
    ]
    if homes:
        return f"{text}: it belongs under {' or '.join(homes)}"
    candidates = [k for k in _accepted_keys(model) if k not in model._LEGACY]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f"{text}; did you mean '{close[0]}'?"
    return f"{text}; allowed in {_dotted(parent)}: {', '.join(_main_keys(model))}"


def _explain(error: Any, loc: tuple[int | str, ...]) -> str:
    """One pydantic error in plain words, with the value received."""
    kind = error["type"]
    got = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_field_message(loc)
    if kind == "missing":
        return "is required"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        text = f"must be one of {', '.join(options)}; got {_show(got)}"
        if isinstance(got, str):
            guess = _LITERAL_ALIASES.get(got.lower())
            close = [guess] if guess else difflib.get_close_matches(got.lower(), options, n=1)
            if close:
                text += f"; did you mean '{close[0]}'?"
        return text
    plain = {
        "string_type": "expected text",
        "int_type": "expected a whole number",
        "float_type": "expected a number",
        "finite_number": "expected a finite number",
        "bool_type": "expected true or false",
        "dict_type": "expected a mapping (indented `key: value` lines)",
        "model_type": "expected a mapping (indented `key: value` lines)",
        "model_attributes_type": "expected a mapping (indented `key: value` lines)",
        "list_type": "expected a list",
    }
    if kind in plain:
        if "[key]" in loc:
            return f"names here must be text, got {_show(got)}"
        return f"{plain[kind]}, got {_show(got)}"
    if kind == "invalid_key":
        return f"field names must be text, got {_show(loc[-1])}"
    bounds = {
        "greater_than_equal": ("at least", "ge"),
        "greater_than": ("greater than", "gt"),
        "less_than_equal": ("at most", "le"),
        "less_than": ("less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return f"must be {words} {_show(ctx.get(key))}, got {_show(got)}"
    return f"{error['msg']}; got {_show(got)}"


def _locate(root: Node | None, loc: Sequence[int | str]) -> tuple[str, int | None]:
    """Dotted path and YAML line of ``loc``; the nearest present parent's line when absent."""
    parts: list[str] = []
    node = root
    line: int | None = None
    for part in loc:
        if part == "[key]":  # pydantic's marker for "the key itself": same line
            continue
        child: Node | None = None
        if isinstance(node, MappingNode):
            found = False
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.value == str(part):
                    child, found = value_node, True
                    line = key_node.start_mark.line + 1
            if not found and not isinstance(part, str):
                # A key YAML typed (``true:``, ``1:``, ``~:``) reaches pydantic as a value whose
                # str() is not what the file says; match it by value to find its line.
                for key_node, value_node in node.value:
                    if isinstance(key_node, ScalarNode) and _scalar_value(key_node) == part:
                        child = value_node
                        line = key_node.start_mark.line + 1
            parts.append(f".{_key_text(part)}" if parts else _key_text(part))
        elif (
            isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
            parts.append(f"[{part}]")
        elif isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(f".{_key_text(part)}" if parts else _key_text(part))
        node = child
    return "".join(parts), line


def _scalar_value(node: ScalarNode) -> Any:
    """The value PyYAML builds from one scalar, or a marker when it cannot build one."""
    try:
        return yaml.SafeLoader("").construct_object(node)
    except Exception:
        return _UNREADABLE


_UNREADABLE = object()


def _loc_text(path: Sequence[int | str]) -> str:
    """``path`` (mapping keys and sequence indexes) as the dotted text issues use."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(f".{_key_text(part)}" if parts else _key_text(part))
    return "".join(parts)


def _key_text(key: object) -> str:
    """A key as a path shows it: cut short, so a 100 KB key does not make a 100 KB path."""
    text = str(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _child(node: Node | None, key: str) -> Node | None:
    found: Node | None = None
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.value == key:
                found = value_node
    return found


def _keep_text_as_written(node: Node | None, values: Any) -> None:
    """Use the text the user wrote for numbers and booleans in ``values`` (a dict).

    For env vars and headers YAML's typing only loses information: ``PYTHON: 3.10`` would
    become "3.1" and ``DEBUG: yes`` "True".
    """
    if not isinstance(node, MappingNode) or not isinstance(values, dict):
        return
    for key_node, value_node in node.value:
        if not (isinstance(key_node, ScalarNode) and isinstance(value_node, ScalarNode)):
            continue
        current = values.get(key_node.value)
        if isinstance(current, bool | int | float):
            values[key_node.value] = value_node.value


def _walk_nodes(root: Node, source: str) -> list[SpecIssue]:
    """Flag duplicate keys (YAML silently keeps the last) and refuse absurdly large documents."""
    issues: list[SpecIssue] = []
    stack: list[tuple[Node, tuple[int | str, ...]]] = [(root, ())]
    checked: set[int] = set()
    count = 0
    while stack:
        node, path = stack.pop()
        count += 1
        if len(path) > MAX_YAML_DEPTH:
            raise SpecError(
                [
                    SpecIssue(
                        "",
                        f"the spec nests deeper than {MAX_YAML_DEPTH} levels (an alias that "
                        "contains itself?); a service spec is much flatter",
                        node.start_mark.line + 1,
                    )
                ],
                source,
            )
        if count > MAX_YAML_NODES:
            raise SpecError(
                [
                    SpecIssue(
                        "",
                        f"the spec expands to more than {MAX_YAML_NODES} YAML values "
                        "(aliases repeated too often?); a service spec is much smaller",
                        node.start_mark.line + 1,
                    )
                ],
                source,
            )
        if isinstance(node, MappingNode):
            first_seen: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, ScalarNode):
                    stack.append((key_node, path))
                    stack.append((value_node, path))
                    continue
                if key_node.tag == "tag:yaml.org,2002:merge":
                    stack.append((value_node, path))
                    continue
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key_node.value)
                if id(node) not in checked and ident in first_seen:
                    # The path is known here: searching the tree for it again per duplicate
                    # made a file of 100000 repeated keys take minutes (found by fuzzing).
                    issues.append(
                        SpecIssue(
                            _loc_text((*path, key_node.value)),
                            f"'{key_node.value}' is given twice (first at line "
                            f"{first_seen[ident]}); YAML would silently keep only the last one",
                            line,
                        )
                    )
                first_seen.setdefault(ident, line)
                stack.append((value_node, (*path, key_node.value)))
            checked.add(id(node))
        elif isinstance(node, SequenceNode):
            stack.extend((item, (*path, index)) for index, item in enumerate(node.value))
    return issues


def _unreadable_scalar(root: Node) -> tuple[str, int | None]:
    """Where the first scalar PyYAML cannot turn into a value is; only used on the error path."""
    stack: list[tuple[Node, tuple[int | str, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(node)
            except Exception:
                return _locate(root, path)[0], node.start_mark.line + 1
        elif isinstance(node, MappingNode):
            for key_node, value_node in reversed(node.value):
                key = key_node.value if isinstance(key_node, ScalarNode) else "?"
                stack.append((value_node, (*path, key)))
                stack.append((key_node, path))
        elif isinstance(node, SequenceNode):
            stack.extend((item, (*path, i)) for i, item in reversed(list(enumerate(node.value))))
    return "", None


def _check_flow_depth(text: str, source: str) -> None:
    """Refuse bracket nesting that only an attack has: PyYAML's scanner is quadratic in it.

    Brackets in quoted text or block scalars are counted too; only a run of 200 unclosed ones
    trips this, which no real spec has.
    """
    if text.count("[") + text.count("{") <= 200:
        return
    depth = 0
    for index, char in enumerate(text):
        if char in "[{":
            depth += 1
            if depth > 200:
                line = text.count("\n", 0, index) + 1
                message = "not valid YAML: brackets nested more than 200 deep"
                raise SpecError([SpecIssue("", message, line)], source)
        elif char in "]}" and depth:
            depth -= 1


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document past MAX_YAML_NODES values or MAX_YAML_DEPTH
    levels while it is being built.

    Counting after composing (as :func:`_walk_nodes` does for what aliases expand to) comes too
    late for size: 250 KB of ``[a,a,a,...]`` is 100000 nodes and many seconds of parsing first.
    Stopping the composer stops the parser and scanner with it, since they run on demand.
    Aliases cost one count here (they are references); their expansion is counted later.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._nodes += 1
        self._depth += 1
        try:
            if self._nodes > MAX_YAML_NODES or self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]
                if self._depth > MAX_YAML_DEPTH:
                    message = (
                        f"the spec nests deeper than {MAX_YAML_DEPTH} levels; "
                        "a service spec is much flatter"
                    )
                else:
                    message = (
                        f"the spec has more than {MAX_YAML_NODES} YAML values; "
                        "a service spec is much smaller"
                    )
                raise _Refused(message, line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Refused(Exception):
    """A limit of :class:`_BoundedLoader` was hit; carries the message and the line."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _read_yaml(text: str, source: str) -> tuple[Any, Node, list[SpecIssue]]:
    """YAML text -> (data, node tree for line numbers, duplicate-key issues)."""

    def fail(message: str, line: int | None = None) -> SpecError:
        return SpecError([SpecIssue("", message, line)], source)

    if len(text) > MAX_SPEC_BYTES:
        raise fail(
            f"the spec is {len(text)} characters long, more than the {MAX_SPEC_BYTES} allowed; "
            "a service spec is a short YAML file",
            text.count("\n", 0, MAX_SPEC_BYTES) + 1,
        )
    _check_flow_depth(text, source)
    loader: _BoundedLoader | None = None
    root: Node | None = None
    try:
        loader = _BoundedLoader(text)
        root = loader.get_single_node()
        if root is None:
            raise fail("the spec is empty; it needs at least a `run` command", 1)
        issues = _walk_nodes(root, source)
        data = loader.construct_document(root)
    except SpecError:
        raise
    except _Refused as exc:
        raise fail(exc.message, exc.line) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        raise fail(f"not valid YAML: {what}", None if mark is None else mark.line + 1) from None
    except ReaderError as exc:
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        raise fail(f"not valid YAML: character {exc.character!r} is not allowed", line) from None
    except yaml.YAMLError as exc:
        raise fail(f"not valid YAML: {exc}") from None
    except RecursionError:
        raise fail("not valid YAML: nested too deeply") from None
    except Exception as exc:
        # PyYAML's constructors let plain exceptions through for values that do not fit their
        # tag: ValueError for a date like 2024-13-01, and (found by fuzzing) AttributeError for
        # `!!timestamp null`, IndexError for an empty `!!int`.
        loc, bad_line = ("", None) if root is None else _unreadable_scalar(root)
        if bad_line is None and root is not None:
            bad_line = root.start_mark.line + 1
        detail = (
            str(exc) if isinstance(exc, ValueError | OverflowError) else "it does not fit its tag"
        )
        message = f"a value cannot be read: {detail}; quote it if it is text"
        raise SpecError([SpecIssue(loc, message, bad_line)], source) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, root, issues


def _cross_section_issues(spec: ServiceSpec) -> list[tuple[tuple[str, ...], str]]:
    """Checks that span sections, run once every section is valid on its own."""
    problems: list[tuple[tuple[str, ...], str]] = []
    opened = spec.resources.ports
    shown = ", ".join(_format_range(r) for r in opened)
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
    return problems


def _validate(data: Any, root: Node, source: str, name_given: bool) -> ServiceSpec:
    issues: list[SpecIssue] = []
    if not isinstance(data, dict):
        raise SpecError(
            [
                SpecIssue(
                    "",
                    f"expected a mapping of fields (run:, service:, resources:, ...) at the top "
                    f"level, got {_show(data)}",
                    root.start_mark.line + 1,
                )
            ],
            source,
        )
    _keep_text_as_written(_child(root, "envs"), data.get("envs"))
    service = data.get("service")
    if isinstance(service, dict) and isinstance(service.get("readiness_probe"), dict):
        probe_node = _child(_child(_child(root, "service"), "readiness_probe"), "headers")
        _keep_text_as_written(probe_node, service["readiness_probe"].get("headers"))
    try:
        spec = ServiceSpec.model_validate(data)
    except ValidationError as exc:
        # Only what can be shown is located and explained (each costs a walk of the tree).
        for error in exc.errors(include_url=False)[: MAX_ISSUES + 1]:
            loc = tuple(error["loc"])
            dotted, line = _locate(root, loc)
            if name_given and loc[:1] == ("name",):
                line = None  # the override did not come from the file
            issues.append(_issue(dotted, _explain(error, loc), line))
        raise SpecError(issues, source) from None
    for loc, message in _cross_section_issues(spec):
        dotted, line = _locate(root, loc)
        issues.append(_issue(dotted, message, line))
    if issues:
        raise SpecError(issues, source)
    spec._lines = {str(k): _locate(root, (k,))[1] for k in data}
    spec._unset = {field: _locate(root, field.split(".", 1))[1] for field in spec._unset}
    return spec


# The parts of a message that say what to do, shown as the issue's hint.
_HINT_MARKERS = ("; did you mean ", ": it belongs under ")


def _issue(loc: str, message: str, line: int | None) -> SpecIssue:
    for marker in _HINT_MARKERS:
        head, found, tail = message.partition(marker)
        if found:
            return SpecIssue(loc, head, line, f"{marker.lstrip(';: ')}{tail}")
    return SpecIssue(loc, message, line)


def _sorted(issues: Iterable[SpecIssue]) -> list[SpecIssue]:
    """File order, then field order; drop repeats (one cause can surface twice); at most
    MAX_ISSUES, the last saying how many more were left out."""
    unique = list(dict.fromkeys(issues))
    ordered = sorted(unique, key=lambda i: -1 if i.line is None else i.line)
    if len(ordered) <= MAX_ISSUES:
        return ordered
    last = ordered[MAX_ISSUES - 1]
    more = len(ordered) - MAX_ISSUES
    note = f"{last.message} (and {more} more problems not shown; fix these first)"
    return [*ordered[: MAX_ISSUES - 1], SpecIssue(last.loc, note, last.line)]


def parse_spec(text: str, source: str = "<string>", name: str | None = None) -> ServiceSpec:
    """Parse and validate a spec; ``name`` (e.g. from the command line) overrides ``name:``.

    Raises SpecError listing every problem found, and nothing else, whatever ``text`` holds.
    """
    try:
        if not isinstance(text, str):
            raise SpecError([SpecIssue("", f"expected YAML text, got {_show(text)}")], source)
        data, root, issues = _read_yaml(text, source)
        if name is not None and isinstance(data, dict):
            data = {**data, "name": name}
        try:
            spec = _validate(data, root, source, name is not None)
        except SpecError as exc:
            raise SpecError(_sorted([*issues, *exc.issues]), source) from None
        if issues:
            raise SpecError(_sorted(issues), source)
        return spec
    except SpecError:
        raise
    except Exception as exc:  # the promise is "only SpecError"; a bug here must not crash callers
        message = (
            f"internal error while checking the spec ({type(exc).__name__}: {exc}); "
            "please report it"
        )
        raise SpecError([SpecIssue("", message)], source) from exc


def load_spec(path: str | os.PathLike[str], name: str | None = None) -> ServiceSpec:
    """Read a spec file and parse it; unreadable files are SpecErrors like any other problem."""
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
    return parse_spec(text, source=source, name=name)
