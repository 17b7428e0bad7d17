"""A tiny HTTP app for the demo and the tests: answers who it is, and /health.

Reads its port from $PORT (corral gives each local replica its own) and needs only the standard
library, so a fresh machine can run it.
"""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLICA = os.environ.get("CORRAL_REPLICA_ID", "?")
VERSION = os.environ.get("APP_VERSION", "1")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out as two writes: with Nagle on, the body waits for the client's
    # delayed ACK (~40 ms) on every keep-alive request.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        self._answer(
            {
                "replica": REPLICA,
                "version": VERSION,
                "path": self.path,
                "pid": os.getpid(),
                "time": time.time(),
            }
        )

    def do_POST(self) -> None:
        """Echo what arrived: the tests check that a POST reaches exactly one replica, once."""
        length = int(self.headers.get("Content-Length") or 0)
        received = self.rfile.read(length) if length else b""
        self._answer(
            {"replica": REPLICA, "pid": os.getpid(), "path": self.path, "received": len(received)}
        )

    def _answer(self, fields: dict[str, object]) -> None:
        body = json.dumps(fields).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        print(f"replica {REPLICA}: {format % args}", flush=True)


class Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: a burst of new connections (a balancer
    # spreading the load of a replica that just died) overflowed it, and the dropped SYNs came
    # back only after the kernel's 1 s, 3 s, 7 s retransmissions. Real servers use hundreds.
    request_queue_size = 1024
    daemon_threads = True


if __name__ == "__main__":
    port = int(os.environ["PORT"])
    print(f"replica {REPLICA} listening on 127.0.0.1:{port}", flush=True)
    sys.stdout.flush()
    Server(("127.0.0.1", port), Handler).serve_forever()
