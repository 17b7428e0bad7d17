"""corral's LoadBalancer alone in a process, for bench/balancer.py.

Why a process of its own: the benchmark charges the proxy's CPU (psutil cpu_times of this pid) per
request, which needs the balancer to be the only thing in its process. It runs on uvloop, as the
balancer workers do in production (``--asyncio`` for the stock loop).

Run: ``python bench/_lb_proxy.py --replica http://127.0.0.1:P1 ... [--metrics] [--policy P]
[--port N] [--reuse-port] [--board PATH --slot I --workers N] [--env NAME=VALUE]``; prints
``PORT <n>`` once listening, serves until SIGTERM/SIGINT.
Listens on 127.0.0.1 only. With ``--reuse-port`` several of these can serve one port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

# --env NAME=VALUE (repeatable) is set before corral is imported, so that a --variant row of
# bench/balancer.py can run the engine with a setting read at import (CORRAL_BALANCER_PUMP=0).
for _flag, _value in zip(sys.argv, sys.argv[1:], strict=False):
    if _flag == "--env":
        _name, _, _setting = _value.partition("=")
        os.environ[_name] = _setting

import uvloop  # noqa: E402

from corral.balancer import LoadBalancer, merge_stats, render  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    # With --board, the processes on one port share their counts, as a service's workers do.
    routing = (
        {"load_file": args.board, "slot": args.slot, "workers": args.workers} if args.board else {}
    )
    lb = LoadBalancer(
        name="bench",
        port=args.port,
        policy=args.policy,
        reuse_port=args.reuse_port,
        routing=routing,
    )
    await lb.start()
    lb.set_ready({i + 1: url for i, url in enumerate(args.replica)})
    print(f"PORT {lb.port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if args.metrics:
        # one scrape at the end, so a run with metrics also proves they render
        text = render({"bench": merge_stats([lb.stats()])}).decode()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("corral_lb_requests_total{")
        )
        print(f"METRICS requests_total={total:.0f}", flush=True)
    await lb.stop()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--metrics", action="store_true", help="render the metrics at the end")
    parser.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT")
    parser.add_argument("--board", help="the load board shared with the other processes")
    parser.add_argument("--slot", type=int, default=0, help="this process's row on the board")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the board")
    parser.add_argument("--asyncio", action="store_true", help="stock asyncio loop, not uvloop")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE set before corral is imported"
    )
    args = parser.parse_args()
    if args.asyncio:
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))


if __name__ == "__main__":
    cli()
