"""Benchmark: corral's balancer and its policies side by side with the LLM routers people would
otherwise use (sglang-router, vllm-router) and nginx, in front of the same simulated engines.

Why: an LLM router is judged by what the engines behind it do, not by its own proxying speed. A
prompt whose prefix is in a replica's KV cache costs a fraction of one that is not, and a
request behind a long engine queue waits even while another replica idles. So the figures that
matter are the client's time to first token (TTFT), the fleet's prefix-cache hit rate, how even
the load is and what the router costs in CPU; this script measures all of them for every router
in one run, interleaved, so every figure shares the machine's state.

What runs (everything on 127.0.0.1, every run bounded in time and requests):

* The fleet: 4 ``corral.llmsim`` engines (docs/llmsim.md), max_batch 8, block size 16, a prefix
  cache of ``--cache-blocks`` (default 1536 blocks, 24k tokens: the working set of the chat
  workload under round robin does not fit, under affinity it does, so eviction matters a
  little), 0.2 ms of engine time per uncached prompt token (``--prefill-ms``: raise it for a
  fleet whose engines spend their time on prompts, where caching them buys capacity and not
  only TTFT). The same 4 processes serve every run: each run's prompts are new text (a fresh salt)
  with the same lengths and arrival times, so what one run cached is only LRU garbage to the
  next, as good as a cold cache. Each engine serves its own model name (``corral-llmsim-eN``)
  while clients ask for ``corral-llmsim`` (the simulator answers any name), so the client
  learns which engine served each request from the stream's ``model`` field: the simulator has
  no engine-id header.
* Routers (rows; ``--routers`` picks some by name): nginx round robin (Debian's package,
  ``apt-get install -y nginx-light`` when missing, as bench/balancer.py does); corral's
  ``LoadBalancer`` in a process of its own (bench/_llm_lb.py, uvloop, refreshing the engines'
  metrics every second as a balancer worker does) with ``round_robin``, ``least_load``,
  ``prefix_affinity``, ``prefix_affinity`` in 2 processes on one port (SO_REUSEPORT,
  ``routing["workers"]=2``) and, as optional rows, ``prefix_affinity`` with a hold
  (``max_in_flight_per_replica`` 8; and ``hold8 fifo``, the hold with ``hold_patience`` 0),
  ``least_load`` in 2 processes (what two processes cost a policy that shares nothing between
  them) and ``prefix_aff x2 noshare`` (the share bound off: ``share_balance`` 1000);
  sglang-router 0.3.2 (``cache_aware`` default and with ``--balance-abs-threshold 4``;
  ``round_robin`` as an optional row, nginx's policy); vllm-router 0.1.17 (``cache_aware``
  default and tuned, ``consistent_hash`` on ``X-Session-ID``). The two Rust routers are pip
  wheels installed into this script's Python environment (the project's .venv) when missing:
  benchmark-only, small, and deliberately not dependencies in pyproject.toml. Nothing is
  downloaded but from PyPI (and Debian's mirror for nginx). ``--compare NAME=SRC`` runs each
  corral row picked again from another tree's ``src`` (PYTHONPATH; its compiled module built
  there), as ``ROW [NAME]``: a change against the code before it, in one run.
* Workloads, each client request on a NEW connection (as many clients do), streaming:
  ``chat``: conversations over 5 shared ~600-token system prompts (``--system-prompts``),
  Poisson conversation starts, several turns each (turn N+1 = turn N's messages + the answer +
  a new user message, after a short think time), ``/v1/chat/completions``, ``X-Session-ID`` =
  the conversation;
  ``rag``: independent questions after one of 4 (``--documents``) shared ~1500-token documents,
  Poisson arrivals, ``/v1/completions``; ``control``: random prompts of a chat turn's length,
  nothing shared.
* Per run: achieved req/s, client TTFT p50/p99 (request sent to the first ``data:`` bytes),
  end-to-end p99, errors, the fleet's prefix-cache hit rate (deltas of
  ``vllm:prefix_cache_hits_total`` / ``queries_total`` over the 4 engines), the engines' own
  median TTFT (``vllm:time_to_first_token_seconds`` bucket deltas, interpolated), each
  engine's share of requests (``vllm:request_success_total`` deltas; max share vs an even 25%),
  the router's CPU per request (its process tree's CPU, delta / requests: the scheduler's
  nanoseconds per thread, or psutil's 10 ms ticks where a thread ended during the run, as the
  JSON's ``cpu_counted`` says; the idle routers' own background work, corral's metrics refresh
  and the Rust routers' health checks, lands on the engines meanwhile), and for chat the
  turns' affinity: the share of each
  conversation's turns that reached its most frequent engine.
* Rounds: ``--rounds`` (default 2) times, each workload at each load level runs every router
  back to back, in an order that rotates with the round. Reported: the median over rounds;
  raw runs in the JSON. Goodput: per router and workload, the highest offered rate among the
  levels whose TTFT p99 stayed under 0.5 s with no errors.

Load levels are offered request rates (``--chat-rates``, ``--rag-rates``, ``--control-rates``).
The defaults come from a short ramp of round robin on this 2-core machine (2026-12-04): control
saturates near 19 req/s (TTFT p99 0.3 s at 12, 1.3 s at 24); rag's TTFT p99 passes 0.5 s from
~12 req/s and 1 s at 28; chat with 100 conversations of 3 turns tops out near 25 req/s achieved
whatever the offered rate (each conversation waits for its answers: the workload's own
ceiling), so its second level, 36, is "as fast as 100 conversations go", where a hot replica
shows. Every process this script starts is ended by its pid (its process tree), also on Ctrl-C
or SIGTERM.

Run: ``.venv/bin/python bench/llm_routing.py`` (2 rounds of the 10 default rows, ~17 min here)
or ``--quick`` (1 round, 20 conversations and 30 questions a run, ~3.5 min). Results: tables on
stdout and bench/results/llm_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import uvloop
from _cpu import thread_nanoseconds
from _lb_peers import apt_install, find_binary, free_port, tool_version

from corral.balancer.http1 import BadRequest, ChunkedDecoder
from corral.llmsim import EngineConfig, command

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "llm_routing.json"
LLM_LB = HERE / "_llm_lb.py"
HOST = "127.0.0.1"
MODEL = "corral-llmsim"
N_ENGINES = 4
SYSTEM_PROMPTS = 5
DOCUMENTS = 4
GOODPUT_TTFT_P99 = 0.5  # seconds
PEER_WHEELS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
READY_LINE = "corral.llmsim listening on "


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- processes


def end_tree(popen: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """End a process this script started and every child of it, by pid: ``sig``, then
    SIGKILL after ``grace`` seconds. Never by name."""
    try:
        root = psutil.Process(popen.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
    _gone, alive = psutil.wait_procs(family, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(grace)


@dataclass
class CpuSnapshot:
    """A router's CPU so far: per thread from the scheduler (``/proc/PID/task/TID/schedstat``,
    nanoseconds) and per process from psutil (user + system, in 10 ms ticks, counting threads
    that have exited too)."""

    threads: dict[tuple[int, int], int]
    ticks: float


def cpu_snapshot(pids: list[int]) -> CpuSnapshot:
    """Of these processes and their children (nginx's workers; a launcher's Rust threads are
    in the process itself)."""
    threads: dict[tuple[int, int], int] = {}
    ticks = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                ticks += t.user + t.system
            for tid, ns in thread_nanoseconds(proc.pid).items():
                threads[(proc.pid, tid)] = ns
    return CpuSnapshot(threads, ticks)


def cpu_between(a: CpuSnapshot, b: CpuSnapshot) -> tuple[float, str]:
    """CPU seconds from ``a`` to ``b`` and how they were counted. The scheduler's nanoseconds
    where every thread of ``a`` is still there (a run of 100 requests at ~1 ms each is 10
    ticks, so ticks alone put +-10% on a row); psutil's ticks where a thread ended on the way
    (its time is in its process's ticks only), or the ticks exceed the threads' sum by more
    than two ticks a process (a thread born and gone between the two)."""
    ticks = b.ticks - a.ticks
    if not a.threads.keys() <= b.threads.keys():
        return ticks, "ticks"
    precise = sum(b.threads[k] - a.threads.get(k, 0) for k in b.threads) / 1e9
    processes = len({pid for pid, _ in b.threads}) or 1
    if ticks - precise > 0.02 * processes:
        return ticks, "ticks"
    return precise, "schedstat"


def read_line(popen: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The rest of the first stdout line starting with ``prefix``; RuntimeError otherwise."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([popen.stdout], [], [], left)[0]:
            line = popen.stdout.readline()
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if not line:
                break
    raise RuntimeError(f"no {prefix!r} line from {popen.args!r} (exit {popen.poll()})")


@dataclass
class Engine:
    popen: subprocess.Popen[str]
    url: str
    model: str


def start_fleet(
    config: EngineConfig, logdir: Path, started: list[subprocess.Popen[Any]], tagged: bool = True
) -> list[Engine]:
    """4 simulators, each (``tagged``) with its own model name: how the client tells them
    apart, since the simulator's answers carry no engine id."""
    fleet = []
    for i in range(N_ENGINES):
        model = f"{MODEL}-e{i + 1}" if tagged else MODEL
        argv = command(config, host=HOST, port=0, model=model)
        err = (logdir / f"engine{i + 1}.log").open("w")
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        started.append(popen)
        fleet.append(Engine(popen, read_line(popen, READY_LINE, 30), model))
    return fleet


# ---------------------------------------------------------------------------- engine metrics


def scrape(url: str) -> dict[str, Any]:
    """The counters this benchmark reads from one engine's /metrics (summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {"hits": 0.0, "queries": 0.0, "success": 0.0, "ttft_buckets": {}}
    names = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:request_success_total": "success",
    }
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name in names:
            out[names[name]] += float(value)
        elif name == "vllm:time_to_first_token_seconds_bucket":
            le = head.split('le="', 1)[1].split('"', 1)[0]
            buckets = out["ttft_buckets"]
            buckets[le] = buckets.get(le, 0.0) + float(value)
    return out


def histogram_median(buckets: dict[str, float]) -> float | None:
    """The median of a cumulative histogram (Prometheus ``le`` buckets), linearly interpolated
    within its bucket, as histogram_quantile does."""
    edges = sorted((math.inf if le == "+Inf" else float(le), n) for le, n in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return None
    rank = edges[-1][1] / 2
    lower, below = 0.0, 0.0
    for upper, count in edges:
        if count >= rank:
            if math.isinf(upper):
                return lower
            span = count - below
            return lower + (upper - lower) * ((rank - below) / span if span else 1.0)
        lower, below = upper, count
    return None


def fleet_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    served = [a["success"] - b["success"] for a, b in zip(after, before, strict=True)]
    buckets: dict[str, float] = {}
    for a, b in zip(after, before, strict=True):
        for le, n in a["ttft_buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + n - b["ttft_buckets"].get(le, 0.0)
    total = sum(served)
    return {
        "hit_rate": hits / queries if queries else None,
        "prefix_hits": hits,
        "prefix_queries": queries,
        "served_per_engine": served,
        "max_share": max(served) / total if total else None,
        "engine_ttft_p50": histogram_median(buckets),
    }


# ---------------------------------------------------------------------------- routers


@dataclass
class RouterSpec:
    name: str
    kind: str  # corral | sglang | vllm | nginx
    policy: str = "round_robin"
    extra: list[str] = field(default_factory=list)
    workers: int = 1
    # Not in the default run (its ~15 min budget): named with --routers, or --routers all.
    optional: bool = False
    # A corral row run from another tree's ``src`` (--compare), as PYTHONPATH.
    src: str | None = None


def default_specs() -> list[RouterSpec]:
    abs4 = ["--balance-abs-threshold", "4"]
    return [
        RouterSpec("nginx rr", "nginx"),
        RouterSpec("corral round_robin", "corral", "round_robin"),
        RouterSpec("corral least_load", "corral", "least_load"),
        RouterSpec("corral prefix_affinity", "corral", "prefix_affinity"),
        RouterSpec(
            "corral prefix_aff hold8",
            "corral",
            "prefix_affinity",
            ["--max-in-flight", "8"],
            optional=True,
        ),
        # The same hold, first in first out to any replica (what the hold was before it
        # waited for the replica with the cache).
        RouterSpec(
            "corral prefix_aff hold8 fifo",
            "corral",
            "prefix_affinity",
            ["--max-in-flight", "8", "--hold-patience", "0"],
            optional=True,
        ),
        RouterSpec("corral prefix_aff x2", "corral", "prefix_affinity", workers=2),
        # What two processes cost a policy that shares nothing between them: the control.
        RouterSpec("corral least_load x2", "corral", "least_load", workers=2, optional=True),
        # The same without the bound on a replica's share of the requests (what it changes).
        RouterSpec(
            "corral prefix_aff x2 noshare",
            "corral",
            "prefix_affinity",
            ["--option", "share_balance=1000"],
            workers=2,
            optional=True,
        ),
        RouterSpec("sglang cache_aware", "sglang", "cache_aware"),
        RouterSpec("sglang cache_aware abs4", "sglang", "cache_aware", abs4),
        RouterSpec("sglang round_robin", "sglang", "round_robin", optional=True),
        RouterSpec("vllm cache_aware", "vllm", "cache_aware"),
        RouterSpec("vllm cache_aware abs4", "vllm", "cache_aware", abs4),
        RouterSpec("vllm consistent_hash", "vllm", "consistent_hash"),
    ]


@dataclass
class Router:
    spec: RouterSpec
    procs: list[subprocess.Popen[Any]]
    port: int

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


NGINX_CONF = """\
{user}worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_max_body_size 64m;
    upstream engines {{
        {servers}
        keepalive 64;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering on;
            proxy_read_timeout 120s;
        }}
    }}
}}
"""


def venv_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def start_router(
    spec: RouterSpec,
    urls: list[str],
    tmp: Path,
    nginx: str | None,
    started: list[subprocess.Popen[Any]],
) -> Router:
    """Start one router; return once it routes to all 4 engines."""
    slug = spec.name.replace(" ", "_")
    out = (tmp / f"{slug}.log").open("w")
    procs: list[subprocess.Popen[Any]] = []

    def popen(argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, **kw)
        started.append(proc)
        procs.append(proc)
        return proc

    if spec.kind == "corral":
        base = [sys.executable, str(LLM_LB), "--policy", spec.policy, *spec.extra]
        base += [a for url in urls for a in ("--replica", url)]
        base += ["--workers", str(spec.workers)]
        # As the data plane's workers do: one conversation table, one board of counts in
        # flight and the engine readings they split, for the router's processes, each process
        # a slot of its own.
        base += ["--affinity-file", str(tmp / f"{slug}.affinity")]
        base += ["--load-file", str(tmp / f"{slug}.load")]
        base += ["--engine-share", str(tmp / f"{slug}.engines")]
        reuse = ["--reuse-port"] if spec.workers > 1 else []
        env = None if spec.src is None else {**os.environ, "PYTHONPATH": spec.src}
        first = popen([*base, *reuse], stdout=subprocess.PIPE, stderr=out, text=True, env=env)
        port = int(read_line(first, "PORT ", 30))
        for slot in range(1, spec.workers):
            argv = [*base, *reuse, "--port", str(port), "--slot", str(slot)]
            more = popen(argv, stdout=subprocess.PIPE, stderr=out, text=True, env=env)
            read_line(more, "PORT ", 30)
    elif spec.kind in ("sglang", "vllm"):
        port = free_port()
        if spec.kind == "sglang":
            argv = [sys.executable, "-m", "sglang_router.launch_router"]
            tail = ["--shutdown-grace-period-secs", "1", "--log-level", "warn"]
        else:
            argv = [venv_bin("vllm-router")]
            tail = ["--log-level", "warning"]
        argv += ["--host", HOST, "--port", str(port), "--policy", spec.policy]
        argv += ["--worker-urls", *urls, "--prometheus-port", str(free_port()), *tail, *spec.extra]
        popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True)
    elif spec.kind == "nginx":
        if nginx is None:
            raise RuntimeError("nginx is not installed")
        prefix = tmp / slug
        prefix.mkdir(parents=True, exist_ok=True)
        port = free_port()
        conf = prefix / "nginx.conf"
        servers = "\n        ".join(
            f"server {u.removeprefix('http://')} max_fails=0;" for u in urls
        )
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf.write_text(
            NGINX_CONF.format(user=user, prefix=prefix, host=HOST, port=port, servers=servers)
        )
        base = [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
        popen(base, stdout=out, stderr=subprocess.STDOUT, text=True)
    else:
        raise ValueError(spec.kind)
    router = Router(spec, procs, port)
    try:
        wait_routing(router, urls)
    except BaseException:
        for proc in procs:
            end_tree(proc, grace=2)
        raise
    return router


def http(
    port: int, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_routing(router: Router, urls: list[str], timeout: float = 60.0) -> None:
    """Until the router lists all engines (sglang-router answers before it has registered
    them: its ``GET /workers``) and a request through it succeeds."""
    deadline = time.monotonic() + timeout
    probe = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}
    while time.monotonic() < deadline:
        for proc in router.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{router.spec.name} exited {proc.returncode}")
        with contextlib.suppress(OSError):
            if router.spec.kind == "sglang":
                status, body = http(router.port, "GET", "/workers")
                if status != 200 or not all(u.encode() in body for u in urls):
                    time.sleep(0.2)
                    continue
            status, _ = http(router.port, "POST", "/v1/completions", probe)
            if status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{router.spec.name} did not route within {timeout:g} s")


# ---------------------------------------------------------------------------- installing


def ensure_peers() -> dict[str, bool]:
    """The two Rust routers, pip-installed into this Python's environment when missing."""
    have = {
        "sglang-router": importlib.util.find_spec("sglang_router") is not None,
        "vllm-router": Path(venv_bin("vllm-router")).exists(),
    }
    missing = [f"{name}=={PEER_WHEELS[name]}" for name, ok in have.items() if not ok]
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", *missing]
        log(f"installing the peer routers (benchmark-only): {' '.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log(
            f"  pip exit {proc.returncode}: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}"
        )
        importlib.invalidate_caches()
        have = {
            "sglang-router": importlib.util.find_spec("sglang_router") is not None,
            "vllm-router": Path(venv_bin("vllm-router")).exists(),
        }
    return have


def ensure_nginx() -> str | None:
    found = find_binary("nginx")
    if found or shutil.which("apt-get") is None:
        return found
    for package in ("nginx-light", "nginx"):
        if apt_install(package, log):
            break
    return find_binary("nginx")


def versions() -> dict[str, str]:
    out = {}
    for dist in PEER_WHEELS:
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            out[dist] = version(dist)
    nginx = find_binary("nginx")
    out["nginx"] = tool_version([nginx, "-v"]) if nginx else "none"
    return out


# ---------------------------------------------------------------------------- client


@dataclass
class Result:
    sent: float
    ttft: float | None
    e2e: float | None
    ok: bool
    status: int
    text: str = ""
    engine: str = ""
    error: str = ""


def parse_stream(body: bytes, chunked: bool) -> tuple[str, str, bool]:
    """(the generated text, the serving engine's model name, whether [DONE] came)."""
    if chunked:
        try:
            pieces, _, _ = ChunkedDecoder().feed(body)
        except BadRequest:
            pieces = []
        body = b"".join(pieces)
    text, model, done = [], "", False
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            chunk = json.loads(data)
            model = model or chunk.get("model", "")
            choice = chunk["choices"][0]
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
    return "".join(text), model, done


async def stream_request(
    port: int, path: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> Result:
    """One streamed request on a new connection; TTFT = sending the request to the first
    ``data:`` bytes of the answer."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\nConnection: close\r\nAccept: text/event-stream\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sent = time.perf_counter()
    ttft: float | None = None
    writer: asyncio.StreamWriter | None = None
    buf = b""
    header_end = -1
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(HOST, port)
            sent = time.perf_counter()
            writer.write(head.encode() + payload)
            while chunk := await reader.read(65536):
                buf += chunk
                if ttft is None:
                    if header_end < 0:
                        header_end = buf.find(b"\r\n\r\n")
                    if header_end >= 0 and buf.find(b"data:", header_end) >= 0:
                        ttft = time.perf_counter() - sent
    except (OSError, TimeoutError) as exc:
        return Result(sent, ttft, None, False, 0, error=type(exc).__name__)
    finally:
        if writer is not None:
            writer.close()
    e2e = time.perf_counter() - sent
    header_end = buf.find(b"\r\n\r\n")
    status_line = buf[: buf.find(b"\r\n")].split()
    status = int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0
    chunked = b"transfer-encoding: chunked" in buf[:header_end].lower()
    text, engine, done = parse_stream(buf[header_end + 4 :], chunked)
    ok = status == 200 and done
    error = "" if ok else f"status {status}" + ("" if done else ", no [DONE]")
    return Result(sent, ttft, e2e, ok, status, text, engine, error)


def words(rng: random.Random, tokens: int) -> str:
    """``tokens`` simulator tokens of random text (3 hex digits and a space: 4 bytes each)."""
    return " ".join(f"{rng.getrandbits(12):03x}" for _ in range(tokens))


@dataclass
class Workload:
    name: str
    rate: float  # offered requests per second
    requests: int  # bound on requests of the run (chat: conversations x turns)
    max_tokens: int
    turns: int = 1
    think: float = 0.0
    documents: int = DOCUMENTS  # rag: the shared documents the questions follow
    system_prompts: int = SYSTEM_PROMPTS  # chat: the shared system prompts (prompt families)


async def run_workload(
    port: int, wl: Workload, shape_seed: str, salt: str, timeout: float, deadline: float
) -> tuple[list[Result], dict[str, list[str]]]:
    """Play one workload against a router. ``shape_seed`` fixes arrival times and lengths
    (the same for every router at this level and round); ``salt`` makes the text new, so no
    earlier run's cache entries help. Returns the results and, for chat, the engines that
    served each conversation's turns in order."""
    shape = random.Random(shape_seed)
    text = random.Random(f"{shape_seed}/{salt}")
    results: list[Result] = []
    served: dict[str, list[str]] = {}
    start = time.perf_counter() + 0.05
    loop_deadline = start + deadline

    async def at(offset: float) -> bool:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return time.perf_counter() < loop_deadline

    tasks: list[asyncio.Task[None]] = []
    if wl.name == "chat":
        systems = [words(text, 600) for _ in range(wl.system_prompts)]
        conversations = max(1, wl.requests // wl.turns)
        conv_rate = wl.rate / wl.turns
        offset = 0.0
        for c in range(conversations):
            offset += shape.expovariate(conv_rate)
            system = systems[shape.randrange(wl.system_prompts)]
            users = [words(text, shape.randint(40, 100)) for _ in range(wl.turns)]
            thinks = [shape.expovariate(1 / wl.think) if wl.think else 0.0 for _ in range(wl.turns)]
            conv = f"{salt}-c{c}"

            async def chat(
                offset: float, system: str, users: list[str], thinks: list[float], conv: str
            ) -> None:
                if not await at(offset):
                    return
                messages = [{"role": "system", "content": system}]
                for user, think in zip(users, thinks, strict=True):
                    messages.append({"role": "user", "content": user})
                    body = {
                        "model": MODEL,
                        "messages": messages,
                        "max_tokens": wl.max_tokens,
                        "stream": True,
                    }
                    res = await stream_request(
                        port, "/v1/chat/completions", body, {"X-Session-ID": conv}, timeout
                    )
                    results.append(res)
                    if not res.ok:
                        return
                    served.setdefault(conv, []).append(res.engine)
                    messages = [*messages, {"role": "assistant", "content": res.text}]
                    await asyncio.sleep(think)
                    if time.perf_counter() >= loop_deadline:
                        return

            tasks.append(asyncio.create_task(chat(offset, system, users, thinks, conv)))
    else:
        docs = [words(text, 1500) for _ in range(wl.documents)]
        offset = 0.0
        for q in range(wl.requests):
            offset += shape.expovariate(wl.rate)
            if wl.name == "rag":
                doc = docs[shape.randrange(wl.documents)]
                question = words(text, shape.randint(20, 60))
                prompt = f"{doc}\n\nQuestion: {question}\nAnswer:"
            else:
                prompt = words(text, shape.randint(640, 900))
            session = f"{salt}-q{q}"

            async def one(offset: float, prompt: str, session: str) -> None:
                if not await at(offset):
                    return
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": wl.max_tokens,
                    "stream": True,
                }
                results.append(
                    await stream_request(
                        port, "/v1/completions", body, {"X-Session-ID": session}, timeout
                    )
                )

            tasks.append(asyncio.create_task(one(offset, prompt, session)))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), deadline + timeout + 5)
    except TimeoutError:
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results, served


# ---------------------------------------------------------------------------- measuring


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def affinity(served: dict[str, list[str]]) -> float | None:
    """Share of conversations' turns that reached the conversation's most frequent engine."""
    turns = sum(len(v) for v in served.values())
    if not turns:
        return None
    return sum(Counter(v).most_common(1)[0][1] for v in served.values() if v) / turns


def measure(
    router: Router,
    fleet: list[Engine],
    wl: Workload,
    shape_seed: str,
    salt: str,
    timeout: float,
) -> dict[str, Any]:
    before = [scrape(e.url) for e in fleet]
    cpu0 = cpu_snapshot(router.pids)
    deadline = wl.requests / wl.rate + wl.turns * (wl.think + 1.0) + 10.0
    results, served = uvloop.run(run_workload(router.port, wl, shape_seed, salt, timeout, deadline))
    cpu1 = cpu_snapshot(router.pids)
    cpu, cpu_counted = cpu_between(cpu0, cpu1)
    time.sleep(0.3)  # the engines count a request after its last token is sent
    after = [scrape(e.url) for e in fleet]
    ok = [r for r in results if r.ok]
    span = (max(r.sent + (r.e2e or 0) for r in ok) - min(r.sent for r in ok)) if ok else 0.0
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    errors = Counter(r.error for r in results if not r.ok)
    engines = {e.model: i for i, e in enumerate(fleet)}
    client_share = Counter(engines.get(r.engine, -1) for r in ok)
    run = {
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(errors),
        "rps": len(ok) / span if span else 0.0,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "e2e_p50": pct([r.e2e for r in ok if r.e2e is not None], 0.5),
        "e2e_p99": pct([r.e2e for r in ok if r.e2e is not None], 0.99),
        "cpu_ms_per_req": 1000 * cpu / len(ok) if ok else None,
        "cpu_counted": cpu_counted,
        "client_share": [client_share.get(i, 0) for i in range(len(fleet))],
        "affinity": affinity(served) if wl.name == "chat" and len(engines) > 1 else None,
        "loadavg": os.getloadavg()[0],
    }
    run.update(fleet_delta(before, after))
    return run


# ---------------------------------------------------------------------------- reporting

COLUMNS = [
    ("req/s", "rps", "{:.1f}", 1),
    ("TTFT p50", "ttft_p50", "{:.0f}", 1000),
    ("TTFT p99", "ttft_p99", "{:.0f}", 1000),
    ("e2e p99", "e2e_p99", "{:.0f}", 1000),
    ("hit", "hit_rate", "{:.2f}", 1),
    ("eng TTFT p50", "engine_ttft_p50", "{:.0f}", 1000),
    ("max share", "max_share", "{:.2f}", 1),
    ("CPU ms/req", "cpu_ms_per_req", "{:.2f}", 1),
    ("affinity", "affinity", "{:.2f}", 1),
    ("errors", "errors_n", "{:.0f}", 1),
]


def med(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for _, k, _, _ in COLUMNS if k != "errors_n"] + ["e2e_p50", "ok", "requests"]
    out: dict[str, Any] = {k: med([r[k] for r in runs]) for k in keys}
    out["errors_n"] = sum(sum(r["errors"].values()) for r in runs)
    out["rounds"] = len(runs)
    return out


def table(title: str, rows: dict[str, dict[str, Any]]) -> str:
    head = ["router", *(c for c, _, _, _ in COLUMNS)]
    body = []
    for name, s in rows.items():
        cells = [name]
        for _, key, spec, scale in COLUMNS:
            value = s.get(key)
            cells.append("-" if value is None else spec.format(value * scale))
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = [
        title,
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(head, widths, strict=True))
        ),
    ]
    for cells in body:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 round, fewer requests (~3 min)")
    p.add_argument("--rounds", type=int, default=None, help="default 2 (quick: 1)")
    p.add_argument(
        "--routers",
        default="",
        help="comma-separated row names (substrings), or all; default: every row but"
        " the optional ones (corral prefix_aff hold8 [fifo], least_load x2, prefix_aff x2"
        " noshare, sglang round_robin)",
    )
    p.add_argument("--workloads", default="chat,rag,control")
    p.add_argument("--chat-rates", default="20,36", help="offered req/s levels of chat")
    p.add_argument("--rag-rates", default="12,24")
    p.add_argument("--control-rates", default="16")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think", type=float, default=0.3, help="mean think time between turns, s")
    p.add_argument("--questions", type=int, default=100, help="requests per rag/control run")
    p.add_argument("--documents", type=int, default=DOCUMENTS, help="rag's shared documents")
    p.add_argument(
        "--system-prompts",
        type=int,
        default=SYSTEM_PROMPTS,
        help="chat's shared system prompts (prompt families)",
    )
    p.add_argument("--chat-max-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16, help="rag and control answers")
    p.add_argument("--cache-blocks", type=int, default=1536, help="each engine's KV cache")
    p.add_argument(
        "--prefill-ms",
        type=float,
        default=EngineConfig.prefill_per_token_ms,
        help="the engines' time per uncached prompt token (raise it for a prefill-bound fleet:"
        " a slower GPU or a bigger model)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="per request, s")
    p.add_argument(
        "--untagged",
        action="store_true",
        help="every engine serves the model name clients ask for (no affinity column): to"
        " check that naming the engines apart changes no router's choices",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="run each corral row picked also from another tree's src (its compiled module"
        " built there), as a row named 'ROW [NAME]': a change measured in one run",
    )
    p.add_argument("--seed", default="llm-routing")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main() -> int:
    args = build_parser().parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    if args.quick:
        args.conversations = min(args.conversations, 20)
        args.questions = min(args.questions, 30)
    levels: dict[str, list[float]] = {
        "chat": rates(args.chat_rates),
        "rag": rates(args.rag_rates),
        "control": rates(args.control_rates),
    }
    workloads = [w for w in args.workloads.split(",") if w in levels]
    have = ensure_peers()
    nginx = ensure_nginx()
    specs = default_specs()
    if not args.routers:
        specs = [s for s in specs if not s.optional]
    elif args.routers != "all":
        wanted = [w.strip() for w in args.routers.split(",") if w.strip()]
        specs = [s for s in specs if any(w in s.name for w in wanted)]
    for item in args.compare:
        label, _, src = item.partition("=")
        specs += [
            replace(s, name=f"{s.name} [{label}]", src=src) for s in specs if s.kind == "corral"
        ]
    usable = []
    for spec in specs:
        if spec.kind == "sglang" and not have["sglang-router"]:
            log(f"skipping {spec.name}: sglang-router is not installed")
        elif spec.kind == "vllm" and not have["vllm-router"]:
            log(f"skipping {spec.name}: vllm-router is not installed")
        elif spec.kind == "nginx" and nginx is None:
            log(f"skipping {spec.name}: nginx could not be installed")
        elif spec.kind == "corral" and spec.policy == "prefix_affinity" and not prefix_importable():
            log(f"skipping {spec.name}: corral.balancer.prefix_policy does not import yet")
        else:
            usable.append(spec)
    config = EngineConfig(
        max_batch=8,
        block_size=16,
        cache_blocks=args.cache_blocks,
        prefill_per_token_ms=args.prefill_ms,
    )
    started: list[subprocess.Popen[Any]] = []
    raw: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": os.getloadavg(),
        },
        "versions": versions(),
        "config": {
            "engine": asdict(config),
            "engines": N_ENGINES,
            "rounds": rounds,
            "levels": {w: levels[w] for w in workloads},
            **{k: v for k, v in vars(args).items() if k not in ("out",)},
        },
        "runs": raw,
    }
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="llm-routing-") as tmp_name:
            tmp = Path(tmp_name)
            os.chmod(tmp, 0o755)  # nginx's workers may run as another user
            fleet = start_fleet(config, tmp, started, tagged=not args.untagged)
            urls = [e.url for e in fleet]
            log(f"fleet: {N_ENGINES} engines {config}")
            routers: list[Router] = []
            for spec in usable:
                try:
                    routers.append(start_router(spec, urls, tmp, nginx, started))
                    log(f"router up: {spec.name} on port {routers[-1].port}")
                except (RuntimeError, OSError) as exc:
                    log(f"skipping {spec.name}: {exc}")
            run_index = 0
            for rnd in range(rounds):
                for wname in workloads:
                    for li, rate in enumerate(levels[wname]):
                        wl = workload_of(args, wname, rate)
                        shape_seed = f"{args.seed}/{wname}/{rate}/{rnd}"
                        k = (rnd + li) % max(1, len(routers))
                        for router in routers[k:] + routers[:k]:
                            run_index += 1
                            salt = f"r{run_index}"
                            run = measure(router, fleet, wl, shape_seed, salt, args.timeout)
                            run.update(
                                round=rnd, workload=wname, rate=rate, router=router.spec.name
                            )
                            raw.append(run)
                            log(
                                f"round {rnd + 1}/{rounds} {wname}@{rate:g} {router.spec.name:<24} "
                                f"{run['rps']:5.1f} req/s ttft p50/p99 "
                                f"{fmt_ms(run['ttft_p50'])}/{fmt_ms(run['ttft_p99'])} ms "
                                f"hit {fmt(run['hit_rate'])} share {fmt(run['max_share'])} "
                                f"err {sum(run['errors'].values())}"
                            )
            for router in routers:
                for proc in router.procs:
                    end_tree(proc)
    except KeyboardInterrupt:
        log("interrupted: stopping every process this script started")
    finally:
        for proc in reversed(started):
            end_tree(proc, grace=3)
        signal.signal(signal.SIGTERM, previous)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["summary"] = report_tables(raw, workloads, levels, [s.name for s in usable])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    log(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the same cleanup ends every process this script started."""
    raise KeyboardInterrupt


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def workload_of(args: argparse.Namespace, name: str, rate: float) -> Workload:
    if name == "chat":
        return Workload(
            "chat",
            rate,
            args.conversations * args.turns,
            args.chat_max_tokens,
            args.turns,
            args.think,
            system_prompts=args.system_prompts,
        )
    return Workload(name, rate, args.questions, args.max_tokens, documents=args.documents)


def prefix_importable() -> bool:
    try:
        from corral.balancer.routing import make_policy

        make_policy("prefix_affinity")
    except Exception:  # any failure means "not finished yet"
        return False
    return True


def report_tables(
    raw: list[dict[str, Any]],
    workloads: list[str],
    levels: dict[str, list[float]],
    names: list[str],
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for wname in workloads:
        for rate in levels[wname]:
            rows = {}
            for name in names:
                runs = [
                    r
                    for r in raw
                    if r["workload"] == wname and r["rate"] == rate and r["router"] == name
                ]
                if runs:
                    rows[name] = summarize(runs)
            if rows:
                summary[f"{wname}@{rate:g}"] = rows
                n = max(s["rounds"] for s in rows.values())
                print()
                print(
                    table(
                        f"== {wname}, offered {rate:g} req/s (median of {n} round(s); times in"
                        " ms; hit = the fleet's prefix-cache hit rate)",
                        rows,
                    )
                )
    goodput: dict[str, dict[str, float | None]] = {}
    for wname in workloads:
        for name in names:
            best = None
            for rate in sorted(levels[wname]):
                s = summary.get(f"{wname}@{rate:g}", {}).get(name)
                if (
                    s
                    and s["ttft_p99"] is not None
                    and s["ttft_p99"] < GOODPUT_TTFT_P99
                    and s["errors_n"] == 0
                ):
                    best = rate
            goodput.setdefault(name, {})[wname] = best
    summary["goodput"] = goodput
    print()
    print(
        f"== goodput: highest offered req/s among the levels with TTFT p99 <"
        f" {GOODPUT_TTFT_P99 * 1000:.0f} ms and no errors"
    )
    width = max([len(n) for n in names] + [6])
    print("router".ljust(width) + "".join(f"  {w:>8}" for w in workloads))
    for name in names:
        cells = "".join(f"  {fmt_rate(goodput[name].get(w)):>8}" for w in workloads)
        print(name.ljust(width) + cells)
    return summary


def fmt_rate(value: float | None) -> str:
    return "<min" if value is None else f"{value:g}"


if __name__ == "__main__":
    sys.exit(main())
