"""The floor for a balancer written in Python on uvloop: a relay that does nothing else.

Why: issue 24 asks corral's balancer to cost no more CPU per request than nginx. This script
tells how much of corral's cost is the machinery every Python proxy on uvloop pays (the event
loop, one protocol callback per read, one ``write`` per relayed batch) and how much is corral's
own work (parsing, rewriting headers, routing, counting, timeouts, retries). It is a bench
helper, not a proxy anyone should run: it checks nothing, adds no header, retries nothing, has
no timeout, and keeps the request and response bytes as they come.

What it does per request: the bytes the client sent are written, as read, on a pooled
keep-alive connection to the next replica (round robin); the replica's bytes are written to the
client as read; an ``httptools`` response parser, fed every batch with no per-header callback,
finds the answer's end so the replica connection goes back to the pool. A request whose bytes
say ``Connection: close`` has its client connection closed after its answer (the benchmark's
readiness probe sends one). Pipelined requests are not supported (wrk does not pipeline).

Run as bench/_lb_proxy.py is (``bench/balancer.py --floor`` does): ``python bench/_lb_floor.py
--replica http://127.0.0.1:P1 ... [--port N] [--reuse-port]``; prints ``PORT <n>`` once
listening, serves until SIGTERM/SIGINT. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from urllib.parse import urlsplit

import httptools
import uvloop

HOST = "127.0.0.1"
Address = tuple[str, int]


class Replica(asyncio.Protocol):
    """A keep-alive connection to one replica; its answer's bytes go to ``client`` as read."""

    def __init__(self, pool: list[Replica]) -> None:
        self.pool = pool
        self.client: Client | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.pool.append(self)
        if client is not None:
            client.replica = None
            if client.close_after and client.transport is not None:
                client.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None and self.client.transport is not None:
            self.client.transport.close()


class Client(asyncio.Protocol):
    """A client connection: each request's bytes go, as read, to one pooled replica connection."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.replica: Replica | None = None
        self.close_after = False
        self.dialing: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        replica = self.replica
        if replica is not None and replica.transport is not None:
            replica.transport.write(data)  # the rest of a request already under way
            return
        self.close_after = b"onnection: close" in data
        address = next(self.relay.order)
        pool = self.relay.pools[address]
        if pool:
            replica = self.replica = pool.pop()
            replica.client = self
            assert replica.transport is not None
            replica.transport.write(data)
        else:
            self.dialing = asyncio.ensure_future(self.dial(address, data))

    async def dial(self, address: Address, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        pool = self.relay.pools[address]
        transport, replica = await loop.create_connection(lambda: Replica(pool), *address)
        replica.client = self
        self.replica = replica
        transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        replica, self.replica = self.replica, None
        if replica is not None and replica.transport is not None:
            replica.transport.close()  # an answer half relayed: the connection cannot be reused


class Relay:
    def __init__(self, replicas: list[str]) -> None:
        self.pools: dict[Address, list[Replica]] = {}
        for url in replicas:
            parts = urlsplit(url)
            self.pools[(parts.hostname or HOST, parts.port or 80)] = []
        self.order = itertools.cycle(list(self.pools))


async def main(args: argparse.Namespace) -> None:
    relay = Relay(args.replica)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Client(relay), HOST, args.port, reuse_port=args.reuse_port or None
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT")
    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
