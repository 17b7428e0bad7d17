"""Benchmark: corral's load balancer vs nginx vs direct-to-replica, on the same 4 replicas.

Why this exists: users put production traffic (LLM token streams included) through corral's
balancer, and the reference points are known: nginx at ~7-10k req/s on this kind of machine, a
minimal aiohttp proxy at ~2-2.6k, SkyServe's FastAPI+httpx balancer at ~250-350 req/s. This
script measures corral's balancer next to nginx and next to no proxy at all, in one run, so the
numbers share the machine's state, and checks that streaming adds no delay.

What runs (everything on 127.0.0.1, every load bounded in time):

1. 4 replicas: bench/_lb_replica.py, a raw-asyncio HTTP server, one process each (fast enough
   that the proxy is the bottleneck).
2. Targets: ``direct`` (wrk straight at replica 1), ``nginx`` (Debian's package, 1 worker, round
   robin, upstream keepalive, in its own prefix under a temp dir, stopped by the pid in its pid
   file), ``corral`` (bench/_lb_proxy.py: the LoadBalancer alone in a process, round_robin) and
   ``corral+metrics`` (the same with a BalancerMetrics registry).
3. Throughput: ``wrk -t1 -cN -dDs --latency`` at N = 1, 16, 64 against each target, targets
   interleaved per N. Reported: req/s, p50, p99 (wrk's), non-2xx + socket errors, and the proxy's
   CPU seconds per 1k requests (psutil cpu_times of the proxy's processes over the run; nginx =
   master + worker). Ratios are against nginx.
4. Metrics cost: corral and corral+metrics in 8 back-to-back pairs (ABBA order) of 2 s runs
   at 64 connections; reported: the median of the per-pair ratios.
5. Streaming: each replica's ``/sse`` sends 200 events 5 ms apart (the first with the headers).
   A raw-socket client measures time to first event and to the end of the stream, direct vs
   through corral vs through nginx (``proxy_buffering off``), interleaved, and checks all 200
   events arrive.

wrk and nginx are installed with ``apt-get install -y`` when missing (``apt-get update`` first if
the install fails); rows that need a tool that cannot be installed are skipped with a message.

Run: ``.venv/bin/python bench/balancer.py`` (about 2.5 min here) or ``--quick`` (about 40 s).
Results:
a table on stdout and bench/results/balancer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import socket
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "balancer.json"
HOST = "127.0.0.1"
N_REPLICAS = 4
SSE_EVENTS = 200
SSE_INTERVAL = 0.005
# "Equal to direct within a small margin": a proxy's median time to the first event may exceed
# direct's by at most this. 5 ms is a tenth of a typical LLM inter-token gap (~50 ms) and of
# SkyServe's balancer's own p50 (45 ms at 16 connections).
STREAM_TTFB_MARGIN_MS = 5.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- tools


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def apt_install(packages: list[str]) -> bool:
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    log(f"running: {' '.join(cmd)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"  failed: {exc}")
        return False
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        log(f"  exit {proc.returncode}: {' '.join(tail)}")
    return proc.returncode == 0


def ensure_tools() -> tuple[str | None, str | None]:
    """wrk and nginx paths, installing the Debian packages when missing."""
    wanted = {"wrk": shutil.which("wrk"), "nginx": find_nginx()}
    if all(wanted.values()):
        return wanted["wrk"], wanted["nginx"]
    if shutil.which("apt-get") is None:
        log("apt-get not found: cannot install wrk/nginx")
        return wanted["wrk"], wanted["nginx"]
    updated = False
    for tool, candidates in (("wrk", ["wrk"]), ("nginx", ["nginx-light", "nginx"])):
        if wanted[tool]:
            continue
        for package in candidates:
            ok = apt_install([package])
            if not ok and not updated:
                log("running: apt-get update (once)")
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(["apt-get", "update"], capture_output=True, timeout=300)
                updated = True
                ok = apt_install([package])
            if ok:
                break
        wanted[tool] = shutil.which("wrk") if tool == "wrk" else find_nginx()
        if not wanted[tool]:
            log(f"{tool} could not be installed: its rows will be skipped")
    return wanted["wrk"], wanted["nginx"]


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    port: int
    output: list[str] = field(default_factory=list)  # drained by a thread: a full pipe blocks

    @property
    def pid(self) -> int:
        return self.popen.pid


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def start_python(name: str, args: list[str], timeout: float = 20.0) -> Proc:
    """Start one of the bench helpers and wait for its ``PORT n`` line."""
    popen = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if line.startswith("PORT "):
            proc = Proc(name, popen, int(line.split()[1]))
            threading.Thread(target=proc.output.extend, args=(popen.stdout,), daemon=True).start()
            return proc
        if not line and popen.poll() is not None:
            break
    stop_pid(popen.pid, popen)
    raise RuntimeError(f"{name} did not start")


def stop_pid(
    pid: int, popen: subprocess.Popen[str] | None = None, sig: int = signal.SIGTERM
) -> None:
    """Stop one process by pid: the signal, then SIGKILL after 5 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if popen is not None:
            if popen.poll() is not None:
                return
        elif not psutil.pid_exists(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(5)


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
    keepalive_requests 1000000;
    upstream replicas {{
        {servers}
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
        location /sse {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@dataclass
class Nginx:
    popen: subprocess.Popen[str]
    prefix: Path
    port: int

    @property
    def pid(self) -> int:
        """The master's pid, from its own pid file (what it is stopped by)."""
        return int((self.prefix / "nginx.pid").read_text().strip())


def start_nginx(binary: str, prefix: Path, replica_ports: list[int]) -> Nginx:
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;\n" if os.geteuid() == 0 else "",
            prefix=prefix,
            host=HOST,
            port=port,
            servers="\n        ".join(f"server {HOST}:{p};" for p in replica_ports),
        )
    )
    base = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise RuntimeError(f"nginx -t failed: {check.stderr.strip()}")
    popen = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    nginx = Nginx(popen, prefix, port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            log_file = prefix / "error.log"
            errors = log_file.read_text()[-500:] if log_file.exists() else ""
            raise RuntimeError(f"nginx exited {popen.returncode}: {errors}")
        with contextlib.suppress(OSError, ValueError):
            if nginx.pid == popen.pid and http_ok(port):
                return nginx
        time.sleep(0.05)
    stop_nginx(nginx)
    raise RuntimeError("nginx did not start")


def stop_nginx(nginx: Nginx) -> None:
    """SIGQUIT (graceful) to the pid in the pid file, falling back to the Popen pid."""
    try:
        pid = nginx.pid
    except (OSError, ValueError):
        pid = nginx.popen.pid
    if pid != nginx.popen.pid:  # never signal anything this script did not start
        pid = nginx.popen.pid
    stop_pid(pid, nginx.popen, signal.SIGQUIT)


def http_ok(port: int, path: str = "/") -> bool:
    with socket.create_connection((HOST, port), timeout=2) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and their children (nginx's worker)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ---------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    target: str
    connections: int
    duration_s: float
    requests: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0
    proxy_cpu_s: float | None = None
    cpu_s_per_1k: float | None = None
    note: str = ""


_UNIT = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if m is None:
        raise ValueError(f"unparsable latency {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_wrk(out: str, result: WrkResult) -> None:
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m:
        result.requests = int(m.group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        result.rps = float(m.group(1))
    for pct, attr in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", out, re.M)
        if m:
            setattr(result, attr, _ms(m.group(1)))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        result.errors += sum(int(g) for g in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        result.errors += int(m.group(1))


def run_wrk(
    wrk: str, target: str, port: int, conns: int, duration: int, cpu_pids: list[int]
) -> WrkResult:
    result = WrkResult(target, conns, duration)
    cmd = [
        wrk,
        "-t1",
        f"-c{conns}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "5s",
        f"http://{HOST}:{port}/",
    ]
    before = cpu_seconds(cpu_pids) if cpu_pids else 0.0
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30)
    if cpu_pids:
        result.proxy_cpu_s = round(cpu_seconds(cpu_pids) - before, 3)
    if proc.returncode != 0:
        result.note = f"wrk exit {proc.returncode}: {proc.stderr.strip()[:200]}"
    parse_wrk(proc.stdout, result)
    if result.proxy_cpu_s is not None and result.requests:
        result.cpu_s_per_1k = round(result.proxy_cpu_s / result.requests * 1000, 4)
    return result


def metrics_ab(
    wrk: str, targets: dict[str, tuple[int, list[int]]], rounds: int, duration: int
) -> dict[str, Any]:
    """corral without and with metrics, in short alternated runs at 64 connections.

    The cost measured (a few us per request) is far below the drift of a shared machine over a
    minute, so each round is a back-to-back pair, in ABBA order (whatever favours the first run
    of a pair favours both alike), and the result is the median of the per-pair ratios: drift
    slower than a pair cancels out.
    """
    off: list[WrkResult] = []
    on: list[WrkResult] = []
    for i in range(rounds):
        order = ["corral", "corral+metrics"] if i % 2 == 0 else ["corral+metrics", "corral"]
        for name in order:
            port, pids = targets[name]
            r = run_wrk(wrk, name, port, 64, duration, pids)
            (on if name == "corral+metrics" else off).append(r)
    rps_ratios = [b.rps / a.rps for a, b in zip(off, on, strict=True) if a.rps and b.rps]
    cpu_ratios = [
        b.cpu_s_per_1k / a.cpu_s_per_1k
        for a, b in zip(off, on, strict=True)
        if a.cpu_s_per_1k and b.cpu_s_per_1k
    ]

    def pct(ratios: list[float]) -> float | None:
        return round((statistics.median(ratios) - 1) * 100, 1) if ratios else None

    return {
        "connections": 64,
        "rounds": rounds,
        "duration_s": duration,
        "rps_off": [round(r.rps) for r in off],
        "rps_on": [round(r.rps) for r in on],
        "cpu_s_per_1k_off": [r.cpu_s_per_1k for r in off],
        "cpu_s_per_1k_on": [r.cpu_s_per_1k for r in on],
        "rps_change_pct": pct(rps_ratios),
        "cpu_per_req_change_pct": pct(cpu_ratios),
    }


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


# ---------------------------------------------------------------------------- report


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[WrkResult]) -> str:
    nginx = {r.connections: r for r in results if r.target == "nginx" and r.rps}
    head = (
        "| conns | target         |   req/s | p50 ms | p99 ms | errors | proxy CPU s/1k req "
        "| req/s vs nginx | CPU/req vs nginx |"
    )
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in results:
        ref = nginx.get(r.connections)
        ratio = f"{r.rps / ref.rps:.2f}x" if ref and r.rps and r.target != "nginx" else ""
        cpu_ratio = ""
        if ref and ref.cpu_s_per_1k and r.cpu_s_per_1k and r.target != "nginx":
            cpu_ratio = f"{r.cpu_s_per_1k / ref.cpu_s_per_1k:.1f}x"
        rps = f"{r.rps:7.0f}" if r.rps else "skipped"
        lines.append(
            f"| {r.connections:5d} | {r.target:14s} | {rps:>7s} | {fmt(r.p50_ms, '6.2f'):>6s} "
            f"| {fmt(r.p99_ms, '6.2f'):>6s} | {r.errors:6d} | {fmt(r.cpu_s_per_1k, '.3f'):>18s} "
            f"| {ratio:>14s} | {cpu_ratio:>16s} |"
        )
    return "\n".join(lines)


def stream_table(summary: dict[str, Any]) -> str:
    lines = [
        "| target | runs | TTFB median ms | TTFB max ms | TTFB vs direct ms "
        f"| total median ms | total vs direct ms | events | within {STREAM_TTFB_MARGIN_MS:g} ms |",
        "|--------|------|----------------|-------------|-------------------"
        "|-----------------|--------------------|--------|-------------|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['runs']} | {s['ttfb_ms_median']:.2f} | {s['ttfb_ms_max']:.2f} "
            f"| {s.get('ttfb_vs_direct_ms', 0):+.2f} | {s['total_ms_median']:.0f} "
            f"| {s.get('total_vs_direct_ms', 0):+.0f} | {s['events_min']}/{SSE_EVENTS} "
            f"| {'ok' if s.get('ttfb_within_margin') else 'MISS'} |"
        )
    return "\n".join(lines)


@dataclass
class Report:
    started: str
    machine: dict[str, Any]
    config: dict[str, Any]
    throughput: list[dict[str, Any]] = field(default_factory=list)
    metrics_ab: dict[str, Any] = field(default_factory=dict)
    streaming: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def machine() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def tool_version(cmd: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        out = (proc.stdout + proc.stderr).strip().splitlines()
        return out[0] if out else ""
    return ""


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            stop_pid(p.pid, p.popen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s runs, 1 and 64 connections")
    parser.add_argument("--duration", type=int, help="seconds per wrk run (default 5, quick 2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    duration: int = args.duration or (2 if args.quick else 5)
    conns_list = [1, 64] if args.quick else [1, 16, 64]
    stream_rounds = 4 if args.quick else 12
    ab_rounds = 2 if args.quick else 8
    ab_duration = 2  # wrk takes whole seconds
    warmup = 0 if args.quick else 1
    t_start = time.monotonic()

    report = Report(
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        config={
            "duration_s": duration,
            "connections": conns_list,
            "wrk": "wrk -t1 -cN --latency",
            "replicas": N_REPLICAS,
            "corral_policy": "round_robin",
            "sse_events": SSE_EVENTS,
            "sse_interval_s": SSE_INTERVAL,
            "stream_rounds": stream_rounds,
            "stream_ttfb_margin_ms": STREAM_TTFB_MARGIN_MS,
        },
    )
    log(f"load average at start: {report.machine['loadavg_start']}")
    wrk, nginx_bin = ensure_tools()
    log(f"wrk: {wrk or 'missing'}; nginx: {nginx_bin or 'missing'}")
    report.config["wrk_version"] = tool_version([wrk, "--version"]) if wrk else None
    report.config["nginx_version"] = tool_version([nginx_bin, "-v"]) if nginx_bin else None

    with processes() as procs, tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp:
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
        urls = [arg for port in replica_ports for arg in ("--replica", f"http://{HOST}:{port}")]
        corral = start_python("corral", [str(HERE / "_lb_proxy.py"), *urls])
        procs.append(corral)
        corral_m = start_python("corral+metrics", [str(HERE / "_lb_proxy.py"), *urls, "--metrics"])
        procs.append(corral_m)

        nginx: Nginx | None = None
        if nginx_bin:
            prefix = Path(tmp) / "nginx"
            prefix.mkdir()
            os.chmod(tmp, 0o755)
            try:
                nginx = start_nginx(nginx_bin, prefix, replica_ports)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                log(f"nginx did not start ({exc}): nginx rows skipped")
                report.skipped.append(f"nginx: {exc}")
        else:
            report.skipped.append("nginx: not installed and could not be installed")
        try:
            targets: dict[str, tuple[int, list[int]]] = {
                "direct": (replica_ports[0], []),
                "corral": (corral.port, [corral.pid]),
                "corral+metrics": (corral_m.port, [corral_m.pid]),
            }
            if nginx is not None:
                targets = {"nginx": (nginx.port, [nginx.pid]), **targets}
            for name, (port, _) in targets.items():
                if not http_ok(port):
                    raise RuntimeError(f"{name} does not answer 200 ok on port {port}")
            log(f"targets up: { {k: v[0] for k, v in targets.items()} }")

            if wrk is None:
                report.skipped.append("throughput: wrk not installed and could not be installed")
                log("wrk missing: throughput rows skipped")
            else:
                results: list[WrkResult] = []
                for conns in conns_list:
                    for name, (port, pids) in targets.items():
                        if warmup:
                            run_wrk(wrk, name, port, conns, warmup, [])
                        r = run_wrk(wrk, name, port, conns, duration, pids)
                        results.append(r)
                        log(
                            f"c={conns:<3d} {name:15s} {r.rps:8.0f} req/s  "
                            f"p50 {fmt(r.p50_ms, '.2f')} ms  p99 {fmt(r.p99_ms, '.2f')} ms  "
                            f"cpu/1k {fmt(r.cpu_s_per_1k, '.3f')} s  errors {r.errors} {r.note}"
                        )
                report.throughput = [asdict(r) for r in results]

                report.metrics_ab = metrics_ab(wrk, targets, ab_rounds, ab_duration)
                log(f"metrics A/B at 64 connections: {report.metrics_ab}")

            stream_targets = {"direct": replica_ports[0], "corral": corral.port}
            if nginx is not None:
                stream_targets["nginx"] = nginx.port
            log(f"streaming: {stream_rounds} rounds of /sse ({SSE_EVENTS} events) per target")
            report.streaming = run_streams(stream_targets, stream_rounds)
        finally:
            if nginx is not None:
                stop_nginx(nginx)
        stop_pid(corral_m.pid, corral_m.popen)
        time.sleep(0.2)  # let the drain thread take the last line
        m = re.search(r"METRICS requests_total=(\d+)", "".join(corral_m.output))
        report.config["corral_metrics_requests_total"] = int(m.group(1)) if m else None

    report.machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report.wall_s = round(time.monotonic() - t_start, 1)
    print()
    print(
        f"Machine: nproc {report.machine['nproc']}, load average "
        f"{report.machine['loadavg_start']} at start, {report.machine['loadavg_end']} at end; "
        f"{report.config.get('nginx_version') or 'nginx: none'}; "
        f"{report.config.get('wrk_version') or 'wrk: none'}; wall {report.wall_s} s"
    )
    if report.throughput:
        print()
        print(table([WrkResult(**r) for r in report.throughput]))
    if report.metrics_ab:
        ab = report.metrics_ab
        print()
        print(
            f"Metrics on vs off (64 conns, {ab['rounds']} ABBA pairs, median of pair ratios): "
            f"req/s {fmt(ab['rps_change_pct'], '+.1f')}%, CPU per request "
            f"{fmt(ab['cpu_per_req_change_pct'], '+.1f')}%"
        )
    if report.streaming:
        print()
        print(stream_table(report.streaming))
    for s in report.skipped:
        print(f"SKIPPED: {s}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
