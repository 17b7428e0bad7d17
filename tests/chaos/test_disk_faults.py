"""Disk faults: a service's log directory full or read-only, the state file locked by another
process. corral must answer with clear errors and keep serving traffic through every balancer.

How each fault is made, for real (the tests run as root, so ``chmod`` would not stop anything):

* **log directory full**: ``services/NAME/logs`` is a small tmpfs mount; a filler file takes
  every byte of it, so writes fail with ENOSPC (file creation still works, as on a real full
  disk). Freeing it is deleting the filler.
* **log directory read-only**: a read-only bind mount of the directory onto itself. A plain
  ``mount -o remount,ro`` is refused (EBUSY) while files are open for writing there, which they
  always are (the controller log, the replicas' own logs): the bind mount is what a real
  read-only directory looks like to anything opening a file, while descriptors opened before
  keep writing, as they would after a real remount. Undoing it is unmounting the bind.
* **state file locked**: a python process the test starts opens ``state.db`` and holds
  ``BEGIN EXCLUSIVE`` (in WAL mode: the write lock; readers go on) on command, for a bounded
  time, while the test drives the API and the controller through changes (and restarts the
  daemon under the lock); the last test checks the store's waiting rules on their own.
* **the home's disk full**: the whole home (``state.db``, its WAL, every log) on a small tmpfs
  that a filler file fills: SQLite answers "database or disk is full", which no waiting cures.

Every mount is undone in ``finally`` (lazily if a file on it is still open, so nothing is ever
left in the mount table). Traffic is a bounded stream of requests to the balancer on 127.0.0.1
that must see no failure at all. ``CORRAL_CHAOS=long`` runs more rounds and longer locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos_support import LONG, record, rng, rounds
from conftest import CorralHome, LineReader, http, pid_alive, wait_for, write_spec
from invariants import check_home, read_state

from corral.state import StateBusy, Store

pytestmark = pytest.mark.timeout(600 if LONG else 240)

SERVICE = "disky"
SETTLE = 60.0  # deadline for the service to reach what was asked (a loaded, shared machine)

# The replicas' app: answers who it is and logs every request through `logging`, which, like
# any real server's logging, survives a log it cannot write (Handler.handleError). An app that
# print()s and lets the OSError escape fails its requests on a full disk: that is the app's
# choice, not something corral can catch (its output is a file the app writes itself).
# On SIGTERM it takes a second to exit, as a server finishing its work does: a teardown then
# lasts long enough for a lock on the state file to land in the middle of it.
APP = textwrap.dedent(
    """
    import json, logging, os, signal, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    signal.signal(signal.SIGTERM, lambda *_: threading.Timer(1.0, os._exit, (0,)).start())

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    REPLICA = os.environ.get("CORRAL_REPLICA_ID", "?")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = json.dumps({"replica": REPLICA, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            logging.info("replica %s: %s", REPLICA, format % args)

    port = int(os.environ["PORT"])
    logging.info("replica %s listening on 127.0.0.1:%d", REPLICA, port)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)

# Holds the state file's write lock on command ("lock" / "unlock" / "quit" on stdin), so the
# test decides exactly when the lock starts and ends (no interpreter start-up in between).
LOCKER = textwrap.dedent(
    """
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
    print("open", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "lock":
            db.execute("BEGIN EXCLUSIVE")
            print("locked", flush=True)
        elif command == "unlock":
            db.execute("ROLLBACK")
            print("unlocked", flush=True)
        elif command == "quit":
            break
    db.close()
    """
)


# -- mounts -------------------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


def _mount_problem() -> str | None:
    """Why this sandbox cannot make the mounts these tests need, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs and a read-only bind mount"
    probe = Path(tempfile.mkdtemp(prefix="corral-mount-probe-"))
    try:
        made = _run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
        if made.returncode != 0:
            return f"`mount -t tmpfs` is not allowed here: {made.stderr.strip()}"
        _run("umount", str(probe))
        return None
    finally:
        if _mounted(probe):
            _run("umount", "-l", str(probe))
        probe.rmdir()


class Mounts:
    """The mounts one test made; :meth:`undo_all` (in ``finally``) removes every one of them."""

    def __init__(self) -> None:
        self.stack: list[Path] = []

    def tmpfs(self, path: Path, size: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._mount(
            path, "mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)
        )

    def read_only(self, path: Path) -> None:
        self._mount(path, "mount", "--bind", str(path), str(path))
        remount = _run("mount", "-o", "remount,bind,ro", str(path))
        if remount.returncode != 0:
            self.undo(path)
            raise AssertionError(f"read-only remount of {path} failed: {remount.stderr}")

    def _mount(self, path: Path, *command: str) -> None:
        done = _run(*command)
        assert done.returncode == 0, f"{' '.join(command)} failed: {done.stderr}"
        self.stack.append(path)

    def undo(self, path: Path) -> None:
        """Remove the most recent mount on ``path`` (lazily when something holds it open)."""
        assert self.stack and self.stack[-1] == path, (path, self.stack)
        self.stack.pop()
        if _run("umount", str(path)).returncode != 0:
            _run("umount", "-l", str(path))

    def undo_all(self) -> None:
        while self.stack:
            self.undo(self.stack[-1])


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    """Mounts undone at teardown. Ask for it BEFORE ``corral_home``: fixtures are torn down in
    reverse, so the home's teardown (``down --all``, stopping the daemon) runs first and the
    mounts are free to go."""
    problem = _mount_problem()
    if problem is not None:
        pytest.skip(problem)
    made = Mounts()
    try:
        yield made
    finally:
        paths = list(made.stack)
        made.undo_all()
    left = [p for p in paths if _mounted(p)]
    assert not left, f"mounts left behind: {left}"


# -- traffic ------------------------------------------------------------------------------------


class Traffic(threading.Thread):
    """A bounded stream of GETs to the balancer (one at a time, ~20/s) that records failures."""

    def __init__(self, endpoint: str, limit: int) -> None:
        super().__init__(name="disk-faults-traffic", daemon=True)
        self.endpoint = endpoint
        self.limit = limit
        self.ok = 0
        self.failed: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        for i in range(self.limit):
            if self._stop_event.is_set():
                return
            try:
                answer = http(f"{self.endpoint}/disk/{i}", timeout=30)
            except OSError as exc:
                self.failed.append(f"request {i}: {exc!r}")
            else:
                if answer.status == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"request {i}: {answer.status} {answer.body[:200]!r}")
            self._stop_event.wait(0.05)

    def finish(self) -> None:
        self._stop_event.set()
        self.join(60)
        assert not self.is_alive(), "traffic thread did not stop"


@contextlib.contextmanager
def traffic(endpoint: str, limit: int = 20_000) -> Iterator[Traffic]:
    stream = Traffic(endpoint, limit)
    stream.start()
    try:
        yield stream
    finally:
        stream.finish()


# -- the service --------------------------------------------------------------------------------


def spec_text(app_dir: Path, replicas: int) -> str:
    return textwrap.dedent(
        f"""\
        name: {SERVICE}
        workdir: {app_dir}
        run: {json.dumps(f"exec {sys.executable} app.py")}
        service:
          readiness_probe:
            path: /health
            initial_delay_seconds: 30
            period_seconds: 0.2
            timeout_seconds: 2
          replicas: {replicas}
        """
    )


def start_service(home: CorralHome, tmp_path: Path) -> tuple[str, Path]:
    """`corral up` the service (daemon already running); return its endpoint and app dir."""
    app_dir = tmp_path / "app"
    app_dir.mkdir(exist_ok=True)
    (app_dir / "app.py").write_text(APP)
    spec = write_spec(tmp_path / f"{SERVICE}.yaml", spec_text(app_dir, 2))
    home.run("up", str(spec))
    service = home.wait_replicas(SERVICE, 2, timeout=SETTLE)
    assert service["endpoint"], service
    return str(service["endpoint"]), app_dir


def scale(home: CorralHome, app_dir: Path, replicas: int) -> int:
    """Store a new version asking for ``replicas``; return its number. Only the `service:`
    section changes and the base directory is the one `corral up` sent, so the update is in
    place: the running replicas stay, the target moves."""
    body = {
        "spec": spec_text(app_dir, replicas),
        "mode": "rolling",
        "base_dir": str(app_dir.parent.resolve()),
    }
    answer = home.api("POST", f"/v1/services/{SERVICE}/versions", body=body, timeout=30)
    assert answer.status == 201, (answer.status, answer.body[:500])
    return int(answer.json()["version"])


def _unsettled(home: CorralHome, replicas: int, version: int) -> list[str]:
    """What keeps the service from being exactly ``replicas`` READY replicas of ``version``
    with nothing in flight; failed replicas kept for display (torn down) are allowed."""
    state = read_state(home)
    svc = state.services.get(SERVICE)
    if svc is None or svc["intent"] != "running" or svc["current_version"] != version:
        return [f"service row {svc}"]
    rows = [r for r in state.replicas.values() if r["service"] == SERVICE]
    problems = []
    ready = [r for r in rows if r["version"] == version and r["ready"] and _live(r)]
    if len(ready) != replicas:
        problems.append(f"{len(ready)} READY replicas of version {version}, not {replicas}")
    for r in rows:
        if r in ready:
            continue
        if not (r["failure"] and r["teardown_state"] == "succeeded"):
            problems.append(f"replica {r['id']}: {dict(r)}")
    return problems


def _live(row: dict[str, Any]) -> bool:
    return (
        row["launch_state"] == "succeeded"
        and row["teardown_state"] is None
        and not row["scale_down"]
        and not row["failure"]
    )


def wait_intended(home: CorralHome, replicas: int, version: int, what: str) -> None:
    """Wait until the service settles as asked, then check the home's invariants (no dangling
    row, no orphan process, no duplicate: see invariants.py)."""

    def done() -> bool:
        assert home.healthy(), "the daemon stopped answering"
        return not _unsettled(home, replicas, version)

    try:
        wait_for(done, SETTLE, what, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_unsettled(home, replicas, version)}") from None
    findings = check_home(home)
    assert not findings, f"after {what}:\n{findings}"


def events(home: CorralHome, name: str = SERVICE) -> list[dict[str, Any]]:
    answer = home.api("GET", f"/v1/services/{name}/events")
    assert answer.status == 200, (answer.status, answer.body[:300])
    return list(answer.json()["events"])


# What the daemon writes when one of its tasks or callbacks died, or when the API gave a 500.
CRASH = re.compile(r"Task exception was never retrieved|Exception in callback|API \S+ \S+ failed")


def assert_no_crash(home: CorralHome) -> None:
    """No task or callback of the daemon died with an unhandled exception, no 500 was given."""
    texts = {"daemon.log": home.tail("daemon.log", 1_000_000)}
    controller_log = home.path / "services" / SERVICE / "logs" / "controller.log"
    with contextlib.suppress(OSError):
        texts["controller.log"] = controller_log.read_text(errors="replace")
    for name, text in texts.items():
        crashes = [line for line in text.splitlines() if CRASH.search(line)]
        assert not crashes, f"{name} shows a crash: {crashes[:5]}"


# -- 1. log directory full ---------------------------------------------------------------------


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem; return the filler file."""
    filler = directory / "filler.bin"
    chunk = b"\0" * (1 << 16)
    # Unbuffered: a buffered file keeps what a short write left, and its close() then fails
    # with ENOSPC itself (seen when the free space was not a multiple of the chunk).
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert "No space left" in str(exc), exc
    # What the buffer held when the disk filled: written byte by byte until nothing fits.
    with open(filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0"):
            pass
    return filler


def test_log_dir_full(mounts: Mounts, corral_home: CorralHome, tmp_path: Path) -> None:
    """A full log disk: launches and teardowns still work (their output is dropped, and said
    so in the events and the daemon log), running replicas keep serving, and once space is
    freed the logs fill again."""
    n = rounds(1, 3)
    logs = corral_home.path / "services" / SERVICE / "logs"
    mounts.tmpfs(logs, "4m")
    corral_home.start_daemon()
    endpoint, app_dir = start_service(corral_home, tmp_path)
    version = 1
    launches_with_lost_log = 0
    with traffic(endpoint) as load:
        for round_no in range(n):
            gen = rng("log_dir_full", round_no)
            filler = _fill(logs)
            # A launch and a teardown on the full disk: both work, the lost output is said.
            before = {e["id"] for e in events(corral_home)}
            version = scale(corral_home, app_dir, 3)
            wait_intended(corral_home, 3, version, f"round {round_no}: scale up on a full disk")
            lost = [
                e
                for e in events(corral_home)
                if e["id"] not in before and e["action"] == "replica.log_error"
            ]
            assert len(lost) == 1 and "No space left" in str(lost[0]["reason"]), lost
            launches_with_lost_log += 1
            version = scale(corral_home, app_dir, 2)
            wait_intended(corral_home, 2, version, f"round {round_no}: scale down on a full disk")
            assert corral_home.service(SERVICE) is not None
            time.sleep(gen.uniform(0.0, 0.5))  # traffic on the full disk for a random while
            # Space comes back: the next launch's log is whole, the controller logs again.
            controller_log = logs / "controller.log"
            written = controller_log.stat().st_size
            filler.unlink()
            before = {e["id"] for e in events(corral_home)}
            version = scale(corral_home, app_dir, 3)
            wait_intended(corral_home, 3, version, f"round {round_no}: scale up after freeing")
            launched = [
                e
                for e in events(corral_home)
                if e["id"] not in before and e["action"] == "replica.launched"
            ]
            assert launched, "no launch after space was freed"
            rid = launched[-1]["replica_id"]
            launch_log = logs / f"replica_{rid}_launch.log"
            assert "[corral] started pid" in launch_log.read_text(), launch_log.read_text()
            assert not [
                e
                for e in events(corral_home)
                if e["id"] not in before and e["action"] == "replica.log_error"
            ], "a launch after space was freed still lost its log"
            with open(controller_log, errors="replace") as f:
                f.seek(written)
                assert "target 3" in f.read(), "the controller log did not recover"
            version = scale(corral_home, app_dir, 2)
            wait_intended(corral_home, 2, version, f"round {round_no}: back to 2")
    daemon_log = corral_home.tail("daemon.log", 100_000)
    assert "No space left on device" in daemon_log, "the lost log output was never reported"
    assert_no_crash(corral_home)
    failed = len(load.failed)
    record(
        "disk: log directory full",
        rounds=n,
        lost=failed,
        served=load.ok,
        launches_with_lost_log=launches_with_lost_log,
    )
    assert not load.failed, f"{failed} of {load.ok + failed} requests failed: {load.failed[:5]}"
    corral_home.run("down", SERVICE, "--purge")
    wait_for(lambda: corral_home.service(SERVICE) is None, SETTLE, "the service to be removed")


# -- 2. log directory read-only ----------------------------------------------------------------


def failed_launch(home: CorralHome, version: int) -> dict[str, Any] | None:
    """The newest FAILED_PROVISION replica of ``version``, if any."""
    svc = home.service(SERVICE)
    assert svc is not None
    failed = [
        r for r in svc["replicas"] if r["status"] == "FAILED_PROVISION" and r["version"] == version
    ]
    return failed[-1] if failed else None


def test_log_dir_read_only(mounts: Mounts, corral_home: CorralHome, tmp_path: Path) -> None:
    """A read-only log directory: a launch fails with an error naming the log and the reason
    (in status and events), a teardown still stops its replica, running replicas keep
    serving, and once the directory is writable again the service gets back to its target."""
    n = rounds(1, 3)
    logs = corral_home.path / "services" / SERVICE / "logs"
    mounts.tmpfs(logs, "16m")
    corral_home.start_daemon()
    endpoint, app_dir = start_service(corral_home, tmp_path)
    refused_launches = 0
    with traffic(endpoint) as load:
        for round_no in range(n):
            gen = rng("log_dir_read_only", round_no)
            mounts.read_only(logs)
            try:
                # A launch cannot open its log: it fails, clearly, and is retried (backoff).
                version = scale(corral_home, app_dir, 3)

                failed = wait_for(
                    functools.partial(failed_launch, corral_home, version),
                    SETTLE,
                    "a launch refused for its log",
                )
                reason = str(failed["failure"])
                assert "Read-only file system" in reason and "_launch.log" in reason, reason
                assert any(
                    e["action"] == "replica.launch_failed" and "Read-only" in str(e["reason"])
                    for e in events(corral_home)
                )
                refused_launches += 1
                ready = [
                    r for r in corral_home.service(SERVICE)["replicas"] if r["status"] == "READY"
                ]
                assert len(ready) == 2, ready
                # A teardown whose log cannot be opened still stops its replica.
                version = scale(corral_home, app_dir, 1)
                wait_intended(corral_home, 1, version, f"round {round_no}: scale down, read-only")
                time.sleep(gen.uniform(0.0, 0.5))  # traffic on one replica for a random while
            finally:
                mounts.undo(logs)
            version = scale(corral_home, app_dir, 2)
            wait_intended(corral_home, 2, version, f"round {round_no}: writable again")
    assert_no_crash(corral_home)
    failed_requests = len(load.failed)
    record(
        "disk: log directory read-only",
        rounds=n,
        lost=failed_requests,
        served=load.ok,
        refused_launches=refused_launches,
    )
    assert not load.failed, f"{failed_requests} requests failed: {load.failed[:5]}"
    corral_home.run("down", SERVICE, "--purge")
    wait_for(lambda: corral_home.service(SERVICE) is None, SETTLE, "the service to be removed")


# -- 3. state file locked by another process ---------------------------------------------------


class Locker:
    """A python process holding ``state.db``'s write lock when told to."""

    def __init__(self, db: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(db)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.reader = LineReader(self.proc)
        self.reader.wait_line("^open", 30)
        self.sent: dict[str, int] = {}

    def _say(self, command: str, answer: str) -> None:
        """Send a command; wait (bounded) for its answer line."""
        self.sent[answer] = self.sent.get(answer, 0) + 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + 30
        while sum(line.strip() == answer for line in self.reader.seen) < self.sent[answer]:
            assert time.monotonic() < deadline, f"no {answer!r} from the locker: {self.reader.seen}"
            with contextlib.suppress(queue.Empty):
                self.reader.seen.append(self.reader.lines.get(timeout=0.2))

    def lock(self) -> None:
        self._say("lock", "locked")

    def unlock(self) -> None:
        self._say("unlock", "unlocked")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def test_state_db_locked(corral_home: CorralHome, tmp_path: Path) -> None:
    """Another process holds the state file's write lock while the controller is mid-change
    (a scale up or down, started just before the lock, at a seeded random moment): traffic
    goes on, reads answer, API writes are refused with a clear 503 (never a 500, never a hang),
    and once the lock is gone the change completes and nothing refused happened."""
    n = rounds(4, 12)
    corral_home.start_daemon()
    endpoint, app_dir = start_service(corral_home, tmp_path)
    locker = Locker(corral_home.path / "state.db")
    refused = 0
    held = 0.0
    replicas = 2
    try:
        with traffic(endpoint) as load:
            for round_no in range(n):
                gen = rng("state_db_locked", round_no)
                replicas = 3 if replicas == 2 else 2
                version = scale(corral_home, app_dir, replicas)
                time.sleep(gen.uniform(0.0, 1.5))  # the lock lands somewhere in the change
                hold = gen.uniform(2.0, 4.0) if not LONG else gen.uniform(2.0, 12.0)
                locker.lock()
                locked_at = time.monotonic()
                try:
                    refused += _while_locked(corral_home, tmp_path, app_dir, round_no)
                    left = hold - (time.monotonic() - locked_at)
                    if left > 0:
                        time.sleep(left)  # the fault's duration (not a wait for an outcome)
                finally:
                    held += time.monotonic() - locked_at
                    locker.unlock()
                wait_intended(corral_home, replicas, version, f"round {round_no}: after the lock")
                extra = f"extra-{round_no}"
                assert corral_home.api("GET", f"/v1/services/{extra}").status == 404
        # The daemon restarted while the file is locked (no traffic: its balancer restarts
        # too): it comes up, and adopts the running replicas once it can write, not relaunching
        # them and never giving the service up as CONTROLLER_FAILED.
        before = corral_home.service(SERVICE)
        assert before is not None
        pids = sorted(r["pid"] for r in before["replicas"] if r["status"] == "READY")
        corral_home.stop_daemon()
        locker.lock()
        try:
            corral_home.start_daemon()
            time.sleep(rng("state_db_locked", n).uniform(1.0, 3.0))  # the lock goes on a while
            during = corral_home.service(SERVICE)
            assert during is not None and during["status"] != "CONTROLLER_FAILED", during
        finally:
            locker.unlock()
        wait_intended(corral_home, replicas, version, "a daemon started on a locked file")
        after = corral_home.service(SERVICE)
        assert after is not None
        assert sorted(r["pid"] for r in after["replicas"] if r["status"] == "READY") == pids
        # Adopted means served again: the restarted balancer has them in its ready set.
        wait_for(lambda: http(f"{endpoint}/adopted", timeout=10).status == 200, SETTLE, "serving")
        statuses = [http(f"{endpoint}/adopted/{i}", timeout=30).status for i in range(20)]
        assert statuses == [200] * 20, statuses
    finally:
        locker.close()
    assert_no_crash(corral_home)
    # Steps whose outcome write the lock refused, picked up again by the reconcile loop.
    resumed = sum("not recorded" in str(e["reason"]) for e in events(corral_home))
    failed = len(load.failed)
    record(
        "disk: state file locked by another process",
        rounds=n,
        lost=failed,
        served=load.ok,
        refused_writes=refused,
        resumed_steps=resumed,
        locked_seconds=round(held, 1),
    )
    assert not load.failed, f"{failed} requests failed: {load.failed[:5]}"


def _while_locked(home: CorralHome, tmp_path: Path, app_dir: Path, round_no: int) -> int:
    """Drive the API while the state file is locked; return how many writes were refused."""
    started = time.monotonic()
    answer = home.api("GET", f"/v1/services/{SERVICE}", timeout=30)
    assert answer.status == 200, (answer.status, answer.body[:300])  # WAL: reads go on
    # Writes: refused with a 503 that says why, quickly (well before any client gives up).
    spec = write_spec(tmp_path / f"extra-{round_no}.yaml", spec_text(app_dir, 1))
    up = home.run("up", str(spec), "-n", f"extra-{round_no}", check=False)
    assert up.returncode != 0, f"`corral up` went through a locked state file: {up.stdout}"
    assert "locked" in up.stderr and "Traceback" not in up.stderr, up.stderr
    down = home.api("DELETE", f"/v1/services/{SERVICE}", timeout=30)
    assert down.status == 503, (down.status, down.body[:300])
    assert "locked" in down.json()["error"], down.json()
    update = home.api(
        "POST",
        f"/v1/services/{SERVICE}/versions",
        body={"spec": spec_text(app_dir, 5), "mode": "rolling"},
        timeout=30,
    )
    assert update.status == 503 and "retry" in update.json()["error"], update.body[:300]
    assert time.monotonic() - started < 30, "refusals took too long"
    return 3


# -- 4. the home's disk full: state file and logs ----------------------------------------------


def replica_status_is(home: CorralHome, replica_id: int, status: str) -> bool:
    svc = home.service(SERVICE)
    assert svc is not None
    return any(r["id"] == replica_id and r["status"] == status for r in svc["replicas"])


def test_home_disk_full(mounts: Mounts, corral_home: CorralHome, tmp_path: Path) -> None:
    """The whole home on a full disk: SQLite refuses every write ("database or disk is full",
    not a lock: no waiting helps). API writes get a 503 saying so, a replica that exits
    meanwhile cannot be recorded yet but the controller keeps trying (it never dies), traffic
    goes on, and once space is freed the failure is recorded, the replica replaced and writes
    accepted again."""
    n = rounds(1, 3)
    home = corral_home.path
    mounts.tmpfs(home, "32m")
    corral_home.start_daemon()
    endpoint, app_dir = start_service(corral_home, tmp_path)
    version = 1
    refused = 0
    with traffic(endpoint) as load:
        for round_no in range(n):
            gen = rng("home_disk_full", round_no)
            filler = _fill(home)
            try:
                answer = corral_home.api("GET", f"/v1/services/{SERVICE}", timeout=30)
                assert answer.status == 200, (answer.status, answer.body[:300])
                body = {"spec": spec_text(app_dir, 3), "base_dir": str(tmp_path.resolve())}
                update = corral_home.api(
                    "POST", f"/v1/services/{SERVICE}/versions", body=body, timeout=30
                )
                assert update.status == 503, (update.status, update.body[:300])
                assert "disk is full" in update.json()["error"], update.json()
                spec = write_spec(tmp_path / f"extra-{round_no}.yaml", spec_text(app_dir, 1))
                up = corral_home.run("up", str(spec), "-n", f"extra-{round_no}", check=False)
                assert up.returncode != 0 and "disk is full" in up.stderr, up
                assert "Traceback" not in up.stderr, up.stderr
                refused += 2
                # A replica exits (SIGTERM: it finishes, then goes) while nothing can be written.
                svc = corral_home.service(SERVICE)
                assert svc is not None
                victim = gen.choice([r for r in svc["replicas"] if r["status"] == "READY"])
                os.kill(int(victim["pid"]), signal.SIGTERM)
                wait_for(
                    lambda pid=int(victim["pid"]): not pid_alive(pid),
                    SETTLE,
                    f"replica pid {victim['pid']} to exit",
                )
                time.sleep(gen.uniform(1.0, 3.0))  # the fault's duration, not a wait for news
                assert corral_home.healthy(), "the daemon stopped answering on a full disk"
            finally:
                filler.unlink()
            # Space again: the exit is recorded (the picture until now still shows it READY),
            # the replica replaced.
            wait_for(
                functools.partial(replica_status_is, corral_home, int(victim["id"]), "FAILED"),
                SETTLE,
                f"replica {victim['id']} recorded FAILED once space was freed",
            )
            wait_intended(corral_home, 2, version, f"round {round_no}: space freed")
    version = scale(corral_home, app_dir, 3)
    wait_intended(corral_home, 3, version, "a write after the disk had space again")
    assert corral_home.api("GET", f"/v1/services/extra-{n - 1}").status == 404
    assert_no_crash(corral_home)
    failed = len(load.failed)
    record(
        "disk: home (state file and logs) full",
        rounds=n,
        lost=failed,
        served=load.ok,
        refused_writes=refused,
    )
    assert not load.failed, f"{failed} requests failed: {load.failed[:5]}"
    corral_home.run("down", SERVICE, "--purge")
    wait_for(lambda: corral_home.service(SERVICE) is None, SETTLE, "the service to be removed")
    corral_home.stop_daemon()  # it holds files on the mount: stopped, the mount can go cleanly


# -- 5. the store under a lock, up close ---------------------------------------------------------


def test_store_waits_outside_its_lock_and_briefly_on_the_event_loop(tmp_path: Path) -> None:
    """What the daemon-level test relies on, measured on the store itself with a real second
    process holding the lock: the event loop's thread gives up fast with StateBusy (nothing
    written), a job thread waits and gets through once the lock goes, and while it waits the
    store's own lock is free (reads from other threads are not queued behind the wait)."""
    store = Store(tmp_path / "state.db", busy_timeout=30.0, loop_busy_timeout=0.25)
    store.create_service("svc", "run: x", source=None, base_dir=None, lb_port=None)
    locker = Locker(tmp_path / "state.db")
    try:
        locker.lock()

        async def on_the_loop() -> float:
            started = time.monotonic()
            with pytest.raises(StateBusy, match="locked by another process"):
                store.event("svc", "refused")
            return time.monotonic() - started

        waited = asyncio.run(on_the_loop())
        assert waited < 10, f"the event loop's thread waited {waited:.1f}s"  # bounded, not timed
        # Having run out of time once, the loop's next calls try once without waiting (else
        # several services writing would keep the loop blocked): still refused, still bounded.
        assert store._loop_busy_until > time.monotonic()
        asyncio.run(on_the_loop())
        written = threading.Event()
        worker = threading.Thread(target=lambda: (store.event("svc", "waited"), written.set()))
        worker.start()
        # The worker is waiting for the file: the store's own lock is free for readers.
        assert not written.wait(0.5), "a write went through a locked state file"
        assert store.service("svc") is not None
        assert not written.is_set()
    finally:
        locker.unlock()
        locker.close()
    assert written.wait(30), "the job thread's write never got through after the lock went"
    worker.join(10)

    async def after_unlock() -> None:
        store.event("svc", "cooled")  # the one attempt of a cooling loop call succeeds

    asyncio.run(after_unlock())
    actions = [e.action for e in store.events("svc")]
    assert "waited" in actions and "cooled" in actions and "refused" not in actions, actions
    store.close()
