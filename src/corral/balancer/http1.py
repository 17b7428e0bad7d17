"""HTTP/1.x pieces the proxy needs around httptools: request lines, chunked bodies, errors.

httptools (llhttp) validates request heads and parses responses (on the fast path, what it
accepted once stands in for it: the same bytes again, or the same Host line with new lines that
stricter line grammars check; see :mod:`corral.balancer.fast`); what it does not give is
*where* in the byte stream a message ends, which a proxy needs to pass blocks through whole and
to serve pipelined requests. So the request side frames messages itself: the head ends at the
first blank line (llhttp rejects bare-LF heads, so CRLF CRLF is the only end), a body is
Content-Length bytes or chunked, decoded by :class:`ChunkedDecoder`, which reports how many
bytes it used so the bytes after the body are kept for the next request.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Final

import httptools

__all__ = [
    "CONTINUE",
    "ChunkedDecoder",
    "chunk",
    "content_length",
    "error_response",
    "origin_form",
    "parse_request_line",
]

CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK: Final = b"0\r\n\r\n"
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_MAX_CHUNK_LINE: Final = 4096
_REASONS: Final = {s.value: s.phrase.encode() for s in HTTPStatus}


class BadRequest(Exception):
    """Malformed HTTP from the client (answered with 400)."""


def parse_request_line(head: bytes) -> tuple[bytes, bytes, bool, int]:
    """``(method, target, is_http11, end_of_line)`` of a head llhttp has accepted.

    llhttp also accepts HTTP/0.9, 2.0 and 3.0 request lines; only 1.0 and 1.1 are spoken here.
    """
    eol = head.find(b"\r\n")
    line = head[:eol]
    parts = line.split(b" ")
    if len(parts) != 3 or b"\n" in line or b"\r" in line:
        # A bare LF (or CR) in it: llhttp reads it as a line end before the version, so the
        # rest would reach the replica as a header line of the client's making.
        raise BadRequest("invalid request line")
    method, target, version = parts
    if target == b"*" and method != b"OPTIONS":
        # RFC 9112 section 3.2.4: asterisk-form is OPTIONS's alone. Passed on, it became the
        # origin-form "/" (origin_form): a "DELETE *" acted on the replica's root.
        raise BadRequest("a '*' target is only for OPTIONS")
    if version == b"HTTP/1.1":
        return method, target, True, eol
    if version == b"HTTP/1.0":
        return method, target, False, eol
    raise BadRequest(f"unsupported HTTP version {version.decode('latin-1')!r}")


def origin_form(target: bytes) -> bytes:
    """Path and query of a request target, exactly as sent (never re-quoted).

    An absolute-form target (``GET http://other/x``) is reduced to its path: the balancer only
    ever proxies to its own replicas, whatever host the client names. Asterisk-form becomes
    ``/``.
    """
    if target[:1] == b"/":
        return target
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        return b"/"
    path = url.path or b"/"
    if path[:1] != b"/":
        path = b"/"
    return path + b"?" + url.query if url.query else path


def request_host(target: bytes, hosts: list[bytes] | None, http11: bool) -> bytes | None:
    """The host a request names, for X-Forwarded-Host: an absolute-form target's (RFC 9112
    section 3.2.2: the Host line is then ignored), else its Host line's. BadRequest for more
    than one Host line (section 3.2: the replica would hear of one while a proxy in front of
    the balancer may have routed, cached or authorized by the other), and for an HTTP/1.1
    request with none (section 3.2 again; nginx answers it so too)."""
    if hosts is not None and len(hosts) > 1:
        raise BadRequest("more than one Host header")
    if hosts is None and http11:
        raise BadRequest("an HTTP/1.1 request without a Host header")
    return target_authority(target) or (hosts[0] if hosts else None)


def target_authority(target: bytes) -> bytes | None:
    """The host (and port) an absolute-form target names, as a Host value; None for any
    other form or an unparsable one."""
    if target[:1] == b"/" or target == b"*":
        return None
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        return None
    host = url.host
    if not host:
        return None
    if b":" in host:
        host = b"[%b]" % host  # an IPv6 literal, bracketed again as in a Host value
    return host if url.port is None else b"%b:%d" % (host, url.port)


def content_length(value: bytes) -> int:
    """A Content-Length value llhttp accepted, as a number. ``int()`` alone is not enough: the
    grammar is 1*DIGIT, so llhttp reads a zero-padded ``000...02`` as 2 however long it is,
    while CPython refuses to convert more than 4300 digits (a ValueError, which would turn a
    valid message into an internal error)."""
    return int(value.lstrip(b"0") or b"0")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class ChunkedDecoder:
    """Incremental decoder of a chunked body (RFC 9112 section 7.1); trailers are dropped.

    :meth:`feed` returns the data pieces, how many input bytes belong to the body, and whether
    the body ended; it raises :class:`BadRequest` on broken framing.
    """

    __slots__ = ("_left", "_line", "_state")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self) -> None:
        self._state = self._SIZE
        self._left = 0
        self._line = b""

    def feed(self, data: bytes) -> tuple[list[bytes], int, bool]:
        pieces: list[bytes] = []
        pos = 0
        n = len(data)
        while pos < n:
            state = self._state
            if state == self._DATA:
                take = min(self._left, n - pos)
                pieces.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = self._DATA_END
                continue
            eol = data.find(b"\n", pos)
            if eol < 0:
                self._line += data[pos:]
                if len(self._line) > _MAX_CHUNK_LINE:
                    raise BadRequest("chunk line too long")
                return pieces, n, False
            line = self._line + data[pos : eol + 1]
            self._line = b""
            pos = eol + 1
            if not line.endswith(b"\r\n"):
                raise BadRequest("chunked framing: bare LF")
            line = line[:-2]
            if state == self._DATA_END:
                if line:
                    raise BadRequest("chunked framing: no CRLF after chunk data")
                self._state = self._SIZE
            elif state == self._SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 15 or not _HEX.issuperset(size):
                    raise BadRequest(f"invalid chunk size {line[:40]!r}")
                self._left = int(size, 16)
                self._state = self._DATA if self._left else self._TRAILER
            elif not line:  # trailer section over: the body ended
                return pieces, pos, True
        return pieces, n, False


def error_response(
    status: int,
    message: str,
    service: str,
    *,
    close: bool,
    version: bytes = b"HTTP/1.1",
    extra: bytes = b"",
) -> bytes:
    """A JSON error generated by the balancer itself: ``{"error": ..., "service": ...}``."""
    body = json.dumps({"error": message, "service": service}).encode()
    return b"".join(
        (
            b"%b %d %b\r\n" % (version, status, _REASONS.get(status, b"Error")),
            b"Content-Type: application/json; charset=utf-8\r\n",
            b"Content-Length: %d\r\n" % len(body),
            b"Connection: close\r\n" if close else b"",
            extra,
            b"\r\n",
            body,
        )
    )
