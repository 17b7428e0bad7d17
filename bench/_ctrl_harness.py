"""Harness for ``bench/controller.py``: a throwaway corral home, driven the way a user drives it.

Why a harness: every scenario needs the same things done right, and a benchmark that leaks a
daemon or forty replicas on a shared 2-core machine skews every number after it (and other
people's work). So each scenario gets:

* a fresh ``CORRAL_HOME`` in a temporary directory, so no state, daemon or port is inherited;
* the real CLI (``.venv/bin/corral``) for what a user would type (``up``, ``down``, ``daemon
  stop``), because its start-up cost is part of what a user waits for;
* :class:`corral.client.Client` for polling, because a CLI start per poll (about a second of
  imports) would swamp the thing being measured;
* a cleanup that always runs (``finally``): ``down --all``, ``daemon stop``, then SIGTERM/SIGKILL
  *by pid* of the daemon and of every replica ever seen in a status answer that is still alive.
  A pid is only signalled when its process start time matches the one recorded when it was first
  seen, so a recycled pid is never hit. Anything that had to be killed is reported: it means
  ``down``/``daemon stop`` left something behind.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from corral.client import Client, ClientError
from corral.home import read_info

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PYTHON = sys.executable
CORRAL_BIN = str(Path(sys.executable).with_name("corral"))

READY = "READY"


def progress(msg: str) -> None:
    """Progress lines go to stderr so stdout holds only the final report."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def spec_yaml(name: str, replicas: int, period: float) -> str:
    """The benchmark service: examples/app.py, probed on /health every ``period`` seconds.

    ``initial_delay_seconds`` is generous (60 s) so a replica that starts slowly on a loaded
    machine is measured as slow rather than failed. ``run`` uses the benchmark's own interpreter,
    the same one the no-corral baseline starts, so the comparison is app vs app.
    """
    run = f"exec {shlex.quote(PYTHON)} app.py"
    return (
        f"name: {name}\n"
        f"workdir: {json.dumps(str(EXAMPLES))}\n"
        f"run: {json.dumps(run)}\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 60\n"
        f"    period_seconds: {period:g}\n"
        f"  replicas: {replicas}\n"
    )


def ready_count(service: dict[str, Any]) -> int:
    return sum(1 for r in service["replicas"] if r["status"] == READY)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ok(port: int, path: str, timeout: float) -> bool:
    """One GET to 127.0.0.1:port; True on a 2xx. Connection refused is the common, cheap case."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return 200 <= response.status < 300
    except OSError:
        return False
    finally:
        conn.close()


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def kill_if_same(pid: int, create_time: float, grace: float) -> str | None:
    """Stop ``pid`` if it is still the process first seen with ``create_time``.

    Returns None when it was already gone (or is a zombie, i.e. already dead), else a line
    saying what had to be done. SIGTERM first, SIGKILL after ``grace`` seconds.
    """
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > 0.01:
            return None  # the pid now belongs to someone else
        if proc.status() == psutil.STATUS_ZOMBIE:
            with contextlib.suppress(psutil.Error):
                proc.wait(timeout=0)  # reaps it if it is our child; harmless otherwise
            return None
        proc.terminate()
        try:
            proc.wait(timeout=grace)
            return f"pid {pid} was still running: stopped with SIGTERM"
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)
            return f"pid {pid} was still running: SIGTERM ignored, killed with SIGKILL"
    except psutil.NoSuchProcess:
        return None
    except psutil.Error as exc:
        return f"pid {pid}: could not be checked or stopped: {exc!r}"


@dataclass
class CorralHome:
    """One corral home for one scenario, plus every pid it was seen to run."""

    label: str
    root: Path
    daemons: dict[int, float] = field(default_factory=dict)  # pid -> create_time
    replicas: dict[int, float] = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def client(self) -> Client:
        return Client(self.home, timeout=15.0)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CORRAL_HOME"] = str(self.home)
        return env

    def argv(self, *args: str) -> list[str]:
        return [CORRAL_BIN, "--home", str(self.home), *args]

    def cli(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        """Run the CLI to completion (killed by ``subprocess.run`` if it overruns)."""
        return subprocess.run(
            self.argv(*args),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def write_spec(self, name: str, replicas: int, period: float) -> Path:
        path = self.root / f"{name}.yaml"
        path.write_text(spec_yaml(name, replicas, period))
        return path

    # -- observation ----------------------------------------------------------------------------

    def daemon_pid(self) -> int | None:
        """The daemon's pid from ``daemon.json``, remembered (with its start time) for cleanup."""
        info = read_info(self.home)
        if info is None:
            return None
        pid = int(info["pid"])
        if pid not in self.daemons:
            created = _create_time(pid)
            if created is not None:
                self.daemons[pid] = created
        return pid

    def track(self, service: dict[str, Any]) -> None:
        """Remember every replica pid a status answer shows, so cleanup can verify it is gone."""
        for r in service["replicas"]:
            pid = r.get("pid")
            if isinstance(pid, int) and pid not in self.replicas:
                created = _create_time(pid)
                if created is not None:
                    self.replicas[pid] = created

    def service(self, name: str) -> dict[str, Any] | None:
        """The service's status, or None while there is no daemon or no such service yet."""
        try:
            service = self.client.service(name)
        except ClientError:
            return None
        self.track(service)
        return service

    def services(self) -> list[dict[str, Any]]:
        try:
            services = self.client.services()
        except ClientError:
            return []
        for s in services:
            self.track(s)
        return services

    def events(self, name: str) -> list[dict[str, Any]]:
        """Every event of a service (the API pages by 200)."""
        out: list[dict[str, Any]] = []
        after = 0
        for _ in range(100):  # bounded: 20k events is far beyond any scenario here
            page = self.client.events(name, after=after)
            out.extend(page)
            if len(page) < 200:
                break
            after = int(page[-1]["id"])
        return out

    def wait_until(
        self,
        check: Callable[[list[dict[str, Any]]], bool],
        timeout: float,
        interval: float = 0.1,
    ) -> float:
        """Poll every service until ``check`` holds; return the seconds waited."""
        start = time.perf_counter()
        deadline = start + timeout
        while time.perf_counter() < deadline:
            if check(self.services()):
                return time.perf_counter() - start
            time.sleep(interval)
        raise TimeoutError(f"{self.label}: condition not reached within {timeout:g}s")

    def down_all(self, problems: list[str], timeout: float = 60.0) -> float:
        """`corral down --all`, then make sure every service is really gone; return the seconds.

        A failing `down` is recorded in ``problems``, not raised: it is a finding about corral
        (the CLI can exit 1 while the teardown goes on), and the benchmark must still clean up.
        The wait after it is what `down` itself should have done.
        """
        started = time.perf_counter()
        try:
            result = self.cli("down", "--all", "--timeout", f"{timeout:g}", timeout=timeout + 30)
            if result.returncode != 0:
                problems.append(
                    f"{self.label}: `corral down --all` exited {result.returncode}: "
                    f"{result.stderr.strip()[-300:]}"
                )
        except subprocess.TimeoutExpired:
            problems.append(f"{self.label}: `corral down --all` timed out")
        self.wait_until(lambda services: not services, timeout=timeout)
        return time.perf_counter() - started

    # -- cleanup --------------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        """Take everything down; return a line for anything abnormal (leftovers, failures)."""
        started = time.perf_counter()
        problems: list[str] = []
        if self.client.health():
            self.daemon_pid()
            if self.services():  # also a last look at the replica pids
                try:
                    self.down_all(problems)
                except TimeoutError as exc:
                    problems.append(str(exc))
            try:
                result = self.cli("daemon", "stop", "--all", timeout=45.0)  # workers too
                if result.returncode != 0:
                    problems.append(
                        f"{self.label}: `corral daemon stop --all` exited {result.returncode}: "
                        f"{result.stderr.strip()[-300:]}"
                    )
            except subprocess.TimeoutExpired:
                problems.append(f"{self.label}: `corral daemon stop --all` timed out")
        for pid, created in self.daemons.items():
            # `daemon stop` returns once the API is down; the process then stops its controllers
            # and its job pool. Give it that time before signalling it.
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and _alive(pid, created):
                time.sleep(0.05)
            line = kill_if_same(pid, created, grace=5.0)
            if line:
                problems.append(f"{self.label}: daemon {line}")
        for pid, created in self.replicas.items():
            line = kill_if_same(pid, created, grace=2.0)
            if line:
                problems.append(f"{self.label}: replica {line}")
        progress(f"  [{self.label}] cleanup took {time.perf_counter() - started:.1f} s")
        return problems


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) <= 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def corral_home(label: str, problems: list[str]) -> Iterator[CorralHome]:
    """A fresh home for one scenario; everything in it is stopped on the way out, even on error.

    Cleanup problems are appended to ``problems`` (and printed) rather than raised, so a
    leftover never hides the scenario's own exception.
    """
    root = Path(tempfile.mkdtemp(prefix=f"corral-bench-{label}-"))
    h = CorralHome(label, root)
    try:
        yield h
    finally:
        try:
            found = h.cleanup()
        except Exception as exc:  # cleanup must never mask the scenario's error
            found = [f"{label}: cleanup failed: {exc!r}"]
        if found:
            kept = _keep_logs(h)
            if kept is not None:
                found.append(f"{label}: daemon and service logs kept in {kept}")
        for line in found:
            progress(f"  cleanup: {line}")
        problems.extend(found)
        shutil.rmtree(root, ignore_errors=True)


def _keep_logs(h: CorralHome) -> Path | None:
    """Copy the home's logs out before the home is deleted: a cleanup problem is a finding, and
    its evidence (the daemon's traceback) must outlive the temp dir."""
    try:
        kept = Path(tempfile.mkdtemp(prefix=f"corral-bench-logs-{h.label}-"))
        for log in [h.home / "daemon.log", *h.home.glob("services/*/logs/controller.log")]:
            if log.is_file():
                rel = log.relative_to(h.home)
                (kept / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(log, kept / rel)
        return kept
    except OSError:
        return None


# -- the app without corral -----------------------------------------------------------------------


@dataclass
class DirectApps:
    """N copies of examples/app.py started with subprocess, no corral, and when each answered."""

    started: list[float]  # perf_counter just before each Popen
    answered: list[float | None]  # perf_counter of the first 2xx on /health


def run_apps_direct(n: int, timeout: float = 60.0, interval: float = 0.005) -> DirectApps:
    """Start ``n`` app processes at once and poll each until it answers; stop them all after.

    Same interpreter, working directory and ``$PORT`` contract as a corral replica, so the time
    measured here is the app's own start time on this machine under the same parallelism.
    """
    ports = [free_port() for _ in range(n)]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    procs: list[subprocess.Popen[bytes]] = []
    started: list[float] = []
    answered: list[float | None] = [None] * n
    try:
        for i, port in enumerate(ports):
            env = dict(base_env, PORT=str(port), CORRAL_REPLICA_ID=str(i + 1))
            started.append(time.perf_counter())
            procs.append(
                subprocess.Popen(
                    [PYTHON, "app.py"],
                    cwd=EXAMPLES,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline = time.perf_counter() + timeout
        pending = set(range(n))
        while pending and time.perf_counter() < deadline:
            for i in sorted(pending):
                if http_ok(ports[i], "/health", timeout=1.0):
                    answered[i] = time.perf_counter()
                    pending.discard(i)
            if pending:
                time.sleep(interval)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5.0)
    return DirectApps(started, answered)
