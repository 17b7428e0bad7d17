# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""corral.balancer.lead in C: the request split under a remembered lead, in one call; and a
live stream's end of batch (StreamBatch), the relay's one Python call per streamed event.

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
        cdef timespec ts
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
        clock_gettime(CLOCK_MONOTONIC, &ts)
        client.deadline_kind = self.kind
        client.deadline = ts.tv_sec + ts.tv_nsec * 1e-9 + self.idle
