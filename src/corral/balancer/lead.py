"""A request under a remembered lead, split without llhttp: the fast path's commonest step.

Why a module of its own: this is the byte work of nearly every request a keep-alive client
sends (:data:`corral.balancer.fast.Lead`: a connection's remembered request line and Host line),
a dozen bytes searches, slices and a regex in Python. ``_speedups.pyx`` does the same in one C
call (``setup.py`` builds it; :mod:`corral.balancer.speedups` picks it at import), and this is
its pure-Python twin: the behaviour both must have, and the build that runs without a compiler
or with ``CORRAL_BALANCER_PURE=1``. tests/test_balancer_fastpath.py runs under either (and
tests/test_balancer_speedups.py holds the two to the same answers byte for byte).
"""

from __future__ import annotations

import re
from typing import Final

from corral.balancer.headers import PASS_LINES_RE, short_length

__all__ = ["METHODS", "REQUEST_LINE_RE", "Split", "lead_split"]

METHODS: Final = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"})
# An HTTP/1.1 request line the fast path may pass on without llhttp's word on it: one of those
# methods, an origin-form target of visible ASCII (llhttp accepts each such byte anywhere in a
# path, query or fragment; it refuses controls, space, DEL and bytes above 0x7e in some places),
# the version. Anything else goes to the full parse; tests/test_balancer_fastpath.py holds the
# two to the same verdicts.
REQUEST_LINE_RE: Final = re.compile(
    rb"(" + b"|".join(sorted(METHODS)) + rb") (/[!-~]*) HTTP/1\.1\r\n"
)
# method, origin-form target, the header lines kept (each with the CRLF before it, then the
# block's last CRLF), the Content-Length body or None
Split = tuple[bytes, bytes, bytes, "bytes | None"]

_COUNT_HEADERS_ABOVE: Final = 500
_MAX_HEADERS: Final = 128
_CRLF: Final = b"\r\n"
_STRIP: Final = b" \t"


def lead_split(
    data: bytes,
    lead: tuple[bytes, bytes, bytes, bytes | None, bytes | None, bytes, bytes],
    max_header_bytes: int,
    max_buffered_body: int,
    max_body: int | None,
) -> Split | None:
    """``data`` (one read) as a whole request under ``lead`` (``fast.Lead``): its method,
    target, kept header lines and body; None when the full parse must judge it. What passes:
    the remembered request line (or one meeting :data:`REQUEST_LINE_RE`) and Host line, a
    remembered Connection line (dropped), a Content-Length line of digits framing exactly the
    bytes after the head (within the body limits), other lines meeting ``PASS_LINES_RE``
    (which refuses every header the balancer acts on, a second Host included)."""
    request_line, method, target, host_line, conn_line, length_name, _ = lead
    if data.startswith(request_line):
        at = len(request_line) - 2  # the header block starts with the request line's CRLF
    elif (m := REQUEST_LINE_RE.match(data)) is not None:
        method, target = m.group(1, 2)  # a client that varies its path
        at = m.end() - 2
    else:
        return None
    end = data.find(b"\r\n\r\n", at)
    if (
        end < 0
        or end + 4 > max_header_bytes
        or (end > _COUNT_HEADERS_ABOVE and data.count(_CRLF, 0, end) > _MAX_HEADERS)
    ):
        return None
    block = data[at : end + 2]
    if host_line is None:
        kept = block
    elif (i := block.find(host_line)) >= 0:
        kept = block[:i] + block[i + len(host_line) - 2 :]
    else:
        return None  # Host is not the remembered one
    if conn_line is not None and (i := kept.find(conn_line)) >= 0:
        # dropped as the full parse drops it (a missing one means the same in HTTP/1.1; a
        # second one, or any other Connection line, is refused below)
        kept = kept[:i] + kept[i + len(conn_line) - 2 :]
    body = None
    if end + 4 != len(data):
        # A body (a POST's JSON): taken when the value is digits and the bytes after the head
        # are exactly that many; else the full parse judges it (a Content-Length: 0 too).
        i = kept.find(length_name)
        if i < 0:
            return None  # pipelined bytes or a body without a length: the general path
        j = kept.find(_CRLF, i + 17)
        size = len(data) - end - 4
        if (
            short_length(kept[i + 17 : j].strip(_STRIP)) != size
            or size > max_buffered_body
            or (max_body is not None and size > max_body)
        ):
            return None
        body = data[end + 4 :]
        kept = kept[:i] + kept[j:]
    if PASS_LINES_RE.fullmatch(kept) is None:
        return None
    return method, target, kept, body
