"""TLS clients that reset mid-download: the balancer's log stays quiet (no line per write the
TLS transport refused after the client was gone), and the balancer keeps serving."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from pathlib import Path

import pytest
from aiohttp import web
from conftest import make_cert, needs_openssl

from corral.balancer import LoadBalancer

uvloop = pytest.importorskip("uvloop")

HOST = "127.0.0.1"
BODY = b"x" * (32 << 20)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def reset_mid_download(port: int, client: ssl.SSLContext) -> None:
    with socket.create_connection((HOST, port), timeout=10) as raw:
        tls = client.wrap_socket(raw, server_hostname=HOST)
        tls.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        assert tls.recv(65536)
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tls.close()  # an RST, with most of the answer still to come


async def scenario(server: ssl.SSLContext, client: ssl.SSLContext) -> None:
    async def big(_request: web.Request) -> web.Response:
        return web.Response(body=BODY)

    app = web.Application()
    app.router.add_get("/big", big)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    replica_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    lb = LoadBalancer(name="svc", ssl_context=server)
    try:
        port = await lb.start()
        lb.set_ready({1: f"http://{HOST}:{replica_port}"})
        for _ in range(10):
            await asyncio.to_thread(reset_mid_download, port, client)
        reader, writer = await asyncio.open_connection(HOST, port, ssl=client)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(BODY[-100:])
    finally:
        await lb.stop()
        await runner.cleanup()


@needs_openssl
def test_clients_resetting_tls_downloads_leave_no_log_lines(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "127.0.0.1", "IP:127.0.0.1")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    lines = Lines()
    root = logging.getLogger()
    root.addHandler(lines)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(asyncio.wait_for(scenario(server, client), 60))
    finally:
        root.removeHandler(lines)
    noise = [line for line in lines.lines if "SSL connection is closed" in line]
    assert noise == [], f"{len(noise)} lines, e.g. {noise[:2]}"
