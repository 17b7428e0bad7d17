"""An answer the daemon cut short (it died while sending it) is the daemon gone
(DaemonUnreachable, which the waiting commands ride through), not an IncompleteRead
traceback out of every command."""

from __future__ import annotations

import http.client
import socket
import threading
from pathlib import Path

import pytest

from corral.apiconn import Endpoint
from corral.client import Client, DaemonUnreachable


def test_an_answer_cut_midway_is_the_daemon_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_half() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            body = b'{"services": []}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            conn.sendall(b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body)

    server = threading.Thread(target=answer_half, daemon=True)
    server.start()
    ep = Endpoint("http", "127.0.0.1", port)
    client = Client(tmp_path)
    monkeypatch.setattr(
        client,
        "_connection",
        lambda timeout: (http.client.HTTPConnection("127.0.0.1", port, timeout=5), "t", ep),
    )
    with pytest.raises(DaemonUnreachable, match="ended its answer midway"):
        client.services()
    server.join(5)
    listener.close()
