# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""corral.balancer.lead in C: the request split under a remembered lead, in one call; a live
stream's end of batch (StreamBatch), the relay's one Python call per streamed event; a live
stream of plain chunks relayed as framed, with no Python call per event (ChunkScan, LiveChunks);
and the fast path's common request and answer (twins of corral.balancer.fast's try_request,
_send and try_response), which read the connections' and the balancer's slots at fixed offsets
(wire); a prompt's chained block hashes and their record in the prefix index
(corral.balancer.prefix.block_hashes, insert_blocks); and the board of counts the balancer
workers share (corral.balancer.load_board.LoadBoard).

Same answers as ``corral.balancer.lead.lead_split`` byte for byte (tests/test_balancer_speedups.py
holds them to it; tests/test_balancer_fastpath.py runs on whichever build is installed), with
the header lines checked by hand instead of ``headers.PASS_LINES_RE`` and every search done on
the buffer, no intermediate bytes object. Built by setup.py (Cython), chosen at import by
corral.balancer.speedups; the pure-Python module is the fallback and the reference.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdlib cimport free, malloc
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from libc.string cimport memchr, memcmp, memcpy, memmove
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from cpython.object cimport PyObject, PyObject_TypeCheck, PyTypeObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport int64_t, uint32_t, uint64_t

import logging

_log = logging.getLogger("corral.balancer")

cdef unsigned char TOKEN[256]  # RFC 9110 tchar: a header name's bytes
cdef unsigned char VALUE[256]  # a field value's: HTAB, SP, visible ASCII, obs-text
cdef unsigned char TARGET[256]  # an origin-form target's (after its "/"): visible ASCII

cdef int _k
for _k in range(256):
    TOKEN[_k] = 0
    VALUE[_k] = 1 if (_k == 9 or 0x20 <= _k <= 0x7E or _k >= 0x80) else 0
    TARGET[_k] = 1 if 0x21 <= _k <= 0x7E else 0
for _k in b"!#$%&'*+.^_`|~-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ":
    TOKEN[_k] = 1

# The request lines' methods, as the pure module's METHODS (the bytes objects are shared, not
# made per request).
cdef tuple _METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS")
# Lower-case names of the headers a kept line may not have (configure()).
cdef tuple _DROP = ()
cdef Py_ssize_t _DROP_MAX = 0

cdef const char *_VERSION = b" HTTP/1.1\r\n"
cdef const char *_HEAD_END = b"\r\n\r\n"


def configure(names):
    """The header names (lower case) a kept line may not have: headers.REQUEST_DROP."""
    global _DROP, _DROP_MAX
    _DROP = tuple(sorted(bytes(n) for n in names))
    _DROP_MAX = max([len(n) for n in _DROP] or [0])


cdef Py_ssize_t _find(const char *h, Py_ssize_t hn, Py_ssize_t start,
                      const char *n, Py_ssize_t nn) noexcept nogil:
    """bytes.find(n, start) over h[:hn] (n not empty)."""
    cdef const char *p
    cdef const char *last = h + hn - nn
    cdef const char *at = h + start
    while at <= last:
        p = <const char *>memchr(at, n[0], <size_t>(last - at + 1))
        if p == NULL:
            return -1
        if memcmp(p, n, <size_t>nn) == 0:
            return p - h
        at = p + 1
    return -1


cdef bint _dropped(const unsigned char *name, Py_ssize_t n):
    """Whether a header name (any case) is one the balancer acts on."""
    cdef unsigned char low[64]
    cdef Py_ssize_t k
    cdef bytes drop
    if n > _DROP_MAX or n > 64:
        return False
    for k in range(n):
        low[k] = name[k] + 32 if 65 <= name[k] <= 90 else name[k]
    for drop in _DROP:
        if PyBytes_GET_SIZE(drop) == n and memcmp(PyBytes_AS_STRING(drop), low, <size_t>n) == 0:
            return True
    return False


cdef bint _pass_lines(const unsigned char *p, Py_ssize_t n):
    """headers.PASS_LINES_RE.fullmatch: (CRLF token ":" value*)* CRLF, no name to act on."""
    cdef Py_ssize_t i = 0, s
    while True:
        if i + 2 > n or p[i] != 13 or p[i + 1] != 10:
            return False
        i += 2
        if i == n:
            return True
        s = i
        while i < n and TOKEN[p[i]]:
            i += 1
        if i == s or i >= n or p[i] != 58:
            return False
        if _dropped(p + s, i - s):
            return False
        i += 1
        while i < n and VALUE[p[i]]:
            i += 1


cdef Py_ssize_t _short_length(const unsigned char *p, Py_ssize_t a, Py_ssize_t b):
    """headers.short_length(p[a:b].strip(b" \\t")): up to 15 digits, else -1."""
    cdef Py_ssize_t value = 0
    while a < b and (p[a] == 32 or p[a] == 9):
        a += 1
    while b > a and (p[b - 1] == 32 or p[b - 1] == 9):
        b -= 1
    if a == b or b - a > 15:
        return -1
    while a < b:
        if p[a] < 48 or p[a] > 57:
            return -1
        value = value * 10 + (p[a] - 48)
        a += 1
    return value


cdef object _request_line(bytes data, Py_ssize_t *at):
    """lead.REQUEST_LINE_RE.match: (method, target), the CRLF's offset in at; None."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), sp = -1, k
    cdef bytes method = None, m
    for k in range(8 if n > 8 else n):
        if p[k] == 32:
            sp = k
            break
    if sp <= 0:
        return None
    for m in _METHODS:
        if PyBytes_GET_SIZE(m) == sp and memcmp(PyBytes_AS_STRING(m), p, <size_t>sp) == 0:
            method = m
            break
    if method is None or sp + 1 >= n or p[sp + 1] != 47:  # "/"
        return None
    k = sp + 2
    while k < n and TARGET[<unsigned char>p[k]]:
        k += 1
    if k + 11 > n or memcmp(p + k, _VERSION, 11) != 0:
        return None
    at[0] = k + 9
    return method, data[sp + 1 : k]


def lead_split(bytes data not None, tuple lead not None, Py_ssize_t max_header_bytes,
               Py_ssize_t max_buffered_body, object max_body):
    """corral.balancer.lead.lead_split, compiled (same arguments, same answers)."""
    cdef bytes request_line = lead[0]
    cdef object method = lead[1], target = lead[2], host_line = lead[3], conn_line = lead[4]
    cdef bytes length_name = lead[5]
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), rn = PyBytes_GET_SIZE(request_line)
    cdef Py_ssize_t at, end, k, count, i, j, size, ln, kn
    cdef char *buf
    cdef object line, body = None, kept
    if n >= rn and memcmp(p, PyBytes_AS_STRING(request_line), <size_t>rn) == 0:
        at = rn - 2
    else:
        line = _request_line(data, &at)
        if line is None:
            return None
        method, target = line
    end = _find(p, n, at, _HEAD_END, 4)
    if end < 0 or end + 4 > max_header_bytes:
        return None
    if end > 500:
        count = 0
        for k in range(end - 1):
            if p[k] == 13 and p[k + 1] == 10:
                count += 1
        if count > 128:
            return None
    kn = end + 2 - at
    buf = <char *>malloc(<size_t>kn)
    if buf == NULL:
        raise MemoryError()
    try:
        memcpy(buf, p + at, <size_t>kn)
        if host_line is not None:
            ln = PyBytes_GET_SIZE(host_line)
            i = _find(buf, kn, 0, PyBytes_AS_STRING(host_line), ln) if ln >= 4 else -1
            if i < 0:
                return None  # Host is not the remembered one
            memmove(buf + i, buf + i + ln - 2, <size_t>(kn - i - ln + 2))
            kn -= ln - 2
        if conn_line is not None:
            ln = PyBytes_GET_SIZE(conn_line)
            if ln < 4:
                return None  # never made so: a remembered line is CRLF, a field, CRLF
            i = _find(buf, kn, 0, PyBytes_AS_STRING(conn_line), ln)
            if i >= 0:
                memmove(buf + i, buf + i + ln - 2, <size_t>(kn - i - ln + 2))
                kn -= ln - 2
        if end + 4 != n:
            ln = PyBytes_GET_SIZE(length_name)
            i = _find(buf, kn, 0, PyBytes_AS_STRING(length_name), ln) if ln == 17 else -1
            if i < 0:
                return None
            j = _find(buf, kn, i + 17, b"\r\n", 2)
            if j < 0:
                return None  # cannot be: a kept block ends with CRLF
            size = n - end - 4
            if (
                _short_length(<const unsigned char *>buf, i + 17, j) != size
                or size > max_buffered_body
                or (max_body is not None and size > max_body)
            ):
                return None
            body = data[end + 4 :]
            memmove(buf + i, buf + j, <size_t>(kn - j))
            kn -= j - i
        if not _pass_lines(<const unsigned char *>buf, kn):
            return None
        kept = PyBytes_FromStringAndSize(buf, kn)
    finally:
        free(buf)
    return method, target, kept, body


# ---------------------------------------------------------------------------- streams

cdef bytes _EMPTY = b""
cdef const char *_HEX = b"0123456789abcdef"


def chunk_frame(bytes data not None):
    """``b"%x\\r\\n%b\\r\\n" % (len(data), data)``: one HTTP/1.1 chunk, in one allocation."""
    return _frame(data)


cdef bytes _frame(bytes data):
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t v = n
    cdef char digits[16]
    cdef int nd = 0
    while True:
        digits[15 - nd] = _HEX[v & 15]
        nd += 1
        v >>= 4
        if v == 0:
            break
    cdef bytes framed = PyBytes_FromStringAndSize(NULL, nd + n + 4)
    cdef char *p = PyBytes_AS_STRING(framed)
    memcpy(p, &digits[16 - nd], nd)
    p[nd] = 13
    p[nd + 1] = 10
    memcpy(p + nd + 2, PyBytes_AS_STRING(data), n)
    p[nd + 2 + n] = 13
    p[nd + 3 + n] = 10
    return framed


cdef inline double _now() noexcept nogil:
    """``time.monotonic()``: the same clock (CLOCK_MONOTONIC), without the call."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class StreamBatch:
    """A live stream's ``on_upstream_data_done`` (corral.balancer.relay, ``_go_live``).

    Its pure twin is ``ResponseRelay.on_upstream_data_done`` itself, which it shadows on one
    exchange once the answer's head and first bytes went out: the batch the connection's body
    callback gathered in ``out`` is sent (framed as one chunk when ``chunked``) unless the
    client is closing, and the client's idle deadline moved, with the same clock as
    ``time.monotonic``. Anything else (the answer complete) goes to the method, through a weak
    reference to the exchange, so the exchange and this object make no cycle to collect.
    """

    cdef object exchange, method, client, write
    cdef list out
    cdef bint chunked
    cdef double idle
    cdef object kind

    def __init__(self, exchange_ref, method, client, write, list out not None, bint chunked,
                 double idle, kind):
        self.exchange = exchange_ref
        self.method = method
        self.client = client
        self.write = write
        self.out = out
        self.chunked = chunked
        self.idle = idle
        self.kind = kind

    def __call__(self, complete):
        cdef list out = self.out
        cdef Py_ssize_t n
        if complete:
            exchange = self.exchange()
            if exchange is not None:
                self.method(exchange, complete)
            return
        client = self.client
        n = PyList_GET_SIZE(out)
        if n:
            if n == 1:
                data = <object>PyList_GET_ITEM(out, 0)
            else:
                data = _EMPTY.join(out)
            del out[:]
            if self.chunked:
                data = _frame(data)
            if not client._closing:
                self.write(data)
        client.deadline_kind = self.kind
        client.deadline = _now() + self.idle


# ---------------------------------------------------------------------------- live chunks

cdef enum:
    # What ChunkScan.scan found in a batch.
    MORE = 0  # every byte taken; the answer goes on
    DONE = 1  # the last chunk and its empty trailer section ended the answer
    BAIL = 2  # framing this scanner leaves to httptools (an extension, a trailer, an error)
    # Where the scanner is in the chunked framing.
    S_SIZE = 0  # a chunk-size line's hex digits
    S_SIZE_LF = 1  # its CR seen
    S_DATA = 2  # a chunk's data
    S_DATA_CR = 3  # the CRLF after it
    S_DATA_LF = 4
    S_LAST = 5  # after "0\r\n": the empty line that ends the answer, or a trailer
    S_LAST_LF = 6
    S_END = 7  # done or bailed: takes nothing more
    MAX_DIGITS = 15  # a size up to 2**60 - 1; longer (leading zeros too) is left to httptools

cdef bytes _PRIME_DATA_CR = b"1\r\nX"     # a parser left where the CR after a chunk is due
cdef bytes _PRIME_DATA_LF = b"1\r\nX\r"   # ... where its LF is


cdef inline int _hex(unsigned char c) noexcept nogil:
    """A hex digit's value; -1 for any other byte."""
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef class ChunkScan:
    """The chunked framing of one answer's body, followed byte by byte so that a live stream's
    bytes can go to the client as the replica framed them (corral.balancer.relay, _go_live).

    It follows the body from its first byte (the replica connection feeds it each batch beside
    httptools until the stream goes live), so its state is httptools' at every batch's end. It
    knows the plain framing only: hex sizes, data, CRLFs, and the last chunk with no trailer.
    Anything else (an extension, a trailer, a malformed line) is a BAIL: the bytes not yet
    relayed are handed back, with the prefix that puts a fresh httptools parser where this one
    stopped, so httptools alone judges them as it would have. A size line is held back until
    it is whole (it may still turn out to have an extension), and the last chunk is never
    relayed (the relay writes its own, as for every chunked answer, in the same write as the
    answer's last batch: ``LiveChunks`` holds that batch back).
    """

    cdef int state
    cdef int digits
    cdef long long size
    cdef Py_ssize_t remaining
    cdef bytes held           # a line's bytes from earlier batches, not relayed yet
    # What the last scan() found, for the caller:
    cdef public bytes forward  # the bytes to relay now (may be empty)
    cdef public bytes prime    # BAIL: what follows a chunked head to put httptools here
    cdef public bytes replay   # BAIL: the bytes httptools takes from there
    cdef public bint extra     # DONE: bytes followed the end (a second message)
    # A data byte was scanned (a size line alone is not the answer's first token).
    cdef public bint fed

    def __init__(self):
        self.state = S_SIZE
        self.held = _EMPTY
        self.forward = _EMPTY
        self.prime = _EMPTY
        self.replay = _EMPTY

    @property
    def open(self):
        """False once it ended the answer or bailed: nothing it says counts any more."""
        return self.state != S_END

    @property
    def at_boundary(self):
        """Between two chunks (or before the first): nothing of a chunk or its size line is
        part-way. The relay's general path frames what httptools gave it as chunks of its
        own, so the replica's own framing may follow them only from such a point."""
        return self.state == S_SIZE and self.digits == 0 and PyBytes_GET_SIZE(self.held) == 0

    def scan(self, bytes data not None):
        """Follow ``data``; MORE (0), DONE (1) or BAIL (2), with ``forward``, ``prime``,
        ``replay`` and ``extra`` set as the class docstring says."""
        return self._scan(data)

    cdef int _scan(self, bytes data) except -1:
        cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t line = 0      # where the line being read began in data (0: before it)
        cdef Py_ssize_t take
        cdef bint release = False      # the held line is whole: relay it before data[:line]
        cdef int state = self.state
        cdef unsigned char c
        cdef int v
        if state == S_END:
            raise ValueError("the answer's framing already ended")
        if state == S_DATA or state == S_DATA_CR or state == S_DATA_LF:
            line = -1  # no line under way: everything taken is relayed
        while i < n:
            c = p[i]
            if state == S_DATA:
                take = n - i
                if take > self.remaining:
                    take = self.remaining
                i += take
                self.remaining -= take
                self.fed = True
                if self.remaining == 0:
                    state = S_DATA_CR
                continue
            if state == S_SIZE:
                v = _hex(c)
                if v < 0:
                    if c == 13 and self.digits:
                        state = S_SIZE_LF
                        i += 1
                        continue
                    return self._bail(data, line, i, state, release)
                if self.digits == MAX_DIGITS:
                    return self._bail(data, line, i, state, release)
                self.size = self.size * 16 + v
                self.digits += 1
            elif state == S_SIZE_LF:
                if c != 10:
                    return self._bail(data, line, i, state, release)
                if self.size == 0:
                    state = S_LAST
                else:
                    self.remaining = <Py_ssize_t>self.size
                    state = S_DATA
                    if line == 0 and PyBytes_GET_SIZE(self.held):
                        release = True
                    line = -1
            elif state == S_DATA_CR:
                if c != 13:
                    return self._bail(data, line, i, state, release)
                state = S_DATA_LF
            elif state == S_DATA_LF:
                if c != 10:
                    return self._bail(data, line, i, state, release)
                state = S_SIZE
                self.size = 0
                self.digits = 0
                line = i + 1
            elif state == S_LAST:
                if c != 13:
                    return self._bail(data, line, i, state, release)
                state = S_LAST_LF
            else:  # S_LAST_LF
                if c != 10:
                    return self._bail(data, line, i, state, release)
                self.state = S_END
                self.extra = i + 1 < n
                self.forward = self._relayed(data, release, line)
                self.held = _EMPTY
                return DONE
            i += 1
        self.state = state
        if line < 0:
            self.forward = self._relayed(data, release, n)
            self.held = _EMPTY
        elif line == 0:  # the line held from earlier batches goes on to the end of this one
            self.forward = _EMPTY
            self.held = self.held + data
        else:  # a line began in this batch: held until it is whole
            self.forward = self._relayed(data, release, line)
            self.held = data[line:]
        return MORE

    cdef bytes _relayed(self, bytes data, bint release, Py_ssize_t end):
        """What goes to the client of this batch: the held line if it became whole in it,
        then ``data`` up to ``end`` (where a line under way, or the last chunk, starts)."""
        cdef bytes part = data if end == PyBytes_GET_SIZE(data) else data[:end]
        return self.held + part if release else part

    cdef int _bail(self, bytes data, Py_ssize_t line, Py_ssize_t i, int state,
                   bint release) except -1:
        self.state = S_END
        if line < 0:
            # In a chunk's CRLF: what came before i is relayed, and httptools resumes where
            # that CRLF is due.
            self.forward = self._relayed(data, release, i)
            self.prime = _PRIME_DATA_CR if state == S_DATA_CR else _PRIME_DATA_LF
            self.replay = data[i:]
        elif line == 0:
            # A line held from earlier batches: none of it was relayed; httptools reads it.
            self.forward = _EMPTY
            self.prime = _EMPTY
            self.replay = self.held + data
        else:
            self.forward = self._relayed(data, release, line)
            self.prime = _EMPTY
            self.replay = data[line:]
        self.held = _EMPTY
        return BAIL


# ---------------------------------------------------------------------------- stream pump

# A long live stream's batches relayed by an epoll set of its own (Pump), nested in the loop's:
# epoll, read, scan, send, and no Python at all per batch. Why: on uvloop each batch costs a
# loop wake-up, a bytes object, a protocol call and a transport write, about 1.8 us of user
# time per event against nginx's 1.0, whatever that protocol does (docs/benchmarks.md). The
# pump takes a stream's replica socket (uvloop's reading paused meanwhile) and a duplicate of
# its client's socket once the stream proves long (PUMP_LONG), relays only batches that are
# whole chunk data, and hands anything else back to the loop before relaying it: the batch
# that ends the answer, framing the scanner leaves to httptools, a client that does not take a
# whole batch at once, the replica's end or error. The loop then runs that batch as LiveChunks
# would have (LiveChunks.reclaim), so the stream's end, flow control and failures keep the one
# code path they have.
#
# Why nested in the loop and not a thread of its own (as it was until 2026-12-07): the loop
# watches the pump's set as one reader, and each wake-up relays every ready stream in one C
# call. A thread cost two threads' wake-ups, a lock per batch and an eventfd per hand-back:
# measured side by side, 440-458 us of the balancer's CPU per 50-event stream against 418-423
# nested (docs/benchmarks.md, "The stream pump nested in the loop").

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void *ptr
        int fd
        uint32_t u32
        uint64_t u64
    cdef struct epoll_event:
        uint32_t events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    int EPOLLIN
    int EPOLLET
    int EPOLL_CTL_ADD
    int EPOLL_CTL_DEL
    int EPOLL_CTL_MOD
    int EPOLL_CLOEXEC

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int sockfd, const void *buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT

cdef extern from "<unistd.h>" nogil:
    ssize_t c_read "read" (int fd, void *buf, size_t n)
    int c_close "close" (int fd)

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, int arg)
    int F_DUPFD_CLOEXEC

cdef extern from "<errno.h>" nogil:
    int errno
    int EAGAIN
    int EINTR

cdef enum:
    # A stream goes to the pump after PUMP_LONG batches on the loop, or after its first if
    # the last stream on the same replica connection had that many: handing one over and back
    # cost about 24 us with a thread (two epoll changes, a duplicate socket, a wake-up of each
    # thread), each batch it relayed about 1.3 us less than the loop, so a stream paid back
    # from about 20 batches on (docs/benchmarks.md). Nested, a hand-over costs less (no
    # wake-ups); the bound was not tuned again.
    PUMP_LONG = 32
    PUMP_HOLD = 24  # bytes of a size line cut by a batch's end the pump holds (15 digits, CR)
    PUMP_SLOTS = 4096  # streams one pump relays at once; more stay on the loop
    PUMP_BUF = 65536  # one read's bytes
    PUMP_EVENTS = 64
    # Reads one flow gets per wake-up (256 KiB): a flow with more waiting is queued again
    # behind the others and the loop's own callbacks (EPOLL_CTL_MOD re-reports a ready socket),
    # so a replica faster than the pump cannot hold the loop for as long as its client reads.
    PUMP_ROUNDS = 4
    # What a flow handed back to the loop (Flow.back).
    BACK_NONE = 0  # nothing: the pump relays it
    BACK_UNSENT = 1  # bytes scanned and partly sent: the rest go through the client transport
    BACK_REPLAY = 2  # a batch not relayed: LiveChunks takes it as uvloop would have given it
    BACK_END = 3  # the replica's end or error: uvloop reads it again once reading resumes
    BACK_LOST = 4  # a batch the pump could not keep (no memory): the stream is cut
    # What relaying a batch left (_pump_batch).
    BATCH_DRAINED = 0  # the replica's socket is empty: wait for its next edge
    BATCH_BACK = 1  # the flow is handed back (Flow.back)
    BATCH_MORE = 2  # the read filled the buffer (or was interrupted): read again


cdef struct Flow:
    # One stream the pump relays; it lives in its LiveChunks, which the pump keeps alive.
    int slot
    uint32_t gen
    # Duplicates of the replica's and the client's sockets (uvloop's reading of the replica
    # paused): a close by uvloop, which may come before the connection hears of it, cannot
    # hand either number to another socket while the pump reads or sends on it.
    int up
    int down
    int state  # ChunkScan's framing, carried over and back
    int digits
    long long size
    Py_ssize_t remaining
    double last  # when a batch was last relayed (the idle deadline runs from it)
    int batches  # batches the pump relayed
    int back
    char *data  # BACK_UNSENT, BACK_REPLAY: the bytes, malloc'd by the pump
    Py_ssize_t ndata
    unsigned char held[PUMP_HOLD]  # a size line cut by the last batch's end, not relayed yet
    Py_ssize_t nheld


cdef struct PumpCore:
    int ep  # the pump's epoll set (a reader on the loop)
    Flow *table[PUMP_SLOTS]
    uint32_t gens[PUMP_SLOTS]
    int free_slots[PUMP_SLOTS]
    int nfree
    uint64_t done[PUMP_SLOTS]  # flows handed back, as (gen << 32 | slot), until given back
    int ndone
    unsigned char buf[PUMP_BUF]


cdef Py_ssize_t _scan_whole(Flow *f, const unsigned char *p, Py_ssize_t n) noexcept nogil:
    """ChunkScan's MORE for a batch of plain chunk data: how many of its bytes to relay, the
    framing moved past them. What follows them is a size line the batch cut (at most
    PUMP_HOLD bytes), which the caller holds back, as ChunkScan does, until it is whole: it
    may yet turn out to have an extension, httptools' to read. -1, with the framing
    untouched, for anything else (the last chunk, an extension, anything ChunkScan would bail
    on): the loop's ChunkScan takes that batch whole."""
    cdef int state = f.state
    cdef int digits = f.digits
    cdef long long size = f.size
    cdef Py_ssize_t remaining = f.remaining
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t line = 0 if state == S_SIZE else -1  # where a size line began (-1: none)
    cdef Py_ssize_t take
    cdef unsigned char c
    cdef int v
    while i < n:
        if state == S_DATA:
            take = n - i
            if take > remaining:
                take = remaining
            i += take
            remaining -= take
            if remaining == 0:
                state = S_DATA_CR
            continue
        c = p[i]
        if state == S_SIZE:
            v = _hex(c)
            if v < 0:
                if c == 13 and digits:
                    state = S_SIZE_LF
                    i += 1
                    continue
                return -1
            if digits == MAX_DIGITS:
                return -1
            size = size * 16 + v
            digits += 1
        elif state == S_SIZE_LF:
            if c != 10 or size == 0:
                return -1
            remaining = <Py_ssize_t>size
            state = S_DATA
            line = -1
        elif state == S_DATA_CR:
            if c != 13:
                return -1
            state = S_DATA_LF
        elif state == S_DATA_LF:
            if c != 10:
                return -1
            state = S_SIZE
            size = 0
            digits = 0
            line = i + 1
        else:
            return -1
        i += 1
    if state == S_SIZE_LF or (state == S_SIZE and digits):
        if line < 0 or n - line > PUMP_HOLD:
            return -1
        f.state = S_SIZE  # where the held line begins
        f.digits = 0
        f.size = 0
        return line
    f.state = state
    f.digits = digits
    f.size = size
    f.remaining = remaining
    return n


cdef void _hand_back(Flow *f, const unsigned char *p, Py_ssize_t n, int kind) noexcept nogil:
    f.data = <char *>malloc(n if n > 0 else 1)
    if f.data == NULL:
        f.back = BACK_LOST
        return
    memcpy(f.data, p, n)
    f.ndata = n
    f.back = kind


cdef int _pump_batch(PumpCore *c, Flow *f, double *sent) noexcept nogil:
    """Relay what the replica sent: BATCH_BACK if the flow is handed back (``f.back`` says
    why), BATCH_MORE if the replica may have sent more than one read took (the set is
    edge-triggered: read again now, no new edge will say so), else BATCH_DRAINED. A size
    line held from the last batch goes in front of this one's bytes. ``sent``: when bytes
    went to the client (0: none), for the caller to store in the flow."""
    cdef Py_ssize_t held = f.nheld
    cdef ssize_t r
    cdef ssize_t w
    cdef Py_ssize_t n, end
    if held:
        memcpy(c.buf, f.held, held)
    r = c_read(f.up, c.buf + held, PUMP_BUF - held)
    if r < 0:
        if errno == EAGAIN:
            return BATCH_DRAINED
        if errno == EINTR:
            return BATCH_MORE
        f.back = BACK_END  # the held line stays held: the loop takes it
        return BATCH_BACK
    if r == 0:
        f.back = BACK_END
        return BATCH_BACK
    n = held + r
    end = _scan_whole(f, c.buf, n)
    if end < 0:
        f.nheld = 0  # it is the batch's start
        _hand_back(f, c.buf, n, BACK_REPLAY)
        return BATCH_BACK
    f.nheld = n - end
    memcpy(f.held, c.buf + end, n - end)
    if end:
        w = send(f.down, c.buf, end, MSG_NOSIGNAL | MSG_DONTWAIT)
        if w > 0:
            sent[0] = _now()
        f.batches += 1
        if w != end:
            if w < 0:
                w = 0  # EAGAIN, or an error the client transport meets again and reports
            _hand_back(f, c.buf + w, end - w, BACK_UNSENT)
            return BATCH_BACK
    # A read shorter than the room it had emptied the socket (the next bytes make an edge).
    return BATCH_MORE if r == PUMP_BUF - held else BATCH_DRAINED


cdef bint _pump_events(PumpCore *c, epoll_event *events, int n) noexcept nogil:
    """Relay the batches of the ``n`` flows the wait found ready; True if any was handed back
    (its key added to ``done``, for the loop to take it back once this returns)."""
    cdef uint64_t key
    cdef int i, slot, done, rounds
    cdef bint handed = False
    cdef double sent
    cdef Flow *f
    cdef epoll_event again
    for i in range(n):
        key = events[i].data.u64
        slot = <int>(key & 0xFFFFFFFFU)
        f = c.table[slot]
        if f == NULL or f.gen != <uint32_t>(key >> 32) or f.back != BACK_NONE:
            continue  # given back, or taken back, since the wait returned
        sent = 0.0
        done = BATCH_MORE
        rounds = 0
        while done == BATCH_MORE and rounds < PUMP_ROUNDS:
            done = _pump_batch(c, f, &sent)
            rounds += 1
        if sent != 0.0:
            f.last = sent  # the loop reads it to move the idle deadline
        if done == BATCH_MORE:  # its turn is over, not its bytes: no edge will say so
            again.events = EPOLLIN | EPOLLET
            again.data.u64 = key
            epoll_ctl(c.ep, EPOLL_CTL_MOD, f.up, &again)
        elif done == BATCH_BACK:
            epoll_ctl(c.ep, EPOLL_CTL_DEL, f.up, NULL)
            c.done[c.ndone] = key
            c.ndone += 1
            handed = True
    return handed


cdef class Pump


cdef class LiveChunks:
    """The compiled reader in front of a replica connection once it has carried a live chunked
    stream (corral.balancer.relay, _go_live; ``UpstreamConnection.go_raw``).

    Armed for a live stream, it takes each batch the replica sends with no Python frame:
    ChunkScan follows the framing, the bytes go to the client as they came, and the client's
    idle deadline moves, as ``StreamBatch`` does for the pieces httptools found. The answer's
    end, a framing it leaves to httptools, and a bug disarm it and go back to the connection
    (``UpstreamConnection.raw_done``, ``raw_resume``, ``raw_failed``).

    Why it stays the transport's protocol between streams, disarmed, handing every event to the
    connection: uvloop stops and restarts reading on each ``set_protocol`` (two changes to the
    loop's epoll set, which libuv submits through io_uring), and swapping the protocol in and
    out around every stream made 2.4 ``io_uring_enter`` calls per 50-event stream, against
    none now (``bench/balancer.py --syscalls --only-streamed``, docs/benchmarks.md). What a
    disarmed reader costs instead is one C call per read: 0.02 us per plain answer on such a
    connection, in the engine alone.
    """

    cdef object conn, received, client, write
    cdef ChunkScan scan  # None: disarmed
    cdef double idle
    cdef object kind
    cdef bint first  # the answer's first body bytes are still to come (conn.raw_first)
    cdef Pump pumps  # the balancer's pump, for a stream that goes on (None: never)
    cdef Pump pump  # not None: the pump holds this stream (Flow below)
    cdef int batches  # batches this stream relayed (the pump's counted when it gives back)
    cdef int after  # ... when the pump takes it
    cdef bint long_last  # the last stream on this connection was long (PUMP_LONG)
    cdef Flow flow

    def __init__(self, conn):
        self.conn = conn
        self.received = conn.data_received  # the connection's own path, for a disarmed read
        self.scan = None
        self.pumps = None
        self.pump = None

    @property
    def armed(self):
        """A live stream's batches are this reader's to relay."""
        return self.scan is not None

    @property
    def pumped(self):
        """The pump holds this stream: ``reclaim`` before touching either socket."""
        return self.pump is not None

    def arm(self, ChunkScan scan not None, client, write, double idle, kind, bint first=False,
            Pump pump=None):
        """Relay the live stream ``scan`` follows to ``client`` (``write``: its transport's),
        moving its ``kind`` deadline ``idle`` seconds on with each batch. ``first``: none of
        the answer's body came yet; the batch that brings its first bytes calls the
        connection's ``raw_first`` (one Python call per stream: its time to first token).
        ``pump``: the pump to hand the stream to once it proves long (PUMP_LONG)."""
        self.scan = scan
        self.client = client
        self.write = write
        self.idle = idle
        self.kind = kind
        self.first = first
        self.pumps = pump
        self.batches = 0
        self.after = 1 if self.long_last else PUMP_LONG

    cdef inline void _disarm(self):
        """Hand every event to the connection again: done here before each call back to it."""
        self.scan = None
        self.client = None
        self.write = None
        self.first = False
        self.pumps = None

    cdef _to_pump(self, ChunkScan scan, client):
        """Hand the rest of this stream to the pump, if nothing stands in the way:
        a line held back, a client with bytes still queued, a paused replica, transports
        with no socket of their own (or not uvloop's: any error here leaves it on the loop)."""
        cdef Flow *f = &self.flow
        cdef int down, fd
        conn = self.conn
        transport = client.transport
        up = conn.transport
        if (PyBytes_GET_SIZE(scan.held) or scan.state == S_END or transport is None
                or up is None or client._closing or conn.closed or conn.read_paused):
            return
        try:
            if transport.get_write_buffer_size():
                return
            sock = transport.get_extra_info("socket")
            usock = up.get_extra_info("socket")
            if sock is None or usock is None:
                return
            down = sock.fileno()
            fd = usock.fileno()
        except Exception:
            return
        down = fcntl(down, F_DUPFD_CLOEXEC, 0)
        if down < 0:
            return
        fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)
        if fd < 0:
            c_close(down)
            return
        f.state = scan.state
        f.digits = scan.digits
        f.size = scan.size
        f.remaining = scan.remaining
        f.last = _now()
        f.batches = 0
        f.nheld = 0
        try:
            up.pause_reading()  # before the pump can read: one reader at a time
        except Exception:
            c_close(down)
            c_close(fd)
            return
        if not self.pumps.take(self, fd, down):
            c_close(down)
            c_close(fd)
            up.resume_reading()
            return
        self.pump = self.pumps
        client.pumped = self

    cpdef reclaim(self, bint replay):
        """Take this stream back from the pump. ``replay``: what the pump handed back is run
        as uvloop would have given it; False: dropped, for a connection being closed or cut
        (the caller goes on to do that)."""
        cdef Pump pump = self.pump
        cdef Flow *f = &self.flow
        cdef ChunkScan scan = self.scan
        cdef int back
        if pump is None:
            return
        self.pump = None
        pump.release(f)
        c_close(f.down)
        c_close(f.up)
        back = f.back
        self.batches += f.batches
        if scan is not None:
            scan.state = f.state
            scan.digits = f.digits
            scan.size = f.size
            scan.remaining = f.remaining
        client = self.client
        conn = self.conn
        client.pumped = None
        up = conn.transport
        if up is not None and not conn.closed and not conn.read_paused:
            try:
                up.resume_reading()
            except Exception:
                pass  # closed under us (connection_lost comes next): nothing to read
        data = held = None
        try:  # the stream is the loop's again whatever happens here
            if replay and f.data != NULL:
                data = PyBytes_FromStringAndSize(f.data, f.ndata)
            if replay and f.nheld:
                held = PyBytes_FromStringAndSize(<char *>f.held, f.nheld)
        finally:
            free(f.data)
            f.data = NULL
            f.nheld = 0
        if not replay:
            return
        client.deadline_kind = self.kind
        client.deadline = f.last + self.idle
        if back == BACK_UNSENT:
            if not client._closing:
                self.write(data)
        elif back == BACK_REPLAY:
            self.data_received(data)
            return  # a line the pump held is the start of that batch
        elif back == BACK_LOST:
            self._disarm()
            try:
                raise MemoryError("the stream pump had no memory to keep a batch")
            except MemoryError:
                conn.raw_failed()  # logs the error it is handling, and cuts
            return
        if held is not None:  # ChunkScan holds it from here, as it would have
            self.data_received(held)

    def extend(self):
        """The client's deadline passed while the pump holds the stream: True, with the
        deadline moved, if a batch went within ``idle``; else False, taken back (dropped)."""
        cdef double due
        if self.pump is None:
            return False
        due = self.flow.last + self.idle
        if due > _now():
            self.client.deadline = due
            return True
        self.reclaim(False)
        return False

    def connection_made(self, transport):
        pass

    def data_received(self, bytes data not None):
        cdef ChunkScan scan = self.scan
        cdef int found
        if scan is None:
            self.received(data)
            return
        try:
            found = scan._scan(data)
            forward = scan.forward
            scan.forward = _EMPTY
            if self.first and scan.fed:
                self.first = False
                self.conn.raw_first()
            # DONE: the last batch goes out with the last chunk, in one write (raw_done).
            if found != DONE and PyBytes_GET_SIZE(forward) and not self.client._closing:
                self.write(forward)
            if found == MORE:
                client = self.client
                client.deadline_kind = self.kind
                client.deadline = _now() + self.idle
                if self.pumps is not None and not self.first:
                    self.batches += 1
                    if self.batches == self.after:
                        self._to_pump(scan, client)
                return
        except Exception:
            self._disarm()
            self.conn.raw_failed()  # logged with its traceback there; the exchange cuts
            return
        self._disarm()
        if found == DONE:
            self.long_last = self.batches >= PUMP_LONG
            self.conn.raw_done(scan.extra, forward)
        else:
            self.conn.raw_resume(scan.prime, scan.replay)

    def eof_received(self):
        return self.conn.eof_received()  # its decision, armed or not (connection_lost follows)

    def connection_lost(self, exc):
        self.reclaim(False)
        self._disarm()
        self.conn.connection_lost(exc)

    def pause_writing(self):
        self.conn.pause_writing()

    def resume_writing(self):
        self.conn.resume_writing()


cdef class Pump:
    """The epoll set that relays long live streams for one balancer (see "stream pump" above).

    LiveChunks hands it a stream (``take``) and takes it back (``release``); the loop reads the
    set as one reader (``_poll``), relays every ready stream's batch in C, and gives back at
    once the streams whose batch is the loop's to run. Created by corral.balancer.pump for a
    balancer with no TLS on its client side; it ends in ``close``.
    """

    cdef PumpCore *c
    cdef object loop
    cdef dict owners  # slot: the LiveChunks whose flow it is (alive while taken)
    cdef public bint closed
    cdef public long long taken  # streams handed to the pump, ever
    cdef long long backs[5]  # streams it gave back (to end, or to go on), by why (Flow.back)

    def __cinit__(self):
        cdef int i
        self.c = <PumpCore *>malloc(sizeof(PumpCore))
        if self.c == NULL:
            raise MemoryError()
        c = self.c
        for i in range(5):
            self.backs[i] = 0
        c.ndone = 0
        c.nfree = PUMP_SLOTS
        for i in range(PUMP_SLOTS):
            c.table[i] = NULL
            c.gens[i] = 0
            c.free_slots[i] = PUMP_SLOTS - 1 - i
        c.ep = epoll_create1(EPOLL_CLOEXEC)
        if c.ep < 0:
            self.c = NULL
            free(c)
            raise OSError(errno, "the stream pump's epoll set could not be made")

    def __init__(self, loop):
        self.loop = loop
        self.owners = {}
        loop.add_reader(self.c.ep, self._poll)

    @property
    def streams(self):
        """How many streams the pump holds now (taken and not yet given back)."""
        return len(self.owners)

    @property
    def given_back(self):
        """How many streams the pump gave back, by why: ``unsent`` (the client did not take
        a whole batch), ``replayed`` (a batch it does not relay: the end, other framing),
        ``ended`` (the replica's end or error), ``lost`` (no memory for a batch)."""
        return {
            "unsent": self.backs[BACK_UNSENT],
            "replayed": self.backs[BACK_REPLAY],
            "ended": self.backs[BACK_END],
            "lost": self.backs[BACK_LOST],
        }

    cdef bint take(self, LiveChunks front, int up, int down):
        """Hand ``front``'s flow (its framing already in it) to the pump: ``up`` the
        replica's socket, ``down`` the client's, both duplicates. False: not taken (closed,
        or full: the stream stays on the loop)."""
        cdef PumpCore *c = self.c
        cdef Flow *f = &front.flow
        cdef epoll_event ev
        cdef int slot
        if self.closed or c.nfree == 0:
            return False
        c.nfree -= 1
        slot = c.free_slots[c.nfree]
        c.gens[slot] += 1
        f.slot = slot
        f.gen = c.gens[slot]
        f.up = up
        f.down = down
        f.back = BACK_NONE
        f.data = NULL
        f.ndata = 0
        c.table[slot] = f
        # Edge-triggered: a wait then reports a socket once per arrival, where a level one
        # polls every ready socket again at the next wait (tcp_poll per flow per wake-up).
        ev.events = EPOLLIN | EPOLLET
        ev.data.u64 = (<uint64_t>f.gen << 32) | <uint64_t>slot
        if epoll_ctl(c.ep, EPOLL_CTL_ADD, up, &ev):
            c.table[slot] = NULL
            c.free_slots[c.nfree] = slot
            c.nfree += 1
            return False
        self.owners[slot] = front
        self.taken += 1
        return True

    cdef void release(self, Flow *f):
        """The flow is the loop's again: out of the pump's set (or its list of flows handed
        back), its slot free for another."""
        cdef PumpCore *c = self.c
        cdef uint64_t key = (<uint64_t>f.gen << 32) | <uint64_t>f.slot
        cdef int i
        if f.back == BACK_NONE:  # out of the set before the loop reads the socket again
            epoll_ctl(c.ep, EPOLL_CTL_DEL, f.up, NULL)
        else:
            for i in range(c.ndone):
                if c.done[i] == key:
                    c.ndone -= 1
                    c.done[i] = c.done[c.ndone]
                    break
        c.table[f.slot] = NULL
        c.free_slots[c.nfree] = f.slot
        c.nfree += 1
        self.owners.pop(f.slot, None)

    def _poll(self):
        """The loop found the set ready: relay its streams' batches; give back what ends."""
        cdef PumpCore *c = self.c
        cdef epoll_event events[PUMP_EVENTS]
        cdef int n
        if c == NULL:
            return
        n = epoll_wait(c.ep, events, PUMP_EVENTS, 0)
        if n > 0 and _pump_events(c, events, n):
            self._give_back()

    cdef _give_back(self):
        """Each flow handed back goes on as LiveChunks would have. One at a time from the
        list: running one may take others back (a client cut, the balancer stopping)."""
        cdef PumpCore *c = self.c
        cdef uint64_t key
        cdef LiveChunks front
        while self.c != NULL and c.ndone:
            c.ndone -= 1
            key = c.done[c.ndone]
            front = self.owners.get(<int>(key & 0xFFFFFFFFU))
            if front is None or front.flow.gen != <uint32_t>(key >> 32):
                continue
            self.backs[front.flow.back] += 1
            try:
                front.reclaim(True)
            except Exception:  # a bug: the others still go on
                _log.exception("balancer: unexpected error taking a stream back")

    def close(self):
        """Give every stream back (dropped: their connections are being closed) and close
        the set. Safe to call twice."""
        cdef PumpCore *c = self.c
        if self.closed:
            return
        self.closed = True
        for front in list(self.owners.values()):
            (<LiveChunks>front).reclaim(False)
        try:
            self.loop.remove_reader(c.ep)
        except Exception:
            pass  # the loop is closed already: nothing of ours is in it any more
        self.c = NULL
        c_close(c.ep)
        free(c)

    def __dealloc__(self):
        cdef PumpCore *c = self.c
        if c != NULL:
            self.c = NULL
            c_close(c.ep)
            free(c)


# ---------------------------------------------------------------------------- least load

def least_loaded(candidates, in_flight, last):
    """``policies.least_loaded``, compiled: the same pass over the candidates with the same
    comparisons (Python's, so ints and floats compare as they do there), without the bytecode."""
    cdef bint found_after = False
    cdef bint has_last = last is not None
    cdef bint exact = type(in_flight) is dict
    least = -1
    smallest = 0
    after = 0
    for rid in candidates:
        if exact:
            load = (<dict>in_flight).get(rid, 0)
        else:
            load = in_flight.get(rid, 0)
        if least < 0 or load < least:
            least = load
            smallest = rid
            found_after = has_last and rid > last
            after = rid
        elif load == least:
            if rid < smallest:
                smallest = rid
            if has_last and rid > last and (not found_after or rid < after):
                found_after = True
                after = rid
    if least < 0:
        raise ValueError("no candidate replica")
    return after if found_after else smallest


# ---------------------------------------------------------------------------- prefix blocks

# CPython's own hashes, as ``hash((parent, int.from_bytes(block, "little")))`` computes them on
# a 64-bit build: an int's hash is its value modulo 2**61 - 1 (signed as the int), a tuple's
# mixes its items' hashes as xxHash's round does (Objects/longobject.c, Objects/tupleobject.c;
# unchanged since 3.8). So the twin gives the pure function's values exactly (the tests hold
# it to that) and a worker of either build agrees with every other.
cdef extern from *:
    """
    #include <stdint.h>
    static const uint64_t CORRAL_P61 = (((uint64_t)1) << 61) - 1;
    static inline uint64_t corral_fold61(unsigned __int128 x) {
        uint64_t r;
        x = (x & CORRAL_P61) + (x >> 61);
        x = (x & CORRAL_P61) + (x >> 61);
        r = (uint64_t)x;
        return r >= CORRAL_P61 ? r - CORRAL_P61 : r;
    }
    /* hash(int.from_bytes(p[:n], "little")): the value modulo 2**61 - 1, by Horner's rule
       over 64-bit words from the most significant (2**64 is 8 modulo 2**61 - 1). */
    static inline int64_t corral_block_hash(const unsigned char *p, Py_ssize_t n) {
        Py_ssize_t words = n >> 3, top = n & 7, i;
        uint64_t h = 0, w;
        for (i = top - 1; i >= 0; i--) h = (h << 8) | p[(words << 3) + i];
        for (i = words - 1; i >= 0; i--) {
            memcpy(&w, p + (i << 3), 8);
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            w = __builtin_bswap64(w);  /* the bytes are read as a little-endian number */
    #endif
            h = corral_fold61(((unsigned __int128)h << 3) + w);
        }
        return (int64_t)h;
    }
    /* hash(n) for an int n that is itself a hash (so never -1). */
    static inline uint64_t corral_int_hash(int64_t n) {
        uint64_t m = n < 0 ? (uint64_t)0 - (uint64_t)n : (uint64_t)n;
        uint64_t r = corral_fold61(m);
        if (n < 0) { r = (uint64_t)0 - r; if (r == (uint64_t)-1) r = (uint64_t)-2; }
        return r;
    }
    /* hash((a, b)) for two ints whose hashes are ha and hb. */
    static inline int64_t corral_pair_hash(uint64_t ha, uint64_t hb) {
        const uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                       P5 = 2870177450012600261ULL;
        uint64_t acc = P5;
        acc += ha * P2; acc = (acc << 31) | (acc >> 33); acc *= P1;
        acc += hb * P2; acc = (acc << 31) | (acc >> 33); acc *= P1;
        acc += 2 ^ (P5 ^ 3527539UL);
        if (acc == (uint64_t)-1) return 1546275796;
        return (int64_t)acc;
    }
    """
    int64_t corral_block_hash(const unsigned char *p, Py_ssize_t n) noexcept nogil
    uint64_t corral_int_hash(int64_t n) noexcept nogil
    int64_t corral_pair_hash(uint64_t ha, uint64_t hb) noexcept nogil

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)
    void *PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)


def block_hashes(str text not None, Py_ssize_t block_chars=64, limit_blocks=None):
    """``prefix.block_hashes``, compiled: the same chained hashes, with no Python object per
    block but the list's ints, and an ASCII prompt read where it lies (no encoded copy).
    Routing calls it once a request; in a router on a busy machine, from cold caches, the
    pure loop was about a sixth of the policy's time (docs/benchmarks.md)."""
    if block_chars < 1:
        raise ValueError("block_chars must be positive")
    cdef bytes encoded
    cdef const unsigned char *data
    cdef Py_ssize_t size
    if PyUnicode_IS_ASCII(text):
        data = <const unsigned char *>PyUnicode_DATA(text)
        size = PyUnicode_GET_LENGTH(text)
    else:
        encoded = text.encode("utf-8", "surrogatepass")
        data = <const unsigned char *>PyBytes_AS_STRING(encoded)
        size = PyBytes_GET_SIZE(encoded)
    cdef Py_ssize_t end = size - size % block_chars
    cdef Py_ssize_t limit
    if limit_blocks is not None:
        limit = max(<Py_ssize_t>limit_blocks, 0)
        if limit < end // block_chars:
            end = limit * block_chars
    cdef list out = []
    cdef int64_t parent = 0
    cdef Py_ssize_t i = 0
    while i < end:
        parent = corral_pair_hash(
            corral_int_hash(parent), <uint64_t>corral_block_hash(data + i, block_chars)
        )
        out.append(parent)
        i += block_chars
    return out


cdef extern from "Python.h":
    PyObject *PyDict_GetItemWithError(object d, object key) except? NULL
    int PyDict_Contains(object d, object key) except -1


def insert_blocks(lru not None, dict owners not None, hashes, Py_ssize_t limit, bit not None,
                  Py_ssize_t bound):
    """``prefix.insert_blocks``, compiled: the same index changes in the same order, with no
    bytecode per block. A one-off prompt records all its blocks (about 50 for a chat turn's
    length); in a router, from cold caches, the pure loop was about a fifth of the policy's
    time (docs/benchmarks.md)."""
    cdef list chain = hashes if type(hashes) is list else list(hashes)
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = limit
    cdef Py_ssize_t mid, i, held, extra
    cdef PyObject *found
    if limit > PyList_GET_SIZE(chain):
        raise ValueError("limit is past the hashes")
    while lo < hi:  # prefix._held: the blocks are prefix-closed, so the held run is leading
        mid = (lo + hi + 1) >> 1
        if PyDict_Contains(lru, <object>PyList_GET_ITEM(chain, mid - 1)):
            lo = mid
        else:
            hi = mid - 1
    held = lo
    i = limit - 1
    while i >= held:  # the new blocks, last first: each more recently used than its children
        h = <object>PyList_GET_ITEM(chain, i)
        lru[h] = None
        found = PyDict_GetItemWithError(owners, h)
        owners[h] = bit if found == NULL else (<object>found) | bit
        i -= 1
    if held:
        move = lru.move_to_end
        i = held - 1
        while i >= 0:
            move(<object>PyList_GET_ITEM(chain, i))
            i -= 1
    extra = len(lru) - bound
    if extra > 0:
        pop = lru.popitem
        while extra > 0:
            h = pop(False)[0]
            left = owners[h] & ~bit
            if left:
                owners[h] = left
            else:
                del owners[h]
            extra -= 1


# ---------------------------------------------------------------------------- the load board

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

cdef enum:
    _BOARD_COLUMNS = 64  # load_board.COLUMNS
cdef uint64_t _COUNT_BITS = 0xFFFFFFFF
cdef double _LESS = 1.0 - 1.0 / 16  # 1 - policies.STREAM_WEIGHT


cdef class LoadBoard:
    """``load_board.LoadBoard``, compiled: the same cells, read and written through a pointer
    into the map (one aligned 64-bit load or store each, where the pure class unpacks a whole
    row per worker), so a load policy's pick and a request's count and release cost no Python
    per worker. Little-endian machines only, as the pure layout is (``load_board`` offers it
    nowhere else)."""

    cdef Py_buffer view
    cdef uint64_t *cells
    cdef Py_ssize_t slot, rows
    cdef dict column
    cdef object mapped
    cdef public object streams  # the board of streams under way beside this one, or None

    def __init__(self, mapped not None, Py_ssize_t slot, Py_ssize_t rows):
        if rows < 1 or not 0 <= slot < 16:
            raise ValueError("a board has rows 1..16 and slots 0..15")
        PyObject_GetBuffer(mapped, &self.view, PyBUF_WRITABLE)
        if self.view.len < 16 * _BOARD_COLUMNS * 8:
            PyBuffer_Release(&self.view)
            raise ValueError("the board's map is smaller than its rows")
        self.cells = <uint64_t *>self.view.buf
        self.mapped = mapped
        self.slot = slot
        self.rows = rows
        self.column = {}
        self.streams = None

    def __dealloc__(self):
        if self.cells != NULL:
            self.cells = NULL
            PyBuffer_Release(&self.view)

    cdef inline uint64_t *_row(self) except NULL:
        if self.cells == NULL:
            raise ValueError("the load board is closed")
        return self.cells + self.slot * _BOARD_COLUMNS

    def arrange(self, ready, in_flight):
        cdef uint64_t *row = self._row()
        cdef Py_ssize_t i = 0
        cdef dict column = {}
        cells = [0] * _BOARD_COLUMNS
        for rid in ready[:_BOARD_COLUMNS]:
            column[rid] = i
            cells[i] = _cell(rid, in_flight.get(rid, 0))
            i += 1
        self.column = column
        for i in range(_BOARD_COLUMNS):
            row[i] = <uint64_t>cells[i]

    cpdef publish(self, rid, count):
        cdef uint64_t *row = self._row()
        i = self.column.get(rid)
        if i is not None:
            row[<Py_ssize_t>i] = _cell(rid, count)

    cdef Py_ssize_t _at(self, rid) except -2:
        """``rid``'s column, or -1: none (not ready when the row was arranged)."""
        found = PyDict_GetItemWithError(self.column, rid)
        if found == NULL:
            return -1
        return <Py_ssize_t><object>found

    cdef uint64_t _others(self, uint64_t want, Py_ssize_t at) noexcept:
        """What the other workers' rows say replica ``want`` (in column ``at``) carries."""
        cdef Py_ssize_t r
        cdef uint64_t cell, n = 0
        for r in range(self.rows):
            if r != self.slot:
                cell = self.cells[r * _BOARD_COLUMNS + at]
                if cell >> 32 == want:
                    n += cell & _COUNT_BITS
        return n

    cpdef dict totals(self, candidates, own):
        self._row()
        cdef dict totals = {}
        cdef bint exact = type(own) is dict
        cdef Py_ssize_t at
        cdef uint64_t n
        for rid in candidates:
            value = (<dict>own).get(rid, 0) if exact else own.get(rid, 0)
            at = self._at(rid)
            if at >= 0:
                n = self._others(<uint64_t>rid, at)
                if n:
                    value = value + n
            totals[rid] = value
        return totals

    def loads(self, candidates, own, own_streams):
        """``load_board.LoadBoard.loads``: every worker's counts, streams weighed. No stream
        under way among the candidates (plain HTTP) builds one dict, as ``totals``. Its board
        of streams is of this build too (``load_board`` builds both)."""
        cdef dict totals = self.totals(candidates, own)
        cdef LoadBoard board = self.streams
        cdef Py_ssize_t at
        if board is not None:
            board._row()  # refuses a closed board
        for rid in candidates:
            if own_streams.get(rid, 0):
                break
            if board is not None:
                at = board._at(rid)
                if at >= 0 and board._others(<uint64_t>rid, at):
                    break
        else:
            return totals
        counts = own_streams if board is None else board.totals(candidates, own_streams)
        return {
            rid: (n := totals[rid]) - _LESS * min(counts.get(rid, 0), n) for rid in candidates
        }

    def clear(self):
        cdef uint64_t *row = self._row()
        cdef Py_ssize_t i
        for i in range(_BOARD_COLUMNS):
            row[i] = 0
        self.column = {}

    def close(self):
        if self.cells != NULL:
            self.cells = NULL
            PyBuffer_Release(&self.view)
        self.mapped.close()


cdef inline uint64_t _cell(rid, count) except? 0:
    """A cell as ``load_board`` packs it: the id above, the count's low 32 bits below."""
    cdef int64_t c = count
    return (<uint64_t>rid << 32) | (<uint64_t>c & _COUNT_BITS)


# ---------------------------------------------------------------------------- the fast path's state

# The compiled fast path reads the connections' and the balancer's state through the slots
# their classes declare (``__slots__``), at the offsets the interpreter itself uses: what made
# Cython slower than CPython 3.11 on ``fast.py`` was the generic attribute lookup, not the work.
# ``wire`` takes the offsets from the classes' slot descriptors; an object of another class
# (a test double) takes the pure path instead.

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    PyTypeObject PyMemberDescr_Type

cdef extern from "structmember.h":
    int T_OBJECT_EX
    int READONLY


cdef Py_ssize_t _offset(type cls, str name) except -1:
    descr = getattr(cls, name, None)
    if type(descr) is not <object>&PyMemberDescr_Type:
        raise TypeError(f"{cls.__name__}.{name} is not a slot")
    cdef PyMemberDef *member = (<PyMemberDescrObject *>descr).d_member
    if member.type != T_OBJECT_EX or member.flags & READONLY:
        raise TypeError(f"{cls.__name__}.{name} is not a writable object slot")
    return member.offset


cdef inline object _get(object o, Py_ssize_t offset):
    cdef PyObject *p = (<PyObject **>((<char *><PyObject *>o) + offset))[0]
    if p == NULL:
        raise AttributeError(f"{type(o).__name__}: a slot the fast path reads is not set")
    return <object>p


cdef inline void _put(object o, Py_ssize_t offset, object value):
    cdef PyObject **slot = <PyObject **>((<char *><PyObject *>o) + offset)
    cdef PyObject *old = slot[0]
    Py_INCREF(value)
    slot[0] = <PyObject *>value
    Py_XDECREF(old)


cdef bint _wired = False
cdef tuple _TYPES = ()
cdef PyTypeObject *_CLIENT
cdef PyTypeObject *_UPSTREAM
cdef PyTypeObject *_TARGET
cdef PyTypeObject *_BALANCER
cdef PyTypeObject *_POOL
cdef object _pure_response = None
cdef object _pure_request = None
cdef object _pure_send = None
cdef object _start_exchange = None
cdef object _DL_HEAD = None
cdef object _DL_FIRST_BYTE = None
cdef object _IDEMPOTENT = None
cdef double _NONIDEMPOTENT_MAX_IDLE = 0.0
cdef double _BUCKETS[64]
cdef Py_ssize_t _NBUCKETS = 0
cdef bytes _HEAD = b"HEAD"
cdef bytes _KEEP_ALIVE = b"Connection: keep-alive\r\n"
cdef bytes _CLOSE = b"Connection: close\r\n"
cdef bytes _SPACE = b" "
cdef bytes _CRLF = b"\r\n"
cdef bytes _CLOSE_TOKEN = b"close"
cdef bytes _KEEP_ALIVE_TOKEN = b"keep-alive"

# The slots read, by index into OFF (their offsets): C_ the client connection's, U_ the replica
# connection's, T_ its target's, B_ the balancer's, P_ its pool's. _FIELDS names them in the
# same order, with the role of the class that holds each.
cdef enum:
    C_BUF, C_CLOSING, C_DEADLINE, C_DEADLINE_KIND, C_EOF, C_FAST, C_KEPT_ALIVE, C_LB, C_LEAD,
    C_MEMO, C_PAUSED, C_TRANSPORT, C_XFF_LINE,
    U_CLOSED, U_FAST_CLIENT, U_HEAD, U_IDLE_SINCE, U_READ_PAUSED, U_TARGET, U_TRANSPORT,
    T_IDLE, T_LINE_TAIL, T_MEMO, T_PREFIX, T_RETIRED,
    B_BOARD, B_CODES, B_DRAINED, B_EJECTED, B_FIRST_BYTE_TIMEOUT, B_GATED, B_HEADER_TIMEOUT,
    B_HELD, B_IN_FLIGHT, B_LATENCY, B_LATENCY_SUM, B_MAX_BODY, B_MAX_BUFFERED_BODY,
    B_MAX_HEADER_BYTES, B_POLICY, B_POOL, B_PROTO_LINE, B_READY, B_READY_IDS, B_REQUESTS,
    B_SERVED, B_STOPPING, B_STREAMING, B_TIMESTAMPS,
    P_TARGETS,
    N_FIELDS

_FIELDS = (
    *(("client", n) for n in (
        "_buf", "_closing", "deadline", "deadline_kind", "_eof", "fast", "kept_alive", "lb",
        "lead", "memo", "_paused", "transport", "xff_line",
    )),
    *(("upstream", n) for n in (
        "closed", "fast_client", "_head", "idle_since", "read_paused", "target", "transport",
    )),
    *(("target", n) for n in ("idle", "line_tail", "memo", "prefix", "retired")),
    *(("balancer", n) for n in (
        "_board", "_codes", "_drained", "_ejected", "_first_byte_timeout", "_gated",
        "_header_timeout", "_held", "_in_flight", "_latency", "_latency_sum", "_max_body",
        "_max_buffered_body", "_max_header_bytes", "_policy", "_pool", "_proto_line", "_ready",
        "_ready_ids", "_requests", "_served", "_stopping", "_streaming", "_timestamps",
    )),
    ("pool", "_targets"),
)
cdef Py_ssize_t OFF[N_FIELDS]


def wire(dict classes not None, dict pure not None, dict constants not None):
    """Take the slots' offsets from the classes the fast path runs on (``classes``: by role,
    ``client``, ``upstream``, ``target``, ``balancer``, ``pool``). ``pure``: the pure functions
    (``fast``'s ``try_request``, ``_send``, ``try_response`` and ``start_exchange``), which serve
    any other object and whatever the compiled ones leave to them; ``constants``:
    ``LATENCY_BUCKETS`` (the latency histogram's bounds), ``DL_HEAD`` and ``DL_FIRST_BYTE``
    (deadline kinds), ``IDEMPOTENT`` and ``NONIDEMPOTENT_MAX_IDLE``. Checks everything before
    changing anything: a class without one of the slots is a TypeError naming it."""
    global _wired, _TYPES, _CLIENT, _UPSTREAM, _TARGET, _BALANCER, _POOL, _NBUCKETS
    global _pure_response, _pure_request, _pure_send, _start_exchange
    global _DL_HEAD, _DL_FIRST_BYTE, _IDEMPOTENT, _NONIDEMPOTENT_MAX_IDLE
    if len(_FIELDS) != N_FIELDS:
        raise AssertionError("_FIELDS and the slot indices disagree")
    offsets = [_offset(classes[role], name) for role, name in _FIELDS]
    buckets = tuple(float(b) for b in constants["LATENCY_BUCKETS"])
    if len(buckets) > 64:
        raise ValueError("more than 64 latency buckets")
    functions = [pure[n] for n in ("try_response", "try_request", "_send", "start_exchange")]
    kinds = constants["DL_HEAD"], constants["DL_FIRST_BYTE"]
    idempotent = frozenset(constants["IDEMPOTENT"])
    max_idle = float(constants["NONIDEMPOTENT_MAX_IDLE"])
    types = [classes[role] for role in ("client", "upstream", "target", "balancer", "pool")]
    for k in range(N_FIELDS):
        OFF[k] = offsets[k]
    for k in range(len(buckets)):
        _BUCKETS[k] = buckets[k]
    _NBUCKETS = len(buckets)
    _TYPES = tuple(types)  # held, so the pointers below stay valid
    _CLIENT = <PyTypeObject *>_TYPES[0]
    _UPSTREAM = <PyTypeObject *>_TYPES[1]
    _TARGET = <PyTypeObject *>_TYPES[2]
    _BALANCER = <PyTypeObject *>_TYPES[3]
    _POOL = <PyTypeObject *>_TYPES[4]
    _pure_response, _pure_request, _pure_send, _start_exchange = functions
    _DL_HEAD, _DL_FIRST_BYTE = kinds
    _IDEMPOTENT = idempotent
    _NONIDEMPOTENT_MAX_IDLE = max_idle
    _wired = True


def latency_bucket(double seconds):
    """The histogram bucket the compiled path counts a latency in (tests hold it to
    ``bisect.bisect_left(LATENCY_BUCKETS, seconds)``)."""
    return _bucket(seconds)


cdef inline Py_ssize_t _bucket(double seconds) noexcept nogil:
    """``bisect.bisect_left(LATENCY_BUCKETS, seconds)``."""
    cdef Py_ssize_t k = 0
    while k < _NBUCKETS and _BUCKETS[k] < seconds:
        k += 1
    return k


def try_response(cl, conn, bytes data not None):
    """``fast.try_response``, its pure twin, for a replica whose last validated head this
    answer repeats (the common case); any other answer, and objects of other classes, go to
    the pure function, before anything is done."""
    if not (
        _wired
        and PyObject_TypeCheck(cl, _CLIENT)
        and PyObject_TypeCheck(conn, _UPSTREAM)
    ):
        return _pure_response(cl, conn, data)
    fast = _get(cl, OFF[C_FAST])
    if fast is None or _get(conn, OFF[U_HEAD]):
        return False
    lb = _get(cl, OFF[C_LB])
    dest = _get(conn, OFF[U_TARGET])
    if not (
        PyObject_TypeCheck(lb, _BALANCER)
        and PyObject_TypeCheck(dest, _TARGET)
        and type(fast) is tuple
        and len(<tuple>fast) == 11
    ):
        return _pure_response(cl, conn, data)
    memo = _get(dest, OFF[T_MEMO])
    if memo is None or type(memo) is not tuple or len(<tuple>memo) != 4:
        return _pure_response(cl, conn, data)
    seen = (<tuple>memo)[0]
    if type(seen) is not bytes or not data.startswith(<bytes>seen):
        return _pure_response(cl, conn, data)
    cdef tuple state = <tuple>fast
    method = state[3]
    if method == _HEAD:
        return False  # the general path knows its framing
    rid = state[1]
    cdef double t0 = state[2]
    cdef bint http11 = state[5]
    cdef bint keep_alive = state[6]
    status = (<tuple>memo)[1]
    cdef Py_ssize_t length = (<tuple>memo)[2]
    head = (<tuple>memo)[3]
    cdef Py_ssize_t body_at = PyBytes_GET_SIZE(<bytes>seen)
    cdef Py_ssize_t end = body_at - 4
    if PyBytes_GET_SIZE(data) != body_at + length:
        return False
    if keep_alive and not _get(lb, OFF[B_STOPPING]):
        extra = _EMPTY if http11 else _KEEP_ALIVE
    else:
        extra = _CLOSE
    if head is None and extra is _EMPTY:
        out = data
    else:
        out = _EMPTY.join((data[: end + 2] if head is None else head, extra, data[end + 2 :]))
    # Committed from here: count it, send it, give the replica and its connection back.
    _put(cl, OFF[C_FAST], None)
    _put(conn, OFF[U_FAST_CLIENT], None)
    cdef dict served = _get(lb, OFF[B_SERVED])
    served[rid] = served.get(rid, 0) + 1
    cdef double now = _now()
    cdef double seconds = now - t0
    cdef dict codes = _get(lb, OFF[B_CODES])
    codes[status] = codes.get(status, 0) + 1
    cdef list latency = _get(lb, OFF[B_LATENCY])
    cdef Py_ssize_t k = _bucket(seconds)
    if k < PyList_GET_SIZE(latency):
        latency[k] = latency[k] + 1
    else:
        lb._latency[k] += 1  # the pure path's error, if the histogram was cut short
    _put(lb, OFF[B_LATENCY_SUM], _get(lb, OFF[B_LATENCY_SUM]) + seconds)
    cdef bint closing = _get(cl, OFF[C_CLOSING])
    if not closing:
        _get(cl, OFF[C_TRANSPORT]).write(out)
    cdef dict in_flight = _get(lb, OFF[B_IN_FLIGHT])
    board = _get(lb, OFF[B_BOARD])
    count = in_flight.get(rid, 0)
    if (
        (
            count > 1
            or (
                count == 1
                and not _get(lb, OFF[B_DRAINED])
                and rid in <dict?>_get(lb, OFF[B_READY])
            )
        )
        and not _get(lb, OFF[B_HELD])
        and (board is None or isinstance(board, LoadBoard))
    ):
        in_flight[rid] = count - 1  # what lb._release does when nothing waits
        if board is not None:
            (<LoadBoard>board).publish(rid, count - 1)
    else:
        lb._release(rid)
    pool = _get(lb, OFF[B_POOL])
    if (
        _get(conn, OFF[U_CLOSED])
        or _get(dest, OFF[T_RETIRED])
        or _get(conn, OFF[U_READ_PAUSED])
    ):
        pool.put(conn)
    else:
        _put(conn, OFF[U_IDLE_SINCE], now)
        _get(dest, OFF[T_IDLE]).append(conn)
        if PyObject_TypeCheck(pool, _POOL):
            (<set?>_get(pool, OFF[P_TARGETS])).add(dest)
        else:
            pool._targets.add(dest)
    if closing:
        return True
    if not keep_alive or _get(lb, OFF[B_STOPPING]):
        cl._close()
        return True
    _put(cl, OFF[C_KEPT_ALIVE], True)
    _put(cl, OFF[C_DEADLINE_KIND], _DL_HEAD)
    _put(cl, OFF[C_DEADLINE], now + <double>_get(lb, OFF[B_HEADER_TIMEOUT]))
    if _get(cl, OFF[C_PAUSED]):
        cl._unpause()
    if _get(cl, OFF[C_BUF]):
        cl._process()
    return True


def try_request(cl, bytes data not None):
    """``fast.try_request``, its pure twin, for the bytes of the connection's last request
    again or a request under its remembered lead; anything else (a parse, another class) goes
    to the pure function, with nothing done yet."""
    if not (_wired and PyObject_TypeCheck(cl, _CLIENT)):
        return _pure_request(cl, data)
    lb = _get(cl, OFF[C_LB])
    if not PyObject_TypeCheck(lb, _BALANCER) or _get(lb, OFF[B_STOPPING]):
        return _pure_request(cl, data)
    cdef bint http11
    memo = _get(cl, OFF[C_MEMO])
    if (
        memo is not None
        and type(memo) is tuple
        and len(<tuple>memo) == 7
        and (<tuple>memo)[0] == data
    ):
        # The bytes of the last parsed request on this connection again (see the pure twin).
        m = <tuple>memo
        http11 = m[3]
        token = m[6]
        keep_alive = (
            (token != _CLOSE_TOKEN if http11 else token == _KEEP_ALIVE_TOKEN)
            and not _get(cl, OFF[C_EOF])
        )
        xff_line = _get(cl, OFF[C_XFF_LINE])
        return _send(cl, lb, m[1], m[2], http11, keep_alive, m[4], xff_line, m[5], None)
    lead = _get(cl, OFF[C_LEAD])
    if lead is not None and type(lead) is tuple and len(<tuple>lead) == 7:
        split = lead_split(
            data,
            lead,
            _get(lb, OFF[B_MAX_HEADER_BYTES]),
            _get(lb, OFF[B_MAX_BUFFERED_BODY]),
            _get(lb, OFF[B_MAX_BODY]),
        )
        if split is not None:
            method, target, kept, body = split
            keep_alive = not _get(cl, OFF[C_EOF])
            xff_line = _get(cl, OFF[C_XFF_LINE])
            fhost = (<tuple>lead)[6]
            return _send(cl, lb, method, target, True, keep_alive, kept, xff_line, fhost, body)
    return _pure_request(cl, data)


cdef object _send(cl, lb, method, target, bint http11, bint keep_alive, kept, xff_line, fhost,
                  body):
    """``fast._send``: a pooled connection to the replica the policy picks, the request
    written on it; a held request, or one with no such connection, goes to the pure code."""
    if _get(lb, OFF[B_GATED]):
        return _pure_send(cl, method, target, http11, keep_alive, kept, xff_line, fhost, body)
    ids = _get(lb, OFF[B_READY_IDS])
    cdef double now = _now()
    rid = None
    conn = None
    transport = None
    board = _get(lb, OFF[B_BOARD])
    if ids:
        if board is None:
            loads = lb._loads(ids) if _get(lb, OFF[B_STREAMING]) else _get(lb, OFF[B_IN_FLIGHT])
        elif isinstance(board, LoadBoard):  # every worker's: what lb._loads reads
            loads = (<LoadBoard>board).loads(
                ids, _get(lb, OFF[B_IN_FLIGHT]), _get(lb, OFF[B_STREAMING])
            )
        else:
            loads = lb._loads(ids)
        pick = lb._healthy(ids) if _get(lb, OFF[B_EJECTED]) else ids
        rid = _get(lb, OFF[B_POLICY]).select(pick, loads)
    if ids and rid is not None:
        dest = (<dict?>_get(lb, OFF[B_READY]))[rid]
        if not PyObject_TypeCheck(dest, _TARGET):
            return _start_exchange(
                cl, method, target, http11, keep_alive, kept, xff_line, fhost, body, rid, False
            )
        idle = _get(dest, OFF[T_IDLE])
        if idle:
            conn = idle.pop()
            if not PyObject_TypeCheck(conn, _UPSTREAM):
                idle.append(conn)
                conn = None
            else:
                transport = _get(conn, OFF[U_TRANSPORT])
                if (
                    _get(conn, OFF[U_CLOSED])
                    or transport is None
                    or transport.is_closing()
                    or (
                        method not in _IDEMPOTENT
                        and now - <double>_get(conn, OFF[U_IDLE_SINCE]) > _NONIDEMPOTENT_MAX_IDLE
                    )
                ):
                    idle.append(conn)  # Pool.take, on the general path, sorts these out
                    conn = None
    if conn is None or rid is None:
        return _start_exchange(
            cl, method, target, http11, keep_alive, kept, xff_line, fhost, body, rid, False
        )
    _put(lb, OFF[B_REQUESTS], _get(lb, OFF[B_REQUESTS]) + 1)
    _get(lb, OFF[B_TIMESTAMPS]).append(now)  # what lb._count_request does, without the call
    if board is None or isinstance(board, LoadBoard):
        in_flight = <dict?>_get(lb, OFF[B_IN_FLIGHT])
        count = in_flight[rid] = in_flight.get(rid, 0) + 1
        if board is not None:
            (<LoadBoard>board).publish(rid, count)  # the other workers see it
    else:
        lb._acquire(rid)
    if body is None:
        tail = _CRLF
    else:
        tail = b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    dest = _get(conn, OFF[U_TARGET])
    _put(conn, OFF[U_FAST_CLIENT], cl)
    transport.write(
        _EMPTY.join(
            (
                method,
                _SPACE,
                _get(dest, OFF[T_PREFIX]),
                target,
                _get(dest, OFF[T_LINE_TAIL]),
                kept,
                xff_line,
                _get(lb, OFF[B_PROTO_LINE]),
                fhost,
                tail,
            )
        )
    )
    state = (conn, rid, now, method, target, http11, keep_alive, kept, xff_line, fhost, body)
    _put(cl, OFF[C_FAST], state)
    _put(cl, OFF[C_DEADLINE_KIND], _DL_FIRST_BYTE)
    _put(cl, OFF[C_DEADLINE], now + <double>_get(lb, OFF[B_FIRST_BYTE_TIMEOUT]))
    return True
