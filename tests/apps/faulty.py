"""One misbehaving HTTP replica for the chaos tests, its fault chosen on the command line.

Standard library only. Serves ``GET /`` (who it is, as JSON) and ``GET /health`` on
``127.0.0.1:$PORT`` like examples/app.py, except for the fault it is told to have:

``--mode ok``           behave (the control).
``--mode crash-start``  say why on stderr and exit 3 before binding anything.
``--mode crash-after``  serve, then die with ``os._exit(4)`` while handling request number
                        ``--requests + --step * (replica id % 3)`` (probes not counted): the
                        request in hand is never answered, as in a real crash. With
                        ``--crash-budget FILE:N`` at most N replicas sharing FILE crash (the
                        others keep serving), so a service is never left without a replica.
``--mode hang``         after ``--after`` seconds (0: from the start) keep accepting
                        connections but never answer anything, probes included.
``--mode slow-start``   sleep ``--delay`` seconds before binding the port, then serve.
``--mode flap``         ``/health`` answers 200 for ``--up`` seconds, then 503 for ``--down``
                        seconds, over and over (``/`` always answers).
``--mode huge-health`` ``/health`` answers 200 announcing a 1 GiB body, sends 64 KiB of it, then
                        nothing more (``/`` answers as usual).
``--mode flood``        serve, and write ``--mb`` MiB of log lines to stdout as fast as it can,
                        then print ``FLOOD DONE <bytes>``.
``--mode tree``         serve, after starting ``--children`` children that each start
                        ``--children`` grandchildren (``--depth`` levels). Every node ignores
                        SIGTERM; odd-numbered nodes call ``setsid`` (leaving the replica's
                        process group), and with ``--respawn`` a node restarts a child that dies.
                        With ``--scrub-env`` the odd-numbered nodes also start with an empty
                        environment (no replica key: only a cgroup can still find them).
                        Each node appends its pid to ``--pidfile``. ``--leader-exit-after S``
                        makes the server itself exit (code 5) after S seconds, leaving the tree.

Every line it prints names the replica, so a test can tell whose log it reads.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLICA = os.environ.get("CORRAL_REPLICA_ID", "?")


def say(message: str, *, err: bool = False) -> None:
    print(f"replica {REPLICA}: {message}", file=sys.stderr if err else sys.stdout, flush=True)


class Faults:
    """What the request handler consults: shared, set once at start."""

    mode = "ok"
    crash_at = 0
    budget = ""
    served = 0
    lock = threading.Lock()
    hang_at = float("inf")
    up = 1.0
    down = 1.0
    started = time.monotonic()
    never = threading.Event()  # never set: what a hung handler waits on


def take_crash_budget() -> bool:
    """True when this replica may crash: no budget, or one of its N crashes is left."""
    if not Faults.budget:
        return True
    path, _, limit = Faults.budget.rpartition(":")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        used = int(os.read(fd, 32) or b"0")
        if used >= int(limit):
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(used + 1).encode())
        return True
    finally:
        os.close(fd)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if time.monotonic() >= Faults.hang_at:
            Faults.never.wait()  # accepted, read, never answered
        if self.path == "/health":
            self._health()
            return
        if Faults.mode == "crash-after":
            with Faults.lock:
                Faults.served += 1
                crash = Faults.served == Faults.crash_at
            if crash and take_crash_budget():
                say(f"crashing on request {Faults.served} (simulated)", err=True)
                os._exit(4)
        body = json.dumps(
            {"replica": REPLICA, "pid": os.getpid(), "path": self.path, "mode": Faults.mode}
        ).encode()
        self._answer(200, body)

    def _health(self) -> None:
        if Faults.mode == "huge-health":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            self.wfile.write(b"x" * 65536)
            self.wfile.flush()
            Faults.never.wait(60)  # the rest never comes (a probe must not wait for it)
            return
        if Faults.mode == "flap":
            phase = (time.monotonic() - Faults.started) % (Faults.up + Faults.down)
            if phase >= Faults.up:
                self._answer(503, b"flapping: down\n")
                return
        self._answer(200, b"ok\n")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the flood mode is the only one that should fill the log


def serve(port: int, *, background: bool = False) -> None:
    ThreadingHTTPServer.request_queue_size = 1024  # socketserver's 5 drops bursts of SYNs
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    say(f"listening on 127.0.0.1:{port} (mode {Faults.mode})")
    if background:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    else:
        server.serve_forever()


def flood(mib: float) -> None:
    line = (f"replica {REPLICA}: flood " + "x" * 100 + "\n").encode()
    block = line * max(1, (1 << 16) // len(line))
    total = int(mib * (1 << 20))
    written = 0
    out = sys.stdout.buffer
    while written < total:
        out.write(block)
        written += len(block)
    out.flush()
    say(f"FLOOD DONE {written}")


def record_pid(pidfile: str) -> None:
    fd = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def start_node(args: argparse.Namespace, depth: int, index: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--mode",
        "tree-node",
        "--depth",
        str(depth),
        "--children",
        str(args.children),
        "--pidfile",
        args.pidfile,
        "--index",
        str(index),
    ]
    if args.respawn:
        command.append("--respawn")
    if args.scrub_env:
        command.append("--scrub-env")
    # With --scrub-env, odd-numbered nodes start with an EMPTY environment: no replica key, no
    # home marker, nothing that could tell whose they are.
    env = {} if args.scrub_env and index % 2 == 1 else None
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)


def tree_node(args: argparse.Namespace) -> None:
    """One node below the server: ignores SIGTERM, maybe leaves the group, keeps its children."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.index % 2 == 1:
        os.setsid()
    record_pid(args.pidfile)
    children = []
    if args.depth > 0:
        children = [start_node(args, args.depth - 1, i) for i in range(args.children)]
    while True:
        time.sleep(0.2)
        for i, child in enumerate(children):
            if child.poll() is not None and args.respawn:
                children[i] = start_node(args, args.depth - 1, i)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--crash-budget", default="")
    parser.add_argument("--after", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=5.0)
    parser.add_argument("--up", type=float, default=1.0)
    parser.add_argument("--down", type=float, default=1.0)
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--respawn", action="store_true")
    parser.add_argument("--scrub-env", action="store_true")
    parser.add_argument("--pidfile", default=os.devnull)
    parser.add_argument("--leader-exit-after", type=float, default=None)
    args = parser.parse_args()
    if args.mode == "tree-node":
        tree_node(args)
        return

    Faults.mode = args.mode
    port = int(os.environ["PORT"])
    if args.mode == "crash-start":
        say("cannot start: simulated crash at start", err=True)
        sys.exit(3)
    if args.mode == "crash-after":
        rid = int(REPLICA) if REPLICA.isdigit() else 0
        Faults.crash_at = args.requests + args.step * (rid % 3)
        Faults.budget = args.crash_budget
    if args.mode == "flap":
        Faults.up, Faults.down = args.up, args.down
        Faults.started = time.monotonic()
    if args.mode == "hang":
        Faults.hang_at = time.monotonic() + args.after
    if args.mode == "slow-start":
        say(f"slow start: binding in {args.delay:g}s")
        time.sleep(args.delay)
    if args.mode == "flood":
        serve(port, background=True)
        flood(args.mb)
        threading.Event().wait()
    if args.mode == "tree":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record_pid(args.pidfile)
        nodes = [start_node(args, args.depth - 1, i) for i in range(args.children)]
        say(f"started {len(nodes)} children")
        if args.leader_exit_after is not None:
            serve(port, background=True)
            time.sleep(args.leader_exit_after)
            say("leader exiting, leaving its tree behind", err=True)
            os._exit(5)
    serve(port)


if __name__ == "__main__":
    main()
