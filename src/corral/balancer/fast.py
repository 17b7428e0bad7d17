"""The fast path: the common request proxied with no Exchange, task or per-request object.

Why: a proxied request's Python work is what separates this balancer from nginx (the syscalls
are already at the minimum, one read and one write per side). The general machinery (an
:class:`~corral.balancer.exchange.Exchange` per request, httptools callbacks per response, a
dozen small methods) costs several times the work a request needs. Most requests need none of
it: a GET/HEAD/POST... whose head (and small Content-Length body) came in one read, with only
Host, Content-Length, ``Connection: keep-alive|close`` and X-Forwarded-For among the headers the
balancer must rewrite, sent on a pooled keep-alive connection, answered by a response whose head
and Content-Length body come in one read. That request runs here: two functions, one per side,
with the request's state kept in one tuple on the client connection (:data:`FastState`).

Anything else, or anything unexpected at any point, goes to the general path, which stays the
only place where failures are handled:

* Before committing (nothing counted, no replica picked, nothing written), a function returns
  False and the caller runs the general path on the same bytes. The request parser is reset
  when it was already fed, so the general path re-validates from a clean state.
* Once a request is out, anything but a plain complete response (an error, a timeout, the
  client or the replica going away, a chunked or HEAD or 1xx/204/304 answer, one split over
  reads) first turns the fast state into the Exchange it stands for (:func:`materialize`), in
  exactly the state the general path would have reached, and lets that handle it (retries
  included). The one exception is a stream whose head the replica sent before
  (:mod:`corral.balancer.fast_stream`), which stays a fast request while it is live and is
  materialized, live, only if something but its end happens.

What a parse found is remembered, so that what a client repeats is not parsed again: per client
connection, its last parsed request (the same bytes again skip the parse and llhttp, whose
verdict on them is known), its header lines (the same lines under another request line) and its
request line and Host line (:data:`Lead`: a client that varies other headers, a request id or
a cookie, has only those lines checked; one that also varies its path or method has its request
line checked too, and a body is framed by its Content-Length line); per replica, its last
response head, and the last one it turned down (a stream's, :mod:`corral.balancer.plain_answer`,
which has the check of an answer's head).

Both sides are validated by llhttp (the request parser the general path uses; a second,
callback-free response parser per replica connection), so framing is as strict as before:
conflicting or duplicate Content-Length and Transfer-Encoding are rejected, absolute-form
targets never take this path. Bytes llhttp has not seen pass only under a remembered Host line,
and only when every new line meets a grammar stricter than llhttp's
(:mod:`corral.balancer.lead`, compiled by ``setup.py`` when it can be: ``REQUEST_LINE_RE``
for a new request line, ``headers.PASS_LINES_RE`` for header lines, which also refuses every
header the balancer acts on).

These functions are the fast path's reference and its pure build. The compiled build
(:mod:`corral.balancer.speedups`) has twins of :func:`try_request` (its memo and lead
branches), :func:`_send` and :func:`try_response` (an answer under its replica's remembered
head), which read the state through the slots :mod:`corral.balancer.fast_state` describes and
hand anything else to these functions before doing anything. :mod:`corral.balancer.wiring`
installs whichever build runs (``ClientConnection.fast_request`` and ``fast_response``).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Final

import httptools

from corral.balancer.exchange import (
    DL_FIRST_BYTE,
    DL_HEAD,
    IDEMPOTENT,
    NONIDEMPOTENT_MAX_IDLE,
    Exchange,
)
from corral.balancer.fast_state import Blocks, FastState, Lead, Memo
from corral.balancer.fast_stream import live_exchange
from corral.balancer.headers import (
    REQUEST_OTHER_RE,
    forwarded,
    forwarded_host,
    header_line,
    scan_common_request,
)
from corral.balancer.lead import METHODS
from corral.balancer.metrics import LATENCY_BUCKETS
from corral.balancer.plain_answer import check_head, turned_down
from corral.balancer.policies import RequestView
from corral.balancer.speedups import lead_split

if TYPE_CHECKING:
    from typing import Protocol

    from corral.balancer.roles import Balancer, Downstream
    from corral.balancer.upstream import UpstreamConnection

__all__ = ["Blocks", "FastState", "Lead", "Memo", "materialize", "try_request", "try_response"]

if TYPE_CHECKING:

    class FastDownstream(Downstream, Protocol):
        """A :class:`~corral.balancer.client.ClientConnection` as its fast path sees it: the
        functions here are its methods (``fast_response``, ``materialize``) or run in its
        ``data_received``, so they read its state as it does."""

        @property
        def lb(self) -> Balancer: ...

        peer: bytes
        xff_line: bytes
        memo: Memo | None
        blocks: Blocks | None
        lead: Lead | None
        fast: FastState | None
        exchange: Exchange | None
        kept_alive: bool
        _buf: bytes
        _parser: httptools.HttpRequestParser | None
        _eof: bool
        _paused: int

        def _run(
            self, ex: Exchange, length: int | None, chunked: bool, picked: int | None
        ) -> None: ...

        def _process(self) -> None: ...

        def _unpause(self) -> None: ...

        def _close(self) -> None: ...

        def fast_response(self, conn: UpstreamConnection, data: bytes) -> bool: ...

        def try_stream(self, conn: UpstreamConnection, data: bytes) -> bool: ...

        def stream_done(self, conn: UpstreamConnection, last: bytes) -> None: ...

        def materialize(self) -> Exchange: ...


# A head this long may hold MAX_HEADERS (128) minimal header lines; shorter ones cannot.
# Request and response heads up to this long are remembered (one per client connection, one per
# replica): the same bytes again skip the scans and llhttp, whose verdict on them is known.
_MEMO_MAX: Final = 2048
_COUNT_HEADERS_ABOVE: Final = 500
_MAX_HEADERS: Final = 128
_CRLF: Final = b"\r\n"
_STRIP: Final = b" \t"
_HOST: Final = b"\r\nhost:"
_CONNECTION: Final = b"\r\nconnection:"
_LENGTH: Final = b"\r\ncontent-length:"
_LENGTH_NAME: Final = b"\r\nContent-Length:"  # as most clients spell it


def try_request(cl: FastDownstream, data: bytes) -> bool:
    """Proxy ``data`` if it is one whole common request (see the module docstring); False
    when the general path must handle it, with nothing done yet."""
    lb = cl.lb
    memo = cl.memo
    if memo is not None and memo[0] == data and not lb._stopping:
        # The bytes of the last parsed request on this connection again (a client polling):
        # everything below depends on those bytes alone, and the parser is back where it was.
        _, method, target, http11, kept, fhost, token = memo
        keep_alive = (token != b"close" if http11 else token == b"keep-alive") and not cl._eof
        return _send(cl, method, target, http11, keep_alive, kept, cl.xff_line, fhost, None)
    lead = cl.lead
    if lead is not None and not lb._stopping:
        # A recent request's Host line again (llhttp accepted it), other lines new: only those
        # are looked at (corral.balancer.lead, compiled when it was built). The parser is not
        # fed, so it is where it was after the last whole request, as on the memo path.
        split = lead_split(data, lead, lb._max_header_bytes, lb._max_buffered_body, lb._max_body)
        if split is not None:
            method, target, kept, body = split
            return _send(cl, method, target, True, not cl._eof, kept, cl.xff_line, lead[6], body)
    end = data.find(b"\r\n\r\n")
    if end < 0 or end + 4 > lb._max_header_bytes or lb._stopping:
        return False
    # One split, no search for the line's end: "METHOD SP target SP HTTP/1.x CRLF" puts it
    # right after the version, and a line that is anything else fails a check below. Not
    # llhttp: it reads "GET /a CRLF" as an HTTP/0.9 line and what follows as headers, so a
    # "target" holding line ends would carry header lines of the client's past every check.
    line = data.split(b" ", 2)
    if len(line) != 3:
        return False
    method, target, rest = line
    if b"\n" in target or b"\r" in target:
        return False  # the general path refuses it (http1.parse_request_line)
    version = rest[:10]
    http11 = version == b"HTTP/1.1\r\n"
    if method not in METHODS or target[:1] != b"/" or not (http11 or version == b"HTTP/1.0\r\n"):
        return False
    eol = len(method) + len(target) + 10
    if end > _COUNT_HEADERS_ABOVE and data.count(_CRLF, 0, end) > _MAX_HEADERS:
        return False
    block = data[eol : end + 2]
    blocks = cl.blocks
    lead = None
    if blocks is not None and blocks[0] == block:
        # The header lines of the last request on this connection again (a client sends the
        # same headers with each request): what the scan below found in them. llhttp still
        # checks the whole request below.
        _, kept, fhost = blocks
        length, token, xff = -1, None, None
    elif (low := block.lower()) is not None and REQUEST_OTHER_RE.search(low) is None:
        # the common case: at most Host to take out (low has the same offsets as block)
        i = low.find(_HOST)
        if i < 0:
            kept, fhost, host_line = block, b"", None
        else:
            j = low.find(_CRLF, i + 7)
            if low.find(_HOST, j) >= 0:
                return False
            kept, host_line = block[:i] + block[j:], block[i : j + 2]
            fhost = forwarded_host(block[i + 7 : j].strip(_STRIP))
        length, token, xff = -1, None, None
        if end < _MEMO_MAX:
            cl.blocks = (block, kept, fhost)
            if http11:
                lead = (data[: eol + 2], method, target, host_line, None, _LENGTH_NAME, fhost)
    else:
        scanned = scan_common_request(block, low)
        if scanned is None:
            return False
        kept, host, length, token, xff = scanned
        fhost = forwarded_host(host)
        if token != b"close" and http11 and xff is None and end < _MEMO_MAX:
            # Host, Connection: keep-alive and Content-Length at most (a POST, python-requests'
            # requests): one of each, as the scan found them, so find gives each one's line.
            host_line = None if host is None else header_line(block, low, _HOST)
            conn_line = None if token is None else header_line(block, low, _CONNECTION)
            length_name = _LENGTH_NAME if length < 0 else block[(i := low.find(_LENGTH)) : i + 17]
            lead = (data[: eol + 2], method, target, host_line, conn_line, length_name, fhost)
    if http11 and not fhost:
        return False  # no Host line: the general path answers 400 (RFC 9112 section 3.2)
    head_end = end + 4
    if length < 0:
        body = None
        if len(data) != head_end:
            return False  # pipelined bytes: the general path keeps them in order
    else:
        if len(data) != head_end + length or length > lb._max_buffered_body:
            return False
        if lb._max_body is not None and length > lb._max_body:
            return False
        body = data[head_end:]
    parser = cl._parser
    if parser is None:
        parser = cl._parser = httptools.HttpRequestParser(cl)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:  # the general path answers it, from a fresh parser
        cl._parser = None
        return False
    persistent = token != b"close" if http11 else token == b"keep-alive"
    keep_alive = persistent and not cl._eof
    if xff is None:
        xff_line = cl.xff_line
        if persistent and end < _MEMO_MAX:
            if body is None:
                cl.memo = (data, method, target, http11, kept, fhost, token)
            if lead is not None:
                cl.lead = lead
    else:
        peer = cl.peer
        xff_line = b"X-Forwarded-For: %b\r\n" % (xff + b", " + peer if peer else xff)
    return _send(cl, method, target, http11, keep_alive, kept, xff_line, fhost, body)


def _send(
    cl: FastDownstream,
    method: bytes,
    target: bytes,
    http11: bool,
    keep_alive: bool,
    kept: bytes,
    xff_line: bytes,
    fhost: bytes,
    body: bytes | None,
) -> bool:
    """Pick a replica and write the request on one of its pooled connections; without one,
    start an Exchange for it (with the replica already picked, so a policy is asked once)."""
    lb = cl.lb
    ids = lb._ready_ids
    rid: int | None = None
    conn: UpstreamConnection | None = None
    now = time.monotonic()
    wait = False
    if lb._gated:  # a policy that reads the request, or a limit that may hold it
        rid = lb._pick((), RequestView(target, body, kept))
        ids = () if rid is None else ids
        wait = rid is None and lb._full(())
    elif ids:
        loads = lb._loads(ids) if lb._streaming or lb._board is not None else lb._in_flight
        rid = lb._policy.select(lb._healthy(ids) if lb._ejected else ids, loads)
    if ids and rid is not None:
        idle = lb._ready[rid].idle
        if idle:
            conn = idle[-1]
            transport = conn.transport
            if (
                conn.closed
                or transport is None
                or transport.is_closing()
                or (method not in IDEMPOTENT and now - conn.idle_since > NONIDEMPOTENT_MAX_IDLE)
            ):
                conn = None  # Pool.take, on the general path, sorts these out
            else:
                idle.pop()
    if conn is None or rid is None:
        return start_exchange(
            cl, method, target, http11, keep_alive, kept, xff_line, fhost, body, rid, wait
        )
    lb._requests += 1
    lb._timestamps.append(now)  # what lb._count_request does, without the call
    if lb._board is None:
        in_flight = lb._in_flight
        in_flight[rid] = in_flight.get(rid, 0) + 1
    else:
        lb._acquire(rid)  # and the other workers see it on the board
    tail = b"\r\n" if body is None else b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    dest = conn.target
    conn.fast_client = cl
    out = b"".join(
        (
            method,
            b" ",
            dest.prefix,
            target,
            dest.line_tail,
            kept,
            xff_line,
            lb._proto_line,
            fhost,
            tail,
        )
    )
    transport.write(out)  # type: ignore[union-attr]
    cl.fast = (conn, rid, now, method, target, http11, keep_alive, kept, xff_line, fhost, body)
    cl.deadline_kind = DL_FIRST_BYTE
    cl.deadline = now + lb._first_byte_timeout
    return True


def start_exchange(
    cl: FastDownstream,
    method: bytes,
    target: bytes,
    http11: bool,
    keep_alive: bool,
    kept: bytes,
    xff_line: bytes,
    fhost: bytes,
    body: bytes | None,
    rid: int | None,
    wait: bool,
) -> bool:
    """The request on the general path after all: no pooled connection to ``rid`` (already
    picked: a policy is asked once), or none picked (``wait``: hold it at once)."""
    lb = cl.lb
    fwd = forwarded(kept, xff_line, lb._proto_line, fhost)
    ex = Exchange(lb, cl, method, target, http11, keep_alive, fwd, None)
    ex.must_wait = wait  # held at once: asking the policy again would count it twice
    cl._buf = body or b""
    cl._run(ex, None if body is None else len(body), False, rid)
    return True


def try_response(cl: FastDownstream, conn: UpstreamConnection, data: bytes) -> bool:
    """Relay ``data`` if it is the whole plain answer to the fast request in flight; False
    when the general path must handle it (nothing done yet)."""
    fast = cl.fast
    if fast is None or conn._head:
        return False
    _, rid, t0, method, _, http11, keep_alive, _, _, _, _ = fast
    if method == b"HEAD":
        return False  # the general path knows its framing
    dest = conn.target
    memo = dest.memo
    if memo is not None and data.startswith(memo[0]):
        # This replica's last validated head again (same bytes: same verdict from llhttp,
        # whose state after a whole message is the one before it). It holds one CRLF CRLF,
        # at its end, so that is where this head ends too.
        _, status, length, head = memo
        body_at = len(memo[0])
        end = body_at - 4
    else:
        end = data.find(b"\r\n\r\n")
        if end < 0 or turned_down(conn, data):
            return False
        body_at = end + 4
        checked = check_head(conn, data, end)
        if checked is None:
            return False
        status, length, head = checked
        if body_at <= _MEMO_MAX:
            dest.memo = (data[:body_at], status, length, head)
    if len(data) != body_at + length:
        return False
    lb = cl.lb
    if keep_alive and not lb._stopping:
        extra = b"" if http11 else b"Connection: keep-alive\r\n"
    else:
        extra = b"Connection: close\r\n"
    if head is None and not extra:
        out = data
    else:
        out = b"".join((data[: end + 2] if head is None else head, extra, data[end + 2 :]))
    # Committed from here: count it, send it, give the replica and its connection back.
    cl.fast = None
    conn.fast_client = None
    served = lb._served
    served[rid] = served.get(rid, 0) + 1
    now = time.monotonic()
    seconds = now - t0
    # LoadBalancer._record, inlined on purpose: per-request calls are what this path saves.
    codes = lb._codes
    codes[status] = codes.get(status, 0) + 1
    lb._latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
    lb._latency_sum += seconds
    closing = cl._closing
    if not closing:
        cl.transport.write(out)  # type: ignore[union-attr]
    in_flight = lb._in_flight
    count = in_flight.get(rid, 0)
    if (
        (count > 1 or (count == 1 and not lb._drained and rid in lb._ready))
        and not lb._held
        and lb._board is None
    ):
        in_flight[rid] = count - 1  # what lb._release does when nothing waits and none reads
    else:
        lb._release(rid)
    if conn.closed or dest.retired or conn.read_paused:
        lb._pool.put(conn)
    else:
        conn.idle_since = now
        dest.idle.append(conn)
        lb._pool._targets.add(dest)
    if closing:
        return True
    if not keep_alive or lb._stopping:
        cl._close()
        return True
    cl.kept_alive = True
    cl.deadline_kind = DL_HEAD
    cl.deadline = now + lb._header_timeout
    if cl._paused:
        cl._unpause()
    if cl._buf:
        cl._process()
    return True


def materialize(cl: FastDownstream) -> Exchange:
    """The Exchange a fast request in flight stands for, in the state the general path would
    have it in after sending the request; it takes over from here."""
    fast = cl.fast
    assert fast is not None
    conn, rid, t0, method, target, http11, keep_alive, kept, xff_line, fhost, body = fast
    cl.fast = None
    conn.fast_client = None
    lb = cl.lb
    fwd = forwarded(kept, xff_line, lb._proto_line, fhost)
    ex = Exchange(lb, cl, method, target, http11, keep_alive, fwd, None)
    ex.t0 = ex.ttft_from = t0  # sent in the same turn it was read
    if body is not None:
        ex.had_length = True
        if body:
            ex.body_kind = 1
            ex.body = [body]
            ex.body_size = len(body)
    ex.tried.append(rid)
    ex.rid = rid
    ex.conn = conn
    conn.begin(ex)
    if conn.fast_stream is not None:
        live_exchange(ex, conn)  # its stream is live already (corral.balancer.fast_stream)
    cl.exchange = ex
    return ex
