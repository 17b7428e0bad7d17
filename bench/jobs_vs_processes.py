"""Benchmark: corral's JobPool (threads + capture router) against a process per job.

Why this exists: corral runs replica launch/teardown jobs on threads and gets per-job output
from :mod:`corral.capture` instead of from a process per job. That trade is only worth it if the
thread pool is much faster to start and much lighter, and if routing every write through one
router object costs little. This script measures all of it side by side, in ONE run, on the same
noisy machine, and reports ratios as well as absolute numbers, because absolute numbers on a
shared 2-core box drift from minute to minute while ratios taken seconds apart drift much less.

Part 1, jobs. The same job (``bench/_jobload.py``: ~200 lines through print and logging, one
``sh -c 'echo child-<id>'``, simulated I/O) runs on ``JobPool(max_workers=N)`` and as one
``multiprocessing.Process`` per job with start methods fork, forkserver and spawn, for N jobs
submitted at once. Reported: submit-to-start latency p50/p99, makespan, peak memory of the whole
process tree (RSS summed, and PSS, which counts pages shared after fork once), CPU seconds of the
parent plus every reaped descendant, and whether every log holds exactly its own job's lines.
Within a size the variants run back to back (fork first, while no other thread is alive); the
1-job size is repeated for several rounds, interleaved, and its latencies pooled. Memory is
sampled by a separate process (``_jobs_sampler.py``). spawn/forkserver sizes projected to exceed
the memory cap or the time budget are skipped and say so (``--heavy`` runs them anyway).

Part 2, the router. ns per ``write()`` of a line-buffered UTF-8 log file written directly vs
through ``sys.stdout`` while routed by ``capture.to``, for 1, 32 and 256 threads, each thread with
its own log (each direct writer owns its file, so the direct baseline needs no lock): a line with
its newline, a bare string, and ``print()`` for context. Many short repetitions, alternating
which mode goes first; best of each, plus the median of back-to-back pairs.

Heavy imports (psutil, rich, corral, the job module) are done inside functions on purpose:
spawn and forkserver children re-import this script as ``__mp_main__``, and anything imported at
the top would be paid (or, for forkserver, pre-imported) on their behalf, skewing the comparison.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import io
import itertools
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "results" / "jobs_vs_processes.json"
POOL = "jobpool"
SAFE_METHODS = ("forkserver", "spawn")  # usable from a daemon that already runs threads
MB = 1024 * 1024

# Targets from the issue.
LATENCY_TARGET = 50.0  # JobPool p50 submit-to-start at least this many times lower
MEMORY_TARGET = 10.0  # peak memory at MEMORY_SIZE jobs at least this many times lower
MEMORY_SIZE = 64
WRITE_OVERHEAD_TARGET_NS = 500.0  # router adds less than this per write, 1 thread
THROUGHPUT_TARGET = 0.70  # routed keeps at least this share of direct throughput, 32 threads
THROUGHPUT_THREADS = 32
MIN_TIMEOUT_S = 15.0  # a variant always gets at least this long, even past the budget

_START_RE = re.compile(r"^START (\d+\.\d+) job=(\d+)$")
_END_RE = re.compile(r"^END (\d+\.\d+) job=(\d+)$")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class Config:
    """Everything that shapes a run; written into the JSON so results can be compared."""

    quick: bool
    sizes: list[int]
    methods: list[str]
    rounds_1job: int
    lines: int
    io_ms: float
    timeout_s: float
    budget_s: float
    reserve_s: float
    heavy: bool
    mem_budget_gb: float
    sampler_interval_ms: float
    pss_interval_ms: float
    # threads -> (writes per thread, repetitions). Many SHORT repetitions: on a shared box the
    # best one is the one that ran in a quiet window, and short windows are more often quiet.
    write_plan: dict[int, tuple[int, int]]


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, Path]:
    p = argparse.ArgumentParser(description="JobPool vs a process per job; router cost per write.")
    p.add_argument("--quick", action="store_true", help="1 and 16 jobs, fork+spawn, fewer writes")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    p.add_argument("--io-ms", type=float, default=200.0, help="simulated I/O per job (ms)")
    p.add_argument("--lines", type=int, default=200, help="lines each job prints + logs")
    p.add_argument("--sizes", default=None, help="comma list of concurrent jobs")
    p.add_argument("--methods", default=None, help="comma list of start methods")
    p.add_argument("--timeout", type=float, default=None, help="per-variant timeout (s)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="wall-clock budget (s); a process variant projected to overrun it is skipped",
    )
    p.add_argument(
        "--heavy", action="store_true", help="run every variant even if projected too big"
    )
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=6.0,
        help="skip a spawn/forkserver size whose projected peak RSS exceeds this (shared box)",
    )
    p.add_argument("--sampler-interval-ms", type=float, default=10.0, help="RSS sampling period")
    p.add_argument(
        "--pss-interval-ms",
        type=float,
        default=100.0,
        help="minimum PSS sweep period (a sweep reads smaps_rollup of every process: ~0.4 ms each)",
    )
    a = p.parse_args(argv)
    quick = bool(a.quick)
    sizes = [1, 16] if quick else [1, 16, 64, 256]
    methods = ["fork", "spawn"] if quick else ["fork", "forkserver", "spawn"]
    if a.sizes:
        sizes = [int(x) for x in a.sizes.split(",")]
    if a.methods:
        methods = [x.strip() for x in a.methods.split(",") if x.strip()]
    for m in methods:
        if m not in multiprocessing.get_all_start_methods():
            p.error(f"start method {m!r} is not available here")
    cfg = Config(
        quick=quick,
        sizes=sizes,
        methods=methods,
        rounds_1job=3,
        lines=a.lines,
        io_ms=a.io_ms,
        timeout_s=a.timeout if a.timeout is not None else (30.0 if quick else 120.0),
        budget_s=a.budget if a.budget is not None else (55.0 if quick else 270.0),
        reserve_s=6.0 if quick else 30.0,
        heavy=bool(a.heavy),
        mem_budget_gb=a.mem_budget_gb,
        sampler_interval_ms=a.sampler_interval_ms,
        pss_interval_ms=a.pss_interval_ms,
        write_plan=(
            {1: (2_000, 15), 32: (200, 5), 256: (40, 3)}
            if quick
            else {1: (5_000, 41), 32: (500, 15), 256: (100, 7)}
        ),
    )
    return cfg, a.json


# --------------------------------------------------------------------------------------------
# Memory sampler (a separate process: see bench/_jobs_sampler.py for why)
# --------------------------------------------------------------------------------------------


class Sampler:
    """Client of the sampler process, which sums memory over this process's whole tree."""

    def __init__(self, interval_s: float, pss_interval_s: float) -> None:
        script = str(BENCH_DIR / "_jobs_sampler.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, str(os.getpid()), str(interval_s), str(pss_interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def _ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def start(self) -> None:
        reply = self._ask("start")
        if reply != "ok":
            raise RuntimeError(f"memory sampler did not start: {reply!r}")

    def stop(self) -> dict[str, float]:
        return dict(json.loads(self._ask("stop")))

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(5)
        except Exception:
            self.proc.kill()  # our own child, through its Popen handle
            self.proc.wait()


# --------------------------------------------------------------------------------------------
# Part 1: jobs
# --------------------------------------------------------------------------------------------


@dataclass
class JobRun:
    """One variant at one size (all its rounds merged). Seconds unless the name says ms/MB."""

    variant: str
    jobs: int
    rounds: int = 0
    skipped: str | None = None
    timed_out: bool = False
    unfinished: int = 0  # jobs stopped at the per-variant timeout (not judged by the log check)
    threads_alive_at_start: int = 0
    latency_p50_ms: float = math.nan
    latency_p99_ms: float = math.nan
    latency_max_ms: float = math.nan
    makespan_s: float = math.nan
    wall_s: float = math.nan
    cpu_s: float = math.nan
    cpu_parent_s: float = math.nan
    cpu_children_s: float = math.nan
    peak_rss_mb: float = math.nan
    peak_pss_mb: float = math.nan
    peak_uss_mb: float = math.nan
    baseline_rss_mb: float = math.nan
    peak_procs: int = 0
    memory_samples: int = 0
    pss_sweeps: int = 0
    vfork_skips: int = 0  # samples of a vfork()ed, not yet exec'd child, not counted (same mm)
    logs_ok: bool = False
    bad_logs: int = 0
    first_problem: str | None = None
    latencies_ms: list[float] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: with 16 values p99 is the max, which is what we want to see."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _cpu() -> tuple[float, float]:
    """(self, reaped descendants) user+sys seconds; getrusage has µs resolution, os.times ticks."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def check_logs(
    jobload: ModuleType, logdir: Path, n: int, lines: int, unfinished: set[int]
) -> tuple[dict[int, float], dict[int, float], list[str]]:
    """Parse every job's log: start/end timestamps, and problems if it is not exactly its own.

    A correct log is ``START``, then exactly ``expected_body(job_id)`` in order, then ``END``,
    and nothing else: a line of another job, a stray traceback or a missing line all count.
    Jobs stopped at the timeout (``unfinished``) are not judged: their logs are cut short.
    """
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    problems: list[str] = []
    for i in range(n):
        if i in unfinished:
            continue
        path = logdir / f"job-{i}.log"
        try:
            got = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            problems.append(f"job {i}: no log ({exc})")
            continue
        m_start = _START_RE.match(got[0]) if got else None
        m_end = _END_RE.match(got[-1]) if got else None
        if m_start and int(m_start.group(2)) == i:
            starts[i] = float(m_start.group(1))
        if m_end and int(m_end.group(2)) == i:
            ends[i] = float(m_end.group(1))
        expected = jobload.expected_body(i, lines)
        body = got[1:-1]
        if i not in starts or i not in ends or body != expected:
            diff = next(
                (k for k, (a, b) in enumerate(zip(body, expected, strict=False)) if a != b),
                min(len(body), len(expected)),
            )
            shown = body[diff] if diff < len(body) else "<missing>"
            problems.append(
                f"job {i}: {len(got)} lines (want {len(expected) + 2}), first bad body line "
                f"{diff}: {shown!r}"
            )
    return starts, ends, problems


@dataclass
class _Round:
    """Raw outcome of one round of one variant, before merging rounds."""

    submits: list[float]
    starts: dict[int, float]
    ends: dict[int, float]
    problems: list[str]
    wall_s: float
    cpu_parent_s: float
    cpu_children_s: float
    mem: dict[str, float]
    unfinished: set[int]
    threads_alive: int


def _round(
    jobload: ModuleType,
    logdir: Path,
    lines: int,
    submits: list[float],
    cpu0: tuple[float, float],
    cpu1: tuple[float, float],
    mem: dict[str, float],
    wall: float,
    unfinished: set[int],
    threads_alive: int,
    errors: Sequence[str] = (),
    uncounted_children_cpu: float = 0.0,
) -> _Round:
    starts, ends, problems = check_logs(jobload, logdir, len(submits), lines, unfinished)
    return _Round(
        submits=submits,
        starts=starts,
        ends=ends,
        problems=[*errors, *problems],
        wall_s=wall,
        cpu_parent_s=cpu1[0] - cpu0[0],
        cpu_children_s=cpu1[1] - cpu0[1] - uncounted_children_cpu,
        mem=mem,
        unfinished=unfinished,
        threads_alive=threads_alive,
    )


def run_pool(
    jobload: ModuleType, n: int, cfg: Config, sampler: Sampler, logdir: Path, timeout: float
) -> _Round:
    """N jobs on a warm ``JobPool(max_workers=N)``, all submitted at once."""
    from corral.jobs import JobPool

    threads_alive = threading.active_count()
    io_s = cfg.io_ms / 1000.0
    pool = JobPool(max_workers=n)
    # Warm, like the daemon's pool after its first launches (and like the forkserver, started
    # before the clock): n workers are started by n jobs that wait for each other, then idle.
    barrier = threading.Barrier(n)
    warm = [pool.submit(barrier.wait, 30.0, name=f"warm{i}") for i in range(n)]
    for job in warm:
        job.wait(60.0)
    submits: list[float] = []
    handles = []
    sampler.start()
    cpu0 = _cpu()
    t0 = time.monotonic()
    for i in range(n):
        path = logdir / f"job-{i}.log"
        submits.append(time.time())
        handles.append(pool.submit(jobload.pool_job, i, cfg.lines, io_s, log=path, name=f"j{i}"))
    deadline = t0 + timeout
    for job in handles:
        job.wait(max(0.0, deadline - time.monotonic()))
    unfinished = {i for i, job in enumerate(handles) if not job.done()}
    pool.shutdown(timeout=10.0)  # cancels what is left (and kills its commands)
    wall = time.monotonic() - t0
    cpu1 = _cpu()
    mem = sampler.stop()
    errors = [
        f"{j.name}: {j.exception(0)!r}"
        for i, j in enumerate(handles)
        if i not in unfinished and j.exception(0) is not None
    ]
    return _round(
        jobload,
        logdir,
        cfg.lines,
        submits,
        cpu0,
        cpu1,
        mem,
        wall,
        unfinished,
        threads_alive,
        errors,
    )


def run_processes(
    jobload: ModuleType,
    method: str,
    n: int,
    cfg: Config,
    sampler: Sampler,
    logdir: Path,
    timeout: float,
) -> _Round:
    """N ``multiprocessing.Process`` jobs with one start method, all started at once.

    forkserver: the server is started before the clock (warm, as in a long-lived daemon), then
    stopped after the run so the CPU of the children it reaped reaches our RUSAGE_CHILDREN; the
    server's own start-up CPU is subtracted again.
    """
    import psutil

    threads_alive = threading.active_count()
    # Any: typeshed types get_context(str) as BaseContext, which has no Process attribute.
    ctx: Any = multiprocessing.get_context(method)
    io_s = cfg.io_ms / 1000.0
    server_startup_cpu = 0.0
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
        server_pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        if server_pid is not None:
            times = psutil.Process(server_pid).cpu_times()
            server_startup_cpu = times.user + times.system
    submits: list[float] = []
    procs: list[Any] = []
    sampler.start()
    cpu0 = _cpu()
    t0 = time.monotonic()
    try:
        for i in range(n):
            proc = ctx.Process(
                target=jobload.process_entry,
                args=(i, str(logdir / f"job-{i}.log"), cfg.lines, io_s),
                name=f"j{i}",
                daemon=True,
            )
            submits.append(time.time())
            proc.start()
            procs.append(proc)
        deadline = t0 + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [proc for proc in procs if proc.is_alive()]
        for proc in alive:
            proc.kill()  # only processes this run started, each through its own handle
        for proc in alive:
            proc.join(10.0)
    unfinished = {i for i, proc in enumerate(procs) if proc in alive} | set(range(len(procs), n))
    wall = time.monotonic() - t0
    mem = sampler.stop()
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # type: ignore[attr-defined]
    cpu1 = _cpu()
    errors = [
        f"{p.name}: exit code {p.exitcode}"
        for i, p in enumerate(procs)
        if i not in unfinished and p.exitcode != 0
    ]
    return _round(
        jobload,
        logdir,
        cfg.lines,
        submits,
        cpu0,
        cpu1,
        mem,
        wall,
        unfinished,
        threads_alive,
        errors,
        server_startup_cpu,
    )


def merge(variant: str, n: int, rounds: list[_Round]) -> JobRun:
    """One row from several rounds: latencies pooled, times/CPU median, memory max."""
    lat: list[float] = []
    makespans: list[float] = []
    problems: list[str] = []
    for r in rounds:
        lat += [
            (r.starts[i] - r.submits[i]) * 1000.0 for i in range(len(r.submits)) if i in r.starts
        ]
        if r.ends:
            makespans.append(max(r.ends.values()) - r.submits[0])
        problems += r.problems
    mem = {k: max(r.mem[k] for r in rounds) for k in rounds[0].mem}
    unfinished = sum(len(r.unfinished) for r in rounds)
    complete = all(len(r.starts) + len(r.unfinished) == len(r.submits) == n for r in rounds)
    cpu_parent = statistics.median(r.cpu_parent_s for r in rounds)
    cpu_children = statistics.median(r.cpu_children_s for r in rounds)
    return JobRun(
        variant=variant,
        jobs=n,
        rounds=len(rounds),
        timed_out=unfinished > 0,
        unfinished=unfinished,
        threads_alive_at_start=max(r.threads_alive for r in rounds),
        latency_p50_ms=percentile(lat, 50),
        latency_p99_ms=percentile(lat, 99),
        latency_max_ms=max(lat) if lat else math.nan,
        makespan_s=statistics.median(makespans) if makespans else math.nan,
        wall_s=statistics.median(r.wall_s for r in rounds),
        cpu_s=cpu_parent + cpu_children,
        cpu_parent_s=cpu_parent,
        cpu_children_s=cpu_children,
        peak_rss_mb=mem["peak_rss"] / MB,
        peak_pss_mb=mem["peak_pss"] / MB,
        peak_uss_mb=mem["peak_uss"] / MB,
        baseline_rss_mb=min(r.mem["baseline_rss"] for r in rounds) / MB,
        peak_procs=int(mem["peak_procs"]),
        memory_samples=int(sum(r.mem["ticks"] for r in rounds)),
        pss_sweeps=int(sum(r.mem["pss_sweeps"] for r in rounds)),
        vfork_skips=int(sum(r.mem["vfork_skips"] for r in rounds)),
        logs_ok=not problems and complete,
        bad_logs=len(problems),
        first_problem=problems[0] if problems else None,
        latencies_ms=[round(x, 4) for x in lat],
    )


def _projected_skip(
    method: str, n: int, cfg: Config, done: dict[tuple[str, int], JobRun], elapsed: float
) -> str | None:
    """Why a big process variant is skipped, or None to run it.

    A spawned child importing the dependency set costs ~0.6 s of CPU and ~50 MB; at 256 jobs on
    2 shared cores that is minutes and ~13 GB, enough to hurt the other work on the machine.
    The projection scales the largest size already measured for this method linearly: memory
    above the baseline, and wall time (so it includes whatever else the machine is doing now).
    The time left keeps a reserve for the router benchmark that runs last.
    """
    if cfg.heavy:
        return None
    measured = [(k, r) for (m, k), r in done.items() if m == method and k < n and not r.skipped]
    if not measured:
        return None
    k, ref = max(measured, key=lambda kr: kr[0])
    scale = n / k
    proj_mem_gb = (ref.baseline_rss_mb + (ref.peak_rss_mb - ref.baseline_rss_mb) * scale) / 1024
    proj_s = ref.wall_s * scale
    import psutil

    avail_gb = psutil.virtual_memory().available / 1024**3
    mem_cap = min(cfg.mem_budget_gb, 0.4 * avail_gb)
    left = min(cfg.budget_s - cfg.reserve_s - elapsed, cfg.timeout_s)
    reasons = []
    if method in SAFE_METHODS and proj_mem_gb > mem_cap:
        reasons.append(f"projected peak RSS {proj_mem_gb:.1f} GB > cap {mem_cap:.1f} GB")
    if proj_s > left:
        reasons.append(f"projected {proj_s:.0f} s > {max(left, 0):.0f} s left in the budget")
    if reasons:
        return f"skipped: {'; '.join(reasons)} (scaled x{scale:g} from {k} jobs; --heavy forces)"
    return None


def bench_jobs(cfg: Config, jobload: ModuleType, t_begin: float) -> list[JobRun]:
    """All variants, size by size; within a size fork runs first, while no thread is alive."""
    sampler = Sampler(cfg.sampler_interval_ms / 1000.0, cfg.pss_interval_ms / 1000.0)
    results: dict[tuple[str, int], JobRun] = {}
    if any(m in SAFE_METHODS for m in cfg.methods):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # warm, as in a daemon: not charged to the first run
    try:
        for n in cfg.sizes:
            variants = [*cfg.methods, POOL]
            rounds: dict[str, list[_Round]] = {v: [] for v in variants}
            for round_no in range(cfg.rounds_1job if n == 1 else 1):
                for variant in variants:
                    elapsed = time.monotonic() - t_begin
                    if round_no == 0 and variant != POOL:
                        skip = _projected_skip(variant, n, cfg, results, elapsed)
                        if skip:
                            results[(variant, n)] = JobRun(variant, n, skipped=skip)
                            _progress(f"{variant:>10} x{n:<4} {skip}")
                    if (variant, n) in results:
                        continue
                    # Bounded by the budget too, so one slow variant cannot blow the whole run.
                    left = cfg.budget_s - cfg.reserve_s - elapsed
                    timeout = max(MIN_TIMEOUT_S, min(cfg.timeout_s, left))
                    rounds[variant].append(_one_round(variant, n, cfg, jobload, sampler, timeout))
            for variant in variants:
                if not rounds[variant]:
                    continue
                r = results[(variant, n)] = merge(variant, n, rounds[variant])
                if variant == "fork" and r.threads_alive_at_start > 1:
                    _progress(f"warning: fork ran with {r.threads_alive_at_start} threads alive")
                _progress(
                    f"{variant:>10} x{n:<4} p50 {r.latency_p50_ms:9.2f} ms  makespan "
                    f"{r.makespan_s:6.2f} s  rss {r.peak_rss_mb:7.0f} MB  pss {r.peak_pss_mb:6.0f} "
                    f"MB  cpu {r.cpu_s:6.2f} s  logs {'ok' if r.logs_ok else 'BAD'}"
                    f"{f'  TIMEOUT ({r.unfinished} stopped)' if r.timed_out else ''}"
                    f"  [{time.monotonic() - t_begin:.0f} s]"
                )
    finally:
        sampler.close()
    return list(results.values())


def _one_round(
    variant: str, n: int, cfg: Config, jobload: ModuleType, sampler: Sampler, timeout: float
) -> _Round:
    logdir = Path(tempfile.mkdtemp(prefix=f"corral-bench-{variant}-{n}-"))
    try:
        if variant == POOL:
            return run_pool(jobload, n, cfg, sampler, logdir, timeout)
        return run_processes(jobload, variant, n, cfg, sampler, logdir, timeout)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
        gc.collect()
        time.sleep(0.2)  # let exited children's memory go before the next variant's samples


# --------------------------------------------------------------------------------------------
# Part 2: router cost per write
# --------------------------------------------------------------------------------------------

# "line" and "bare" are the targets' two cases; "print" (one bare write for the text plus one
# "\n" write, through print()) is what job code actually does, shown for context.
WRITE_KINDS = {"line": "routed or not 42\n", "bare": "short", "print": "routed or not 42"}
TARGET_KINDS = ("line", "bare")


@dataclass
class WriteResult:
    """Direct vs routed writes for one thread count and one kind of write.

    ``*_ns``: wall time per write, aggregate over all threads (so 1/throughput), best of the
    repetitions. ``paired_ratio``: median over repetitions of direct/routed wall time, each pair
    run back to back, so a slow minute on the shared machine hits both sides of a pair.
    ``*_cpu_ns``: the same in thread CPU time (best of), for reference: on this VM it is not
    immune to other tenants either (the CPU itself runs slower while they are busy).
    """

    threads: int
    kind: str
    writes_per_thread: int
    repetitions: int
    direct_ns: float
    routed_ns: float
    paired_ratio: float
    direct_cpu_ns: float
    routed_cpu_ns: float
    reps: dict[str, list[list[float]]]

    @property
    def overhead_ns(self) -> float:
        return self.routed_ns - self.direct_ns

    @property
    def overhead_cpu_ns(self) -> float:
        return self.routed_cpu_ns - self.direct_cpu_ns

    @property
    def throughput_ratio(self) -> float:
        """Aggregate throughput routed / direct (best of each)."""
        return self.direct_ns / self.routed_ns


def _open_log(path: Path) -> IO[str]:
    """The same kind of file capture.to opens: append, UTF-8, backslashreplace, line-buffered."""
    return open(path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)


def _write_loop(
    stream: IO[str], kind: str, text: str, n: int, gate: Callable[[], object]
) -> tuple[float, float]:
    """``n`` writes (or prints) of ``text`` to ``stream``: (perf_counter at the end, CPU secs).

    ``gate`` runs just before the loop (a barrier for multi-thread runs). The write method is
    bound once, so both modes pay the same loop and call overhead and differ only in the target.
    """
    loop = itertools.repeat(None, n)
    if kind == "print":
        gate()
        cpu0 = time.thread_time()
        for _ in loop:
            print(text, file=stream)
        return time.perf_counter(), time.thread_time() - cpu0
    write = stream.write
    gate()
    cpu0 = time.thread_time()
    for _ in loop:
        write(text)
    return time.perf_counter(), time.thread_time() - cpu0


def _timed_writes(
    mode: str, kind: str, path: Path, text: str, n: int, gate: Callable[[], object]
) -> tuple[float, float]:
    """Directly to a file this thread owns, or to ``sys.stdout`` routed to the same kind of file."""
    from corral import capture

    if mode == "direct":
        with _open_log(path) as f:
            return _write_loop(f, kind, text, n, gate)
    with capture.to(path):
        return _write_loop(sys.stdout, kind, text, n, gate)  # the router: to() installed it


def _one_rep(mode: str, kind: str, threads: int, per_thread: int, d: Path) -> tuple[float, float]:
    """(wall, CPU) seconds for ``threads`` threads to each write ``per_thread`` times to its log.

    The wall clock starts when the last thread reaches the barrier (in the barrier's action, run
    before anyone is released), not when the main thread gets the GIL back: by then fast
    writers may already be done.
    """
    for p in d.glob("*.log"):
        p.unlink()
    text = WRITE_KINDS[kind]
    marks: list[float] = []

    def mark() -> None:
        marks.append(time.perf_counter())

    if threads == 1:
        end, cpu = _timed_writes(mode, kind, d / "w0.log", text, per_thread, mark)
        return end - marks[0], cpu
    barrier = threading.Barrier(threads, action=mark)
    ends = [(0.0, 0.0)] * threads

    def worker(k: int) -> None:
        ends[k] = _timed_writes(mode, kind, d / f"w{k}.log", text, per_thread, barrier.wait)

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return max(e for e, _ in ends) - marks[0], sum(c for _, c in ends)


def bench_router(cfg: Config) -> list[WriteResult]:
    """Best-of-R direct vs routed writes, alternating which goes first to cancel drift."""
    out: list[WriteResult] = []
    d = Path(tempfile.mkdtemp(prefix="corral-bench-writes-"))
    try:
        for threads, (per_thread, reps) in cfg.write_plan.items():
            for kind in WRITE_KINDS:
                total = threads * per_thread
                wall: dict[str, list[float]] = {"direct": [], "routed": []}
                cpu: dict[str, list[float]] = {"direct": [], "routed": []}
                for rep in range(reps):
                    order = ("direct", "routed") if rep % 2 == 0 else ("routed", "direct")
                    for mode in order:
                        w_s, c_s = _one_rep(mode, kind, threads, per_thread, d)
                        wall[mode].append(w_s / total * 1e9)
                        cpu[mode].append(c_s / total * 1e9)
                pairs = [d_ / r_ for d_, r_ in zip(wall["direct"], wall["routed"], strict=True)]
                r = WriteResult(
                    threads=threads,
                    kind=kind,
                    writes_per_thread=per_thread,
                    repetitions=reps,
                    direct_ns=min(wall["direct"]),
                    routed_ns=min(wall["routed"]),
                    paired_ratio=statistics.median(pairs),
                    direct_cpu_ns=min(cpu["direct"]),
                    routed_cpu_ns=min(cpu["routed"]),
                    reps={
                        mode: [[round(x, 1) for x in wall[mode]], [round(x, 1) for x in cpu[mode]]]
                        for mode in wall
                    },
                )
                out.append(r)
                _progress(
                    f"writes {threads:>3} thr {kind:<5} {r.direct_ns:6.0f} -> {r.routed_ns:6.0f} ns"
                    f" ({r.overhead_ns:+5.0f})  throughput {r.throughput_ratio:4.0%} (paired "
                    f"{r.paired_ratio:4.0%})  cpu {r.direct_cpu_ns:6.0f} -> {r.routed_cpu_ns:6.0f}"
                )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------
# Checks and report
# --------------------------------------------------------------------------------------------


@dataclass
class Check:
    """One target of the issue, evaluated on this run."""

    name: str
    passed: bool | None  # None: not evaluated (variant skipped or not run)
    detail: str
    informational: bool = False

    @property
    def verdict(self) -> str:
        if self.informational:
            return "info"
        return "N/A" if self.passed is None else ("PASS" if self.passed else "MISS")


def _latency_check(n: int, pool: JobRun, procs: list[JobRun], name: str, info: bool) -> Check:
    best = min(procs, key=lambda r: r.latency_p50_ms)
    best99 = min(procs, key=lambda r: r.latency_p99_ms)
    ratio = best.latency_p50_ms / pool.latency_p50_ms
    return Check(
        name,
        ratio >= LATENCY_TARGET,
        f"{best.variant} {best.latency_p50_ms:.2f} ms / JobPool {pool.latency_p50_ms:.2f} ms = "
        f"{ratio:.1f}x (target >= {LATENCY_TARGET:g}x); p99 "
        f"{best99.latency_p99_ms / pool.latency_p99_ms:.1f}x ({best99.variant})",
        informational=info,
    )


def _memory_check(pool: JobRun, procs: list[JobRun], metric: str, name: str, info: bool) -> Check:
    best = min(procs, key=lambda r: float(getattr(r, metric)))
    ratio = float(getattr(best, metric)) / float(getattr(pool, metric))
    return Check(
        name,
        ratio >= MEMORY_TARGET,
        f"{best.variant} {getattr(best, metric):.0f} MB / JobPool {getattr(pool, metric):.0f} MB"
        f" = {ratio:.1f}x (target >= {MEMORY_TARGET:g}x)",
        informational=info,
    )


def evaluate(runs: list[JobRun], writes: list[WriteResult]) -> list[Check]:
    """The issue's targets, PASS/MISS, each against the best process variant measured."""
    checks: list[Check] = []
    by = {(r.variant, r.jobs): r for r in runs}
    for n in sorted({r.jobs for r in runs}):
        pool = by.get((POOL, n))
        procs = [r for r in runs if r.jobs == n and r.variant != POOL and not r.skipped]
        if pool is None or not procs:
            continue
        checks.append(_latency_check(n, pool, procs, f"start latency p50 @ {n} jobs", False))
        safe = [r for r in procs if r.variant in SAFE_METHODS]
        if safe and len(safe) < len(procs):
            name = f"  same, vs thread-safe methods only (forkserver/spawn) @ {n} jobs"
            checks.append(_latency_check(n, pool, safe, name, True))
    pool = by.get((POOL, MEMORY_SIZE))
    procs = [r for r in runs if r.jobs == MEMORY_SIZE and r.variant != POOL and not r.skipped]
    safe = [r for r in procs if r.variant in SAFE_METHODS]
    for metric, label in (("peak_rss_mb", "RSS summed"), ("peak_pss_mb", "PSS summed")):
        name = f"peak memory @ {MEMORY_SIZE} jobs, {label}"
        if pool is None or not procs:
            checks.append(Check(name, None, "not run"))
            continue
        checks.append(_memory_check(pool, procs, metric, name, False))
        if safe and len(safe) < len(procs):
            name = f"  same, vs thread-safe methods only (forkserver/spawn), {label}"
            checks.append(_memory_check(pool, safe, metric, name, True))
    for w in writes:
        detail = (
            f"{w.direct_ns:.0f} -> {w.routed_ns:.0f} ns ({w.overhead_ns:+.0f} ns), throughput "
            f"{w.throughput_ratio:.0%} (paired median {w.paired_ratio:.0%}); CPU "
            f"{w.overhead_cpu_ns:+.0f} ns"
        )
        if w.kind not in TARGET_KINDS:
            if w.threads in (1, THROUGHPUT_THREADS):
                name = f"print(), {w.threads} thread{'s' if w.threads > 1 else ''}"
                checks.append(Check(name, None, detail, informational=True))
            continue
        if w.threads == 1:
            checks.append(
                Check(
                    f"router overhead per write, 1 thread, {w.kind}",
                    w.overhead_ns < WRITE_OVERHEAD_TARGET_NS,
                    f"target < {WRITE_OVERHEAD_TARGET_NS:.0f} ns | {detail}",
                )
            )
        if w.threads == THROUGHPUT_THREADS:
            checks.append(
                Check(
                    f"routed throughput, {w.threads} threads, {w.kind}",
                    w.throughput_ratio >= THROUGHPUT_TARGET,
                    f"target >= {THROUGHPUT_TARGET:.0%} | {detail}",
                )
            )
    ran = [r for r in runs if not r.skipped]
    bad = [f"{r.variant}@{r.jobs}: {r.first_problem}" for r in ran if not r.logs_ok]
    judged = sum(r.rounds * r.jobs - r.unfinished for r in ran)
    cut = [f"{r.variant}@{r.jobs} ({r.unfinished} jobs)" for r in ran if r.timed_out]
    detail = f"all {judged} finished jobs' logs" if not bad else "; ".join(bad)
    if cut:
        detail += "; not judged, stopped at the timeout: " + ", ".join(cut)
    checks.append(Check("every log holds exactly its own job's lines", not bad, detail))
    return checks


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.1f}x"


def render(runs: list[JobRun], writes: list[WriteResult], checks: list[Check]) -> str:
    """Tables in rich's MARKDOWN box, so the same text reads in a terminal and in the docs."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=220, record=True, color_system=None)
    by = {(r.variant, r.jobs): r for r in runs}
    t = Table(box=box.MARKDOWN)
    heads = [
        "jobs",
        "variant",
        "start p50 ms",
        "start p99 ms",
        "makespan s",
        "peak RSS MB",
        "peak PSS MB",
        "CPU s",
        "logs",
        "p50 vs pool",
        "p99 vs pool",
        "RSS vs pool",
        "PSS vs pool",
        "CPU vs pool",
    ]
    for col in heads:
        t.add_column(col, justify="left" if col in ("variant", "logs") else "right")
    for r in runs:
        if r.skipped:
            t.add_row(str(r.jobs), r.variant, "skipped", *[""] * (len(heads) - 3))
            continue
        pool = by.get((POOL, r.jobs))
        rel = [""] * 5
        if pool is not None and r.variant != POOL:
            rel = [
                _ratio(r.latency_p50_ms, pool.latency_p50_ms),
                _ratio(r.latency_p99_ms, pool.latency_p99_ms),
                _ratio(r.peak_rss_mb, pool.peak_rss_mb),
                _ratio(r.peak_pss_mb, pool.peak_pss_mb),
                _ratio(r.cpu_s, pool.cpu_s),
            ]
        t.add_row(
            str(r.jobs),
            r.variant,
            _fmt(r.latency_p50_ms, ".2f"),
            _fmt(r.latency_p99_ms, ".2f"),
            _fmt(r.makespan_s, ".2f"),
            _fmt(r.peak_rss_mb, ".0f"),
            _fmt(r.peak_pss_mb, ".0f"),
            _fmt(r.cpu_s, ".3f"),
            ("ok" if r.logs_ok else "BAD")
            + (f", {r.unfinished} cut by timeout" if r.timed_out else ""),
            *rel,
        )
    w = Table(box=box.MARKDOWN)
    for col in (
        "threads",
        "write",
        "writes/thread x reps",
        "direct ns",
        "routed ns",
        "routed - direct ns",
        "throughput routed/direct",
        "same, paired median",
        "routed - direct CPU ns",
    ):
        w.add_column(col, justify="left" if col == "write" else "right")
    for x in writes:
        w.add_row(
            str(x.threads),
            {"line": "line + newline", "bare": "bare, no newline"}.get(x.kind, "print()"),
            f"{x.writes_per_thread} x {x.repetitions}",
            f"{x.direct_ns:.0f}",
            f"{x.routed_ns:.0f}",
            f"{x.overhead_ns:+.0f}",
            f"{x.throughput_ratio:.0%}",
            f"{x.paired_ratio:.0%}",
            f"{x.overhead_cpu_ns:+.0f}",
        )
    console.print("JobPool vs a process per job")
    console.print(t)
    for r in runs:
        if r.skipped:
            console.print(f"  {r.variant} x{r.jobs} {r.skipped}", soft_wrap=True)
    console.print()
    console.print(
        "Router cost per write: wall ns per write (print: per call) over all threads, best of "
        "the repetitions; paired median = median of back-to-back direct/routed pairs"
    )
    console.print(w)
    console.print()
    console.print("Targets")
    for c in checks:
        console.print(f"  {c.verdict:<4}  {c.name}: {c.detail}", soft_wrap=True, markup=False)
    return console.export_text()


def machine_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "mem_total_gb": round(vm.total / 1024**3, 1),
        "mem_available_gb": round(vm.available / 1024**3, 1),
        "corral": _git_state(),
    }


def _git_state() -> str:
    """Which corral was measured: HEAD, plus the files of src/ that differ from it."""
    root = BENCH_DIR.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True, text=True
        ).stdout.split("\n")
    except OSError:
        return "unknown"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def _progress(msg: str) -> None:
    """Progress to the real stderr, never through the router (which the JobPool installs)."""
    stream = sys.__stderr__
    if stream is not None:
        stream.write(msg + "\n")
        stream.flush()


def _clean(o: object) -> object:
    """JSON has no NaN: a metric that could not be measured (skipped variant) becomes null."""
    if isinstance(o, float):
        return None if math.isnan(o) else round(o, 6)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def main(argv: Sequence[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    t_begin = time.monotonic()
    machine = machine_info()
    _progress(
        f"corral bench: sizes {cfg.sizes}, methods {cfg.methods}, io {cfg.io_ms:g} ms, "
        f"{cfg.lines} lines/job, nproc {machine['nproc']}, load {machine['loadavg']}"
    )
    # The daemon imports its dependency set once; fork children inherit it from here.
    jobload = importlib.import_module("_jobload")
    # As a daemon does at start: logging configured before any job (and before capture's
    # install, which then re-points this handler at the router).
    jobload.configure_logging(sys.stderr)
    runs = bench_jobs(cfg, jobload, t_begin)
    writes = bench_router(cfg)
    checks = evaluate(runs, writes)
    elapsed = time.monotonic() - t_begin
    text = render(runs, writes, checks) + f"\ntotal run time {elapsed:.1f} s\n"
    out = sys.__stdout__
    if out is not None:
        out.write(text)
        out.flush()
    args = list(sys.argv[1:] if argv is None else argv)
    payload = {
        "command": " ".join([".venv/bin/python", "bench/jobs_vs_processes.py", *args]),
        "machine": machine,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": elapsed,
        "config": asdict(cfg),
        "jobs": [asdict(r) for r in runs],
        "writes": [
            {
                **asdict(w),
                "overhead_ns": w.overhead_ns,
                "overhead_cpu_ns": w.overhead_cpu_ns,
                "throughput_ratio": w.throughput_ratio,
            }
            for w in writes
        ],
        "checks": [
            {"name": c.name.strip(), "verdict": c.verdict, "detail": c.detail} for c in checks
        ],
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_clean(payload), indent=2, allow_nan=False) + "\n")
    _progress(f"results written to {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
