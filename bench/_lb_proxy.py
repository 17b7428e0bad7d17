"""corral's LoadBalancer alone in a process, for bench/balancer.py.

Why a process of its own: the benchmark charges the proxy's CPU (psutil cpu_times of this pid) per
request, which needs the balancer to be the only thing in its process. It runs on the default
asyncio loop, as in the daemon.

Run: ``python bench/_lb_proxy.py --replica http://127.0.0.1:P1 ... [--metrics] [--policy P]``;
prints ``PORT <n>`` once listening, serves until SIGTERM/SIGINT. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from prometheus_client import CollectorRegistry

from corral.balancer import BalancerMetrics, LoadBalancer, render


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--metrics", action="store_true", help="count into a registry")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    metrics = BalancerMetrics(CollectorRegistry()) if args.metrics else None
    lb = LoadBalancer(name="bench", port=args.port, policy=args.policy, metrics=metrics)
    await lb.start()
    lb.set_ready({i + 1: url for i, url in enumerate(args.replica)})
    print(f"PORT {lb.port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if metrics is not None:
        # one scrape at the end, so a run with metrics also proves they render
        text = render(metrics.registry).decode()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("corral_lb_requests_total{")
        )
        print(f"METRICS requests_total={total:.0f}", flush=True)
    await lb.stop()


if __name__ == "__main__":
    asyncio.run(main())
