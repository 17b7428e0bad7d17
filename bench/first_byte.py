"""Time to a first byte through corral's balancer and through nginx: plain answers and streams,
with the caches warm and cold.

Why: ``bench/balancer.py``'s stream table (12 streams of 1 s, one target after the other) put
corral's first event 0.5-0.9 ms behind a direct connection, nginx's 0.1. Its wrk rows cannot
tell where such a gap comes from, and a client that leaves a stream after its first event (as
a quick script does) measures something else: the balancer cannot keep a replica connection
that is mid-answer, so the next request pays for a new one. Here every answer is read to its
end, each request on a new client connection, targets interleaved, with two gaps between
requests: ``warm`` (10 ms: the balancer's code and data still in the CPU caches) and ``cold``
(0.5 s, in which the other targets and the replica run).

Targets: ``direct`` (``bench/_lb_replica.py``), ``nginx`` (``proxy_buffering off``, as
bench/balancer.py runs it; skipped if it cannot be installed) and ``corral``
(``bench/_lb_proxy.py``, one process), plus ``corral pure`` with ``--pure``. The answers:
``plain`` (``GET /``: a 2-byte body) and ``stream`` (``GET /sse``: 3 chunked events 5 ms
apart; the first byte is the first event's).

Run: ``.venv/bin/python bench/first_byte.py [--rounds 30] [--pure]``. Prints the median time
to the first byte per target and its difference from direct, and writes
``bench/results/first_byte.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _lb_peers import HOST, ensure_tools, start_nginx, stop_pid
from balancer import Proc, start_corral, start_python

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "first_byte.json"
ANSWERS = {
    "plain": (b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n", b"\r\n\r\nok"),
    "stream": (b"GET /sse?events=3&interval=0.005 HTTP/1.1\r\nHost: bench\r\n\r\n", b"data: 0\n"),
}
GAPS = {"warm": 0.01, "cold": 0.5}


async def first_byte(port: int, answer: str) -> float:
    """Milliseconds from connecting to the answer's first byte (``plain``: the whole answer;
    ``stream``: its first event), the answer then read to its end."""
    request, marker = ANSWERS[answer]
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        data = b""
        took = None
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                raise RuntimeError(f"port {port}: the connection closed before the answer ended")
            data += chunk
            if took is None and marker in data:
                took = (time.perf_counter() - start) * 1000
            if took is not None and (answer == "plain" or data.endswith(b"0\r\n\r\n")):
                return took
    finally:
        writer.close()


async def measure(targets: dict[str, int], rounds: int) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {}
    for answer in ANSWERS:  # a warm-up each, not recorded
        for port in targets.values():
            await first_byte(port, answer)
    for gap_name, gap in GAPS.items():
        for _ in range(rounds):
            for answer in ANSWERS:
                for name, port in targets.items():  # interleaved: drift hits all alike
                    took = await first_byte(port, answer)
                    times.setdefault(f"{answer} {gap_name}", {}).setdefault(name, []).append(took)
                    await asyncio.sleep(gap)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pure", action="store_true", help="also corral's pure-Python build")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    procs: list[Proc] = []
    stops = []
    try:
        replica = start_python("replica", [str(HERE / "_lb_replica.py")])
        procs.append(replica)
        targets = {"direct": replica.port}
        nginx = ensure_tools(lambda line: print(line, file=sys.stderr)).get("nginx")
        if nginx:
            peer = start_nginx(nginx, Path(tempfile.mkdtemp()), [replica.port], 1)
            stops.append(peer)
            targets["nginx"] = peer.port
        url = [f"http://{HOST}:{replica.port}"]
        proxy = HERE / "_lb_proxy.py"
        targets["corral"] = start_corral(proxy, "corral", url, 1, [], procs)[0].port
        if args.pure:
            pure = start_corral(
                proxy, "corral pure", url, 1, [], procs, extra_env={"CORRAL_BALANCER_PURE": "1"}
            )
            targets["corral pure"] = pure[0].port
        times = asyncio.run(measure(targets, args.rounds))
    finally:
        for peer in stops:
            stop_pid(peer.popen.pid, peer.popen, peer.stop_signal)
        for proc in procs:
            stop_pid(proc.popen.pid, proc.popen)
    summary = {
        case: {name: round(statistics.median(ts), 3) for name, ts in by_target.items()}
        for case, by_target in times.items()
    }
    print(f"time to the first byte, ms (median of {args.rounds}; vs direct)")
    print("| case | " + " | ".join(targets) + " |")
    print("|---|" + "---|" * len(targets))
    for case, medians in summary.items():
        cells = [
            f"{medians[name]:.3f} ({medians[name] - medians['direct']:+.3f})" for name in targets
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rounds": args.rounds, "gaps_s": GAPS, "median_ms": summary, "raw_ms": times})
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
