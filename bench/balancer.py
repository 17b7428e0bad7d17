"""Benchmark: corral's load balancer side by side with nginx and HAProxy, on the same 4 replicas.

Why this exists: corral's balancer carries its services' production traffic, LLM token streams
included, so it is held to the proxies people would otherwise put in front of their replicas.
Issue 11 set the bar, on this kind of machine (2 vCPU VM, loopback), against nginx with one
worker: CPU per request at most 1.25x nginx's, throughput at least 0.7x nginx's, and at most
0.2 ms added to the median request at one connection over going to a replica directly. This script
measures all of that in one run, so every figure shares the machine's state, and also checks
that streaming adds no delay.

What runs (everything on 127.0.0.1, every load bounded in time):

1. 4 replicas: bench/_lb_replica.py, a raw-asyncio HTTP/1.1 server, one process each (fast
   enough that the proxy is the bottleneck).
2. Targets, all round robin over the 4 replicas (``--policy least_load``: least connections,
   counted across each proxy's workers) with upstream keep-alive (bench/_lb_peers.py):
   ``direct`` (no proxy: wrk at replica 1), ``nginx`` (Debian's package, 1 worker),
   ``haproxy`` (Debian's package, one process, ``nbthread 1``, ``http-reuse always``) and
   ``corral`` (bench/_lb_proxy.py: corral's balancer alone in a process). Then N workers each
   (N = ``--workers``, default 2): ``nginx xN`` (``worker_processes N``), ``haproxy xN``
   (``nbthread N``) and ``corral xN`` (N ``_lb_proxy.py --reuse-port`` processes on one port,
   SO_REUSEPORT; skipped with a message when _lb_proxy.py does not take ``--reuse-port``).
   ``--variant NAME=ARGS`` adds more corral rows (``_lb_proxy.py ARGS``) to the one-worker
   phases, to compare an option of the proxy in the same run; ``--compare NAME=SRC`` adds one
   running the engine from another source tree (a worktree of an earlier commit), to compare
   commits side by side (and ``NAME xN`` to the N-worker phase).
3. Rounds: each round runs three phases, every target of a phase back to back in an order that
   rotates by round, each run after a short warm-up: ``wrk -t1 -c64`` against the one-worker
   targets, ``wrk -t1 -c1`` against them, and ``wrk -t1 -c64`` against the N-worker targets. Every
   request carries its own ``X-Request-Id`` (``--requests paths``: and its own path; ``--requests
   posts``: a POST of a small JSON body; ``--requests same``: wrk's identical GETs), so a proxy
   that remembers the last request's parse gains nothing real clients would not give it. Reported
   per run: req/s, p50, p99 (wrk's), non-2xx + socket errors, and the proxy's CPU per request:
   user+system CPU of its processes (psutil; nginx = master + workers, HAProxy = its threads,
   corral xN = every process) over the run / requests, also split into user and system time (a
   proxy's own work against the kernel's). Ratios (to nginx with as many workers; p50 added = p50
   minus direct's) are computed within a round, between runs seconds apart, and the median over
   rounds is what is checked against the targets: on a shared 2-core box the absolute figures drift
   by tens of percent over minutes, the ratios much less.
4. Streaming: each replica's ``/sse`` sends 200 events 5 ms apart (the first with the headers).
   A raw-socket client measures time to first event and to the end of the stream, direct vs
   through corral, nginx (``proxy_buffering off``) and HAProxy, interleaved, and checks all 200
   events arrive; the first event may come at most 5 ms later than direct.

5. Streamed answers (``--stream-chunks``, default 50; 0 turns it off): after the streaming test,
   ``wrk -c64`` against ``/sse?events=50&interval=0.001`` on the one-worker targets, the CPU
   per stream against nginx's. ``--pure`` adds ``corral pure`` rows (``CORRAL_BALANCER_PURE=1``:
   the compiled fast path off) to every phase, in the same rounds. ``--only-streamed`` runs this
   phase alone (no phases 1-4): the stream relay's cost in a minute or two.

``--floor`` adds ``floor`` rows (``floor xN`` in the N-worker phase): bench/_lb_floor.py, a relay
that forwards bytes as read and finds each answer's end with httptools, nothing else. It is what
any Python proxy on uvloop pays per request before doing a balancer's work; corral's distance to
it is corral's own work, and its distance to nginx is the event loop's.

``--syscalls`` then counts each proxy's syscalls and context switches per request at 64
connections (``perf stat`` on the kernel's syscall tracepoints; needs perf and root): whether a
proxy's extra CPU is its own work or more trips into the kernel. With ``--only-streamed`` it
counts them per stream, on the streamed answers.

wrk, nginx and HAProxy are installed with ``apt-get install -y`` when missing (their service is
not started); rows that need a tool that cannot be installed are skipped with a message.

Run: ``.venv/bin/python bench/balancer.py`` (3 rounds, ~5 min here) or ``--quick`` (1 round of
2 s runs, under a minute). Results: tables on stdout and bench/results/balancer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _lb_peers import (
    Peer,
    ensure_tools,
    free_port,
    http_ok,
    start_haproxy,
    start_nginx,
    stop_pid,
    tool_version,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "balancer.json"
PROXY = HERE / "_lb_proxy.py"
FLOOR = HERE / "_lb_floor.py"
ENGINE_READY_FLAG = Path("/tmp/corral-engine-ready")
HOST = "127.0.0.1"
N_REPLICAS = 4
SSE_EVENTS = 200
SSE_INTERVAL = 0.005
# "Equal to direct within a small margin": a proxy's median time to the first event may exceed
# direct's by at most this. 5 ms is a tenth of a typical LLM inter-token gap (~50 ms) and of
# SkyServe's balancer's own p50 (45 ms at 16 connections).
STREAM_TTFB_MARGIN_MS = 5.0
# Issue 11's targets for corral against nginx with as many workers.
CPU_RATIO_MAX = 1.25  # CPU per request at 64 connections
RPS_RATIO_MIN = 0.7  # req/s at 64 connections
P50_ADDED_MAX_MS = 0.2  # p50 at 1 connection minus direct's


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- corral processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    port: int
    output: list[str] = field(default_factory=list)  # drained by a thread: a full pipe blocks

    @property
    def pid(self) -> int:
        return self.popen.pid


def start_python(
    name: str,
    args: list[str],
    timeout: float = 20.0,
    src: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Proc:
    """Start one of the bench helpers and wait for its ``PORT n`` line; ``src``: import corral
    from that source tree instead of this checkout's; ``extra_env``: more variables (``--pure``:
    CORRAL_BALANCER_PURE=1)."""
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    if extra_env:
        env = {**(env or os.environ), **extra_env}
    popen = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if line.startswith("PORT "):
            proc = Proc(name, popen, int(line.split()[1]))
            threading.Thread(target=proc.output.extend, args=(popen.stdout,), daemon=True).start()
            return proc
        seen.append(line)
        if not line and popen.poll() is not None:
            break
    stop_pid(popen.pid, popen)
    tail = "".join(seen).strip().splitlines()[-3:]
    raise RuntimeError(f"{name} did not start: {' | '.join(tail)}")


def proxy_options(proxy: Path) -> str:
    """bench/_lb_proxy.py's --help text: which options this version of it takes."""
    proc = subprocess.run(
        [sys.executable, str(proxy), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    return proc.stdout + proc.stderr


def start_corral(
    proxy: Path,
    name: str,
    replica_urls: list[str],
    workers: int,
    extra: list[str],
    procs: list[Proc],
    src: Path | None = None,
    extra_env: dict[str, str] | None = None,
    board: Path | None = None,
) -> list[Proc]:
    """``workers`` _lb_proxy.py processes on one port (SO_REUSEPORT when more than one),
    sharing their counts on ``board`` as a service's workers do (where the policy reads them)."""
    args = [str(proxy), *(a for url in replica_urls for a in ("--replica", url)), *extra]

    def shared(slot: int) -> list[str]:
        if board is None:
            return []
        return ["--board", str(board), "--slot", str(slot), "--workers", str(workers)]

    if workers == 1:
        started = [start_python(name, args, src=src, extra_env=extra_env)]
    else:
        port = free_port()
        started = []
        for i in range(workers):
            started.append(
                start_python(
                    f"{name}#{i + 1}",
                    [*args, "--port", str(port), "--reuse-port", *shared(i)],
                    src=src,
                    extra_env=extra_env,
                )
            )
            procs.append(started[-1])
        if {p.port for p in started} != {port}:
            raise RuntimeError(f"{name}: workers listen on {[p.port for p in started]}, not {port}")
        return started
    procs.extend(started)
    return started


def loaded_engine(pid: int) -> list[str]:
    """Which event loop / HTTP parser libraries a running proxy process has loaded."""
    marks = {
        "uvloop": "uvloop/loop.",
        "httptools": "httptools/parser",
        "aiohttp-parser": "aiohttp/_http_parser",
        "compiled-fast-path": "corral/balancer/_speedups",
    }
    try:
        paths = {m.path for m in psutil.Process(pid).memory_maps()}
    except psutil.Error:
        return []
    return sorted(name for name, mark in marks.items() if any(mark in p for p in paths))


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            stop_pid(p.pid, p.popen)


# ---------------------------------------------------------------------------- CPU, wrk


def family(pids: list[int]) -> list[psutil.Process]:
    """These processes and their children (nginx's workers); gone ones are left out."""
    out: list[psutil.Process] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return out


def cpu_by_process(pids: list[int]) -> dict[int, tuple[float, float]]:
    """User and system CPU seconds of these processes and their children."""
    out: dict[int, tuple[float, float]] = {}
    for p in family(pids):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = (t.user, t.system)
    return out


@dataclass
class Target:
    name: str
    port: int
    pids: list[int]  # CPU is charged to these and their children; [] = not measured
    workers: int = 1


@dataclass
class Run:
    phase: str
    round: int
    target: str
    connections: int
    duration_s: int
    requests: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0
    cpu_s: float | None = None
    cpu_us_per_req: float | None = None
    # The same split into user space and the kernel: where a difference between proxies is.
    user_us_per_req: float | None = None
    sys_us_per_req: float | None = None
    cpu_split_s: list[float] = field(default_factory=list)  # per process that used CPU
    note: str = ""


_UNIT = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if m is None:
        raise ValueError(f"unparsable latency {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_wrk(out: str, run: Run) -> None:
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m:
        run.requests = int(m.group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        run.rps = float(m.group(1))
    for pct, attr in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", out, re.M)
        if m:
            setattr(run, attr, _ms(m.group(1)))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        run.errors += sum(int(g) for g in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        run.errors += int(m.group(1))


# Every request carries its own X-Request-Id (1, 2, 3, ... per wrk thread), as traced traffic
# does: no two consecutive requests on a connection are the same bytes, so a proxy cannot answer
# the benchmark from a cache of the previous request's parse; they share the request line and
# Host, as a client calling one endpoint does. ``--requests paths`` varies the path too (no line
# of a request repeats the last one's but Host); ``--requests same`` sends wrk's plain identical
# GET. The scripts cost wrk ~4 us of CPU per request, far from its limit here.
VARIED_REQUESTS_LUA = """\
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, {["X-Request-Id"] = tostring(n)})
end
"""
PATHS_REQUESTS_LUA = """\
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, "/item/" .. n, {["X-Request-Id"] = tostring(n)})
end
"""
# ``--requests posts``: an inference API's traffic, a small JSON body on every request.
POSTS_REQUESTS_LUA = """\
local n = 0
request = function()
  n = n + 1
  local body = '{"prompt": "hello", "max_tokens": 16, "n": ' .. n .. '}'
  return wrk.format("POST", "/v1/completions",
    {["Content-Type"] = "application/json", ["X-Request-Id"] = tostring(n)}, body)
end
"""
REQUEST_SCRIPTS = {
    "varied": VARIED_REQUESTS_LUA,
    "paths": PATHS_REQUESTS_LUA,
    "posts": POSTS_REQUESTS_LUA,
}


def wrk_cmd(wrk: list[str], port: int, conns: int, duration: int, path: str = "/") -> list[str]:
    return [
        *wrk,
        "-t1",
        f"-c{conns}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "5s",
        f"http://{HOST}:{port}{path}",
    ]


def run_wrk(
    wrk: list[str], target: Target, conns: int, duration: int, phase: str, rnd: int, path: str = "/"
) -> Run:
    run = Run(phase, rnd, target.name, conns, duration)
    before = cpu_by_process(target.pids)
    proc = subprocess.run(
        wrk_cmd(wrk, target.port, conns, duration, path),
        capture_output=True,
        text=True,
        timeout=duration + 30,
    )
    if target.pids:
        after = cpu_by_process(target.pids)
        zero = (0.0, 0.0)
        user = {pid: u - before.get(pid, zero)[0] for pid, (u, _) in after.items()}
        system = {pid: k - before.get(pid, zero)[1] for pid, (_, k) in after.items()}
        used = {pid: user[pid] + system[pid] for pid in after}
        run.cpu_s = round(sum(used.values()), 3)
        run.cpu_split_s = sorted((round(v, 2) for v in used.values() if v >= 0.02), reverse=True)
    if proc.returncode != 0:
        run.note = f"wrk exit {proc.returncode}: {proc.stderr.strip()[:200]}"
    parse_wrk(proc.stdout, run)
    if run.cpu_s is not None and run.requests:
        run.cpu_us_per_req = round(run.cpu_s / run.requests * 1e6, 2)
        run.user_us_per_req = round(sum(user.values()) / run.requests * 1e6, 2)
        run.sys_us_per_req = round(sum(system.values()) / run.requests * 1e6, 2)
    return run


# Syscalls a proxy makes on the way of a request (``--syscalls``): reads, writes, waits.
SYSCALL_GROUPS = {
    "reads": ("read", "recvfrom", "recvmsg", "readv"),
    "writes": ("write", "writev", "sendto", "sendmsg"),
    "waits": ("epoll_wait", "epoll_pwait", "epoll_pwait2"),
    # libuv (uvloop) submits its changes to the epoll set through io_uring where it can
    "epoll changes": ("epoll_ctl", "io_uring_enter"),
}


def count_syscalls(
    wrk: list[str], target: Target, seconds: int = 2, path: str = "/"
) -> dict[str, Any]:
    """Syscalls and context switches per request (to ``path``) of the target's processes at 64
    connections, counted by ``perf stat`` on the kernel's syscall tracepoints while wrk runs.
    Tells whether a proxy's extra CPU is its own work or more trips into the kernel."""
    perf = shutil.which("perf")
    if perf is None:
        return {"error": "perf is not installed"}
    pids = sorted({p.pid for p in family(target.pids)})
    names = [n for group in SYSCALL_GROUPS.values() for n in group]
    events = [f"syscalls:sys_enter_{n}" for n in names] + ["context-switches"]
    load = subprocess.Popen(
        wrk_cmd(wrk, target.port, 64, seconds + 2, path), stdout=subprocess.PIPE, text=True
    )
    time.sleep(1)
    watch = ["-p", ",".join(map(str, pids)), "--", "sleep", str(seconds)]
    stat = subprocess.run(
        [perf, "stat", "-x,", "-e", ",".join(events), *watch],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    )
    out, _ = load.communicate(timeout=seconds + 30)
    run = Run("syscalls", 0, target.name, 64, seconds + 2)
    parse_wrk(out, run)
    counts: dict[str, int] = {}
    for line in stat.stderr.splitlines():
        cells = line.split(",")
        if len(cells) > 2 and cells[0].isdigit():
            counts[cells[2].removeprefix("syscalls:sys_enter_")] = int(cells[0])
    if not run.rps or not counts:
        return {"error": f"perf counted nothing: {stat.stderr.strip()[-200:]}"}
    requests = run.rps * seconds  # wrk's rate over the counted window
    row = {g: sum(counts.get(n, 0) for n in ns) / requests for g, ns in SYSCALL_GROUPS.items()}
    row["context_switches"] = counts.get("context-switches", 0) / requests
    return {k: round(v, 3) for k, v in row.items()}


def syscall_table(rows: dict[str, Any]) -> str:
    cols = ["target", "reads", "writes", "waits", "epoll changes", "context switches"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} |")
            continue
        cells = [row["reads"], row["writes"], row["waits"], row["epoll changes"]]
        cells.append(row["context_switches"])
        lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


@dataclass
class Phase:
    name: str
    title: str
    connections: int
    duration: int
    targets: list[Target]
    reference: str  # ratios are to this target's run of the same round
    path: str = "/"  # wrk's URL path (the streamed phase: the replicas' /sse)
    wrk: list[str] | None = None  # wrk and its script for this phase, if not the run's


def rotated(items: list[Target], k: int) -> list[Target]:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def run_rounds(
    wrk: list[str], phases: list[Phase], rounds: int, warmup: int, loads: list[list[float]]
) -> list[Run]:
    runs: list[Run] = []
    for rnd in range(rounds):
        loads.append([round(x, 2) for x in os.getloadavg()])
        log(f"round {rnd + 1}/{rounds} (load average {loads[-1]})")
        for phase in phases:
            cmd = phase.wrk or wrk
            for target in rotated(phase.targets, rnd):
                if warmup:
                    run_wrk(cmd, target, phase.connections, warmup, phase.name, rnd, phase.path)
                r = run_wrk(
                    cmd, target, phase.connections, phase.duration, phase.name, rnd, phase.path
                )
                runs.append(r)
                log(
                    f"  {phase.name:6s} {target.name:12s} {r.rps:8.0f} req/s  "
                    f"p50 {fmt(r.p50_ms, '.3f')} ms  p99 {fmt(r.p99_ms, '.2f')} ms  "
                    f"CPU {fmt(r.cpu_us_per_req, '.1f')} us/req {r.cpu_split_s or ''}  "
                    f"errors {r.errors} {r.note}"
                )
    return runs


# ---------------------------------------------------------------------------- summaries


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median, min and max of per-round values (None when there are none)."""
    if not values:
        return {"median": None, "min": None, "max": None, "rounds": []}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "rounds": [round(v, digits) for v in values],
    }


def summarize(phase: Phase, runs: list[Run], direct: str | None) -> dict[str, Any]:
    """Per target: medians over rounds, and ratios to the reference taken within each round."""
    mine = [r for r in runs if r.phase == phase.name]
    by_round: dict[int, dict[str, Run]] = {}
    for r in mine:
        by_round.setdefault(r.round, {})[r.target] = r
    out: dict[str, Any] = {}
    for target in phase.targets:
        rs = [r for r in mine if r.target == target.name]
        good = [r for r in rs if r.rps]
        row: dict[str, Any] = {
            "runs": len(rs),
            "errors": sum(r.errors for r in rs),
            "rps": spread([r.rps for r in good], 0),
            "p50_ms": spread([r.p50_ms for r in good if r.p50_ms is not None]),
            "p99_ms": spread([r.p99_ms for r in good if r.p99_ms is not None]),
            "cpu_us_per_req": spread(
                [r.cpu_us_per_req for r in good if r.cpu_us_per_req is not None], 2
            ),
            "user_us_per_req": spread(
                [r.user_us_per_req for r in good if r.user_us_per_req is not None], 2
            ),
            "sys_us_per_req": spread(
                [r.sys_us_per_req for r in good if r.sys_us_per_req is not None], 2
            ),
        }
        rps_ratio: list[float] = []
        cpu_ratio: list[float] = []
        p50_added: list[float] = []
        for cells in by_round.values():
            me, ref = cells.get(target.name), cells.get(phase.reference)
            if me is None or not me.rps:
                continue
            if ref is not None and ref.rps and target.name != phase.reference:
                rps_ratio.append(me.rps / ref.rps)
                if me.cpu_us_per_req and ref.cpu_us_per_req:
                    cpu_ratio.append(me.cpu_us_per_req / ref.cpu_us_per_req)
            base = cells.get(direct) if direct and target.name != direct else None
            if base is not None and me.p50_ms is not None and base.p50_ms is not None:
                p50_added.append(me.p50_ms - base.p50_ms)
        row["rps_vs_ref"] = spread(rps_ratio)
        row["cpu_vs_ref"] = spread(cpu_ratio)
        if direct:
            row["p50_added_ms"] = spread(p50_added)
        out[target.name] = row
    return out


def ratio_text(s: dict[str, Any], unit: str = "x") -> str:
    if s["median"] is None:
        return ""
    if s["min"] == s["max"]:
        return f"{s['median']:.2f}{unit}"
    return f"{s['median']:.2f}{unit} ({s['min']:.2f}-{s['max']:.2f})"


def phase_table(ref: str, summary: dict[str, Any], direct: bool) -> str:
    cols = ["target", "req/s", "p50 ms", "p99 ms", "errors", "CPU us/req", "user / sys"]
    if direct:
        cols.append("p50 added vs direct ms")
    cols += [f"req/s vs {ref}", f"CPU/req vs {ref}"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for name, s in summary.items():
        cells = [
            name,
            fmt(s["rps"]["median"], ".0f") if s["rps"]["median"] else "failed",
            fmt(s["p50_ms"]["median"], ".3f"),
            fmt(s["p99_ms"]["median"], ".2f"),
            str(s["errors"]),
            fmt(s["cpu_us_per_req"]["median"], ".1f"),
            (
                f"{fmt(s['user_us_per_req']['median'], '.1f')} / "
                f"{fmt(s['sys_us_per_req']['median'], '.1f')}"
                if s["user_us_per_req"]["median"] is not None
                else ""
            ),
        ]
        if direct:
            cells.append(ratio_text(s["p50_added_ms"], "") if name != "direct" else "")
        cells += [ratio_text(s["rps_vs_ref"]), ratio_text(s["cpu_vs_ref"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(
    what: str, s: dict[str, Any] | None, limit: float, upper: bool, unit: str
) -> dict[str, Any]:
    """One of issue 11's targets, judged on the median over rounds (and counted per round)."""
    if s is None or s["median"] is None:
        return {"check": what, "median": None, "limit": limit, "met": None, "rounds_met": ""}
    ok = [v <= limit if upper else v >= limit for v in s["rounds"]]
    return {
        "check": what,
        "median": s["median"],
        "min": s["min"],
        "max": s["max"],
        "limit": f"{'<=' if upper else '>='} {limit:g}{unit}",
        "met": s["median"] <= limit if upper else s["median"] >= limit,
        "rounds_met": f"{sum(ok)}/{len(ok)}",
        "unit": unit,
    }


def targets_table(checks: list[dict[str, Any]]) -> str:
    lines = [
        "| check | median of rounds | range | target | result | rounds within target |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        if c["median"] is None:
            lines.append(f"| {c['check']} | - | - | | not measured (see SKIPPED) | |")
            continue
        unit = c["unit"]
        span = "-" if c["min"] is None else f"{c['min']:.2f}-{c['max']:.2f}{unit}"
        lines.append(
            f"| {c['check']} | {c['median']:.2f}{unit} | {span} "
            f"| {c['limit']} | {'met' if c['met'] else 'MISSED'} | {c['rounds_met']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- streaming


@dataclass
class StreamRun:
    target: str
    ttfb_ms: float
    total_ms: float
    events: int


async def one_stream(port: int) -> StreamRun:
    """GET /sse on a fresh connection; time to the first event and to the stream's end."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"GET /sse HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n")
        await writer.drain()
        data = b""
        ttfb = None
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            data += chunk
            if ttfb is None and b"data: 0\n" in data:
                ttfb = time.perf_counter() - start
            if data.endswith(b"0\r\n\r\n"):
                break
        total = time.perf_counter() - start
    finally:
        writer.close()
    events = len(re.findall(rb"data: \d+\n\n", data))
    return StreamRun("", (ttfb or total) * 1000, total * 1000, events)


def run_streams(targets: dict[str, int], rounds: int) -> dict[str, Any]:
    runs: dict[str, list[StreamRun]] = {name: [] for name in targets}

    async def go() -> None:
        for port in targets.values():  # warm-up, not recorded
            await one_stream(port)
        for _ in range(rounds):
            for name, port in targets.items():  # interleaved: drift hits every target alike
                run = await one_stream(port)
                run.target = name
                runs[name].append(run)

    asyncio.run(go())
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            "runs": len(rs),
            "ttfb_ms_median": round(statistics.median(r.ttfb_ms for r in rs), 3),
            "ttfb_ms_max": round(max(r.ttfb_ms for r in rs), 3),
            "total_ms_median": round(statistics.median(r.total_ms for r in rs), 1),
            "events_min": min(r.events for r in rs),
        }
    base = summary.get("direct")
    if base:
        for s in summary.values():
            s["ttfb_vs_direct_ms"] = round(s["ttfb_ms_median"] - base["ttfb_ms_median"], 3)
            s["total_vs_direct_ms"] = round(s["total_ms_median"] - base["total_ms_median"], 1)
            s["ttfb_within_margin"] = (
                s["ttfb_vs_direct_ms"] <= STREAM_TTFB_MARGIN_MS and s["events_min"] == SSE_EVENTS
            )
    return summary


def stream_table(summary: dict[str, Any]) -> str:
    lines = [
        "| target | runs | TTFB median ms | TTFB max ms | TTFB vs direct ms "
        f"| total median ms | total vs direct ms | events | within {STREAM_TTFB_MARGIN_MS:g} ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['runs']} | {s['ttfb_ms_median']:.2f} | {s['ttfb_ms_max']:.2f} "
            f"| {s.get('ttfb_vs_direct_ms', 0):+.2f} | {s['total_ms_median']:.0f} "
            f"| {s.get('total_vs_direct_ms', 0):+.0f} | {s['events_min']}/{SSE_EVENTS} "
            f"| {'ok' if s.get('ttfb_within_margin') else 'MISS'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report


@dataclass
class Report:
    started: str
    machine: dict[str, Any]
    config: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    streaming: dict[str, Any] = field(default_factory=dict)
    syscalls: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def machine() -> dict[str, Any]:
    mem = psutil.virtual_memory().total
    return {
        "nproc": os.cpu_count(),
        "memory_gb": round(mem / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_mark() -> tuple[Any, os.times_result, float]:
    return psutil.cpu_times(), os.times(), time.monotonic()


def other_work(mark: tuple[Any, os.times_result, float]) -> dict[str, float]:
    """How busy the machine was with work other than this benchmark, since ``mark``.

    In cores, averaged over the interval. Everyone's user+system time minus this script's and
    its reaped children's (the replicas, proxies and wrk, all stopped by now) is the rest of the
    box's work; the kernel counts part of the loopback traffic's softirq time into the processes
    it interrupted and the rest apart, so "other" is a range: [that, that + softirq], clipped at
    0. Steal is time the hypervisor gave this VM's vCPUs to someone else.
    """
    sys0, own0, t0 = mark
    sys1, own1 = psutil.cpu_times(), os.times()
    wall = max(1e-9, time.monotonic() - t0)

    def own(t: os.times_result) -> float:
        return t.user + t.system + t.children_user + t.children_system

    everyone = (sys1.user + sys1.nice + sys1.system) - (sys0.user + sys0.nice + sys0.system)
    mine = own(own1) - own(own0)
    softirq = sys1.softirq - sys0.softirq
    return {
        "other_cores_min": round(max(0.0, everyone - mine) / wall, 2),
        "other_cores_max": round(max(0.0, everyone + softirq - mine) / wall, 2),
        "benchmark_cores": round(mine / wall, 2),
        "softirq_cores": round(softirq / wall, 2),
        "steal_cores": round((sys1.steal - sys0.steal) / wall, 2),
    }


def git(*args: str) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
        )
        return proc.stdout.rstrip()  # not strip(): porcelain lines start with a space
    return ""


def engine_info(proxy: Path, options: str) -> dict[str, Any]:
    """What corral's side was: the commit, uncommitted balancer changes, the proxy's options."""
    engine_dirs = ["src/corral/balancer", "src/corral/dataplane"]
    changed = git("status", "--porcelain", "--", *engine_dirs, "bench/_lb_proxy.py")
    digest = hashlib.sha256()
    sources = sorted(p for d in engine_dirs for p in (REPO / d).rglob("*.py"))
    for path in [*sources, proxy]:
        with contextlib.suppress(OSError):
            digest.update(path.read_bytes())
    return {
        "proxy": str(proxy),
        "sources_sha256": digest.hexdigest()[:16],  # engine sources + the proxy script
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted": [line[3:] for line in changed.splitlines()],
        "engine_ready_flag": ENGINE_READY_FLAG.exists(),
        "lb_proxy_reuse_port": "--reuse-port" in options,
        "lb_proxy_metrics_flag": "--metrics" in options,
    }


def issue_targets(report: Report, workers: int) -> list[dict[str, Any]]:
    """Issue 11's targets for corral, each judged on the median of its per-round values."""

    def of(phase: str, target: str, key: str) -> dict[str, Any] | None:
        row = report.phases.get(phase, {}).get("targets", {}).get(target)
        return None if row is None else row.get(key)

    n = workers
    checks = [
        check("CPU/req vs nginx, 64 conns, 1 worker", of("c64", "corral", "cpu_vs_ref"),
              CPU_RATIO_MAX, True, "x"),
        check("req/s vs nginx, 64 conns, 1 worker", of("c64", "corral", "rps_vs_ref"),
              RPS_RATIO_MIN, False, "x"),
        check("p50 added over direct, 1 conn", of("c1", "corral", "p50_added_ms"),
              P50_ADDED_MAX_MS, True, " ms"),
        check(f"CPU/req vs nginx x{n}, 64 conns, {n} workers",
              of(f"c64x{n}", f"corral x{n}", "cpu_vs_ref"), CPU_RATIO_MAX, True, "x"),
        check(f"req/s vs nginx x{n}, 64 conns, {n} workers",
              of(f"c64x{n}", f"corral x{n}", "rps_vs_ref"), RPS_RATIO_MIN, False, "x"),
    ]  # fmt: skip
    s = report.streaming.get("corral")
    if s and "ttfb_vs_direct_ms" in s:
        added = s["ttfb_vs_direct_ms"]
        checks.append(
            {
                "check": "stream first event vs direct",
                "median": added,
                "min": None,
                "max": None,
                "limit": f"<= {STREAM_TTFB_MARGIN_MS:g} ms, all {SSE_EVENTS} events",
                "met": s["ttfb_within_margin"],
                "rounds_met": "",
                "unit": " ms",
            }
        )
    return checks


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, args = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--variant wants NAME=ARGS, got {spec!r}")
        variants[name.strip()] = shlex.split(args)
    return variants


def parse_compare(specs: list[str]) -> dict[str, Path]:
    compare: dict[str, Path] = {}
    for spec in specs:
        name, sep, src = spec.partition("=")
        if not sep or not name.strip() or not (Path(src) / "corral").is_dir():
            raise SystemExit(f"--compare wants NAME=SRC with SRC/corral a package, got {spec!r}")
        compare[name.strip()] = Path(src).resolve()
    return compare


def source_commit(src: Path) -> str | None:
    """The commit a --compare source tree is checked out at (a git worktree), if it is one."""
    proc = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s runs, no warm-up")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    parser.add_argument("--duration", type=int, help="seconds per 64-connection run (default 8)")
    parser.add_argument("--workers", type=int, default=2, help="N for the N-worker phase")
    parser.add_argument(
        "--requests",
        choices=["varied", "paths", "posts", "same"],
        default="varied",
        help="varied (default): a distinct X-Request-Id on every request; paths: and a distinct"
        " path; posts: POSTs of a small JSON body; same: identical GETs",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra corral row: bench/_lb_proxy.py with these extra arguments (repeatable)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="extra corral row running the engine from another source tree (e.g. a git worktree"
        " of an earlier commit: SRC is its src/ directory), side by side in the same rounds",
    )
    parser.add_argument(
        "--proxy",
        type=Path,
        default=PROXY,
        help="the script that runs corral's balancer (default bench/_lb_proxy.py)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also rows 'floor' and 'floor xN': bench/_lb_floor.py, a relay that does nothing"
        " but forward bytes and find each answer's end (what uvloop and Python cost alone)",
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="also count each proxy's syscalls per request (perf stat; needs perf and root)",
    )
    parser.add_argument(
        "--pure",
        action="store_true",
        help="also rows 'corral pure' and 'corral pure xN': this engine with"
        " CORRAL_BALANCER_PURE=1 (its compiled fast path turned off), in the same rounds",
    )
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=50,
        help="a phase of streamed answers at 64 connections: each request a chunked stream of"
        " this many events, --stream-gap-ms apart (0: no such phase)",
    )
    parser.add_argument("--stream-gap-ms", type=float, default=1.0)
    parser.add_argument(
        "--only-streamed",
        action="store_true",
        help="run only the streamed-answers phase (CPU per stream), to measure the stream relay"
        " without the other phases' minutes",
    )
    parser.add_argument(
        "--policy",
        choices=["round_robin", "least_load"],
        default="round_robin",
        help="every proxy's policy: round_robin (default), or least_load (nginx least_conn with"
        " a shared zone, HAProxy leastconn, corral least_load on the board its workers share)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # A run cut short by SIGTERM leaves through the same cleanup as a finished one (every replica,
    # proxy and peer it started is stopped), not with its processes left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rounds: int = args.rounds or (1 if args.quick else 3)
    duration: int = args.duration or (2 if args.quick else 8)
    duration_c1 = min(duration, 5)
    warmup = 0 if args.quick else 1
    stream_rounds = 3 if args.quick else 12
    workers: int = args.workers
    variants = parse_variants(args.variant)
    compare = parse_compare(args.compare)
    t_start = time.monotonic()
    mark = cpu_mark()

    report = Report(
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        config={
            "rounds": rounds,
            "duration_s": {"c64": duration, "c1": duration_c1, "warmup": warmup},
            "wrk": "wrk -t1 -cN -dDs --latency --timeout 5s",
            "requests": args.requests,
            "replicas": N_REPLICAS,
            "workers": workers,
            "policy": f"{args.policy} everywhere",
            "variants": {k: shlex.join(v) for k, v in variants.items()},
            "compare": {k: {"src": str(v), "commit": source_commit(v)} for k, v in compare.items()},
            "sse_events": SSE_EVENTS,
            "sse_interval_s": SSE_INTERVAL,
            "stream_phase": {"chunks": args.stream_chunks, "gap_ms": args.stream_gap_ms},
            "pure_rows": args.pure,
            "floor_rows": args.floor,
            "stream_rounds": stream_rounds,
            "targets": {
                "cpu_ratio_max": CPU_RATIO_MAX,
                "rps_ratio_min": RPS_RATIO_MIN,
                "p50_added_max_ms": P50_ADDED_MAX_MS,
                "stream_ttfb_margin_ms": STREAM_TTFB_MARGIN_MS,
            },
        },
    )
    log(f"load average at start: {report.machine['loadavg_start']}")
    tools = ensure_tools(log)
    wrk, nginx_bin, haproxy_bin = tools["wrk"], tools["nginx"], tools["haproxy"]
    log(f"tools: {tools}")
    if wrk is None:
        log("wrk is missing and could not be installed: nothing to measure")
        return 1
    report.config["versions"] = {
        "wrk": tool_version([wrk, "--version"]),
        "nginx": tool_version([nginx_bin, "-v"]) if nginx_bin else None,
        "haproxy": tool_version([haproxy_bin, "-v"]) if haproxy_bin else None,
    }
    options = proxy_options(args.proxy)
    report.engine = engine_info(args.proxy, options)
    log(f"corral: {report.engine}")

    peers: list[Peer] = []
    corral_procs: dict[str, list[Proc]] = {}
    with processes() as procs, tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp:
        os.chmod(tmp, 0o755)  # nginx's workers run as root here, but not everywhere
        for i in range(N_REPLICAS):
            procs.append(
                start_python(
                    f"replica{i + 1}",
                    [
                        str(HERE / "_lb_replica.py"),
                        "--events",
                        str(SSE_EVENTS),
                        "--interval",
                        str(SSE_INTERVAL),
                    ],
                )
            )
        replica_ports = [p.port for p in procs]
        urls = [f"http://{HOST}:{port}" for port in replica_ports]

        def peer(kind: str, n: int) -> Target | None:
            name = kind if n == 1 else f"{kind} x{n}"
            binary = nginx_bin if kind == "nginx" else haproxy_bin
            if binary is None:
                report.skipped.append(f"{name}: {kind} is not installed and could not be")
                return None
            start = start_nginx if kind == "nginx" else start_haproxy
            try:
                p = start(
                    binary, Path(tmp) / name.replace(" ", ""), replica_ports, n, name, args.policy
                )
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                log(f"{name} did not start ({exc}): its rows are skipped")
                report.skipped.append(f"{name}: {exc}")
                return None
            peers.append(p)
            return Target(name, p.port, [p.pid], n)

        pure_env = {"CORRAL_BALANCER_PURE": "1"}

        def corral(
            name: str,
            n: int,
            extra: list[str],
            src: Path | None = None,
            env: dict[str, str] | None = None,
            proxy: Path | None = None,
        ) -> Target | None:
            try:
                started = start_corral(
                    proxy or args.proxy,
                    name,
                    urls,
                    n,
                    [*extra, "--policy", args.policy] if proxy is None else extra,
                    procs,
                    src,
                    env,
                    Path(tmp) / f"board-{name.replace(' ', '')}.bin" if proxy is None else None,
                )
            except RuntimeError as exc:
                log(f"{name} did not start ({exc}): its rows are skipped")
                report.skipped.append(f"{name}: {exc}")
                return None
            report.engine.setdefault("loaded", {})[name] = loaded_engine(started[0].pid)
            corral_procs[name] = started
            return Target(name, started[0].port, [p.pid for p in started], n)

        try:
            one: list[Target] = [Target("direct", replica_ports[0], [])]
            many: list[Target] = []
            for t in (
                peer("nginx", 1),
                peer("haproxy", 1),
                corral("corral", 1, []),
                *(corral(name, 1, extra) for name, extra in variants.items()),
                *(corral(name, 1, [], src) for name, src in compare.items()),
                corral("corral pure", 1, [], None, pure_env) if args.pure else None,
                corral("floor", 1, [], proxy=FLOOR) if args.floor else None,
            ):
                if t is not None:
                    one.append(t)
            if workers > 1 and not args.only_streamed:
                many += [t for t in (peer("nginx", workers), peer("haproxy", workers)) if t]
                if report.engine["lb_proxy_reuse_port"]:
                    t = corral(f"corral x{workers}", workers, [])
                    if t is not None:
                        many.append(t)
                    for name, src in compare.items():
                        t = corral(f"{name} x{workers}", workers, [], src)
                        if t is not None:
                            many.append(t)
                    if args.pure:
                        t = corral(f"corral pure x{workers}", workers, [], None, pure_env)
                        if t is not None:
                            many.append(t)
                    if args.floor:
                        t = corral(f"floor x{workers}", workers, [], proxy=FLOOR)
                        if t is not None:
                            many.append(t)
                else:
                    msg = (
                        f"corral x{workers}: bench/_lb_proxy.py does not take --reuse-port "
                        f"(this engine cannot serve one port from {workers} processes yet)"
                    )
                    log(msg)
                    report.skipped.append(msg)
            for t in [*one, *many]:
                if not http_ok(t.port):
                    raise RuntimeError(f"{t.name} does not answer 200 ok on port {t.port}")
            log(f"targets up: { {t.name: t.port for t in [*one, *many]} }")

            has_nginx = any(t.name == "nginx" for t in one)
            # direct last at 64 connections would be what the rotation starts from; its place
            # in the list only sets the starting order.
            phases = [
                Phase(
                    "c64",
                    "64 connections, one process / worker / thread",
                    64,
                    duration,
                    [t for t in one if t.name != "direct"] + one[:1],
                    "nginx" if has_nginx else "direct",
                ),
                Phase(
                    "c1",
                    "1 connection, one process / worker / thread",
                    1,
                    duration_c1,
                    one,
                    "nginx" if has_nginx else "direct",
                ),
            ]
            if len(many) > 0:
                ref = f"nginx x{workers}"
                phases.append(
                    Phase(
                        f"c64x{workers}",
                        f"64 connections, {workers} processes / workers / threads",
                        64,
                        duration,
                        many,
                        ref if any(t.name == ref for t in many) else many[0].name,
                    )
                )
            loads: list[list[float]] = []
            wrk_base = [wrk]
            if args.requests in REQUEST_SCRIPTS:
                script = Path(tmp) / f"{args.requests}.lua"
                script.write_text(REQUEST_SCRIPTS[args.requests])
                wrk_base += ["-s", str(script)]
            streamed: list[Phase] = []
            if args.stream_chunks > 0:
                varied = Path(tmp) / "stream.lua"
                varied.write_text(VARIED_REQUESTS_LUA)
                gap = args.stream_gap_ms / 1000
                streamed.append(
                    Phase(
                        "sse",
                        f"64 connections, streamed answers ({args.stream_chunks} chunked events"
                        f" {args.stream_gap_ms:g} ms apart), one process / worker / thread",
                        64,
                        duration,
                        [t for t in one if t.name != "direct"],
                        "nginx" if has_nginx else one[0].name,
                        path=f"/sse?events={args.stream_chunks}&interval={gap:g}",
                        wrk=[wrk, "-s", str(varied)],
                    )
                )
            if args.only_streamed:
                phases, runs = [], []
            else:
                runs = run_rounds(wrk_base, phases, rounds, warmup, loads)
                report.machine["loadavg_per_round"] = loads
                stream_targets = {t.name: t.port for t in one if t.name in ("direct", "nginx")}
                stream_targets |= {t.name: t.port for t in one if t.name in ("haproxy", "corral")}
                log(f"streaming: {stream_rounds} rounds of /sse ({SSE_EVENTS} events) per target")
                report.streaming = run_streams(stream_targets, stream_rounds)
            if streamed:
                # After the time-to-first-event test: wrk ends streams mid-way, and nginx
                # answered that test's first event ~45 ms late right after (1 quick run).
                log("streamed answers at 64 connections, CPU per stream")
                runs += run_rounds(wrk_base, streamed, rounds, warmup, [])
                phases += streamed
            report.runs = [asdict(r) for r in runs]
            for phase in phases:
                report.phases[phase.name] = {
                    "title": phase.title,
                    "connections": phase.connections,
                    "duration_s": phase.duration,
                    "reference": phase.reference,
                    "targets": summarize(phase, runs, "direct" if phase.name == "c1" else None),
                }
            if args.syscalls and args.only_streamed and streamed:
                log("syscalls per stream, 64 connections, perf stat")
                sse = streamed[0]
                for t in sse.targets:
                    if t.pids:
                        report.syscalls[t.name] = count_syscalls(
                            sse.wrk or wrk_base, t, path=sse.path
                        )
            elif args.syscalls:
                log("syscalls per request, 64 connections, perf stat")
                for t in [*one, *many]:
                    if t.pids:
                        report.syscalls[t.name] = count_syscalls(wrk_base, t)
        finally:
            for p in peers:
                p.stop()

    report.targets = issue_targets(report, workers)
    # A proxy that renders its metrics on exit (``_lb_proxy.py --metrics``, e.g. as a
    # --variant) prints the requests it counted: proof the counters saw the traffic.
    time.sleep(0.2)  # the drain threads take the last lines
    for name, started in corral_procs.items():
        counted = [re.search(r"METRICS requests_total=(\d+)", "".join(p.output)) for p in started]
        if any(counted):
            report.engine.setdefault("metrics_requests_total", {})[name] = sum(
                int(m.group(1)) for m in counted if m
            )
    report.machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report.machine["cpu_during_run"] = other_work(mark)
    report.wall_s = round(time.monotonic() - t_start, 1)
    versions = report.config["versions"]
    print()
    print(
        f"Machine: nproc {report.machine['nproc']}, load average "
        f"{report.machine['loadavg_start']} at start, "
        f"{report.machine.get('loadavg_per_round', [])} at each round's start, "
        f"{report.machine['loadavg_end']} at end; cores busy on average: "
        f"{report.machine['cpu_during_run']}; "
        f"{versions['nginx'] or 'nginx: none'}; {versions['haproxy'] or 'haproxy: none'}; "
        f"{versions['wrk']}; wall {report.wall_s} s"
    )
    e = report.engine
    dirty = f" + uncommitted {', '.join(e['uncommitted'])}" if e["uncommitted"] else ""
    print(
        f"corral: {e['commit']}{dirty}; engine-ready flag "
        f"{'present' if e['engine_ready_flag'] else 'absent'}; the proxy process has loaded "
        f"{e.get('loaded', {}).get('corral', [])}"
        + (
            f"; metrics counted {e['metrics_requests_total']}"
            if "metrics_requests_total" in e
            else ""
        )
    )
    for phase_name, ph in report.phases.items():
        print()
        print(
            f"{ph['title']} ({rounds} round(s) of {ph['duration_s']} s runs, {args.requests} "
            f"requests; medians; ratios within a round, median (min-max))"
        )
        print(phase_table(ph["reference"], ph["targets"], phase_name == "c1"))
    if report.streaming:
        print()
        print(stream_table(report.streaming))
    if report.syscalls:
        print()
        what = "stream" if args.only_streamed and args.stream_chunks > 0 else "request"
        print(f"Syscalls and context switches per {what}, 64 connections (perf stat):")
        print(syscall_table(report.syscalls))
    print()
    print("Issue 11's targets (corral):")
    print(targets_table(report.targets))
    for msg in report.skipped:
        print(f"SKIPPED: {msg}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
