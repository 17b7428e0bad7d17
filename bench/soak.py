"""Soak: a daemon under continuous load and churn for a long time; do its memory and fds stay flat?

Why this exists: one daemon hosts every service for as long as the machine runs, so anything it
keeps per request, per replica or per service change (an event, a task, a session, a pooled
connection, a log handle, a metrics child, a Process object) is a leak that only shows after
hours. The chaos tests prove nothing is *lost* under churn; this proves nothing *accumulates*.

What it does, with the real daemon, CLI-equivalent API calls and examples/app.py replicas:

* three services (``s1`` 3 replicas, ``s2`` 2, ``s3`` 2) with steady GET load through their
  balancers (``--rate`` req/s each, paced, keep-alive; bench/_ctrl_traffic.RequestStream);
* churn every ``--churn-every`` seconds, drawn from a seeded generator: SIGKILL of a random READY
  replica's process group, a rolling update that relaunches a service (a new ``APP_VERSION``), a
  scale up or down (a ``service:``-only change), and ``up``/``down`` of a whole fourth service
  (``s4``, created and removed over and over, so per-service state must be freed too);
* every ``--sample-every`` seconds: the daemon's RSS and USS, open fds, threads, the replica
  processes under it (its descendants) and the live replicas its API shows.

At the end churn stops, the services settle, and the replica processes are counted against the
live replicas the API shows (a surplus is a leaked process). Flatness is judged after a warm-up:
the median of the first ``--window`` minutes is compared with the median of the last ones, and the
least-squares slope over everything after warm-up is reported per hour. Verdict thresholds are
stated in :data:`LIMITS`. The table goes to stdout, the samples and the verdict to JSON
(bench/results/soak.json by default).

Run: ``.venv/bin/python bench/soak.py`` (30 min), ``--minutes 2`` for a trial.
All traffic is to 127.0.0.1; everything started is stopped by pid in ``finally`` (the harness).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _ctrl_harness import READY, CorralHome, corral_home, progress, ready_count, spec_yaml
from _ctrl_traffic import RequestStream
from controller import machine_info

from corral.client import ClientError, ensure_daemon

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "results" / "soak.json"
MB = 1024 * 1024

PROBE_PERIOD = 0.5  # s: a realistic, not a stress, probe period
SERVICES = {"s1": 3, "s2": 2, "s3": 2}  # under load all the time; sizes they start with
UPDOWN = "s4"  # created and removed over and over
LIVE = {"PENDING", "PROVISIONING", "STARTING", "NOT_READY", READY}
ACTIONS = ("kill", "kill", "rolling", "scale", "updown")  # kills twice as often as the rest

# A run is flat when, between the first and the last window after warm-up, the medians grew by
# at most this much. RSS gets a relative and an absolute allowance: CPython's allocator keeps
# arenas, so RSS creeps a little before it plateaus; a leak keeps going and shows in the slope.
LIMITS = {"rss_mb": 8.0, "rss_pct": 10.0, "fds": 5, "threads": 4}
# Judged and shown; fds_adjusted is fds minus the live replicas' share (see judge()).
METRICS = ("rss_mb", "uss_mb", "fds", "fds_adjusted", "threads", "replica_procs")


@dataclass
class Sample:
    t_s: float  # since the start of churn and load
    rss_mb: float
    uss_mb: float | None
    fds: int
    threads: int
    replica_procs: int  # the daemon's descendant processes (replicas and what they fork)
    live_replicas: int  # replicas the API shows PENDING..READY, every service
    requests: int  # sent so far by the load streams
    failed: int  # of those, not answered 200 (the load runs through kills, so some may fail)
    actions: int  # churn actions so far
    loadavg1: float


@dataclass
class Churn:
    log: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def note(self, t: float, action: str, detail: str) -> None:
        self.counts[action] = self.counts.get(action, 0) + 1
        self.log.append({"t_s": round(t, 1), "action": action, "detail": detail})


def soak_spec(name: str, replicas: int, version: int) -> str:
    """The harness's benchmark service plus an ``APP_VERSION`` env: bumping it changes the
    launch, so an update relaunches every replica (a rolling update), while changing only
    ``replicas`` is a ``service:``-only change (a scale)."""
    return spec_yaml(name, replicas, PROBE_PERIOD) + f'envs:\n  APP_VERSION: "{version}"\n'


# -- churn ----------------------------------------------------------------------------------------


class Churner:
    """Applies one seeded random action at a time; never waits on the result (the daemon must
    cope with actions piling onto unfinished ones, which is what churn is)."""

    def __init__(self, h: CorralHome, seed: int) -> None:
        self.h = h
        self.random = random.Random(seed)
        self.version = dict.fromkeys(SERVICES, 1)
        self.size = dict(SERVICES)
        self.updown_up = False
        self.churn = Churn()

    def step(self, t: float) -> None:
        action = self.random.choice(ACTIONS)
        name = self.random.choice(sorted(SERVICES))
        try:
            detail = getattr(self, f"_{action}")(name)
        except (ClientError, OSError, RuntimeError) as exc:
            self.churn.errors.append(f"t={t:.0f}s {action} {name}: {exc}")
            detail = f"error: {exc}"
        self.churn.note(t, action, detail)

    def _kill(self, name: str) -> str:
        service = self.h.service(name)
        ready = [r for r in (service or {}).get("replicas", []) if r["status"] == READY]
        if len(ready) < 2:
            return f"{name}: skipped, {len(ready)} READY"
        victim = self.random.choice(sorted(ready, key=lambda r: r["id"]))
        pid = int(victim["pid"])
        created = self.h.replicas.get(pid)
        try:
            same = created is not None and abs(psutil.Process(pid).create_time() - created) <= 0.01
        except psutil.Error:
            same = False
        if not same:
            return f"{name}: skipped, pid {pid} not verified"
        try:
            os.killpg(pid, signal.SIGKILL)  # the local backend makes each replica a group leader
        except ProcessLookupError:
            return f"{name}: replica {victim['id']} already gone"
        return f"{name}: SIGKILL replica {victim['id']} (pid {pid})"

    def _rolling(self, name: str) -> str:
        self.version[name] += 1
        spec = soak_spec(name, self.size[name], self.version[name])
        self.h.client.update(name, spec, mode="rolling", base_dir=str(self.h.root))
        return f"{name}: rolling update to APP_VERSION {self.version[name]}"

    def _scale(self, name: str) -> str:
        choices = [n for n in (1, 2, 3) if n != self.size[name]]
        self.size[name] = self.random.choice(choices)
        spec = soak_spec(name, self.size[name], self.version[name])
        self.h.client.update(name, spec, mode="rolling", base_dir=str(self.h.root))
        return f"{name}: scale to {self.size[name]}"

    def _updown(self, _name: str) -> str:
        if self.updown_up:
            self.h.client.down(UPDOWN, purge=True)
            self.updown_up = False
            return f"{UPDOWN}: down --purge"
        spec = soak_spec(UPDOWN, 2, 1)
        self.h.client.create(spec, name=None, source=None, base_dir=str(self.h.root))
        self.updown_up = True
        return f"{UPDOWN}: up (2 replicas)"


# -- sampling -------------------------------------------------------------------------------------


def sample(
    h: CorralHome, daemon: psutil.Process, t: float, streams: list[RequestStream], actions: int
) -> Sample:
    with daemon.oneshot():
        rss = daemon.memory_info().rss / MB
        fds = daemon.num_fds()
        threads = daemon.num_threads()
        children = daemon.children(recursive=True)
    uss: float | None
    try:
        uss = daemon.memory_full_info().uss / MB
    except (psutil.AccessDenied, AttributeError):
        uss = None
    procs = sum(1 for child in children if _running(child))
    live = sum(1 for s in h.services() for r in s["replicas"] if r["status"] in LIVE)
    replies = [r for s in streams for r in list(s.replies)]
    return Sample(
        t_s=round(t, 1),
        rss_mb=round(rss, 2),
        uss_mb=None if uss is None else round(uss, 2),
        fds=fds,
        threads=threads,
        replica_procs=procs,
        live_replicas=live,
        requests=len(replies),
        failed=sum(1 for r in replies if r.status != 200),
        actions=actions,
        loadavg1=round(os.getloadavg()[0], 2),
    )


# -- verdict --------------------------------------------------------------------------------------


def judge(samples: list[Sample], warmup_s: float, window_s: float) -> dict[str, Any]:
    """Compare the first and last window after warm-up; fit a slope over everything after it."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 4:
        return {"flat": None, "why": f"too few samples after warm-up ({len(after)})"}
    end = after[-1].t_s
    first = [s for s in after if s.t_s < warmup_s + window_s]
    last = [s for s in after if s.t_s > end - window_s]
    out: dict[str, Any] = {
        "warmup_s": warmup_s,
        "window_s": window_s,
        "samples_first": len(first),
        "samples_last": len(last),
    }
    reasons: list[str] = []
    # Open fds follow the live replicas (each holds its log and a pidfd or pipe in the daemon),
    # and churn makes that number swing: judge the fds *beyond* that share, so a window that
    # happened to sample more live replicas is not read as a leak.
    per_replica = 0.0
    if len({s.live_replicas for s in after}) > 1:
        fit = statistics.linear_regression(
            [float(s.live_replicas) for s in after], [float(s.fds) for s in after]
        )
        per_replica = max(0.0, fit.slope)
    out["fds_per_live_replica"] = round(per_replica, 2)

    def value(s: Sample, metric: str) -> float | None:
        if metric == "fds_adjusted":
            return s.fds - per_replica * s.live_replicas
        v = getattr(s, metric)
        return None if v is None else float(v)

    for metric in METRICS:
        a = [v for s in first if (v := value(s, metric)) is not None]
        b = [v for s in last if (v := value(s, metric)) is not None]
        xs = [s.t_s for s in after if value(s, metric) is not None]
        ys = [v for s in after if (v := value(s, metric)) is not None]
        if not a or not b or len(xs) < 2:
            continue
        first_med, last_med = statistics.median(a), statistics.median(b)
        slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
        out[metric] = {
            "first_median": round(first_med, 2),
            "last_median": round(last_med, 2),
            "delta": round(last_med - first_med, 2),
            "slope_per_hour": round(slope * 3600.0, 2),
            "min": round(min(ys), 2),
            "max": round(max(ys), 2),
        }
    rss = out.get("rss_mb")
    if rss is not None:
        allowed = max(LIMITS["rss_mb"], rss["first_median"] * LIMITS["rss_pct"] / 100.0)
        if rss["delta"] > allowed:
            reasons.append(f"RSS median grew {rss['delta']:.1f} MB (> {allowed:.1f} MB allowed)")
    for metric, limit in (("fds_adjusted", "fds"), ("threads", "threads")):
        m = out.get(metric)
        if m is not None and m["delta"] > LIMITS[limit]:
            reasons.append(f"{metric} median grew by {m['delta']:g} (> {LIMITS[metric]})")
    out["flat"] = not reasons
    out["why"] = "; ".join(reasons) if reasons else "within limits"
    return out


def settle(h: CorralHome, churner: Churner, timeout: float = 180.0) -> dict[str, Any]:
    """After churn: wait for every service to have its final size READY and nothing else live,
    then count the daemon's replica processes against the live replicas it shows."""
    want = {name: churner.size[name] for name in SERVICES}
    if churner.updown_up:
        want[UPDOWN] = 2

    def settled(services: list[dict[str, Any]]) -> bool:
        by_name = {s["name"]: s for s in services}
        for name, n in want.items():
            s = by_name.get(name)
            if s is None or ready_count(s) != n:
                return False
            if any(r["status"] in LIVE - {READY} for r in s["replicas"]):
                return False
        return set(by_name) == set(want)

    try:
        waited = h.wait_until(settled, timeout=timeout, interval=0.5)
    except TimeoutError as exc:
        return {"settled": False, "error": str(exc)}
    pid = h.daemon_pid()
    assert pid is not None
    # teardowns of the last replaced replicas may still be finishing: give them a bounded moment
    deadline = time.monotonic() + 30.0
    while True:
        procs = [p for p in psutil.Process(pid).children(recursive=True) if _running(p)]
        live = sum(want.values())
        if len(procs) <= live or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return {
        "settled": True,
        "waited_s": round(waited, 1),
        "live_replicas": live,
        "replica_procs": len(procs),
        "leaked_procs": max(0, len(procs) - live),
    }


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- output ---------------------------------------------------------------------------------------


def render(samples: list[Sample], verdict: dict[str, Any], end: dict[str, Any]) -> str:
    """A row per minute (every sample when there are few) and the verdict, as markdown tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(
        file=io.StringIO(), width=200, record=True, force_terminal=False, color_system=None
    )
    t = Table(box=box.MARKDOWN, show_edge=True)
    cols = (
        "t (min)",
        "RSS MB",
        "USS MB",
        "fds",
        "threads",
        "replica procs",
        "live replicas",
        "requests",
        "failed",
        "churn actions",
        "load1",
    )
    for col in cols:
        t.add_column(col, justify="right")
    step = max(1, round(60.0 / _interval(samples))) if len(samples) > 40 else 1
    shown = samples[::step]
    if samples and shown[-1] is not samples[-1]:
        shown.append(samples[-1])
    for s in shown:
        t.add_row(
            f"{s.t_s / 60:.1f}",
            f"{s.rss_mb:.1f}",
            "-" if s.uss_mb is None else f"{s.uss_mb:.1f}",
            str(s.fds),
            str(s.threads),
            str(s.replica_procs),
            str(s.live_replicas),
            str(s.requests),
            str(s.failed),
            str(s.actions),
            f"{s.loadavg1:.2f}",
        )
    console.print(t)
    v = Table(box=box.MARKDOWN, show_edge=True)
    for col in ("metric", "first window median", "last window median", "delta", "slope / hour"):
        v.add_column(col, justify="right")
    for metric in METRICS:
        m = verdict.get(metric)
        if m:
            v.add_row(
                metric,
                f"{m['first_median']:g}",
                f"{m['last_median']:g}",
                f"{m['delta']:+g}",
                f"{m['slope_per_hour']:+g}",
            )
    console.print(v)
    flat = verdict.get("flat")
    console.print(
        f"verdict: {'FLAT' if flat else 'NOT FLAT' if flat is False else 'UNDECIDED'} "
        f"({verdict.get('why')}); after churn: {end}"
    )
    return console.export_text()


def _interval(samples: list[Sample]) -> float:
    if len(samples) < 2:
        return 10.0
    return max(1e-3, (samples[-1].t_s - samples[0].t_s) / (len(samples) - 1))


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=30.0, help="length of load + churn")
    p.add_argument("--rate", type=float, default=20.0, help="req/s per loaded service")
    p.add_argument("--churn-every", type=float, default=10.0, help="s between churn actions")
    p.add_argument("--sample-every", type=float, default=10.0, help="s between samples")
    p.add_argument(
        "--warmup", type=float, default=None, help="minutes ignored by the verdict (default 10)"
    )
    p.add_argument(
        "--window", type=float, default=None, help="minutes of each compared window (default 5)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    p.add_argument(
        "--judge",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: judge the samples of an earlier run again (rewrites its verdict)",
    )
    args = p.parse_args(argv)
    if args.judge is not None:  # the windows come from the saved run unless given here
        args.minutes = json.loads(args.judge.read_text())["args"]["minutes"]
    default_windows(args)
    return args


def default_windows(args: argparse.Namespace) -> None:
    """Short trial runs scale the windows down so the verdict still has something to compare."""
    if args.warmup is None:
        # 10 min: the balancer keeps that long of request timestamps (TIMESTAMP_HORIZON), so
        # the daemon's memory only reaches its steady state after it
        args.warmup = min(10.0, args.minutes / 3)
    if args.window is None:
        args.window = min(5.0, (args.minutes - args.warmup) / 3)


def rejudge(path: Path, warmup: float, window: float) -> int:
    """Judge a saved run again (after the verdict's rules changed) without running it again;
    ``warmup`` and ``window`` in minutes."""
    data = json.loads(path.read_text())
    samples = [Sample(**s) for s in data["samples"]]
    data["args"].update(warmup=warmup, window=window)
    verdict = judge(samples, warmup * 60.0, window * 60.0)
    sys.stdout.write(render(samples, verdict, data.get("after_churn", {})))
    data["verdict"] = verdict
    path.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if verdict.get("flat") and not data.get("problems") else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.judge is not None:
        return rejudge(args.judge, args.warmup, args.window)
    duration = args.minutes * 60.0
    machine = machine_info()
    progress(f"corral soak: {vars(args)}, nproc {machine['nproc']}, load {machine['loadavg']}")
    problems: list[str] = []
    samples: list[Sample] = []
    end: dict[str, Any] = {}
    churner: Churner | None = None
    streams: list[RequestStream] = []
    t_begin = time.monotonic()
    with corral_home("soak", problems) as h:
        ensure_daemon(h.home)
        pid = h.daemon_pid()
        if pid is None:
            raise RuntimeError("daemon started but daemon.json has no pid")
        daemon = psutil.Process(pid)
        for name, n in SERVICES.items():
            h.client.create(soak_spec(name, n, 1), name=None, source=None, base_dir=str(h.root))
        h.wait_until(
            lambda services: (
                all(ready_count(s) >= SERVICES[s["name"]] for s in services)
                and len(services) == len(SERVICES)
            ),
            timeout=120.0,
        )
        progress(f"services READY after {time.monotonic() - t_begin:.1f} s; load + churn start")
        for name in SERVICES:
            endpoint = h.client.service(name)["endpoint"]
            streams.append(
                RequestStream(endpoint, rate=args.rate, max_seconds=duration, connections=2)
            )
        churner = Churner(h, args.seed)
        t0 = time.monotonic()
        for s in streams:
            s.start()
        try:
            next_churn = t0 + args.churn_every
            next_sample = t0
            while time.monotonic() - t0 < duration:
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(sample(h, daemon, now - t0, streams, len(churner.churn.log)))
                    s = samples[-1]
                    progress(
                        f"  t={s.t_s / 60:5.1f} min rss {s.rss_mb:.1f} MB fds {s.fds} "
                        f"threads {s.threads} procs {s.replica_procs}/{s.live_replicas} "
                        f"req {s.requests} failed {s.failed} actions {s.actions}"
                    )
                    next_sample += args.sample_every
                if now >= next_churn:
                    churner.step(now - t0)
                    next_churn += args.churn_every
                time.sleep(max(0.0, min(next_sample, next_churn) - time.monotonic()))
            samples.append(
                sample(h, daemon, time.monotonic() - t0, streams, len(churner.churn.log))
            )
        finally:
            for s in streams:
                s.stop()
        progress("churn over; waiting for the services to settle")
        end = settle(h, churner)
        if not end.get("settled"):
            problems.append(f"services did not settle after churn: {end.get('error')}")
        elif end["leaked_procs"]:
            problems.append(f"{end['leaked_procs']} replica process(es) more than live replicas")
    verdict = judge(samples, args.warmup * 60.0, args.window * 60.0)
    text = render(samples, verdict, end)
    sys.stdout.write(text + f"\ntotal run time {time.monotonic() - t_begin:.1f} s\n")
    for line in problems:
        sys.stdout.write(f"problem: {line}\n")
    sys.stdout.flush()
    replies = [r for s in streams for r in s.replies]
    payload = {
        "command": " ".join([".venv/bin/python", "bench/soak.py", *(argv or sys.argv[1:])]),
        "machine": machine,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "settings": {
            "probe_period_s": PROBE_PERIOD,
            "services": SERVICES,
            "updown_service": UPDOWN,
            "limits": LIMITS,
        },
        "elapsed_s": round(time.monotonic() - t_begin, 1),
        "verdict": verdict,
        "after_churn": end,
        "load": {
            "requests": len(replies),
            "failed": sum(1 for r in replies if r.status != 200),
            "errors": sorted({r.error or "" for r in replies if r.status != 200})[:20],
        },
        "churn": {
            "counts": churner.churn.counts if churner else {},
            "errors": churner.churn.errors if churner else [],
            "log": churner.churn.log if churner else [],
        },
        "samples": [asdict(s) for s in samples],
        "problems": problems,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    progress(f"results written to {args.json}")
    return 0 if verdict.get("flat") and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
