"""The fast path for a stream: a chunked answer relayed with no Exchange while it is live.

Why: a streamed answer's events already go through the compiled reader (``LiveChunks``, no
Python per event), so what a stream costs in Python is its start and end: the Exchange that
:func:`corral.balancer.fast.materialize` builds, httptools' callbacks on the head, the relay's
decisions, the pool and the client's next request. Measured at 64 connections, that was 26 us
of user time per stream more than a relay that only forwards (``bench/balancer.py
--only-streamed --floor --stream-chunks 2 --stream-gap-ms 20``), as much as 16 events cost.

What it takes: the answer to a request on the fast path (:mod:`corral.balancer.fast`) whose
head is, byte for byte, the last stream head the general path relayed from that replica as
this path would (``Target.stream_memo``, written by ``ResponseRelay.on_response_head``:
chunked and nothing else, to an HTTP/1.1 client kept alive). The same bytes get the same
verdict from llhttp and the same head sent on, so the head is neither parsed nor scanned
again. The head goes out with the body's first bytes as the replica framed them, and the
replica's connection is handed to ``LiveChunks`` at once, with nothing else set up.

While it is live the request is still a fast one (``ClientConnection.fast``) and its replica
connection holds a :class:`FastStream` (``UpstreamConnection.fast_stream``). Its end
(``LiveChunks`` found the last chunk) finishes it here: the last batch and the last chunk in
one write, then what ``Exchange._finish`` and ``try_response`` do. Anything else (the replica
or the client gone, a timeout, a pause, framing ``LiveChunks`` leaves to httptools, the
balancer stopping) turns it into the Exchange it stands for, in the live state the general
path would have reached (:func:`live_exchange`, called by ``materialize``), which handles it as
it handles any stream. Where there is no ``LiveChunks`` (the pure build) the general path
takes every stream.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, cast

from corral.balancer.http1 import LAST_CHUNK
from corral.balancer.relay import _LIVE_CHUNK, DL_HEAD, DL_IDLE
from corral.balancer.speedups import ChunkScan

if TYPE_CHECKING:
    from typing import Protocol

    from corral.balancer.exchange import Exchange
    from corral.balancer.fast_state import FastState
    from corral.balancer.roles import Balancer, Downstream
    from corral.balancer.upstream import UpstreamConnection

    class StreamDownstream(Downstream, Protocol):
        """A :class:`~corral.balancer.client.ClientConnection` as this path sees it (its
        methods ``try_stream`` and ``stream_done``), as ``fast.FastDownstream`` does."""

        @property
        def lb(self) -> Balancer: ...

        fast: FastState | None
        kept_alive: bool
        idle_since: float
        _buf: bytes
        _paused: int

        def _process(self) -> None: ...

        def _unpause(self) -> None: ...

        def _close(self) -> None: ...


__all__ = ["FastStream", "finish", "live_exchange", "try_stream"]

_MORE: Final = 0  # ChunkScan.scan: every byte taken, the answer goes on


class FastStream:
    """A live fast stream's own state: what the Exchange would hold that the fast request's
    tuple does not (its status, the replica's keep-alive, whether its first bytes came)."""

    __slots__ = ("counted", "keep_alive", "lb", "rid", "status", "t0")

    def __init__(self, lb: Balancer, rid: int, t0: float, status: int, keep_alive: bool) -> None:
        self.lb = lb
        self.rid = rid
        self.t0 = t0
        self.status = status
        self.keep_alive = keep_alive
        self.counted = False  # its first bytes went out: TTFT taken, counted as a stream

    def first_bytes(self) -> None:
        """As ``ResponseRelay.on_first_bytes``: the time to first token, and the replica's
        load becomes a stream's (corral.balancer.gate)."""
        lb = self.lb
        lb._observe_ttft(self.rid, time.monotonic() - self.t0)
        lb._stream_began(self.rid)
        self.counted = True


def try_stream(cl: StreamDownstream, conn: UpstreamConnection, data: bytes) -> bool:
    """Relay the start of the stream ``data`` begins and leave the rest to ``LiveChunks``, if
    its head is the replica's remembered stream head (see the module docstring); False, with
    nothing done, when the general path must take it."""
    fast = cl.fast
    memo = conn.target.stream_memo
    if fast is None or memo is None or ChunkScan is None or conn._head:
        return False
    head = memo[0]
    if not data.startswith(head):
        return False
    _, rid, t0, method, _, http11, keep_alive, _, _, _, _ = fast
    lb = cl.lb
    transport = cl.transport
    if (
        method == b"HEAD"
        or not (http11 and keep_alive)
        or lb._stopping
        or transport is None
        or cl._closing
    ):
        return False  # the general path frames or closes these otherwise
    scan = ChunkScan()
    first = b""
    if len(data) > len(head):
        if scan.scan(data[len(head) :]) != _MORE:
            return False  # the whole answer, or framing httptools must judge: not live
        first = scan.forward
        scan.forward = b""
    conn.chunks = scan
    if not conn.go_raw(cl, transport.write, lb._idle_timeout, DL_IDLE, not scan.fed):
        conn.chunks = None  # no LiveChunks for this connection (closing; the pure build)
        return False
    # Committed from here (armed, and nothing is read before this returns): the head is
    # counted and sent, with the body's first bytes. The state is whole before the write,
    # which may pause the client (and so materialize this stream) before it returns.
    _, status, reply, upstream_keep_alive = memo
    now = time.monotonic()
    served = lb._served
    served[rid] = served.get(rid, 0) + 1
    lb._record(status, now - t0)
    stream = conn.fast_stream = FastStream(lb, rid, t0, status, upstream_keep_alive)
    if scan.fed:  # a data byte, not a size line alone: the answer's first token
        stream.first_bytes()
    conn._keep_alive = upstream_keep_alive
    cl.deadline_kind = DL_IDLE
    cl.deadline = now + lb._idle_timeout
    transport.write(reply + first if first else reply)
    return True


def finish(cl: StreamDownstream, conn: UpstreamConnection, last: bytes) -> None:
    """The fast stream on ``conn`` ended (``LiveChunks`` found its last chunk; ``last``: the
    batch it held back): what ``on_live_chunks_done`` and ``Exchange._finish`` do, and then
    ``try_response``'s ending for the client."""
    fast = cl.fast
    stream = cast("FastStream | None", conn.fast_stream)
    assert fast is not None and stream is not None
    rid, keep_alive = fast[1], fast[6]
    cl.fast = None
    conn.fast_client = None
    conn.fast_stream = None
    closing = cl._closing
    if not closing:
        cl.transport.write(last + LAST_CHUNK)  # type: ignore[union-attr]
    lb = cl.lb
    if stream.counted:
        lb._stream_ended(rid)
    lb._release(rid)
    lb._pool.put(conn)
    if closing:
        return
    if not keep_alive:
        cl._close()
        return
    # Kept alive even if the balancer stops now: the head, sent before (try_stream), promised
    # it, and the client may be writing its next request already (answered Connection: close).
    cl.kept_alive = True
    cl.deadline_kind = DL_HEAD
    cl.idle_since = now = time.monotonic()
    cl.deadline = now + lb._header_timeout
    if cl._paused:
        cl._unpause()
    if cl._buf:
        cl._process()


def live_exchange(ex: Exchange, conn: UpstreamConnection) -> None:
    """Make ``ex``, just built for the fast stream on ``conn`` (``materialize``), the Exchange
    of a stream that is live: its head sent and counted, its body relayed as framed, the
    connection past the head (``LiveChunks`` stays armed with the framing it follows: the
    connection's ``chunks`` are only read before a stream goes live)."""
    stream = cast("FastStream | None", conn.fast_stream)
    assert stream is not None
    conn.fast_stream = None
    ex.status = stream.status
    ex.started = True
    ex.mode = _LIVE_CHUNK
    if stream.counted:
        ex.ttft_from = 0.0
        ex.stream_counted = True
    conn._in_head = False
    conn._keep_alive = stream.keep_alive
