"""A worker that exits drops no request: the connections whose answers it promised to keep.

A stream's head goes out before the worker is told to stop, saying keep-alive; when the stream
ends, an HTTP/1.1 client (aiohttp's pool, say) writes its next request on that connection at
once. The stopping worker must answer it (``Connection: close``), not close the connection under
it: a close with the request already in the socket is a reset (docs/architecture.md, "A worker
that exits drops no request"). And a stream count read from the workers' shared boards above
the requests in flight (a slot's old and new worker write one row during restart-workers) must
not make a pick fail: that closed new connections with no answer at all.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest
from conftest import CorralHome, spec_text, wait_for, write_spec

from corral.balancer.load_board import LoadBoard, board_path, streams_path
from corral.balancer.policies import RequestView
from corral.balancer.routing import make_policy

pytestmark = pytest.mark.timeout(180)

LAST_CHUNK = b"\r\n0\r\n\r\n"


def request(port: int, tokens: int) -> bytes:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": True})
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def read_until(sock: socket.socket, end: bytes, got: bytes = b"") -> bytes:
    """Bytes until ``end`` arrives; what came before EOF or a reset, for the failure's text."""
    while end not in got:
        try:
            data = sock.recv(65536)
        except OSError as exc:
            return got + f" <{exc!r}>".encode()
        if not data:
            return got + b" <EOF>"
        got += data
    return got


@pytest.mark.parametrize("path", ["general", "fast"])
def test_a_stream_ending_in_a_stopping_worker_keeps_its_connection_for_the_next_request(
    corral_home: CorralHome, tmp_path: Path, path: str
) -> None:
    """The replica's first stream takes the general path (an Exchange); once its stream head
    is remembered, the fast one (corral.balancer.fast_stream)."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # the connection is on the one replaced
    run = f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT"
    spec = write_spec(tmp_path / "ka.yaml", spec_text("ka", 1, run=run + " --step-base-ms 150"))
    corral_home.run("up", str(spec), timeout=90)
    port = int(str(corral_home.wait_replicas("ka", 1)["endpoint"]).rsplit(":", 1)[1])
    log = corral_home.path / "dataplane" / "worker-0.log"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for _ in range(2 if path == "fast" else 0):
            sock.sendall(request(port, 1))
            assert read_until(sock, LAST_CHUNK).startswith(b"HTTP/1.1 200")
        sock.sendall(request(port, 32))  # about 5 s
        head = read_until(sock, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" not in head, head
        restart = threading.Thread(
            target=corral_home.run, args=("daemon", "restart-workers"), kwargs={"timeout": 120}
        )
        restart.start()
        try:
            wait_for(lambda: "worker 0 stopping" in log.read_text(), 30, "the old worker to stop")
            streamed = read_until(sock, LAST_CHUNK, head)
            assert streamed.endswith(LAST_CHUNK), streamed[-300:]
            assert b"data: [DONE]" in streamed  # it did not end before the stop began
            sock.sendall(request(port, 1))  # at once, as a client's pool does
            answer = read_until(sock, LAST_CHUNK)
        finally:
            restart.join(120)
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head, answer[-300:]


def test_more_streams_than_requests_on_the_boards_never_fail_a_pick(tmp_path: Path) -> None:
    """Slot 0's old and new worker write one row (restart-workers): the old one's last release
    left requests 0 where the new one's stream count says 2. Slot 1 still picks a replica."""
    path = board_path(tmp_path, "llm")

    def pair(slot: int) -> tuple[LoadBoard, LoadBoard]:
        counts, streams = (LoadBoard.open(p, slot, 2) for p in (path, streams_path(path)))
        assert counts is not None and streams is not None
        return counts, streams

    old, new, mine = pair(0), pair(0), pair(1)
    ready = (1, 2)
    for counts, streams in (old, new, mine):
        counts.arrange(ready, {})
        streams.arrange(ready, {})
    for rid in ready:
        new[0].publish(rid, 2)  # the new worker's two streams to each replica
        new[1].publish(rid, 2)
        old[0].publish(rid, 0)  # the old worker's last requests end
    policy = make_policy("prefix_affinity", load_board=mine[0], streams={}, stream_board=mine[1])
    body = json.dumps({"model": "m", "prompt": "a one-off question"}).encode()
    assert policy.select(ready, {}, RequestView(b"/v1/completions", body, b"")) in ready
    assert policy.select(ready, {}) in ready
