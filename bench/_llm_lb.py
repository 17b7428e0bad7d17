"""corral's LoadBalancer alone in a process, in front of LLM engines, for bench/llm_routing.py.

Why a process of its own: the benchmark charges the router's CPU (psutil cpu_times of this
process) per request, as it does nginx's and the Rust routers', so the balancer must be the only
thing in it. Why the engine refresh: a real balancer worker reads every engine's ``/metrics``
each ``corral.dataplane.engines.INTERVAL`` and hands their queues to the policy
(``prefix_affinity`` weighs them), so a benchmark without it would measure a policy that never
runs like that; this loop does the same call, :func:`corral.dataplane.engine_shares.refresh`
(with ``--engine-share``, the processes of one router split the reading as the workers do).

Run: ``python bench/_llm_lb.py --replica URL ... --policy P [--option KEY=JSON]
[--max-in-flight N] [--workers W] [--port N] [--reuse-port] [--affinity-file F]
[--load-file F --slot N] [--engine-share DIR]``; prints
``PORT <n>`` once listening, serves until SIGTERM/SIGINT, then prints ``STATS {json}``
(requests routed by their prompt, for a policy that counts them). Listens on 127.0.0.1 only; on
uvloop as in production.
With ``--reuse-port`` several of these serve one port (``--workers`` tells each how many share
it, as ``routing["workers"]`` does in corral's data plane).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Any

import uvloop

from corral.balancer import LoadBalancer
from corral.dataplane import engine_shares, engines
from corral.dataplane.engine_shares import Share

METRICS_PATH = "/metrics"


def routing_of(args: argparse.Namespace) -> dict[str, Any]:
    """The ``routing`` mapping corral's data plane builds from a service's YAML."""
    options: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    routing: dict[str, Any] = {"options": options, "workers": args.workers}
    if args.affinity_file:
        routing["affinity_file"] = args.affinity_file
    if args.load_file:
        routing["load_file"], routing["slot"] = args.load_file, args.slot
    if args.max_in_flight is not None:
        routing["max_in_flight_per_replica"] = args.max_in_flight
    if args.hold_patience is not None:
        routing["hold_patience"] = args.hold_patience
    return routing


async def refresh_forever(lb: LoadBalancer, ready: dict[int, str], share: Share | None) -> None:
    """What a balancer worker does for a service with engine metrics: read them every INTERVAL,
    split with the other processes when ``share`` says where (as the data plane's workers)."""
    seen: dict[int, Any] = {}
    while True:
        with contextlib.suppress(Exception):  # an engine slow to answer is skipped, as there
            seen = await engine_shares.refresh(lb, ready, METRICS_PATH, seen, share)
        await asyncio.sleep(engines.INTERVAL)


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    lb = LoadBalancer(
        name="llm-bench",
        port=args.port,
        policy=args.policy,
        reuse_port=args.reuse_port,
        routing=routing_of(args),
    )
    await lb.start()
    ready = {i + 1: url for i, url in enumerate(args.replica)}
    lb.set_ready(ready)
    share = Share(Path(args.engine_share), args.slot, args.workers) if args.engine_share else None
    refresher = asyncio.create_task(refresh_forever(lb, ready, share))
    print(f"PORT {lb.port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    refresher.cancel()
    policy = getattr(lb, "_policy", None)
    stats = {"policy": repr(policy), "routed_by_prompt": getattr(policy, "routed", None)}
    print(f"STATS {json.dumps(stats)}", flush=True)
    await lb.stop()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replica", action="append", required=True, help="an engine's URL")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--option", action="append", default=[], help="policy option KEY=JSON")
    parser.add_argument("--max-in-flight", type=int, default=None, help="per replica (a hold)")
    parser.add_argument("--hold-patience", type=float, default=None, help="s; 0: any replica")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT")
    parser.add_argument("--affinity-file", help="the conversation table the processes share")
    parser.add_argument("--load-file", help="the board of counts in flight they share")
    parser.add_argument("--slot", type=int, default=0, help="this process's row in it")
    parser.add_argument("--engine-share", help="the directory of the engine readings they split")
    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
