"""Defaults, bounds and small value checks the spec's models share.

Each check raises ValueError with a whole sentence naming what was expected and what was found:
the error translation in :mod:`corral.spec.messages` shows that sentence as is.
"""

import datetime
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator

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

NAME_RULE = (
    "a service name uses lowercase letters, digits and '-', starts with a letter, "
    "ends with a letter or digit, and is at most 63 characters"
)
_NAME_RE = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PORT_RANGE_RE = re.compile(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?")

LoadBalancingPolicy = Literal[
    "round_robin", "least_load", "power_of_two", "prefix_affinity", "instance_aware_least_load"
]
# What SGLang's and vLLM's routers call their prefix-cache-aware policy.
POLICY_ALIASES = {"cache_aware": "prefix_affinity", "prefix_aware": "prefix_affinity"}
InfraName = Literal["local", "ray", "kubernetes"]
DEFAULT_LOAD_BALANCING_POLICY: LoadBalancingPolicy = "least_load"


def show(value: Any) -> str:
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


def plain(value: Any) -> Any:
    """``value`` as JSON types: the shape of fields corral keeps but does not interpret."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a service name, or None: names end up in paths, URLs and shells."""
    if not isinstance(name, str):
        return f"expected text, got {show(name)}; {NAME_RULE}"
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
    return f"{show(name)} is not a valid service name ({why}): {NAME_RULE}"


def positive_number(value: Any) -> bool:
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
    raise ValueError(f"expected text or a number, got {show(value)}; quote it if it is text")


def env_name_ok(name: object) -> bool:
    """Whether ``name`` can be an environment variable's name."""
    return isinstance(name, str) and _ENV_NAME_RE.fullmatch(name) is not None


def _check_env_name(name: str) -> str:
    if not env_name_ok(name):
        raise ValueError(
            f"{show(name)} is not a valid environment variable name: use letters, digits "
            "and '_', not starting with a digit"
        )
    return name


def _check_header_name(name: str) -> str:
    if not _HEADER_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{show(name)} is not a valid HTTP header name: no spaces, ':' or other separators"
        )
    return name


def _check_header_value(value: str) -> str:
    # A newline in a header value would let the spec inject extra headers or a second request.
    if any(c in value for c in "\r\n\0"):
        raise ValueError("a header value cannot contain a line break or NUL")
    return value


def _parse_port_range(value: Any) -> Any:
    """One ``ports`` item as SkyPilot writes it (8080, "8080", "8000-8010") -> (first, last)."""
    problem = f"expected a port number like 8080 or a range like '8000-8010', got {show(value)}"
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
        raise ValueError(f"ports must be between 1 and 65535, got {show(value)}")
    if last < first:
        raise ValueError(f"a port range must go from low to high, got {show(value)}")
    return (first, last)


def format_range(port_range: tuple[int, int]) -> str:
    first, last = port_range
    return str(first) if first == last else f"{first}-{last}"


PortRange = Annotated[tuple[int, int], BeforeValidator(_parse_port_range)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
EnvValue = Annotated[str, BeforeValidator(_scalar_to_text)]
HeaderName = Annotated[str, AfterValidator(_check_header_name)]
HeaderValue = Annotated[str, BeforeValidator(_scalar_to_text), AfterValidator(_check_header_value)]


def qps_of_accelerator(targets: Mapping[str, float], accelerator: str | None) -> float | None:
    """The target QPS of a replica on ``accelerator`` (``A100``, as placement took it) by
    SkyServe's matching: the key itself, else a key whose name before ``:`` is it (``A100:1``),
    case ignored; None when no key names it."""
    if accelerator is None:
        return None
    want = accelerator.strip().lower()
    for key, qps in targets.items():
        if key.strip().lower() == want:
            return qps
    for key, qps in targets.items():
        if key.partition(":")[0].strip().lower() == want:
            return qps
    return None
