"""pydantic's errors in plain words: "did you mean", "belongs under", the value received.

pydantic's own messages name Python types and its internal error kinds ("Input should be a
valid integer"); a spec is written by someone who thinks in YAML, so each kind is reworded here,
and an unknown field is matched against every section's fields before it is called unknown.
"""

import difflib
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import AliasChoices

from corral.spec.autoscaling import AutoscalingMetric, AutoscalingSettings
from corral.spec.errors import SpecIssue
from corral.spec.model import ServiceSpec
from corral.spec.reader import command_block_hint
from corral.spec.resources import Resources
from corral.spec.section import Section
from corral.spec.service import (
    LegacyHttps,
    LoadBalancerSettings,
    ReadinessProbe,
    ReplicaPolicy,
    ServiceSection,
    TlsSettings,
)
from corral.spec.values import show

# At most this many problems are reported (the last one says how many more there were): a
# generated file with thousands of bad keys must not produce megabytes of error text.
MAX_ISSUES = 100

# Where each section model lives, so an unknown field can be matched against what is allowed
# there ("did you mean") and elsewhere ("belongs under").
_SECTIONS: dict[tuple[str, ...], type[Section]] = {
    (): ServiceSpec,
    ("resources",): Resources,
    ("service",): ServiceSection,
    ("service", "readiness_probe"): ReadinessProbe,
    ("service", "replica_policy"): ReplicaPolicy,
    ("service", "tls"): TlsSettings,
    ("service", "https"): LegacyHttps,
    ("service", "load_balancer"): LoadBalancerSettings,
    ("service", "autoscaling"): AutoscalingSettings,
    ("service", "autoscaling", "metrics"): AutoscalingMetric,
}
_LEGACY_SECTIONS = {("service", "https")}

# Names that are not typos but features corral does not have: say so instead of guessing.
_UNSUPPORTED = {
    "auth_key": (
        "corral's load balancer does not check an auth key; remove it and check credentials "
        "in the service itself"
    ),
    "autoscaling": (
        "autoscaling is set under service: service.autoscaling.metrics, or "
        "service.replica_policy (min_replicas, max_replicas, target_qps_per_replica)"
    ),
    "engine": (
        "corral picks the engine of a model-first spec itself (vLLM or SGLang on a GPU, "
        "llama.cpp's server on CPUs: docs/llm.md); to choose one, or to give it flags, write "
        "its command as `run:`"
    ),
    "engine_args": (
        "a model-first spec's engine runs with its defaults; to give it flags, write its "
        "command as `run:` (e.g. `python -m vllm.entrypoints.openai.api_server --model M "
        "--port $PORT --max-model-len 4096`)"
    ),
    # In SkyServe's spot-hedge example beside min_replicas: "did you mean" sent the user to
    # a key the mapping already had.
    "init_replicas": (
        "a service starts with min_replicas (SkyServe reads no init_replicas either) and "
        "scales from there; remove it, or raise min_replicas"
    ),
    "pool": "SkyPilot worker pools are not supported; size a service with replicas",
    "workers": "SkyPilot worker pools are not supported; size a service with replicas",
}
_LITERAL_ALIASES = {"k8s": "kubernetes", "rr": "round_robin", "least_loaded": "least_load"}


def _accepted_keys(model: type[Section]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            keys.extend(str(choice) for choice in alias.choices)
        else:
            keys.append(name)
    return keys


def _main_keys(model: type[Section]) -> list[str]:
    """Fields worth suggesting: not kept-only placement fields, not old spellings."""
    hidden = set(model._PLACEMENT) | set(model._LEGACY)
    return [name for name in model.model_fields if name not in hidden]


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path) if path else "the top level"


def _unknown_field_message(loc: tuple[int | str, ...]) -> str:
    key = str(loc[-1])
    # A list's items share one model: metrics[0].targt is looked up as metrics.targt.
    parent = tuple(str(p) for p in loc[:-1] if not isinstance(p, int))
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


def explain(error: Any, loc: tuple[int | str, ...]) -> str:
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
        text = f"must be one of {', '.join(options)}; got {show(got)}"
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
    if words := _number_words(kind, got):
        return words
    if kind in plain:
        if "[key]" in loc:
            return f"names here must be text, got {show(got)}"
        if loc in (("run",), ("setup",)) and isinstance(got, dict):
            return f"{plain[kind]}, got {show(got)}; {command_block_hint(str(loc[0]))}"
        return f"{plain[kind]}, got {show(got)}{_exponent_hint(got)}"
    if kind in ("too_short", "too_long") and isinstance(got, list | tuple):
        bound = ctx.get("min_length" if kind == "too_short" else "max_length")
        words = "at least" if kind == "too_short" else "at most"
        return f"must have {words} {bound} item{'s' if bound != 1 else ''}, got {len(got)}"
    if kind == "invalid_key":
        # The key itself ("input"), not its str() in the path: `~:` is null, not 'None'.
        return f"field names must be text, got {show(got)}"
    bounds = {
        "greater_than_equal": ("at least", "ge"),
        "greater_than": ("greater than", "gt"),
        "less_than_equal": ("at most", "le"),
        "less_than": ("less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return f"must be {words} {show(ctx.get(key))}, got {show(got)}"
    return f"{error['msg']}; got {show(got)}"


def _number_words(kind: str, got: Any) -> str | None:
    """Two type errors whose plain words would contradict themselves, said otherwise."""
    if kind == "int_type" and isinstance(got, float) and got.is_integer() and abs(got) < 1e15:
        # show() writes 2.0 as 2, and "expected a whole number, got 2" reads as a contradiction.
        return f"expected a whole number, got {got!r}; write it without the decimal point"
    if kind == "float_type" and isinstance(got, int) and not isinstance(got, bool):
        # Only a whole number beyond any float fails here: "expected a number, got a whole
        # number of 400 digits" reads as a contradiction.
        return f"is too large: got {show(got)}, beyond any number a spec takes"
    return None


# A number in exponent form as YAML 1.1 (PyYAML's, so SkyPilot's and corral's) does NOT read
# it: no dot, or an exponent without its sign (`2e3`, `1.5e3`). It arrives as text.
_EXPONENT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _exponent_hint(got: Any) -> str:
    """Why `target: 2e3` is "not a number": YAML 1.1 reads a float only with a dot and a
    signed exponent (1.0e+3), so `2e3` is the text '2e3', and "expected a number, got '2e3'"
    alone reads as a contradiction. Says so, with the value written the way YAML reads it."""
    if not isinstance(got, str) or not _EXPONENT_TEXT.fullmatch(got.strip()):
        return ""
    value = float(got)
    if not math.isfinite(value):
        return f" (YAML reads {got} as text; {got} is beyond any number a spec takes)"
    if value.is_integer() and abs(value) < 1e15:
        written = str(int(value))
    else:
        mantissa, _, exponent = repr(value).partition("e")
        dot = mantissa if "." in mantissa else mantissa + ".0"
        written = f"{dot}e{'' if exponent[:1] in '+-' else '+'}{exponent}" if exponent else dot
    return f" (YAML reads {got} as text: write {written})"


# The parts of a message that say what to do, shown as the issue's hint.
_HINT_MARKERS = ("; did you mean ", ": it belongs under ", "; write the command as a block")


def make_issue(loc: str, message: str, line: int | None) -> SpecIssue:
    for marker in _HINT_MARKERS:
        head, found, tail = message.partition(marker)
        if found:
            return SpecIssue(loc, head, line, f"{marker.lstrip(';: ')}{tail}")
    return SpecIssue(loc, message, line)


def sorted_issues(issues: Iterable[SpecIssue]) -> list[SpecIssue]:
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
