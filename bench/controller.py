"""Benchmark: corral's controller path: `up` latency, daemon memory, failure detection.

Why this exists: corral's claim against SkyServe is a cheap control plane (one daemon hosting
every service instead of a controller + balancer process pair per service) that reacts fast (the
balancer's ready set is updated in-process, not synced every 20 s). This script puts numbers on
both, on this machine, with the real CLI and the real daemon:

1. `up` latency. From the `corral up --detach` invocation to the first and to all replicas
   READY, for 1, 8 and 32 replicas of examples/app.py (probe period 0.2 s), once with the daemon
   started by that `up` (cold) and once on an already running daemon (warm). The same N copies of
   the app started directly with subprocess give the app's own start time, so corral's overhead
   is reported separately from the app's.
2. Daemon memory (RSS and USS of the daemon pid only, not its replicas) with 0, 1 and 20
   services of 2 replicas, after everything is READY, plus the daemon's idle CPU.
3. Failure detection. A READY replica of a 3-replica service is killed with SIGKILL while ~200
   req/s flow through the balancer; measured: when `status` stops showing it READY, when the
   ready set dropped it (the daemon's event time), how many requests the balancer still routed to
   the dead port (seen by a listener that takes the port over, see bench/_ctrl_traffic.py), how
   many errors the client saw, and when a replacement was READY.

Every scenario runs in a fresh CORRAL_HOME (temp dir) and is torn down in ``finally`` (`down
--all`, `daemon stop`, then kill by pid whatever is left; see bench/_ctrl_harness.py). All
traffic is to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
from _ctrl_harness import (
    CORRAL_BIN,
    READY,
    CorralHome,
    corral_home,
    progress,
    ready_count,
    run_apps_direct,
    spec_yaml,
)
from _ctrl_traffic import DeadPortListener, RequestStream

from corral.client import ensure_daemon
from corral.home import read_info

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "results" / "controller.json"
MB = 1024 * 1024

PROBE_PERIOD = 0.2  # s, scenarios 1 and 3: small, so the probe period does not dominate
MEMORY_PROBE_PERIOD = 1.0  # s, scenario 2: the demo's period, a realistic idle daemon
STATUS_POLL = 0.02  # s between status polls while timing `up`
FAILOVER_POLL = 0.01  # s between status polls after the kill
STREAM_RATE = 200.0  # req/s through the balancer during the kill
STREAM_CONNECTIONS = 8  # keep-alive connections sharing that rate
STREAM_WARMUP = 0.5  # s of traffic before the kill
STREAM_AFTER = 1.0  # s of traffic kept after `status` showed the replica gone
STREAM_MAX = 10.0  # s, hard bound of one stream
FAILOVER_REPLICAS = 3


@dataclass
class Config:
    """What shapes a run; written into the JSON so runs can be compared."""

    quick: bool
    sizes: list[int]
    memory_services: list[int]
    failover_reps: int
    settle_s: float  # wait after everything is READY before sampling the daemon
    cpu_window_s: float  # idle CPU is measured over this long


# -- results --------------------------------------------------------------------------------------


@dataclass
class AppRun:
    """N app processes started directly: seconds from the first Popen to first/all answering."""

    replicas: int
    first_s: float
    all_s: float
    per_process_p50_s: float  # each process: its own Popen -> its first answer


@dataclass
class UpRun:
    """One `corral up --detach` of N replicas, seconds from the CLI invocation."""

    replicas: int
    daemon: str  # "cold": this `up` started the daemon; "warm": it was running
    cli_return_s: float  # `up --detach` exited (service accepted)
    daemon_listening_s: float | None  # cold only: the daemon's API listened (daemon.json)
    accepted_s: float  # the service's first event in the daemon (wall-clock event time)
    first_ready_s: float  # polled: first replica READY in `GET /v1/services/NAME`
    all_ready_s: float
    first_ready_event_s: float  # the daemon's replica.ready event times (no poll granularity)
    all_ready_event_s: float
    down_s: float | None = None  # `corral down --all` of these replicas, wall time

    @property
    def daemon_side_s(self) -> float:
        """Service accepted -> all READY: the daemon's part (launch, app start, probing)."""
        return self.all_ready_event_s - self.accepted_s


@dataclass
class MemPoint:
    services: int
    replicas: int
    rss_mb: float
    uss_mb: float | None
    threads: int
    fds: int
    idle_cpu_pct: float  # daemon CPU over 2 s with everything READY and no traffic


@dataclass
class FailoverRep:
    """One SIGKILL of a READY replica; times in seconds from the kill."""

    rep: int
    replica_id: int
    status_not_ready_s: float | None  # polled `status` first shows it not READY
    status_seen: str | None  # what it showed then
    ready_set_removed_s: float | None  # replica.failed / replica.not_ready event
    removed_by: str | None  # which of the two
    routed_to_dead: int  # stream requests that arrived at the dead port (attempts)
    routed_distinct: int  # ... counting each client request once
    sent_while_routable: int  # client requests sent from the kill to the ready-set removal
    last_routed_s: float | None
    listener_bound_ms: float | None  # kill -> listener owned the port (blind spot before it)
    requests: int
    requests_after_kill: int
    achieved_rate: float  # req/s actually sent (the target is STREAM_RATE)
    client_errors: int  # non-200 or no answer, whole stream
    answered_by_dead: int  # replies after the kill carrying the dead pid (must be 0)
    latency_p50_before_ms: float
    latency_max_after_ms: float
    replaced_s: float | None  # a new replica READY (back to 3 READY)


# -- scenario 1: up latency -----------------------------------------------------------------------


def measure_app(n: int) -> AppRun:
    """The app's own start time for N parallel copies: the floor corral's `up` is compared to."""
    apps = run_apps_direct(n)
    if any(a is None for a in apps.answered):
        raise RuntimeError(f"direct app run: {apps.answered.count(None)} of {n} never answered")
    answered = [a for a in apps.answered if a is not None]
    t0 = apps.started[0]
    return AppRun(
        replicas=n,
        first_s=min(answered) - t0,
        all_s=max(answered) - t0,
        per_process_p50_s=statistics.median(
            a - s for a, s in zip(answered, apps.started, strict=True)
        ),
    )


def measure_up(h: CorralHome, name: str, n: int, daemon: str, timeout: float = 120.0) -> UpRun:
    """Run `corral up --detach` and poll the service until all ``n`` replicas are READY."""
    spec = h.write_spec(name, n, PROBE_PERIOD)
    wall0 = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        h.argv("up", str(spec), "--detach"),
        env=h.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cli_s: float | None = None
    first: float | None = None
    all_: float | None = None
    try:
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            if not h.daemons:
                h.daemon_pid()  # tracked as soon as it exists, so cleanup can always reach it
            if cli_s is None and proc.poll() is not None:
                cli_s = time.perf_counter() - t0
                if proc.returncode != 0:
                    _, stderr = proc.communicate(timeout=5)
                    raise RuntimeError(f"corral up exited {proc.returncode}: {stderr.strip()}")
            service = h.service(name)
            now = time.perf_counter()
            if service is not None:
                ready = ready_count(service)
                if ready and first is None:
                    first = now - t0
                if ready >= n:
                    all_ = now - t0
                    break
            time.sleep(STATUS_POLL)
        if first is None or all_ is None:
            raise TimeoutError(f"{name}: {n} replicas not READY within {timeout:g}s")
        if cli_s is None:
            proc.wait(timeout=30)
            cli_s = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    events = h.events(name)
    ready_ts = sorted(e["ts"] for e in events if e["action"] == "replica.ready")
    h.daemon_pid()  # remembered for cleanup
    listening = None
    info = read_info(h.home)
    if daemon == "cold" and info is not None:
        listening = float(info["started_at"]) - wall0
    return UpRun(
        replicas=n,
        daemon=daemon,
        cli_return_s=cli_s,
        daemon_listening_s=listening,
        accepted_s=min(e["ts"] for e in events) - wall0,
        first_ready_s=first,
        all_ready_s=all_,
        first_ready_event_s=ready_ts[0] - wall0,
        all_ready_event_s=ready_ts[n - 1] - wall0,
    )


def measure_cli_startup() -> float:
    """Wall time of `corral --help`: the CLI's import cost, paid by every `corral` command."""
    t0 = time.perf_counter()
    subprocess.run(
        [CORRAL_BIN, "--help"],
        capture_output=True,
        timeout=60,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def scenario_up(cfg: Config, problems: list[str]) -> tuple[list[AppRun], list[UpRun]]:
    """Per N: the app alone, then a cold `up` (starts the daemon) and a warm one (same daemon,
    after `down --all`), so the daemon's start and the CLI's cost can be told apart."""
    apps: list[AppRun] = []
    ups: list[UpRun] = []
    for n in cfg.sizes:
        progress(f"[up] {n} replicas: app started directly")
        apps.append(measure_app(n))
        with corral_home(f"up{n}", problems) as h:
            progress(f"[up] {n} replicas: cold `corral up` (starts the daemon)")
            cold = measure_up(h, "cold", n, "cold")
            cold.down_s = h.down_all(problems)
            ups.append(cold)
            progress(f"[up] {n} replicas: warm `corral up` (daemon already running)")
            ups.append(measure_up(h, "warm", n, "warm"))
    return apps, ups


# -- scenario 2: daemon memory --------------------------------------------------------------------


def sample_daemon(cfg: Config, pid: int, services: int, replicas: int) -> MemPoint:
    """Memory of the daemon process alone (its replicas are separate processes), after a short
    settle, and its CPU over a short idle window (probes only, no traffic)."""
    proc = psutil.Process(pid)
    time.sleep(cfg.settle_s)
    cpu0 = proc.cpu_times()
    t0 = time.perf_counter()
    time.sleep(cfg.cpu_window_s)
    cpu1 = proc.cpu_times()
    elapsed = time.perf_counter() - t0
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    uss: float | None
    try:
        uss = proc.memory_full_info().uss / MB
    except (psutil.AccessDenied, AttributeError):
        uss = None
    return MemPoint(
        services=services,
        replicas=replicas,
        rss_mb=proc.memory_info().rss / MB,
        uss_mb=uss,
        threads=proc.num_threads(),
        fds=proc.num_fds(),
        idle_cpu_pct=100.0 * cpu / elapsed,
    )


def scenario_memory(cfg: Config, problems: list[str]) -> list[MemPoint]:
    """One daemon, growing from 0 to 1 to 20 services: the per-service cost is the slope, which
    is what compares to SkyServe's per-service controller memory. Services are created through
    the API client (what `up` posts) to keep 20 CLI start-ups out of the run time."""
    points: list[MemPoint] = []
    with corral_home("memory", problems) as h:
        progress("[memory] daemon with 0 services")
        ensure_daemon(h.home)  # what `corral up` does when no daemon answers
        pid = h.daemon_pid()
        if pid is None:
            raise RuntimeError("daemon started but daemon.json has no pid")
        points.append(sample_daemon(cfg, pid, 0, 0))
        made = 0
        for count in cfg.memory_services:
            progress(f"[memory] daemon with {count} service(s) of 2 replicas")
            for i in range(made, count):
                name = f"m{i + 1:02d}"
                h.client.create(
                    spec_yaml(name, 2, MEMORY_PROBE_PERIOD),
                    name=None,
                    source=str(h.root / f"{name}.yaml"),
                    base_dir=str(h.root),
                )
            made = count

            def all_ready(services: list[dict[str, Any]], want: int = count) -> bool:
                return len(services) == want and all(ready_count(s) >= 2 for s in services)

            h.wait_until(all_ready, timeout=120.0)
            points.append(sample_daemon(cfg, pid, count, 2 * count))
    return points


# -- scenario 3: failure detection ----------------------------------------------------------------


def _find(service: dict[str, Any] | None, replica_id: int) -> dict[str, Any] | None:
    if service is None:
        return None
    return next((r for r in service["replicas"] if r["id"] == replica_id), None)


def kill_one(h: CorralHome, name: str, endpoint: str, rep: int) -> FailoverRep:
    """SIGKILL the lowest-id READY replica under traffic; time what the user and the balancer see.

    The pid is signalled only if the harness verified it (seen in a status answer, start time
    recorded), never a pid read and used blindly.
    """
    service = h.service(name)
    if service is None:
        raise RuntimeError(f"service {name} vanished")
    victim = min((r for r in service["replicas"] if r["status"] == READY), key=lambda r: r["id"])
    pid = int(victim["pid"])
    try:
        same = abs(psutil.Process(pid).create_time() - h.replicas[pid]) <= 0.01
    except (KeyError, psutil.Error):
        same = False
    if not same:
        raise RuntimeError(f"replica pid {pid} not verified; refusing to signal it")
    port = urlsplit(victim["endpoint"]).port
    if port is None:
        raise RuntimeError(f"replica endpoint without a port: {victim['endpoint']}")

    stream = RequestStream(
        endpoint, rate=STREAM_RATE, max_seconds=STREAM_MAX, connections=STREAM_CONNECTIONS
    )
    listener = DeadPortListener(port, max_seconds=STREAM_MAX + 2.0)
    stream.start()
    try:
        time.sleep(STREAM_WARMUP)
        listener.start()  # retries bind until the killed process's socket is gone
        wall_kill = time.time()
        t_kill = time.perf_counter()
        os.kill(pid, signal.SIGKILL)

        status_s: float | None = None
        seen: str | None = None
        deadline = t_kill + STREAM_MAX - STREAM_WARMUP - STREAM_AFTER
        while time.perf_counter() < deadline:
            row = _find(h.service(name), victim["id"])
            now = time.perf_counter()
            if row is None or row["status"] != READY:
                status_s = now - t_kill
                seen = "gone" if row is None else str(row["status"])
                break
            time.sleep(FAILOVER_POLL)
        time.sleep(STREAM_AFTER)
    finally:
        stream.stop()
        listener.stop()

    removed_s: float | None = None
    removed_by: str | None = None
    for e in h.events(name):
        if (
            e.get("replica_id") == victim.get("uid", victim["id"])
            and e["action"] in ("replica.failed", "replica.not_ready")
            and e["ts"] >= wall_kill - 0.001
        ):
            removed_s = e["ts"] - wall_kill
            removed_by = str(e["action"])
            break

    hits = listener.bench_hits()
    replies = stream.replies
    before = [r for r in replies if r.sent < t_kill]
    after = [r for r in replies if r.sent >= t_kill]

    replaced: float | None = None
    try:

        def back_to_full(services: list[dict[str, Any]]) -> bool:
            svc = next((s for s in services if s["name"] == name), None)
            if svc is None:
                return False
            ready = [r for r in svc["replicas"] if r["status"] == READY]
            return len(ready) >= FAILOVER_REPLICAS and all(r["id"] != victim["id"] for r in ready)

        h.wait_until(back_to_full, timeout=30.0, interval=0.02)
        replaced = time.perf_counter() - t_kill
    except TimeoutError:
        progress(f"[failover] rep {rep}: no replacement READY within 30 s")

    return FailoverRep(
        rep=rep,
        replica_id=int(victim["id"]),
        status_not_ready_s=status_s,
        status_seen=seen,
        ready_set_removed_s=removed_s,
        removed_by=removed_by,
        routed_to_dead=len(hits),
        routed_distinct=len(listener.bench_requests()),
        sent_while_routable=sum(
            1 for r in after if removed_s is not None and r.sent - t_kill <= removed_s
        ),
        last_routed_s=(max(hits) - t_kill) if hits else None,
        listener_bound_ms=(
            (listener.bound_at - t_kill) * 1000 if listener.bound_at is not None else None
        ),
        requests=len(replies),
        requests_after_kill=len(after),
        achieved_rate=stream.achieved_rate(),
        client_errors=sum(1 for r in replies if r.status != 200),
        answered_by_dead=sum(1 for r in after if r.pid == pid),
        latency_p50_before_ms=(
            statistics.median(r.seconds for r in before) * 1000 if before else float("nan")
        ),
        latency_max_after_ms=max((r.seconds for r in after), default=float("nan")) * 1000,
        replaced_s=replaced,
    )


def scenario_failover(cfg: Config, problems: list[str]) -> list[FailoverRep]:
    """Repeated kills on one service; each rep waits for the replacement, so every kill starts
    from 3 READY replicas."""
    reps: list[FailoverRep] = []
    name = "fo"
    with corral_home("failover", problems) as h:
        progress(f"[failover] {FAILOVER_REPLICAS}-replica service, {cfg.failover_reps} kill(s)")
        spec = h.write_spec(name, FAILOVER_REPLICAS, PROBE_PERIOD)
        result = h.cli("up", str(spec), "--detach")
        if result.returncode != 0:
            raise RuntimeError(f"corral up failed: {result.stderr.strip()}")

        def full(services: list[dict[str, Any]]) -> bool:
            return any(s["name"] == name and ready_count(s) >= FAILOVER_REPLICAS for s in services)

        h.wait_until(full, timeout=60.0, interval=0.05)
        service = h.service(name)
        if service is None or not service["endpoint"]:
            raise RuntimeError(f"service {name} has no endpoint")
        for rep in range(1, cfg.failover_reps + 1):
            r = kill_one(h, name, str(service["endpoint"]), rep)
            progress(
                f"[failover] rep {rep}: status {_s(r.status_not_ready_s)}, ready set "
                f"{_s(r.ready_set_removed_s)}, {r.routed_distinct} routed to dead, "
                f"{r.client_errors} errors"
            )
            reps.append(r)
    return reps


# -- report ---------------------------------------------------------------------------------------


def _s(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _stat(values: Sequence[float | None], how: str) -> float | None:
    present = [v for v in values if v is not None and v == v]
    if not present:
        return None
    return statistics.median(present) if how == "p50" else max(present)


def render(
    apps: list[AppRun],
    ups: list[UpRun],
    mem: list[MemPoint],
    fo: list[FailoverRep],
    cli_startup: float,
) -> str:
    """Markdown-shaped tables (rich, MARKDOWN box): the same text reads in a terminal and in the
    docs."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(
        file=io.StringIO(), width=220, record=True, force_terminal=False, color_system=None
    )
    app_by_n = {a.replicas: a for a in apps}

    t = Table(box=box.MARKDOWN, show_edge=True)
    for col in (
        "replicas",
        "daemon",
        "`up` returns",
        "daemon listening",
        "first READY",
        "all READY",
        "app alone: first",
        "app alone: all",
        "overhead: first",
        "overhead: all",
        "accepted -> all READY",
        "`down --all`",
    ):
        t.add_column(col, justify="left" if col == "daemon" else "right")
    for u in ups:
        a = app_by_n.get(u.replicas)
        t.add_row(
            str(u.replicas),
            u.daemon,
            _s(u.cli_return_s, ".2f"),
            _s(u.daemon_listening_s, ".2f"),
            _s(u.first_ready_s, ".2f"),
            _s(u.all_ready_s, ".2f"),
            _s(a.first_s if a else None, ".2f"),
            _s(a.all_s if a else None, ".2f"),
            _s(u.first_ready_s - a.first_s if a else None, ".2f"),
            _s(u.all_ready_s - a.all_s if a else None, ".2f"),
            _s(u.daemon_side_s, ".2f"),
            _s(u.down_s, ".2f"),
        )

    m = Table(box=box.MARKDOWN, show_edge=True)
    for col in ("services", "replicas", "RSS MB", "USS MB", "threads", "fds", "idle CPU %"):
        m.add_column(col, justify="right")
    for p in mem:
        m.add_row(
            str(p.services),
            str(p.replicas),
            f"{p.rss_mb:.1f}",
            _s(p.uss_mb, ".1f"),
            str(p.threads),
            str(p.fds),
            f"{p.idle_cpu_pct:.1f}",
        )

    f = Table(box=box.MARKDOWN, show_edge=True)
    for col in (
        "kill",
        "`status` not READY s",
        "ready set dropped s",
        "reqs routed to dead / sent before drop",
        "last routed s",
        "client errors / reqs",
        "req/s sent",
        "max latency after kill ms",
        "replacement READY s",
    ):
        f.add_column(col, justify="right")
    for r in fo:
        f.add_row(
            str(r.rep),
            f"{_s(r.status_not_ready_s)} ({r.status_seen or '-'})",
            _s(r.ready_set_removed_s),
            f"{r.routed_distinct} / {r.sent_while_routable}",
            _s(r.last_routed_s),
            f"{r.client_errors} / {r.requests}",
            f"{r.achieved_rate:.0f}",
            _s(r.latency_max_after_ms, ".1f"),
            _s(r.replaced_s, ".2f"),
        )
    if len(fo) > 1:
        for how in ("p50", "max"):
            f.add_row(
                how,
                _s(_stat([r.status_not_ready_s for r in fo], how)),
                _s(_stat([r.ready_set_removed_s for r in fo], how)),
                _s(_stat([float(r.routed_distinct) for r in fo], how), ".0f"),
                _s(_stat([r.last_routed_s for r in fo], how)),
                _s(_stat([float(r.client_errors) for r in fo], how), ".0f"),
                _s(_stat([r.achieved_rate for r in fo], how), ".0f"),
                _s(_stat([r.latency_max_after_ms for r in fo], how), ".1f"),
                _s(_stat([r.replaced_s for r in fo], how), ".2f"),
            )

    console.print("`up` latency, seconds from the CLI invocation (overhead = corral - app alone)")
    console.print(t)
    console.print(
        f"  `corral --help` (the CLI's start-up, paid by every command): {cli_startup:.2f} s; "
        "`accepted -> all READY` is the daemon's part (event times)"
    )
    console.print()
    console.print("Daemon memory (daemon pid only), everything READY, probe period 1 s")
    console.print(m)
    if len(mem) >= 2 and mem[-1].services:
        first, last = mem[0], mem[-1]
        console.print(
            f"  per service (0 -> {last.services}): "
            f"{(last.rss_mb - first.rss_mb) / last.services:.2f} MB RSS"
            + (
                f", {(last.uss_mb - first.uss_mb) / last.services:.2f} MB USS"
                if last.uss_mb is not None and first.uss_mb is not None
                else ""
            )
        )
    console.print()
    console.print(
        f"Failure detection: SIGKILL of 1 of {FAILOVER_REPLICAS} READY replicas under "
        f"{STREAM_RATE:g} req/s; seconds from the kill"
    )
    console.print(f)
    return console.export_text()


def machine_info() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
        "mem_total_gb": round(vm.total / 1024**3, 1),
        "mem_available_gb": round(vm.available / 1024**3, 1),
    }


def _clean(o: object) -> object:
    """JSON has no NaN: a value that could not be measured becomes null."""
    if isinstance(o, float):
        return None if o != o else round(o, 6)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--quick", action="store_true", help="1 and 8 replicas, 1 kill, no 20-service case"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = p.parse_args(argv)
    if args.quick:
        cfg = Config(
            quick=True,
            sizes=[1, 8],
            memory_services=[1],
            failover_reps=1,
            settle_s=0.5,
            cpu_window_s=1.0,
        )
    else:
        cfg = Config(
            quick=False,
            sizes=[1, 8, 32],
            memory_services=[1, 20],
            failover_reps=5,
            settle_s=1.0,
            cpu_window_s=2.0,
        )
    return cfg, args.json


def _timed(label: str, since: float) -> None:
    progress(f"  {label} done at {time.monotonic() - since:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    t_begin = time.monotonic()
    machine = machine_info()
    progress(f"corral controller bench: {cfg}, nproc {machine['nproc']}, load {machine['loadavg']}")
    problems: list[str] = []
    # The machine may be shared: the load around each scenario is part of the result.
    load: dict[str, tuple[float, float, float]] = {"start": os.getloadavg()}
    cli_startup = measure_cli_startup()
    apps, ups = scenario_up(cfg, problems)
    load["after_up"] = os.getloadavg()
    _timed("up", t_begin)
    mem = scenario_memory(cfg, problems)
    load["after_memory"] = os.getloadavg()
    _timed("memory", t_begin)
    fo = scenario_failover(cfg, problems)
    load["after_failover"] = os.getloadavg()
    text = render(apps, ups, mem, fo, cli_startup)
    elapsed = time.monotonic() - t_begin
    sys.stdout.write(text + f"\ntotal run time {elapsed:.1f} s\n")
    for line in problems:
        sys.stdout.write(f"problem: {line}\n")
    sys.stdout.flush()
    payload = {
        "command": " ".join([".venv/bin/python", "bench/controller.py", *(argv or sys.argv[1:])]),
        "machine": machine,
        "loadavg": load,
        "cli_startup_s": cli_startup,
        "config": asdict(cfg),
        "settings": {
            "probe_period_s": PROBE_PERIOD,
            "memory_probe_period_s": MEMORY_PROBE_PERIOD,
            "status_poll_s": STATUS_POLL,
            "failover_poll_s": FAILOVER_POLL,
            "stream_rate": STREAM_RATE,
            "stream_connections": STREAM_CONNECTIONS,
            "failover_replicas": FAILOVER_REPLICAS,
        },
        "elapsed_s": round(elapsed, 2),
        "up": {"app_direct": [asdict(a) for a in apps], "corral": [asdict(u) for u in ups]},
        "memory": [asdict(p) for p in mem],
        "failover": [asdict(r) for r in fo],
        "problems": problems,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_clean(payload), indent=2, allow_nan=False) + "\n")
    progress(f"results written to {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
