"""Spec fuzzing: whatever text reaches ``parse_spec``, it returns a spec or raises SpecError.

The spec is the one input a user writes by hand, and the daemon validates every spec posted to
its API on its only event loop: a validator that crashes is a 500, one that hangs is a daemon
that stops serving every balancer. So, over real SkyServe examples mutated at random (keys
dropped, values swapped for other types, huge / negative / NaN / infinite numbers, unicode, long
strings, deep nesting, duplicated keys, unknown keys injected at random depths, text-level
damage), alias bombs, and random YAML documents, this file checks:

* ``parse_spec`` returns a spec or raises :class:`SpecError`, never anything else, and never an
  "internal error" (the catch-all that hides a bug);
* every issue of a rejection names a field (``loc``) or a position in the YAML (``line``), so a
  user can find what to fix;
* what is accepted is sane: finite durations and counts within their bounds, a valid name,
  JSON-able summary and dump;
* each example is bounded in time (a hang guard, not a speed test: the bound is far above the
  real cost) and alias bombs are refused with bounded memory.

Rounds: ``rounds(short, long)`` hypothesis examples per strategy, seeded by CORRAL_CHAOS_SEED.
"""

from __future__ import annotations

import json
import math
import pickle
import string
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_support import BASE_SEED, record, rounds
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from corral.model_engines import ModelUnavailable, engine_command
from corral.spec import (
    MAX_REPLICAS,
    MAX_SECONDS,
    MAX_YAML_NODES,
    NAME_RULE,
    ServiceSpec,
    SpecError,
    parse_spec,
)

EXAMPLES_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "skyserve-examples"
EXAMPLE_TEXTS: dict[str, str] = (
    {p.name: p.read_text() for p in sorted(EXAMPLES_DIR.glob("*.yaml"))}
    if EXAMPLES_DIR.is_dir()
    else {}
)

# A hang guard per example, not a speed assertion: a healthy parse takes milliseconds, the
# worst accepted size (256 KB, 10000 values) about a second on a loaded 2-core machine.
HANG_SECONDS = 20.0
# Memory an alias bomb may cost while being refused (its text is a few hundred bytes).
BOMB_MEMORY_BYTES = 64 * 1024 * 1024

SETTINGS = {
    "deadline": None,
    "database": None,  # replays come from the seed, not from a local example database
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
}

_stats = {"accepted": 0, "rejected": 0, "slowest": 0.0}


# -- the oracle -----------------------------------------------------------------------------------


def check(text: str) -> ServiceSpec | SpecError:
    """Run parse_spec on ``text`` and assert everything this file promises about the answer."""
    started = time.monotonic()
    try:
        spec = parse_spec(text, source="fuzz.yaml")
    except SpecError as exc:
        outcome: ServiceSpec | SpecError = exc
        assert exc.issues, f"a SpecError without issues for {text[:300]!r}"
        for issue in exc.issues:
            assert issue.message, (issue, text[:300])
            assert not issue.message.startswith("internal error"), (issue, text[:300])
            assert issue.loc or issue.line is not None, (
                f"an issue naming neither a field nor a line: {issue} for {text[:300]!r}"
            )
            assert issue.line is None or issue.line >= 1, issue
        # What the daemon does with a rejection: a JSON answer, and a pickle across processes.
        json.dumps([issue.__dict__ for issue in exc.issues])
        assert str(exc)
        assert pickle.loads(pickle.dumps(exc)).issues == exc.issues
        _stats["rejected"] += 1
    else:
        outcome = spec
        check_sane(spec, text)
        _stats["accepted"] += 1
    elapsed = time.monotonic() - started
    _stats["slowest"] = max(_stats["slowest"], elapsed)
    assert elapsed < HANG_SECONDS, f"parse_spec took {elapsed:.1f}s on {text[:300]!r}"
    return outcome


def check_sane(spec: ServiceSpec, text: str) -> None:
    """An accepted spec holds only values the rest of corral can act on."""
    if spec.model and not spec.run:
        # A model-first spec: its run is chosen at `up` for the machine, or refused with a reason.
        try:
            assert engine_command(spec).strip(), text[:300]
        except ModelUnavailable as exc:
            assert "cannot run here" in str(exc), exc
    else:
        assert spec.run and spec.run.strip(), text[:300]
    if spec.name is not None:
        assert spec.name.isascii() and spec.name[:1].isalpha() and len(spec.name) <= 63, NAME_RULE
    probe = spec.service.readiness_probe
    for seconds in (
        probe.initial_delay_seconds,
        probe.timeout_seconds,
        probe.period_seconds,
        probe.failure_timeout_seconds,
        spec.service.replica_policy.upscale_delay_seconds,
        spec.service.replica_policy.downscale_delay_seconds,
        spec.service.load_balancer.stream_timeout_seconds,
        spec.service.load_balancer.connect_timeout_seconds,
    ):
        assert math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS, (seconds, text[:300])
    assert probe.path.startswith("/")
    policy = spec.service.replica_policy
    assert 0 <= policy.min_replicas <= policy.max_replicas <= MAX_REPLICAS
    assert 0 <= policy.num_overprovision <= MAX_REPLICAS
    if policy.target_qps_per_replica is not None:
        assert math.isfinite(policy.target_qps_per_replica) and policy.target_qps_per_replica > 0
    for size in (spec.resources.cpus, spec.resources.memory):
        if size is not None:
            number = float(size.rstrip("+").rstrip("BbGgMmKkTtPpIi").strip())
            assert math.isfinite(number) and number > 0, (size, text[:300])
    for accelerator in spec.resources.accelerators:
        count = float(accelerator.rsplit(":", 1)[1])
        assert math.isfinite(count) and count > 0, accelerator
    for first, last in spec.resources.ports:
        assert 1 <= first <= last <= 65535
    json.dumps(spec.summary(), allow_nan=False)
    json.dumps(spec.model_dump(), allow_nan=False)
    for warning in spec.warnings:
        assert isinstance(warning, str) and warning


# -- strategies -----------------------------------------------------------------------------------

KEYS = [
    "run", "name", "setup", "envs", "workdir", "infra", "num_nodes", "service", "resources",
    "replicas", "replica_policy", "min_replicas", "max_replicas", "target_qps_per_replica",
    "readiness_probe", "path", "post_data", "headers", "initial_delay_seconds",
    "timeout_seconds", "period_seconds", "ports", "port", "cpus", "memory", "accelerators",
    "load_balancer", "stream_timeout_seconds", "max_body_bytes", "max_header_bytes", "tls",
    "keyfile", "certfile", "load_balancing_policy", "config", "x", "<<", "", "Run", "ünï",
]  # fmt: skip

SPECIAL_NUMBERS = [
    0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30), 10**400, 1e308, -1e308, 1e-320,
    math.inf, -math.inf, math.nan, 0.5, -0.0, 65535, 65536, MAX_REPLICAS + 1, MAX_SECONDS + 1,
]  # fmt: skip

UNICODE_TEXT = [
    "w\u0435b",  # Cyrillic e: a lookalike of "web"
    "\uff57\uff45\uff42",  # fullwidth "web"
    "\u00fc",
    "\u202ename",  # right-to-left override
    "a\u200bb",  # zero-width space
    "\U0001d52f\U0001d532\U0001d52b",  # Fraktur "run"
    "\ufeff",
    "\u0085",
    "日本語",
    "\U0001f600",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(SPECIAL_NUMBERS),
    st.text(max_size=12),
    st.sampled_from(UNICODE_TEXT),
    st.integers(1000, 5000).map(lambda n: "x" * n),  # very long strings
    st.sampled_from(["/", "/health", "8080", "8000-8010", "2+", "A100:8", "$PORT", "../x"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=12,
)


def _dump(data: Any, *, flow: bool, unicode: bool) -> str:
    return yaml.safe_dump(data, default_flow_style=flow, allow_unicode=unicode, sort_keys=False)


def _deep(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"x": leaf}
    return leaf


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value in a tree of dicts and lists (the root included)."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


@st.composite
def mutated_examples(draw: st.DrawFn) -> str:
    """A real SkyServe example with a few structural mutations, then maybe text damage."""
    name = draw(st.sampled_from(sorted(EXAMPLE_TEXTS)))
    data = yaml.safe_load(EXAMPLE_TEXTS[name])
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(data)
        path = draw(st.sampled_from(paths))
        target = _get(data, path[:-1]) if path else None
        what = draw(
            st.sampled_from(["drop", "swap", "inject", "deep", "special", "duplicate-value"])
        )
        if not path:  # the root itself
            if what == "swap":
                data = draw(values)
            elif isinstance(data, dict):
                data[draw(st.sampled_from(KEYS))] = draw(values)
            continue
        key = path[-1]
        if what == "drop" and isinstance(target, dict):
            del target[key]
        elif what == "drop" and isinstance(target, list):
            target.pop(key)
        elif what == "swap":
            target[key] = draw(values)
        elif what == "special":
            target[key] = draw(st.sampled_from(SPECIAL_NUMBERS + UNICODE_TEXT))
        elif what == "deep":
            target[key] = _deep(draw(st.integers(1, 120)), target[key])
        elif what == "inject":
            holder = _get(data, path) if isinstance(_get(data, path), dict) else target
            if isinstance(holder, dict):
                holder[draw(st.text(min_size=1, max_size=10) | st.sampled_from(KEYS))] = draw(
                    values
                )
        else:
            target[key] = [target[key]] * draw(st.integers(2, 5))
    try:
        text = _dump(data, flow=draw(st.booleans()), unicode=draw(st.booleans()))
    except (yaml.YAMLError, RecursionError):
        text = EXAMPLE_TEXTS[name]
    return draw(damaged(text))


TAGS = [
    "!!int", "!!float", "!!str", "!!binary", "!!set", "!!python/name:os.system", "!custom",
    "!!timestamp", "!!omap",
]  # fmt: skip


@st.composite
def damaged(draw: st.DrawFn, text: str) -> str:
    """Text-level mutations: what a bad edit, a bad paste or a hostile writer does to YAML."""
    for _ in range(draw(st.integers(0, 3))):
        lines = text.splitlines(keepends=True) or [""]
        index = draw(st.integers(0, len(lines) - 1))
        kind = draw(
            st.sampled_from(
                ["dup-line", "del-line", "insert", "truncate", "tab", "anchor", "tag", "nothing"]
            )
        )
        if kind == "dup-line":  # a duplicate key, most of the time
            lines.insert(index, lines[index])
        elif kind == "del-line":
            del lines[index]
        elif kind == "insert":
            pos = draw(st.integers(0, len(text)))
            junk = draw(
                st.sampled_from([":", "- ", "[", "]", "{", "}", "&a ", "*a", "? ", "|", ">", "'"])
                | st.text(max_size=5)
            )
            text = text[:pos] + junk + text[pos:]
            continue
        elif kind == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
            continue
        elif kind == "tab":
            lines[index] = "\t" + lines[index]
        elif kind == "anchor":  # an anchor on one value, aliases of it elsewhere
            lines.insert(0, "base: &b {replicas: 3, x: [1, 2]}\n")
            lines.append(f"{draw(st.sampled_from(KEYS))}: *b\n")
        elif kind == "tag":
            tag = draw(st.sampled_from(TAGS))
            line = lines[index]
            colon = line.find(": ")
            if colon >= 0:
                lines[index] = line[: colon + 2] + tag + " " + line[colon + 2 :]
        text = "".join(lines)
    return text


YAML_TOKENS = [
    "run: ", "service:", "  ", "    ", "\n", "- ", "[", "]", "{", "}", ", ", ": ", "? ", "&a ",
    "*a", "&b ", "*b", "!!str ", "!!int ", "<<: ", "'", '"', "|\n", ">-\n", "#c", "~", "---\n",
    "...\n", "%YAML 1.1\n", "replicas: ", "1", "-3", ".inf", ".nan", "0x1F", "0o17", "1e5",
    "2024-13-40", "yes", "x", "é", "\\u0000", "\t", "\r\n", "\x00", "\ud800",
]  # fmt: skip


yamlish = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)
random_documents = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=6).map(
        lambda d: json.dumps(d, allow_nan=True)  # JSON is YAML (NaN/Infinity: plain words)
    ),
    st.dictionaries(st.sampled_from(KEYS), values, max_size=6).map(
        lambda d: _dump(d, flow=False, unicode=True)
    ),
    values.map(lambda v: _dump(v, flow=True, unicode=False)),
    st.text(max_size=200),
    st.text(alphabet=string.printable, max_size=200),
    yamlish,
)


# -- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def report() -> Any:
    yield
    record(
        "spec fuzz",
        rounds=_stats["accepted"] + _stats["rejected"],
        lost=0,  # a crash, an unlocated issue or a hang fails the test instead
        accepted=_stats["accepted"],
        rejected=_stats["rejected"],
        slowest_seconds=round(_stats["slowest"], 3),
    )


def test_real_examples_pass_the_oracle() -> None:
    if not EXAMPLE_TEXTS:
        pytest.skip(f"shared examples not found at {EXAMPLES_DIR}")
    for text in EXAMPLE_TEXTS.values():
        check(text)


def test_mutated_real_specs() -> None:
    if not EXAMPLE_TEXTS:
        pytest.skip(f"shared examples not found at {EXAMPLES_DIR}")

    @seed(BASE_SEED)
    @settings(max_examples=rounds(200, 4000), **SETTINGS)
    @given(mutated_examples())
    def run(text: str) -> None:
        check(text)

    run()


def test_random_documents() -> None:
    @seed(BASE_SEED)
    @settings(max_examples=rounds(200, 4000), **SETTINGS)
    @given(random_documents)
    def run(text: str) -> None:
        check(text)

    run()


def _laughs(levels: int, fan: int, *, mapping: bool) -> str:
    """The billion laughs: each level refers ``fan`` times to the one below."""
    lines = ["l0: &l0 [lol, lol]"]
    for level in range(1, levels + 1):
        refs = [f"*l{level - 1}"] * fan
        body = (
            "{" + ", ".join(f"k{i}: {r}" for i, r in enumerate(refs)) + "}"
            if mapping
            else "[" + ", ".join(refs) + "]"
        )
        lines.append(f"l{level}: &l{level} {body}")
    lines.append("run: x")
    return "\n".join(lines) + "\n"


BOMBS = {
    "laughs-list": _laughs(9, 10, mapping=False),
    "laughs-map": _laughs(9, 10, mapping=True),
    "laughs-wide": _laughs(3, 200, mapping=False),
    "laughs-deep": _laughs(60, 2, mapping=False),
    "merge-keys": "m0: &m0 {x: 1, y: 2}\n"  # each level merges the one below and nests it
    + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}, k: *m{i - 1}}}\n" for i in range(1, 40))
    + "service: *m39\nrun: x\n",
    "self-reference": "run: x\nconfig: &loop [*loop, *loop]\n",
    "mutual-reference": "run: x\na: &a [&b [*a, *b]]\n",
    "bomb-under-envs": "x: &x [" + ", ".join(["y"] * 30) + "]\n"
    + "y: &y [" + ", ".join(["*x"] * 30) + "]\n"
    + "z: &z [" + ", ".join(["*y"] * 30) + "]\n"
    + "run: x\nenvs: {A: *z}\n",
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_alias_bombs_are_refused_with_bounded_memory(kind: str) -> None:
    tracemalloc.start()
    try:
        outcome = check(BOMBS[kind])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(outcome, SpecError), f"{kind} was accepted"
    assert peak < BOMB_MEMORY_BYTES, f"{kind} cost {peak / 1e6:.0f} MB to refuse"
    if kind.startswith(("laughs", "bomb", "merge")):
        assert any(
            "more than" in issue.message or "deeper than" in issue.message
            for issue in outcome.issues
        ), outcome


LARGE = {
    # Each is near or over a limit; each must be answered, and bounded.
    "long-run": "run: " + "x" * 200_000 + "\n",
    "over-size": "run: x\n" + "#" * 300_000 + "\n",
    "many-values": "run: x\nconfig: [" + "a," * (MAX_YAML_NODES + 10) + "]\n",
    "many-duplicates": "run: x\n" + "a: 1\n" * 30_000,
    "many-bad-env-names": "run: x\nenvs:\n" + "".join(f"  {i}x: 1\n" for i in range(4000)),
    "deep-block": "run: x\nconfig:\n"
    + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(300))
    + " " * 301
    + "v\n",
    "deep-flow": "run: x\nconfig: " + "[" * 150 + "]" * 150 + "\n",
    "long-key": "run: x\n? " + "k" * 100_000 + "\n: 1\n",
    "huge-int": "run: x\nservice: {replicas: " + "9" * 5000 + "}\n",
}


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_large_inputs_are_bounded(kind: str) -> None:
    outcome = check(LARGE[kind])
    if kind != "long-run":
        assert isinstance(outcome, SpecError), kind
    if isinstance(outcome, SpecError):
        assert len(outcome.issues) <= 100, len(outcome.issues)
        assert len(str(outcome)) < 100_000, len(str(outcome))


FOUND = {
    # What fuzzing found, kept as plain cases: each was accepted, crashed or hung before.
    "cpus-inf": ("run: x\nresources: {cpus: .inf}\n", "resources.cpus", 2),
    "memory-inf": ("run: x\nresources: {memory: .inf}\n", "resources.memory", 2),
    "accelerator-inf": ("run: x\nresources: {accelerators: {A100: .inf}}\n", "resources", 2),
    "accelerator-digits": ("run: x\nresources:\n  accelerators: A100:" + "9" * 400 + "\n", "", 3),
    "accelerator-bigint": (
        "run: x\nresources: {accelerators: {A100: 1" + "0" * 400 + "}}\n",
        "resources",
        2,
    ),
    "typed-key": ("run: x\ntrue: 1\n", "", 2),
    "timestamp-null": ("run: !!timestamp null\n", "run", 1),  # AttributeError in PyYAML
    "empty-int": ("!!int", "", 1),  # IndexError in PyYAML
    "empty-bool": ("run: x\nservice: {replicas: !!bool }\n", "service.replicas", 2),
}


@pytest.mark.parametrize("kind", sorted(FOUND))
def test_found_by_fuzzing(kind: str) -> None:
    text, loc_prefix, line = FOUND[kind]
    outcome = check(text)
    assert isinstance(outcome, SpecError), f"{kind} was accepted"
    (issue,) = outcome.issues
    assert issue.loc.startswith(loc_prefix), issue
    assert issue.line == line, issue
    assert len(issue.message) < 300, issue
