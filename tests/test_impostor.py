"""The CLI proves it talks to its own daemon before it sends the token (or a spec).

A daemon killed with SIGKILL leaves daemon.json naming its port; any local process may then
listen there. The CLI asks for a proof that only the token's holder can give (an HMAC of a
nonce, bound to the port) and sends nothing to a listener that cannot give it.
"""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path

import pytest
from conftest import CorralHome, spec_text, write_spec

pytestmark = pytest.mark.timeout(120)


class Impostor:
    """A listener on the dead daemon's port that answers every request 200 with an empty
    list of services (what fooled the CLI before), and keeps every byte it was sent."""

    def __init__(self, port: int) -> None:
        self.received = bytearray()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    data = conn.recv(65536)
                except OSError:
                    continue
                self.received += data
                body = b'{"ok": true, "services": []}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def test_a_listener_on_a_dead_daemons_port_never_gets_the_token(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.start_daemon()
    port = int(corral_home.daemon_info()["port"])  # type: ignore[index]
    token = corral_home.token
    corral_home.stop_daemon(signal.SIGKILL)  # daemon.json stays behind
    impostor = Impostor(port)
    try:
        status = corral_home.run("status", check=False)
        said = status.stdout + status.stderr
        assert status.returncode != 0, said
        assert "not this home's daemon" in said and "not running" in said, said
        assert "Traceback" not in said, said

        # `up` starts a new daemon rather than hand the spec to the impostor.
        spec = write_spec(tmp_path / "real.yaml", spec_text("real", 1))
        corral_home.run("up", str(spec))
        assert int(corral_home.daemon_info()["port"]) != port  # type: ignore[index]
        assert corral_home.status("real")["status"] == "READY"
    finally:
        impostor.close()
    assert token.encode() not in impostor.received, "the token was sent to the impostor"
    assert b"Authorization" not in impostor.received
    assert b"real.yaml" not in impostor.received and b"name: real" not in impostor.received
