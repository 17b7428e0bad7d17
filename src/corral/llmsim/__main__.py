"""``python -m corral.llmsim``: one simulated LLM engine on one port, until SIGTERM or SIGINT.

Prints ``corral.llmsim listening on http://HOST:PORT`` once it listens, so a launcher that
passed ``--port 0`` learns the port. The engine's knobs are :class:`EngineConfig`'s fields.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import fields

import uvloop

from corral.llmsim.engine import EngineConfig
from corral.llmsim.server import DEFAULT_MAX_TOKENS, DEFAULT_MODEL, READY_LINE, SimServer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m corral.llmsim",
        description="An OpenAI-compatible LLM engine SIMULATOR (no model: queueing, batching"
        " and a prefix KV cache on a clock, meaningless tokens out).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the served model's name")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="output tokens of a request that names none",
    )
    for knob in fields(EngineConfig):
        flag = "--" + knob.name.replace("_", "-")
        parser.add_argument(flag, type=type(knob.default), default=knob.default, **knob.metadata)
    return parser


async def serve(config: EngineConfig, args: argparse.Namespace) -> None:
    # Handlers first: a launcher may send SIGTERM the moment it reads the ready line.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stop.set)
    server = SimServer(config, model=args.model, default_max_tokens=args.default_max_tokens)
    port = await server.start(args.host, args.port)
    print(f"{READY_LINE}http://{args.host}:{port}", flush=True)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = EngineConfig(
            **{knob.name: getattr(args, knob.name) for knob in fields(EngineConfig)}
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.default_max_tokens < 1:
        parser.error("--default-max-tokens must be at least 1")
    if not 0 <= args.port <= 65535:  # the OS would take 99999 modulo 65536, -1 as an error
        parser.error(f"--port must be 0 to 65535, got {args.port}")
    try:
        uvloop.run(serve(config, args))
    except OSError as exc:  # the address is not this machine's, or the port is taken
        parser.exit(1, f"corral.llmsim: cannot listen on {args.host}:{args.port}: {exc}\n")


if __name__ == "__main__":
    main()
