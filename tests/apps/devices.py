"""A replica that tells what it was given: its device variables and its CPU affinity, on any
GET (/health included). Standard library only."""

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(
            {
                "replica": os.environ.get("CORRAL_REPLICA_ID"),
                "version": os.environ.get("APP_VERSION", "1"),
                "env": {k: os.environ.get(k) for k in KEYS},
                "affinity": sorted(os.sched_getaffinity(0)),
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
