"""A client that stops reading a stream: when it half-closes (FIN) it is gone, and the
replica's connection is closed (its work cancelled) even though the answer is stuck in the
client's write buffer, as ``ClientConnection.eof_received`` promises; when it only stops
reading, it is cut at idle_timeout, and the cut is the client's, not the replica's."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from chunked import HOST
from test_balancer_pump import GET, run, stream_of, until

from corral.balancer import LoadBalancer


async def _client_not_reading(lb: LoadBalancer) -> socket.socket:
    """A raw client that asks for the stream and then reads nothing (a small receive window,
    so the answer backs up into the balancer soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, lb.port))
    sock.sendall(GET)
    return sock


def test_a_half_closed_client_that_does_not_read_ends_the_replicas_work() -> None:
    async def body(lb: LoadBalancer, replica: object) -> None:
        sock = await _client_not_reading(lb)
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


def test_a_client_that_stops_reading_is_cut_for_it_not_blamed_on_the_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that reads nothing of a stream for idle_timeout is cut, as before, but the
    cut is the client's (``client_stalled``): the replica had data and the balancer had paused
    it. It was counted as the replica's silence (``idle_timeout``) and logged against it."""

    async def body(lb: LoadBalancer, replica: object) -> None:
        sock = await _client_not_reading(lb)
        try:
            await asyncio.wait_for(replica.lost.wait(), 10)  # type: ignore[attr-defined]
            await until(lambda: lb._aborted == 1, "the stream was never cut")
        finally:
            sock.close()

    caplog.set_level(logging.WARNING)
    lb = run(stream_of(400, gap=0.0005, size=30_000), body, timeout=60, idle_timeout=0.5)
    reasons = lb.stats()["errors_by_reason"]
    assert reasons.get("client_stalled") == 1 and "idle_timeout" not in reasons, reasons
    assert "mid-response" not in caplog.text, caplog.text
