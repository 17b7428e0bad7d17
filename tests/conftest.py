"""Shared fixtures and helpers for corral's tests.

The main fixture is :func:`corral_home`: an isolated corral home for one test (its own
``CORRAL_HOME`` under ``tmp_path``, so its own daemon, state file, token and free ports), with
helpers to run the CLI, read status, wait with deadlines and talk to the daemon's API. Tests that
use it run in parallel safely (pytest-xdist): nothing is shared between homes.

Teardown takes everything the test started down and FAILS the test when something was left
behind, because a leak is a bug:

1. ``corral down --all --purge`` (best effort; a daemon is started for it when the test left
   services but no daemon),
2. the daemon is stopped by pid (SIGTERM, then SIGKILL after a deadline: needing SIGKILL fails
   the test), then its balancer workers (they outlive a daemon on purpose) by their recorded
   pids,
3. every replica pid seen in a status during the test, every process whose environment
   carries this home's ``CORRAL_HOME_MARKER`` and every balancer worker whose command line
   names this home's id must be gone: survivors are killed by pid and reported as a failure.

Everything waits with a deadline; nothing is killed by name, only by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# SkyServe's own example specs (the project's shared data, beside the checkout), when present.
SKYSERVE_EXAMPLES = REPO.parent / "shared" / "data" / "skyserve-examples"
APPS = Path(__file__).resolve().parent / "apps"

# Deadlines (seconds). Generous for a loaded 2-core machine; a healthy run is far below them.
CLI_TIMEOUT = 60.0
DAEMON_START_TIMEOUT = 30.0
DAEMON_STOP_TIMEOUT = 25.0
KILL_TIMEOUT = 10.0

# The environment variable corral puts in every replica process (see corral.infra.local).
ENV_HOME_MARKER = "CORRAL_HOME_MARKER"


# -- generic helpers ------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Fails the test with ``what`` (and the last value or exception seen) after ``timeout`` s.
    Exceptions raised by ``predicate`` count as "not yet" (the daemon may be restarting).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


async def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    """:func:`wait_for` inside an event loop: polls every 10 ms without blocking the loop (the
    balancer under test runs in it)."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie is dead: in a container whose PID 1 does not reap,
    orphans of a killed daemon stay zombies forever and ``pid_exists`` would still say yes."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def finished(pid: int) -> bool:
    """Dead and its resources released: not :func:`pid_alive`, and no thread left. A SIGKILLed
    process's leader turns zombie while its other threads still exit, holding its descriptors
    (a listening socket) a moment longer: wait on this before reusing what it held."""
    if pid_alive(pid):
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def kill_pids(pids: set[int] | list[int], timeout: float = KILL_TIMEOUT) -> list[int]:
    """SIGKILL each live pid, wait (bounded) until they are dead; return those still alive."""
    procs = []
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                proc.kill()
                procs.append(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p.pid) for p in procs):
        time.sleep(0.05)
    return [p.pid for p in procs if pid_alive(p.pid)]


@dataclass
class HttpAnswer:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    url: str,
    *,
    method: str = "GET",
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> HttpAnswer:
    """One HTTP request with urllib (127.0.0.1 only); 4xx/5xx are returned, not raised."""
    assert url.startswith(("http://127.0.0.1:", "https://127.0.0.1:")), url
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return HttpAnswer(response.status, response.read(), dict(response.headers))
    except urllib.error.HTTPError as exc:
        with exc:
            return HttpAnswer(exc.code, exc.read(), dict(exc.headers))


def spec_text(
    name: str,
    replicas: int,
    *,
    run: str | None = None,
    setup: str | None = None,
    workdir: Path | str = EXAMPLES,
    envs: dict[str, str] | None = None,
    extra: str = "",
    period: float = 0.2,
    initial_delay: float = 60,
) -> str:
    """The YAML of a service running examples/app.py (or ``run`` in ``workdir``) with fast
    probes: what most tests bring up. ``extra`` is inserted as top-level lines (e.g. infra)."""
    run = run or f"exec {sys.executable} app.py"
    lines = [f"name: {name}", f"workdir: {workdir}", f"run: {json.dumps(run)}"]
    if setup:
        lines.append(f"setup: {json.dumps(setup)}")
    if envs:
        lines.append("envs:")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in envs.items()]
    return (
        "\n".join(lines) + "\n" + extra + "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        f"    initial_delay_seconds: {initial_delay}\n"
        f"    period_seconds: {period}\n"
        "    timeout_seconds: 2\n"
        f"  replicas: {replicas}\n"
    )


OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is missing")


def make_cert(directory: Path, stem: str, names: str) -> tuple[Path, Path]:
    """A self-signed EC certificate with ``names`` as subjectAltName (openssl syntax)."""
    assert OPENSSL is not None
    cert, key = directory / f"{stem}.pem", directory / f"{stem}.key"
    subprocess.run(
        [
            OPENSSL,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            f"/CN={stem}",
            "-addext",
            f"subjectAltName={names}",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


READY_LINE = re.compile(r"service (\S+) is READY at (http://127\.0\.0\.1:\d+)")


def endpoint_of(up_output: str) -> str:
    """The endpoint `corral up` printed."""
    match = READY_LINE.search(up_output)
    assert match, f"`corral up` did not print the endpoint:\n{up_output}"
    return match.group(2)


def get_json(url: str, timeout: float = 10.0) -> Any:
    answer = http(url, timeout=timeout)
    assert answer.status == 200, (url, answer.status, answer.body[:500])
    return answer.json()


def write_spec(path: Path, text: str) -> Path:
    """Write a spec file (dedented by the caller) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


class LineReader:
    """Reads a subprocess's stdout on a thread, so the test can wait for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._stdout.readline, b""):
            self.lines.put(raw.decode(errors="replace"))

    def wait_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if re.search(pattern, line):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} in {timeout:g}s: {self.seen}")
            try:
                self.seen.append(self.lines.get(timeout=min(left, 0.2)))
            except queue.Empty:
                continue


# -- the corral home ------------------------------------------------------------------------------


@dataclass
class CorralHome:
    """One isolated corral home and the processes a test started for it.

    ``run`` runs the CLI (``python -m corral``) with ``CORRAL_HOME`` set; ``status`` parses
    ``corral status --json``; ``service`` asks the API directly (cheap: for polling loops).
    Every replica pid seen in a status is remembered, so teardown can check they are gone.
    """

    path: Path
    env: dict[str, str]
    replica_pids: set[int] = field(default_factory=set)
    daemon_pids: set[int] = field(default_factory=set)
    popens: list[subprocess.Popen[bytes]] = field(default_factory=list)

    # -- CLI ----------------------------------------------------------------------------------

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "corral", *args]

    def run(
        self,
        *args: str,
        check: bool = True,
        timeout: float = CLI_TIMEOUT,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``corral ARGS`` (in ``cwd``, default the test's directory; ``env`` added to the
        environment); with ``check``, fail the test (showing its output) unless it exits 0.
        The result has ``returncode``, ``stdout`` and ``stderr`` (text)."""
        try:
            result = subprocess.run(
                self.cli(*args),
                env={**self.env, **(env or {})},
                cwd=cwd or self.path.parent,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            self.note_daemon()
        if check and result.returncode != 0:
            raise AssertionError(
                f"`corral {' '.join(args)}` exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        """Start ``corral ARGS`` in the background (stdout piped, stderr to stdout); it is
        killed at teardown if still running."""
        proc = subprocess.Popen(
            self.cli(*args),
            env=self.env,
            cwd=self.path.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.popens.append(proc)
        return proc

    def status(self, *names: str) -> Any:
        """``corral status --json``: the service dict when one name is given, else the list."""
        result = self.run("status", "--json", *names)
        services = json.loads(result.stdout)["services"]
        self._note_replicas(services)
        return services[0] if len(names) == 1 else services

    # -- API ----------------------------------------------------------------------------------

    @property
    def token(self) -> str:
        return (self.path / "token").read_text().strip()

    def daemon_info(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.path / "daemon.json").read_text()))
        except (OSError, ValueError):
            return None

    @property
    def api_url(self) -> str:
        info = self.daemon_info()
        assert info is not None, f"no daemon.json in {self.path}"
        return f"http://127.0.0.1:{info['port']}"

    def api(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        raw: bytes | None = None,
        token: str | None = "default",
        timeout: float = 10.0,
    ) -> HttpAnswer:
        """A request to the daemon's API. ``token=None`` sends no Authorization header."""
        headers = {}
        if token == "default":
            token = self.token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        return http(self.api_url + path, method=method, data=data, headers=headers, timeout=timeout)

    def service(self, name: str) -> dict[str, Any] | None:
        """The service as the API shows it right now, or None when it does not exist."""
        answer = self.api("GET", f"/v1/services/{name}")
        if answer.status == 404:
            return None
        assert answer.status == 200, (answer.status, answer.body)
        service: dict[str, Any] = answer.json()
        self._note_replicas([service])
        return service

    def healthy(self) -> bool:
        """The daemon of this home answers /v1/health."""
        if self.daemon_info() is None:
            return False
        try:
            return http(self.api_url + "/v1/health", timeout=2.0).status == 200
        except OSError:
            return False

    def wait_for(
        self, predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1
    ) -> T:
        return wait_for(predicate, timeout, what, interval)

    def wait_replicas(
        self, name: str, ready: int, timeout: float = 30.0, *, exact: bool = True
    ) -> dict[str, Any]:
        """Wait until service ``name`` has ``ready`` READY replicas (and, with ``exact``, no
        other live one: PENDING/PROVISIONING/STARTING); return the service."""
        live_states = {"PENDING", "PROVISIONING", "STARTING", "NOT_READY"}

        def check() -> dict[str, Any] | None:
            svc = self.service(name)
            if svc is None:
                return None
            statuses = [r["status"] for r in svc["replicas"]]
            if statuses.count("READY") != ready:
                return None
            if exact and any(s in live_states for s in statuses):
                return None
            return svc

        return wait_for(check, timeout, f"{ready} READY replicas of {name}", interval=0.1)

    # -- daemon -------------------------------------------------------------------------------

    def note_daemon(self) -> int | None:
        info = self.daemon_info()
        if info is None:
            return None
        pid = int(info["pid"])
        self.daemon_pids.add(pid)
        return pid

    def daemon_pid(self) -> int:
        pid = self.note_daemon()
        assert pid is not None, f"no daemon.json in {self.path}"
        return pid

    def start_daemon(
        self,
        timeout: float = DAEMON_START_TIMEOUT,
        *,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        answers: bool = True,
    ) -> int:
        """Start a daemon in the background (detached, like ``corral up`` does), its output in
        the home's daemon.log, and return its pid. ``corral daemon run`` unless ``argv`` names
        another command (the chaos tests' scripts over ``corral.bootstrap.serve``); ``env``
        replaces the home's environment. With ``wait``, until ``daemon.json`` names it and,
        with ``answers``, its API answers plain HTTP (a TLS daemon does not)."""
        self.path.mkdir(parents=True, exist_ok=True)
        log = open(self.path / "daemon.log", "ab")  # noqa: SIM115 - handed to the child
        with log:
            proc = subprocess.Popen(
                argv or self.cli("daemon", "run"),
                env=env or self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.popens.append(proc)
        self.daemon_pids.add(proc.pid)
        if not wait:
            return proc.pid

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited with {proc.returncode}:\n{self.tail('daemon.log')}"
                )
            info = self.daemon_info()
            named = info is not None and info["pid"] == proc.pid
            return named and (not answers or self.healthy())

        try:
            wait_for(up, timeout, "the daemon to answer", interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.tail('daemon.log')}") from None
        return proc.pid

    def stop_daemon(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Signal the daemon (by its pid) and wait until it is gone."""
        pid = self.daemon_pid()
        os.kill(pid, sig)
        self._reap()
        wait_for(lambda: finished(pid), timeout, f"daemon pid {pid} to exit")
        self._reap()

    def _reap(self) -> None:
        for proc in self.popens:
            proc.poll()

    def tail(self, relative: str, lines: int = 40) -> str:
        try:
            text = (self.path / relative).read_text(errors="replace")
        except OSError as exc:
            return f"({relative}: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    # -- processes and state ------------------------------------------------------------------

    @property
    def marker(self) -> str | None:
        try:
            return (self.path / "home_id").read_text().strip() or None
        except OSError:
            return None

    def marked_processes(self) -> list[psutil.Process]:
        """Live processes whose environment carries this home's marker: its replicas, their
        setups and anything they forked."""
        marker = self.marker
        if marker is None:
            return []
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get(ENV_HOME_MARKER) == marker:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def worker_processes(self) -> list[int]:
        """Live balancer workers of this home, found by the ``--home-id`` on their command
        line (not by the state file: a worker it does not record must be found too)."""
        from corral.ownership import worker_home_id

        marker = self.marker
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                owner = worker_home_id(proc.cmdline())
                if owner and owner[0] == marker and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
        return found if marker else []

    def home_processes(self) -> list[psutil.Process]:
        """Live processes with ``CORRAL_HOME`` set to this home (daemons, CLI runs)."""
        me = os.getpid()
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get("CORRAL_HOME") == str(self.path):
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def db_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read-only query on the home's ``state.db``."""
        db = sqlite3.connect(f"file:{self.path / 'state.db'}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()

    def _note_replicas(self, services: list[dict[str, Any]]) -> None:
        for svc in services:
            for r in svc["replicas"]:
                if r.get("pid"):
                    self.replica_pids.add(int(r["pid"]))

    # -- teardown -----------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Take everything down; return the problems found (leaks), empty when clean."""
        problems: list[str] = []
        for proc in self.popens:
            if proc.poll() is None and proc.pid not in self.daemon_pids:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(KILL_TIMEOUT)
            if proc.stdout is not None:
                proc.stdout.close()
        self._down_all(problems)
        self._stop_daemons(problems)
        for proc in self.home_processes():  # CLI processes a test left (e.g. `logs --follow`)
            if kill_pids([proc.pid]):
                problems.append(f"could not kill pid {proc.pid} of {self.path}")
        workers = self.worker_processes()
        if workers:
            problems.append(f"balancer workers left running after teardown: {workers}")
            kill_pids(workers)
        leaked = {p.pid for p in self.marked_processes()}
        leaked |= {pid for pid in self.replica_pids if pid_alive(pid)}
        if leaked:
            details = []
            for pid in sorted(leaked):
                with contextlib.suppress(psutil.Error):
                    details.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())}")
            problems.append(f"replica processes left running after teardown: {details}")
            survivors = kill_pids(leaked)
            if survivors:
                problems.append(f"could not kill leaked pids {survivors}")
        self._reap()
        return problems

    def _has_services(self) -> bool:
        if not (self.path / "state.db").exists():
            return False
        try:
            return bool(self.db_rows("SELECT 1 FROM services LIMIT 1"))
        except sqlite3.Error:
            return False

    def _down_all(self, problems: list[str]) -> None:
        if not self.healthy():
            if not self._has_services() and not self.marked_processes():
                return
            try:
                self.start_daemon()
            except AssertionError as exc:
                problems.append(f"could not start a daemon to take services down: {exc}")
                return
        result = self.run("down", "--all", "--purge", "--timeout", "60", check=False, timeout=90)
        if result.returncode != 0:
            problems.append(f"`corral down --all --purge` failed: {result.stdout}{result.stderr}")

    def _stop_daemons(self, problems: list[str]) -> None:
        self.note_daemon()
        pids = {pid for pid in self.daemon_pids if pid_alive(pid)}
        pids |= {
            p.pid for p in self.home_processes() if "daemon" in _cmdline(p) and "run" in _cmdline(p)
        }
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DAEMON_STOP_TIMEOUT
        while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
            self._reap()
            time.sleep(0.05)
        stuck = [pid for pid in pids if pid_alive(pid)]
        if stuck:
            problems.append(
                f"daemon pid(s) {stuck} still alive {DAEMON_STOP_TIMEOUT:g}s after SIGTERM"
            )
            kill_pids(stuck)
        self.stop_workers()

    def worker_pids(self) -> list[int]:
        """Live balancer workers recorded in the home's state file."""
        if not (self.path / "state.db").exists():
            return []
        try:
            rows = self.db_rows("SELECT pid FROM balancer_workers ORDER BY slot")
        except sqlite3.Error:
            return []
        return [int(pid) for (pid,) in rows if pid_alive(int(pid))]

    def stop_workers(self) -> list[int]:
        """Stop the home's balancer workers (no daemon may run: it would restart them)."""
        from corral.dataplane.processes import stop_recorded_workers

        return stop_recorded_workers(self.path, timeout=KILL_TIMEOUT)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@pytest.fixture
def corral_home(tmp_path: Path) -> Iterator[CorralHome]:
    """An isolated corral home (``tmp_path/"home"``) with its own daemon; see the module doc.

    Fails the test at teardown if any process of the home is left after ``down --all``.
    """
    path = (tmp_path / "home").resolve()  # as the CLI resolves it (CORRAL_HOME of daemons)
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("CORRAL_"):
            del env[key]
    env["CORRAL_HOME"] = str(path)
    # The machine-wide record of homes (corral.ownership) kept per test, not in /tmp.
    env["CORRAL_RUNTIME_DIR"] = str(tmp_path / "runtime")
    env["PYTHONUNBUFFERED"] = "1"
    # Tests kill and restart daemons themselves; the workers' restart of a crashed daemon is
    # turned on by the tests of it.
    env["CORRAL_DAEMON_RESPAWN"] = "0"
    home = CorralHome(path=path, env=env)
    yield home
    problems = home.teardown()
    if problems:
        pytest.fail("teardown of " + str(path) + ":\n" + "\n".join(problems), pytrace=False)


def skyserve_example_files(root: Path) -> None:
    """What SkyServe's examples expect beside them, made under ``root`` as in a SkyPilot
    checkout (they are run from its root): the directories their relative workdirs name, and
    the TLS files of the https example (made with openssl beforehand there)."""
    for spec in SKYSERVE_EXAMPLES.glob("*.yaml"):
        for line in spec.read_text().splitlines():
            if line.startswith("workdir:"):
                (root / line.split(":", 1)[1].strip()).mkdir(parents=True, exist_ok=True)
            key, _, value = line.strip().partition(": ")
            if key in ("key", "cert", "keyfile", "certfile") and value.endswith(".pem"):
                (root / value).parent.mkdir(parents=True, exist_ok=True)
                # A real pair: a certificate and key that do not load are refused.
                cert, private = example_tls_pair(root)
                shutil.copyfile(private if key.startswith("key") else cert, root / value)


def example_tls_pair(root: Path) -> tuple[Path, Path]:
    """One certificate and its key under ``root``, made once."""
    directory = root / ".example-tls"
    if not directory.is_dir():
        directory.mkdir(parents=True)
        make_cert(directory, "example", "DNS:localhost")
    return directory / "example.pem", directory / "example.key"
