"""corral's autoscaler against SkyPilot's own ``RequestRateAutoscaler``, offline, same traces.

Both autoscalers are pure decision functions once their clock is in the caller's hands, so this
runs them side by side on synthetic request traces (step, ramp, spike, diurnal, and an idle
service woken by bursts) with a simulated clock, and reports, per matched target change, when
each one moved and by how much corral was earlier or later. The diurnal trace also runs with
``num_overprovision`` (1 with the default delays, 2 with the short ones): both add it to the
target their hysteresis keeps, so its rows should be the plain ones with every target moved up.

* SkyServe: ``sky.serve.autoscalers.Autoscaler.from_spec`` on a ``SkyServiceSpec`` built by
  SkyPilot's own ``SkyServiceSpec.from_yaml_config`` from the ``service:`` mapping below. Each
  decision is what SkyServe's controller loop does: ``collect_request_information`` with the
  timestamps that arrived since the previous one, then ``generate_scaling_decisions`` (with no
  replicas: the hysteresis does not depend on them), then wait ``get_decision_interval()``
  (20 s, 5 s at zero). Its clock is ``time.time`` inside ``sky.serve.autoscalers`` only, which
  this process replaces with the simulated one: acceptable for a benchmark of a decision
  function, and it touches nothing else. By default the controller sees every request the
  moment it is made, which favours SkyServe: in a real deployment its load balancer sends
  them every 20 s (``--skyserve-lb-sync`` models that).
* corral: ``corral.autoscale.make_autoscaler`` on the ``ReplicaPolicy`` that ``corral.spec``
  parses from the same mapping, called as the controller calls it: ``decide(now, the last
  lookback(now) seconds of requests)``, then wait ``decision_interval``. corral's balancer
  reports requests to the daemon every 0.25 s; that lag is not modelled either.

Besides the matched changes, two checks per trace: for every change SkyServe made at every
phase run, whether corral's target already stood at that level or past it (and if not, how
much later it got there); and for every corral change, whether a SkyServe whose clock falls
somewhere in the second before it makes the same change (``made_by_some_phase``;
``--no-origins`` skips it).

SkyServe's first decision falls at ``phase`` seconds into the trace (``--phases`` spreads it over
its 20 s interval: a load change does not wait for a decision tick); corral's at 0.

Needs SkyPilot, which is not a corral dependency: ``make bench-skyserve`` makes ``.venv-sky``
with ``skypilot==0.14.1`` and corral and runs this file there. No network: SkyPilot is imported,
never run; its import writes ``~/.sky``, so HOME points at a temporary directory first.

Run: ``make bench-skyserve`` or ``.venv-sky/bin/python bench/autoscale_vs_skyserve.py
[--phases N] [--seed S] [--skyserve-lb-sync] [--corral-rev REV] [--json PATH] [--changes]``
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from corral import autoscale  # noqa: E402
from corral.spec import ServiceSection  # noqa: E402

RESULTS = REPO / "bench/results/autoscale_vs_skyserve.json"
SAME = 0.5  # |corral - SkyServe| up to this many seconds counts as "same"
MIN, HOUR = 60.0, 3600.0

# The service sections both autoscalers are built from (SkyServe's YAML shape).
SPECS: dict[str, dict[str, Any]] = {
    "defaults": {  # upscale 300 s, downscale 1200 s: what a spec without delays gets
        "readiness_probe": "/health",
        "replica_policy": {"min_replicas": 1, "max_replicas": 10, "target_qps_per_replica": 2},
    },
    "short delays": {
        "readiness_probe": "/health",
        "replica_policy": {
            "min_replicas": 1,
            "max_replicas": 10,
            "target_qps_per_replica": 2,
            "upscale_delay_seconds": 60,
            "downscale_delay_seconds": 120,
        },
    },
    "scale to zero": {
        "readiness_probe": "/health",
        "replica_policy": {"min_replicas": 0, "max_replicas": 10, "target_qps_per_replica": 2},
    },
    "overprovision": {  # the defaults, plus spare replicas on top of the computed target
        "readiness_probe": "/health",
        "replica_policy": {
            "min_replicas": 1,
            "max_replicas": 10,
            "target_qps_per_replica": 2,
            "num_overprovision": 1,
        },
    },
    "overprovision, short delays": {
        "readiness_probe": "/health",
        "replica_policy": {
            "min_replicas": 1,
            "max_replicas": 10,
            "target_qps_per_replica": 2,
            "upscale_delay_seconds": 60,
            "downscale_delay_seconds": 120,
            "num_overprovision": 2,
        },
    },
}


@dataclass(frozen=True)
class Trace:
    name: str
    duration: float
    rate: Callable[[float], float]  # requests per second at time t
    peak: float  # an upper bound of ``rate``, for thinning
    specs: tuple[str, ...] = ("defaults", "short delays")


def _step(t: float) -> float:
    return 12.0 if 10 * MIN <= t < 50 * MIN else 2.0


def _ramp(t: float) -> float:
    up, down = 60 * MIN, 120 * MIN
    if t < up:
        return 1.0 + 19.0 * t / up
    return max(1.0, 20.0 - 19.0 * (t - up) / (down - up))


def _spike(t: float) -> float:
    # 2 min at 10x (shorter than the default upscale hold), later 8 min (longer).
    if 20 * MIN <= t < 22 * MIN or 60 * MIN <= t < 68 * MIN:
        return 30.0
    return 3.0


def _diurnal(t: float) -> float:
    # A day squeezed into 2 hours: 2 req/s at night, 18 at noon.
    return 10.0 - 8.0 * math.cos(2 * math.pi * t / (2 * HOUR))


def _idle(t: float) -> float:
    # Nothing, then 5 min of 6 req/s every 40 min.
    return 6.0 if (t % (40 * MIN)) >= 35 * MIN else 0.0


TRACES = [
    Trace("step", 100 * MIN, _step, 12.0),
    Trace("ramp", 150 * MIN, _ramp, 20.0),
    Trace("spike", 110 * MIN, _spike, 30.0),
    Trace(
        "diurnal",
        4 * HOUR,
        _diurnal,
        18.0,
        specs=("defaults", "short delays", "overprovision", "overprovision, short delays"),
    ),
    Trace("idle + bursts", 3 * HOUR, _idle, 6.0, specs=("scale to zero",)),
]


def arrivals(trace: Trace, rng: random.Random) -> list[float]:
    """Poisson arrivals at ``trace.rate`` (thinning a process at the peak rate), sorted."""
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(trace.peak)
        if t >= trace.duration:
            return out
        if rng.random() * trace.peak < trace.rate(t):
            out.append(t)


Change = tuple[float, int, int]  # (time, from, to)


def run_corral(
    module: ModuleType, service: dict[str, Any], stamps: list[float], end: float
) -> list[Change]:
    """corral's target changes, deciding as its controller does."""
    policy = ServiceSection.model_validate(service).replica_policy
    scaler = module.make_autoscaler(policy)
    changes: list[Change] = []
    target = None
    now = 0.0
    while now <= end:
        lookback = scaler.lookback(now) if hasattr(scaler, "lookback") else scaler.qps_window
        low = bisect.bisect_right(stamps, now - lookback)
        high = bisect.bisect_right(stamps, now)
        new = scaler.decide(now, stamps[low:high]).target
        if target is not None and new != target:
            changes.append((now, target, new))
        target = new
        now += scaler.decision_interval
    return changes


class SimClock:
    """Stands in for the ``time`` module inside ``sky.serve.autoscalers``: ``time()`` is the
    simulated clock, everything else is the real module."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def import_skyserve() -> tuple[ModuleType, ModuleType, SimClock, str]:
    os.environ["HOME"] = tempfile.mkdtemp(prefix="corral-bench-sky-home-")
    try:
        import sky
        from sky.serve import autoscalers, service_spec
    except ImportError:
        sys.exit("SkyPilot is not installed here: run `make bench-skyserve` (uses .venv-sky)")
    logging.getLogger("sky").setLevel(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("sky"):
            logging.getLogger(name).setLevel(logging.WARNING)
    clock = SimClock()
    autoscalers.time = clock  # the benchmark's one monkeypatch: SkyServe's clock
    return autoscalers, service_spec, clock, sky.__version__


def run_skyserve(
    sky: tuple[ModuleType, ModuleType, SimClock, str],
    service: dict[str, Any],
    stamps: list[float],
    end: float,
    phase: float,
    lb_sync: float | None,
) -> list[Change]:
    """SkyServe's target changes: its controller loop, with the simulated clock."""
    autoscalers, service_spec, clock, _ = sky
    spec = service_spec.SkyServiceSpec.from_yaml_config(service)
    scaler = autoscalers.Autoscaler.from_spec("bench", spec)
    assert type(scaler).__name__ == "RequestRateAutoscaler", type(scaler)
    changes: list[Change] = []
    fed = 0  # stamps[:fed] have been handed over
    target = scaler.get_final_target_num_replicas()
    now = phase
    while now <= end:
        # What the controller has received by now: every request, or those up to the last
        # load-balancer sync (every lb_sync seconds from 0).
        # (Called even with nothing new, as every sync does: that is what drops old requests.)
        seen = now if lb_sync is None else math.floor(now / lb_sync) * lb_sync
        upto = bisect.bisect_right(stamps, seen)
        clock.now = seen
        scaler.collect_request_information({"timestamps": stamps[fed:upto]})
        fed = upto
        clock.now = now
        scaler.generate_scaling_decisions([], [])
        new = scaler.get_final_target_num_replicas()
        if new != target:
            changes.append((now, target, new))
        target = new
        now += scaler.get_decision_interval()
    return changes


def match(
    corral: Sequence[Change], sky: Sequence[Change], tolerance: float
) -> tuple[list[tuple[Change, Change]], list[Change], list[Change]]:
    """Pairs of (SkyServe change, corral change) in the same direction, closest in time first,
    at most ``tolerance`` apart; and what stayed unmatched on each side."""

    def direction(c: Change) -> int:
        return 1 if c[2] > c[1] else -1

    candidates = sorted(
        (abs(c[0] - s[0]), i, j)
        for i, s in enumerate(sky)
        for j, c in enumerate(corral)
        if direction(s) == direction(c) and abs(c[0] - s[0]) <= tolerance
    )
    used_s: set[int] = set()
    used_c: set[int] = set()
    pairs = []
    for _, i, j in candidates:
        if i not in used_s and j not in used_c:
            used_s.add(i)
            used_c.add(j)
            pairs.append((sky[i], corral[j]))
    pairs.sort()
    lone_sky = [s for i, s in enumerate(sky) if i not in used_s]
    lone_corral = [c for j, c in enumerate(corral) if j not in used_c]
    return pairs, lone_sky, lone_corral


def lags(mine: Sequence[Change], theirs: Sequence[Change], initial: int) -> list[float]:
    """For each SkyServe change (t, a -> b): how long after t corral's target first stood at b
    or past it in that direction (0 when it already did): how late corral reached the level."""
    out = []
    for t, a, b in theirs:
        up = b > a
        c = initial
        for when, _, new in mine:
            if when > t + 1e-6:
                break
            c = new
        if (c >= b) if up else (c <= b):
            out.append(0.0)
            continue
        later = [w for w, _, new in mine if w > t + 1e-6 and ((new >= b) if up else (new <= b))]
        out.append(later[0] - t if later else math.inf)
    return out


def made_by_some_phase(
    sky: tuple[ModuleType, ModuleType, SimClock, str],
    service: dict[str, Any],
    stamps: list[float],
    move: Change,
    lb_sync: float | None,
) -> bool:
    """Whether a SkyServe whose clock falls at some instant in the second before corral's
    move (or the 10 ms after: corral moves at the instant a request changed the raw target,
    SkyServe's look just after it) makes the same move, same direction and target, then.
    Looks 1 ms apart after, then 25 ms apart before, are tried, nearest first."""
    t, a, b = move
    up = b > a
    offsets = [-0.001 * j for j in range(1, 11)] + [0.025 * k for k in range(41)]
    for offset in offsets:
        phase = (t - offset) % 20.0
        for at, before, after in run_skyserve(sky, service, stamps, t + 0.011, phase, lb_sync):
            if t - 1.0 - 1e-6 <= at <= t + 0.011 and after == b and (after > before) == up:
                return True
    return False


def load_corral_at(rev: str) -> ModuleType:
    """``corral.autoscale`` as it was at git revision ``rev``, for a before/after column."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:src/corral/autoscale.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="corral-bench-rev-")) / "autoscale_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("autoscale_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Row:
    corral: str
    spec: str
    trace: str
    phase: float
    direction: str
    skyserve_at: float
    skyserve_move: str
    corral_at: float
    corral_move: str
    diff: float  # corral - SkyServe, seconds: negative = corral earlier


def compare(
    label: str,
    module: ModuleType,
    sky: tuple[ModuleType, ModuleType, SimClock, str],
    traces: dict[str, list[float]],
    args: argparse.Namespace,
    churn: dict[tuple[str, ...], dict[str, Any]],
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Matched changes and unmatched ones; ``churn`` gets how often each changed the target."""
    rows: list[Row] = []
    unmatched: list[dict[str, Any]] = []
    phases = [i * 20.0 / args.phases for i in range(args.phases)]
    for trace in TRACES:
        stamps = traces[trace.name]
        for spec_name in trace.specs:
            service = SPECS[spec_name]
            mine = run_corral(module, service, stamps, trace.duration)
            counts = churn[(label, spec_name, trace.name)] = {"corral": len(mine), "skyserve": []}
            counts["lags"] = []
            initial = (
                mine[0][1]
                if mine
                else autoscale.make_autoscaler(
                    ServiceSection.model_validate(service).replica_policy
                )
                .decide(0.0, [])
                .target
            )
            if args.origins:
                counts["origins"] = [
                    made_by_some_phase(sky, service, stamps, m, args.skyserve_lb_sync) for m in mine
                ]
            for phase in phases:
                theirs = run_skyserve(
                    sky, service, stamps, trace.duration, phase, args.skyserve_lb_sync
                )
                counts["skyserve"].append(len(theirs))
                counts["lags"] += lags(mine, theirs, initial)
                pairs, lone_sky, lone_corral = match(mine, theirs, args.tolerance)
                for s, c in pairs:
                    rows.append(
                        Row(
                            label,
                            spec_name,
                            trace.name,
                            phase,
                            "up" if s[2] > s[1] else "down",
                            s[0],
                            f"{s[1]}->{s[2]}",
                            c[0],
                            f"{c[1]}->{c[2]}",
                            c[0] - s[0],
                        )
                    )
                for side, lone in (("SkyServe", lone_sky), ("corral", lone_corral)):
                    for t, a, b in lone:
                        unmatched.append(
                            {"corral": label, "spec": spec_name, "trace": trace.name,
                             "phase": phase, "only": side, "at": t, "move": f"{a}->{b}"}
                        )  # fmt: skip
    return rows, unmatched


def summarize(rows: Sequence[Row]) -> dict[str, Any]:
    diffs = [r.diff for r in rows]
    if not diffs:
        return {"matched": 0}
    return {
        "matched": len(diffs),
        "earlier": sum(d < -SAME for d in diffs),
        "same": sum(abs(d) <= SAME for d in diffs),
        "later": sum(d > SAME for d in diffs),
        "median_s": statistics.median(diffs),
        "min_s": min(diffs),
        "max_s": max(diffs),
    }


def print_summary(
    groups: dict[tuple[str, ...], list[Row]],
    unmatched: list[dict[str, Any]],
    churn: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    print("| corral | spec | trace | matched | corral earlier | same | later | median s "
          "| most earlier s | most later s | unmatched SkyServe / corral "
          "| target changes corral / SkyServe |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, rows in groups.items():
        s = summarize(rows)
        lone = [u for u in unmatched if (u["corral"], u["spec"], u["trace"])[: len(key)] == key]
        lone_s = sum(u["only"] == "SkyServe" for u in lone)
        lone_c = len(lone) - lone_s
        mine = [c for k, c in churn.items() if k[: len(key)] == key]
        ours = sum(c["corral"] for c in mine)
        theirs = [sum(c["skyserve"][i] for c in mine) for i in range(len(mine[0]["skyserve"]))]
        spread = f"{min(theirs)}" if min(theirs) == max(theirs) else f"{min(theirs)}-{max(theirs)}"
        cells = [*key, *[""] * (3 - len(key))]
        if not s["matched"]:
            stats = "0 | | | | | | "
        else:
            stats = (
                f"{s['matched']} | {s['earlier']} | {s['same']} | {s['later']} "
                f"| {s['median_s']:+.1f} | {s['min_s']:+.1f} | {s['max_s']:+.1f}"
            )
        print(f"| {' | '.join(cells)} | {stats} | {lone_s} / {lone_c} | {ours} / {spread} |")


def print_levels(churn: dict[tuple[str, ...], dict[str, Any]]) -> None:
    """Per trace: did corral reach each level SkyServe moved to no later than it (at every
    phase run), and is each corral move one that a SkyServe at some phase makes?"""
    print(
        "\n| corral | spec | trace | SkyServe changes | corral at that level by then "
        "| later by > 0.5 s | most late s | corral changes some SkyServe phase makes |"
    )
    print("|---|---|---|---|---|---|---|---|")  # fmt: skip
    for (label, spec, trace), c in churn.items():
        lag = c["lags"]
        on_time = sum(x <= 1e-6 for x in lag)
        late = sum(x > SAME for x in lag)
        worst = f"{max(lag):.1f}" if lag else ""
        origins = c.get("origins")
        made = f"{sum(origins)} / {len(origins)}" if origins is not None else "not run"
        print(f"| {label} | {spec} | {trace} | {len(lag)} | {on_time} | {late} | {worst} "
              f"| {made} |")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=4, help="SkyServe tick offsets in 20 s")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--tolerance", type=float, default=120.0, help="max s between a match")
    parser.add_argument(
        "--skyserve-lb-sync",
        type=float,
        nargs="?",
        const=20.0,
        default=None,
        help="SkyServe's controller sees requests only at load-balancer syncs (every 20 s)",
    )
    parser.add_argument(
        "--no-origins",
        dest="origins",
        action="store_false",
        help="skip looking for a SkyServe phase that makes each corral move (the slow part)",
    )
    parser.add_argument("--corral-rev", help="also run corral.autoscale as of this git revision")
    parser.add_argument("--changes", action="store_true", help="print every matched change")
    parser.add_argument("--json", type=Path, default=RESULTS)
    return parser.parse_args()


def print_changes(rows: Sequence[Row]) -> None:
    print("| corral | spec | trace | phase | dir | SkyServe at | move | corral at | move "
          "| corral - SkyServe s |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(
            f"| {r.corral} | {r.spec} | {r.trace} | {r.phase:g} | {r.direction} "
            f"| {r.skyserve_at:.1f} | {r.skyserve_move} | {r.corral_at:.1f} "
            f"| {r.corral_move} | {r.diff:+.1f} |"
        )
    print()


def main() -> None:
    args = parse_args()
    sky = import_skyserve()
    rng = random.Random(args.seed)
    traces = {t.name: arrivals(t, rng) for t in TRACES}
    corrals = [("this tree", autoscale)]
    if args.corral_rev:
        corrals.append((f"at {args.corral_rev}", load_corral_at(args.corral_rev)))
    started = time.monotonic()
    rows: list[Row] = []
    unmatched: list[dict[str, Any]] = []
    churn: dict[tuple[str, ...], dict[str, Any]] = {}
    for label, module in corrals:
        more_rows, more_lone = compare(label, module, sky, traces, args, churn)
        rows += more_rows
        unmatched += more_lone

    sync = f"LB sync every {args.skyserve_lb_sync:g} s" if args.skyserve_lb_sync else "no LB lag"
    print(f"SkyPilot {sky[3]} RequestRateAutoscaler vs corral.autoscale; {args.phases} SkyServe "
          f"phases; seed {args.seed}; {sync}; {sum(map(len, traces.values()))} requests; "
          f"{time.monotonic() - started:.1f} s\n")  # fmt: skip
    if args.changes:
        print_changes(rows)
    groups: dict[tuple[str, ...], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.corral, r.spec, r.trace), []).append(r)
    for label, _ in corrals:
        groups[(label,)] = [r for r in rows if r.corral == label]
    print_summary(groups, unmatched, churn)
    print_levels(churn)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "skypilot": sky[3],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": {" / ".join(k): summarize(v) for k, v in groups.items()},
        "target_changes": {" / ".join(k): v for k, v in churn.items()},
        "matched": [asdict(r) for r in rows],
        "unmatched": unmatched,
    }
    args.json.write_text(json.dumps(results, indent=1))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
