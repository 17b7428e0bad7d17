"""The stream pump (corral.balancer.pump, ``_speedups.Pump``): long live streams relayed by an
epoll set of their own that the loop watches, with no Python per batch, on real sockets on
127.0.0.1, on uvloop as the balancer workers run.

A stream goes to the pump once it has relayed PUMP_LONG batches on the loop (or after its
first, when the last stream on that replica connection was that long), and comes back to the
loop for anything but whole chunk data the client takes at once. These tests hold the pumped
stream to what the loop does: every byte to the client in order, the replica connection kept
for the next stream, and each way a stream ends early (client gone, replica lost, a slow
client, a silent replica, the balancer stopping, framing only httptools reads) handled as on
the loop, with the pump holding nothing afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import os
import socket
import ssl
import struct
import subprocess
import sys
import termios
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from chunked import HOST, STREAM_HEAD, Replica, Script, dechunk, frame, read_answer
from conftest import OPENSSL, make_cert

from corral.balancer import LoadBalancer, speedups
from corral.balancer import pump as pump_module

pytestmark = pytest.mark.skipif(
    speedups.Pump is None, reason="the compiled build is not built, or this run is pure"
)

GET = b"GET /sse HTTP/1.1\r\nHost: svc\r\n\r\n"
LONG = 50  # events: past PUMP_LONG (32), so the pump takes the stream


def event(i: int, size: int = 0) -> bytes:
    return b"data: %d %b\n\n" % (i, b"x" * size)


def stream_of(count: int, gap: float = 0.001, size: int = 0) -> Script:
    """Each request answered by ``count`` events, each its own write ``gap`` s apart."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD)
        for i in range(count):
            await writer.drain()
            await asyncio.sleep(gap)
            writer.write(frame(event(i, size)))
        writer.write(b"0\r\n\r\n")

    return script


def want(count: int, size: int = 0) -> bytes:
    return b"".join(event(i, size) for i in range(count))


async def until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Wait for ``check`` to hold, failing with ``what`` past ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def pump_of(lb: LoadBalancer) -> Any:
    pump = getattr(lb, "_stream_pump", None)
    assert pump is not None, "no stream went to the pump"
    return pump


def settled(lb: LoadBalancer) -> None:
    """Nothing counted in flight or streaming, and no stream left with the pump."""
    assert not any(lb._in_flight.values()), lb._in_flight
    assert not any(lb._streaming.values()), lb._streaming
    pump = getattr(lb, "_stream_pump", None)
    assert pump is None or pump.streams == 0


def run(
    script: Script,
    body: Callable[[LoadBalancer, Replica], Awaitable[None]],
    timeout: float = 30,
    replica_tls: ssl.SSLContext | None = None,
    trust: ssl.SSLContext | None = None,
    stock_loop: bool = False,
    **options: Any,
) -> LoadBalancer:
    """``body`` against a balancer in front of one replica answering by ``script`` (over TLS
    with ``replica_tls``, whose certificate ``trust`` has), on uvloop (or asyncio's own
    loop); the balancer, stopped, whose pump must have been closed with it."""
    box: list[LoadBalancer] = []

    async def main() -> None:
        async with Replica(script, replica_tls) as replica:
            lb = LoadBalancer(name="svc", **options)
            box.append(lb)
            if trust is not None:
                lb._client_ssl = trust
            await lb.start()
            try:
                scheme = "https" if replica_tls else "http"
                lb.set_ready({1: f"{scheme}://{HOST}:{replica.port}"})
                await body(lb, replica)
            finally:
                pump = getattr(lb, "_stream_pump", None)
                await lb.stop()
                assert pump is None or pump.closed, "the pump outlived stop()"

    (asyncio.run if stock_loop else uvloop.run)(asyncio.wait_for(main(), timeout))
    return box[0]


async def streams(port: int, count: int, events: int, size: int = 0) -> None:
    """``count`` streams one after the other on one client connection, each read whole."""
    reader, writer = await asyncio.open_connection(HOST, port)
    for _ in range(count):
        writer.write(GET)
        assert await asyncio.wait_for(read_answer(reader), 10) == want(events, size)
    writer.close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_long_streams_go_to_the_pump_and_arrive_whole(loop: str) -> None:
    """Three long streams on one client connection: each reaches the client byte for byte,
    the pump took every one, counted as the loop counts them, over one replica connection
    kept between them; on asyncio's own loop as on uvloop. The first went to the pump after
    32 batches; the next ones, after a long one on the same replica connection, at once."""

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(GET)
        assert await asyncio.wait_for(read_answer(reader), 10) == want(LONG)
        assert pump_of(lb).taken == 1
        for taken in (2, 3):
            writer.write(GET)
            raw = await asyncio.wait_for(reader.readuntil(b"data: 3 "), 10)
            assert (pump_of(lb).taken, pump_of(lb).streams) == (taken, 1)
            raw += await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)
            assert dechunk(raw.partition(b"\r\n\r\n")[2]) == (want(LONG), True)
        writer.close()
        pump = pump_of(lb)
        assert pump.given_back["replayed"] == 3  # each one's last batch: the loop ends it
        assert lb._codes.get(200) == 3
        assert replica.connections == 1
        settled(lb)

    run(stream_of(LONG), body, stock_loop=loop == "asyncio")


@pytest.mark.skipif(OPENSSL is None, reason="the openssl command is missing")
@pytest.mark.parametrize("tls", ["tls replica", "tls client"])
def test_tls_streams_stay_on_the_loop(tmp_path: Path, tls: str) -> None:
    """The pump sends and reads raw sockets: a stream with TLS on either side stays on
    the loop, whole."""
    cert, key = make_cert(tmp_path, "localhost", "IP:127.0.0.1")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        ctx = client if tls == "tls client" else None
        reader, writer = await asyncio.open_connection(HOST, lb.port, ssl=ctx)
        for _ in range(2):
            writer.write(GET)
            assert await asyncio.wait_for(read_answer(reader), 10) == want(LONG)
        writer.close()
        pump = getattr(lb, "_stream_pump", None)
        assert pump is None or pump.taken == 0
        settled(lb)

    if tls == "tls client":
        run(stream_of(LONG), body, ssl_context=server)
    else:
        run(stream_of(LONG), body, replica_tls=server, trust=client)


def test_short_streams_stay_on_the_loop() -> None:
    """Streams shorter than PUMP_LONG batches never pay for the hand-over."""

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        await streams(lb.port, 3, 10)
        assert getattr(lb, "_stream_pump", None) is None or lb._stream_pump.taken == 0
        settled(lb)

    run(stream_of(10), body)


def test_many_clients_at_once() -> None:
    """Twenty clients, two long streams each, at the same time: every byte where it
    belongs."""

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        await asyncio.gather(*(streams(lb.port, 2, LONG) for _ in range(20)))
        assert pump_of(lb).taken >= 20
        assert lb._codes.get(200) == 40
        settled(lb)

    run(stream_of(LONG), body, timeout=60)


def test_framing_the_pump_leaves_to_the_loop() -> None:
    """A chunk larger than the pump's buffer, then a size line cut across writes (the first
    stream) or a chunk extension, httptools' to read (the second), while the pump relays:
    the client gets the data as sent, and the pump gave each stream back to the loop at
    the framing it does not relay."""
    big = b"B" * 200_000
    split = frame(event(40))
    cut = [split[:1], split[1:3], split[3:]]  # "b\r\n..." in three writes
    # an extension whose size line is cut too: what the pump relayed of a line it could
    # not yet judge would be lost to httptools, so the pump relays no part of one
    extended = b"%x;note=1\r\n%b\r\n" % (len(event(40)), event(40))
    extension = [extended[:1], extended[1:]]
    expected = want(40) + big + want(50)[len(want(40)) :]

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        pieces = [frame(event(i)) for i in range(40)] + [frame(big)]
        pieces += cut if n == 0 else extension
        pieces += [frame(event(i)) for i in range(41, 50)]
        writer.write(STREAM_HEAD)
        for piece in pieces:
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(piece)
        writer.write(b"0\r\n\r\n")

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        for _ in range(2):
            writer.write(GET)
            assert await asyncio.wait_for(read_answer(reader), 10) == expected
        writer.close()
        pump = pump_of(lb)
        assert pump.taken == 2
        # The first stream's cut line was the pump's to hold, and its end the loop's; the
        # second came back at its extension and stayed on the loop.
        assert pump.given_back["replayed"] == 2
        settled(lb)

    run(script, body)


def test_a_client_gone_mid_stream_ends_the_replicas_work() -> None:
    """The client reads part of a pumped stream and closes: the replica's connection is
    closed (its work cancelled), and the pump holds nothing."""

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(GET)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readuntil(b"data: 40 ")  # the pump has it by now
        assert pump_of(lb).streams == 1
        writer.transport.abort()
        await asyncio.wait_for(replica.lost.wait(), 10)
        await until(lambda: pump_of(lb).streams == 0, "the pump kept the stream")
        await until(lambda: not any(lb._in_flight.values()), "still in flight")
        settled(lb)

    run(stream_of(2000, gap=0.002), body)


def test_a_replica_lost_mid_stream_cuts_the_client_and_the_next_is_served() -> None:
    """The replica's connection resets while the pump relays: the client is cut (no last
    chunk), never left waiting; the next stream is served on a new replica connection."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        if n != 0:
            await stream_of(LONG)(n, writer)
            return
        writer.write(STREAM_HEAD)
        for i in range(LONG):
            await writer.drain()
            await asyncio.sleep(0.001)
            writer.write(frame(event(i)))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(GET)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_answer(reader), 10)
        writer.close()
        assert pump_of(lb).taken == 1
        assert lb._aborted == 1
        await streams(lb.port, 1, LONG)
        assert replica.connections == 2
        settled(lb)

    run(script, body)


def test_a_slow_client_gets_every_byte() -> None:
    """A client with a small receive buffer that stops reading while the pump relays: the
    pump cannot send a whole batch, the loop takes the stream back with what is unsent and
    holds the replica as it does on the loop, and once the client reads it gets every byte
    in order. 400 events of 30 kB: more than the kernel buffers between (tcp_wmem's 4 MB)."""
    size = 30_000

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((HOST, lb.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 25)
        writer.write(GET)
        raw = await reader.readuntil(b"data: 40 ")  # the pump has it by now
        await asyncio.sleep(0.5)  # not reading: the replica writes on
        assert pump_of(lb).given_back["unsent"] == 1, pump_of(lb).given_back
        raw += await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
        assert dechunk(raw.partition(b"\r\n\r\n")[2]) == (want(400, size), True)
        writer.close()
        settled(lb)

    run(stream_of(400, gap=0.0005, size=size), body, timeout=60)


def test_the_idle_timeout_runs_from_the_last_batch_the_pump_relayed() -> None:
    """With a 0.6 s idle timeout: a stream the pump relays whose events come 0.3 s apart
    for 2.4 s is never cut (each batch moves the deadline on); one whose replica then goes
    silent is cut at the timeout, and the pump holds nothing."""

    async def script(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD)
        for i in range(LONG):  # the pump takes it, after 32 quick ones
            await writer.drain()
            await asyncio.sleep(0.001)
            writer.write(frame(event(i)))
        for i in range(LONG, LONG + 8):
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(frame(event(i)))
        if n == 0:
            writer.write(b"0\r\n\r\n")
            return
        await asyncio.sleep(30)  # silent: the balancer cuts at its idle timeout

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(GET)
        assert await asyncio.wait_for(read_answer(reader), 10) == want(LONG + 8)
        assert pump_of(lb).taken == 1
        writer.write(GET)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_answer(reader), 10)
        writer.close()
        assert pump_of(lb).taken == 2
        await until(lambda: pump_of(lb).streams == 0, "the pump kept the stream")
        assert lb._aborted == 1
        settled(lb)

    run(script, body, idle_timeout=0.6)


def test_the_balancer_stopping_mid_stream_closes_the_pump() -> None:
    """``stop`` while the pump relays a stream: the client is cut, and the pump closes
    (``run`` checks it) without waiting for the stream."""

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        reader, writer = await asyncio.open_connection(HOST, lb.port)
        writer.write(GET)
        await reader.readuntil(b"data: 40 ")
        assert pump_of(lb).streams == 1
        pump = pump_of(lb)
        await asyncio.wait_for(lb.stop(), 10)
        assert pump.streams == 0
        assert pump.closed
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_answer(reader), 10)
        writer.close()

    run(stream_of(5000, gap=0.002), body)


def test_the_environment_turns_the_pump_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CORRAL_BALANCER_PUMP=0`` is read at import; with it off, long streams stay on the
    loop, whole."""
    probe = "from corral.balancer import pump; print(pump._ENABLED)"  # at import
    for value, enabled in (("0", "False"), ("1", "True")):
        env = {**os.environ, pump_module.PUMP_ENV: value}
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == enabled
    monkeypatch.setattr(pump_module, "_ENABLED", False)

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        await streams(lb.port, 2, LONG)
        assert getattr(lb, "_stream_pump", None) is None
        settled(lb)

    run(stream_of(LONG), body)


async def accept(srv: socket.socket) -> socket.socket:
    """The next connection on the non-blocking listener ``srv``."""
    while True:
        try:
            return srv.accept()[0]
        except BlockingIOError:
            await asyncio.sleep(0.005)


def widen_balancer_end(up: socket.socket, size: int) -> None:
    """Give the balancer's socket connected to ``up`` a ``size`` receive buffer."""
    from corral.balancer.upstream import UpstreamConnection

    ends = [
        conn.transport.get_extra_info("socket")
        for conn in gc.get_objects()
        if isinstance(conn, UpstreamConnection) and conn.transport is not None
    ]
    for sock in ends:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # others, closed
            if sock.getsockname() == up.getpeername():
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def test_one_wake_up_relays_a_bounded_share_of_a_flow() -> None:
    """A replica that has written megabytes the client can take at once: one wake-up of the
    pump relays a few reads of it, not all (the set is edge-triggered, and a flow read until
    its socket is empty held the loop as long as the replica kept ahead of the pump and the
    client kept up: 0.3 s with one stream of small chunks), and the rest follows with no new
    bytes from the replica, so no edge."""
    big = 4 << 20

    async def body(lb: LoadBalancer, replica: Replica) -> None:
        srv = socket.create_server((HOST, 0))
        srv.setblocking(False)
        lb.set_ready({1: f"http://{HOST}:{srv.getsockname()[1]}"})
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, big)
        client.connect((HOST, lb.port))
        client.setblocking(False)
        client.sendall(GET)
        up = await accept(srv)
        widen_balancer_end(up, big)  # room for what the replica writes
        up.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, big)
        got = bytearray()

        def drain() -> None:
            with contextlib.suppress(BlockingIOError):
                while chunk := client.recv(1 << 20):
                    got.extend(chunk)

        up.sendall(STREAM_HEAD)
        for i in range(40):  # the pump takes it after 32
            up.sendall(frame(event(i)))
            await asyncio.sleep(0.003)
            drain()
        size = 3 << 20
        up.sendall(b"%x\r\n" % size)
        await until(lambda: pump_of(lb).streams == 1, "the pump did not take the stream")
        await asyncio.sleep(0.05)
        drain()
        before = len(got)
        up.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while sent < size:
                sent += up.send(b"x" * min(65536, size - sent))
        assert sent > 1 << 20, sent  # megabytes wait on the balancer's replica socket
        pump_of(lb)._poll()  # one wake-up, as the loop would call it
        relayed = struct.unpack("i", fcntl.ioctl(client, termios.FIONREAD, b"\0\0\0\0"))[0]
        assert relayed <= 512 << 10, relayed
        await until(lambda: (drain(), len(got) - before >= sent)[1], "the rest stalled")
        assert pump_of(lb).streams == 1
        for sock in (client, up, srv):
            sock.close()

    run(stream_of(1), body)
