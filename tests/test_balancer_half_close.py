"""A client that half-closes (FIN) while it does not read a stream is gone: the replica's
connection is closed (its work cancelled) even though the answer is stuck in the client's
write buffer, as ``ClientConnection.eof_received`` promises."""

from __future__ import annotations

import asyncio
import socket

from chunked import HOST
from test_balancer_pump import GET, run, stream_of, until

from corral.balancer import LoadBalancer


def test_a_half_closed_client_that_does_not_read_ends_the_replicas_work() -> None:
    async def body(lb: LoadBalancer, replica: object) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (HOST, lb.port))
        sock.sendall(GET)
        await until(  # not reading: the answer backs up into the balancer's buffer
            lambda: any(
                c.transport is not None and c.transport.get_write_buffer_size() for c in lb._clients
            ),
            "the balancer never buffered for the client",
        )
        sock.shutdown(socket.SHUT_WR)
        try:
            await asyncio.wait_for(replica.lost.wait(), 5)  # type: ignore[attr-defined]
            await until(lambda: not any(lb._in_flight.values()), "still in flight")
        finally:
            sock.close()

    run(stream_of(400, gap=0.0005, size=30_000), body, timeout=60)
