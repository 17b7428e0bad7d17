"""corral's balancer engine alone: its Python work per proxied request, with no sockets.

Why: ``bench/balancer.py`` measures the whole proxy against nginx, where most of the CPU is the
kernel's and this machine's noise moves one engine's figure by 30-50% between rounds. A change
to the engine's Python (a memo, a grammar, a call saved) is a few microseconds, lost in that
noise. Here the same client and replica protocol objects run on fake transports in one loop,
so what is timed is the engine's own work per request (both sides: the request in, the answer
back), steady to a few percent, and engines from other source trees (``--compare
NAME=SRC``, e.g. a git worktree of an earlier commit) run in the same rounds.

Requests, each kind on one client connection with two replicas (round robin):
``same`` (wrk's identical GETs), ``varied`` (a new X-Request-Id each time, as in
``bench/balancer.py``), ``paths`` (a new path and id each time), ``library`` (``paths`` with
the headers an HTTP client library adds, python-requests' ``Connection: keep-alive`` among
them), ``post`` (a small JSON body, new id), ``general`` (``varied`` with the fast path
turned off: the general path's cost) and ``stream`` (``varied`` answered by a 2-event chunked
stream: what a stream's start and end cost, the per-request part of a streamed answer).

Run: ``python bench/balancer_engine.py [--compare NAME=SRC ...] [--requests N] [--rounds R]``.
Prints a table (median CPU microseconds per request over the rounds, and each engine's ratio to
the first) and writes ``bench/results/balancer_engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "balancer_engine.json"
KINDS = ("same", "varied", "paths", "library", "post", "general", "stream")
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
# ``stream``: a short server-sent-event stream, as the replica's three reads bring it (the head
# with the first event, one more event, the last chunk): what a stream's start and end cost.
STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 0\n\n\r\n",
    b"9\r\ndata: 1\n\n\r\n",
    b"0\r\n\r\n",
)
HOST = b"Host: 127.0.0.1:8080\r\n"


def request(kind: str, n: int) -> bytes:
    if kind == "same":
        return b"GET / HTTP/1.1\r\n" + HOST + b"\r\n"
    if kind == "paths":
        return b"GET /item/%d HTTP/1.1\r\n%bX-Request-Id: %d\r\n\r\n" % (n, HOST, n)
    if kind == "library":
        return (
            b"GET /item/%d HTTP/1.1\r\n%bUser-Agent: python-requests/2.32.3\r\n"
            b"Accept-Encoding: gzip, deflate\r\nAccept: */*\r\nConnection: keep-alive\r\n"
            b"X-Request-Id: %d\r\n\r\n" % (n, HOST, n)
        )
    if kind == "post":
        body = b'{"n": %d}' % (n % 10)
        return (
            b"POST /api HTTP/1.1\r\n%bX-Request-Id: %d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (HOST, n, len(body), body)
        )
    return b"GET / HTTP/1.1\r\n%bX-Request-Id: %d\r\n\r\n" % (HOST, n)  # varied, general


class Transport:
    """As much of asyncio.Transport as the balancer's protocols use; keeps the last write."""

    def __init__(self) -> None:
        self.last = b""
        self.protocol: Any = None  # what set_protocol put in the connection's place, if any

    def write(self, data: bytes) -> None:
        self.last = data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None: ...

    abort = close

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol


def measure(kind: str, count: int) -> float:
    """CPU microseconds per request for ``count`` requests of ``kind`` (this process's engine)."""
    import asyncio

    from corral.balancer import LoadBalancer, fast
    from corral.balancer.client import ClientConnection
    from corral.balancer.upstream import UpstreamConnection

    async def go() -> float:
        lb = LoadBalancer(name="bench", policy="round_robin")
        lb.set_ready({1: "http://127.0.0.1:9001", 2: "http://127.0.0.1:9002"})
        ups = []
        for target in lb._ready.values():
            conn = UpstreamConnection(target)
            transport = Transport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            conn.reusable = True
            lb._pool.put(conn)
            ups.append((conn, transport))
        client = ClientConnection(lb)
        ct = Transport()
        client.connection_made(ct)  # type: ignore[arg-type]
        requests = [request(kind, n) for n in range(count)]
        answer = STREAM if kind == "stream" else (RESPONSE,)
        end = STREAM[-1] if kind == "stream" else b"ok"  # the client's last write ends so
        started = time.process_time()
        for data in requests:
            client.data_received(data)
            for conn, transport in ups:
                if transport.last:
                    transport.last = b""
                    for piece in answer:
                        (transport.protocol or conn).data_received(piece)
            if not ct.last.endswith(end):
                raise RuntimeError(f"{kind}: no answer: {ct.last!r}")
            ct.last = b""
        return (time.process_time() - started) / count * 1e6

    # Trees from before ClientConnection.fast_request called fast.try_request directly.
    owner: Any = ClientConnection if hasattr(ClientConnection, "fast_request") else fast
    name = "fast_request" if owner is ClientConnection else "try_request"
    real = getattr(owner, name)
    if kind == "general":
        setattr(owner, name, lambda cl, data: False)
    try:
        return asyncio.run(go())
    finally:
        setattr(owner, name, real)


def child(count: int) -> None:
    """One engine's figures (run with PYTHONPATH at its source tree): JSON on stdout."""
    measure("varied", count // 10)  # warm-up
    out: dict[str, Any] = {kind: measure(kind, count) for kind in KINDS}
    try:
        from corral.balancer import speedups

        out["accelerated"] = speedups.ACCELERATED
    except ImportError:  # a tree from before the compiled build
        out["accelerated"] = "pure"
    print(json.dumps(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000, help="per kind and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=SRC")
    parser.add_argument(
        "--pure",
        action="store_true",
        help="add a row 'pure': this tree with CORRAL_BALANCER_PURE=1 (the fast path uncompiled)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.requests)
        return 0
    from balancer import parse_compare  # bench/balancer.py's --compare, same rules

    engines = {"corral": HERE.parent / "src", **parse_compare(args.compare)}
    if args.pure:
        engines["pure"] = HERE.parent / "src"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        # The order rotates by round, so no engine always runs first (or last) on a busy box.
        order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
        for name in order:
            env = {**os.environ, "PYTHONPATH": str(engines[name])}
            if name == "pure":
                env["CORRAL_BALANCER_PURE"] = "1"
            else:
                env.pop("CORRAL_BALANCER_PURE", None)
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--requests", str(args.requests)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout
            runs[name].append(json.loads(out))
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr)
    medians = {
        name: {kind: statistics.median(run[kind] for run in rs) for kind in KINDS}
        for name, rs in runs.items()
    }
    first = next(iter(engines))
    print(f"CPU us per request, engine alone, median of {args.rounds} rounds of {args.requests}")
    print("fast path build: " + ", ".join(f"{n} {rs[0]['accelerated']}" for n, rs in runs.items()))
    print("| engine | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 1) + "|")
    for name, m in medians.items():
        cells = []
        for kind in KINDS:
            cell = f"{m[kind]:.2f}"
            if name != first:
                cell += f" ({m[kind] / medians[first][kind]:.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "python": sys.version.split()[0],
        "requests": args.requests,
        "rounds": args.rounds,
        "engines": {name: str(src) for name, src in engines.items()},
        "runs": runs,
        "medians_us": medians,
        "accelerated": {
            name: sorted({run["accelerated"] for run in rs}) for name, rs in runs.items()
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
