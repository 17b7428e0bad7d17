"""Header rewriting between client, balancer and replica, on whole header blocks.

Hop-by-hop headers describe one TCP connection (RFC 9110 section 7.6.1), so they must not cross
the proxy: forwarding ``Connection: close`` or ``Transfer-Encoding: chunked`` from one side to the
other would make the other connection lie about its own framing. Everything else passes through
unchanged, in order, repeated headers (``Set-Cookie``) included.

Why byte strings instead of a header list: parsing one callback per header costs ~0.23 us per
header in Python (nginx: ~0.11 us), and building the outgoing block again costs as much. A
header block is kept as the raw bytes the peer sent (validated by httptools first), and one
regex scan of its lower-cased copy finds the few lines the proxy must look at or drop (a
case-insensitive pattern costs 3-5x more than ``bytes.lower`` plus a case-sensitive one);
everything between them is sliced through untouched. A typical response (no hop-by-hop
header) leaves the scan with its block unchanged and not copied.

A block here is the bytes between the start line and the blank line, *with* the CRLF in front of
every header line and the CRLF after the last one: ``b"\\r\\nA: 1\\r\\nB: 2\\r\\n"`` (``b"\\r\\n"``
when there is no header). Each line then starts with ``\\r\\n``, so a name is matched only at the
start of a line, and a dropped line is the span from its ``\\r\\n`` to the next one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Final

__all__ = [
    "HOP_BY_HOP",
    "HOP_RE",
    "PASS_LINES_RE",
    "REQUEST_DROP",
    "REQUEST_OTHER_RE",
    "REQUEST_RE",
    "RESPONSE_RE",
    "CommonScan",
    "Found",
    "coding_refusal",
    "connection_tokens",
    "drop_keep_alive",
    "forwarded",
    "forwarded_host",
    "header_line",
    "only_chunked",
    "scan_common_request",
    "scan_request",
    "scan_response",
    "short_length",
]

HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",  # not standard, but sent by old clients and means the same
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Request headers the balancer drops on top of the hop-by-hop ones:
# - host: the client's Host names the balancer; the replica gets its own, and the original goes
#   into X-Forwarded-Host.
# - expect: the balancer answers "100 Continue" itself.
# - x-forwarded-proto / x-forwarded-host: always set by the balancer from what it saw, so a
#   client cannot claim the request came over https; x-forwarded-for is rebuilt, appending
#   this hop.
# - content-length: the balancer frames the body it sends itself (length of a buffered body).
_REQUEST_DROP: Final = HOP_BY_HOP | {
    b"host",
    b"expect",
    b"x-forwarded-for",
    b"x-forwarded-proto",
    b"x-forwarded-host",
    b"content-length",
}
# The same, for the compiled fast path (corral.balancer.speedups), whose grammar refuses them.
REQUEST_DROP: Final = frozenset(_REQUEST_DROP)
# Response headers looked at but kept: the replica's length stays right (bytes pass unchanged).
_RESPONSE_KEEP: Final = frozenset({b"content-length"})

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9a-z-]+")


def _pattern(names: Iterable[bytes]) -> re.Pattern[bytes]:
    """A pattern of header lines by (lower-case) name, matched against a lower-cased block.

    The names are laid out as a trie (``c(?:onnection|ontent-length)|...``): re tries the
    alternatives of a group one by one at every line start, so a flat list of 14 names costs
    14 tries per header line where the trie costs one or two. Every request on the fast path
    runs one of these searches.
    """
    return re.compile(rb"\r\n(" + _trie(set(names)) + rb"):")


def _trie(names: set[bytes]) -> bytes:
    """An alternation matching exactly ``names``, grouped by their first byte."""
    groups: dict[bytes, set[bytes]] = {}
    for name in names:
        groups.setdefault(name[:1], set()).add(name[1:])
    parts = []
    for first in sorted(groups):
        rests = groups[first]
        optional = b"" in rests
        rests.discard(b"")
        if not rests:
            parts.append(re.escape(first))
        elif len(rests) == 1 and not optional:
            parts.append(re.escape(first + rests.pop()))
        else:
            shared = b"" if optional else _common_prefix(rests)
            inner = _trie({rest[len(shared) :] for rest in rests})
            parts.append(re.escape(first + shared) + b"(?:" + inner + (b")?" if optional else b")"))
    return b"|".join(parts)


def _common_prefix(names: set[bytes]) -> bytes:
    """What all ``names`` start with: what the first and last of them in order share."""
    first, last = min(names), max(names)
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


REQUEST_RE: Final = _pattern(_REQUEST_DROP)
RESPONSE_RE: Final = _pattern(HOP_BY_HOP | _RESPONSE_KEEP)
# For the fast path's first look: a request with none of these has at most a Host line to drop
# (found with bytes.find); a response without hop-by-hop headers passes unchanged.
REQUEST_OTHER_RE: Final = _pattern(_REQUEST_DROP - {b"host"})
HOP_RE: Final = _pattern(HOP_BY_HOP)
# Header lines the fast path may pass on as they are without llhttp's word on them, all of a
# block (each line with the CRLF before it, then the block's last CRLF): a token name (RFC 9110
# 5.1), a colon, a value of visible bytes, spaces and tabs (5.5: no control byte, no lone CR or
# LF), and none of them a header the balancer acts on. What this refuses (obs-fold, a space
# before the colon, a bare LF, a control byte, a name to act on) goes to the full parse, where
# llhttp judges it; tests/test_balancer_fastpath.py holds the two to the same verdicts.
PASS_LINES_RE: Final = re.compile(
    rb"(?:\r\n(?!(?i:" + _trie(set(_REQUEST_DROP)) + rb"):)"
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*)*\r\n"
)
_RESPONSE_NAMED: Final = HOP_BY_HOP | _RESPONSE_KEEP
_CRLF: Final = b"\r\n"
_STRIP: Final = b" \t"
# What a request head says that the fast path acts on: kept block, Host, Content-Length (-1:
# none), Connection token, X-Forwarded-For.
CommonScan = tuple[bytes, "bytes | None", int, "bytes | None", "bytes | None"]


@functools.lru_cache(maxsize=64)
def _named_pattern(names: frozenset[bytes]) -> re.Pattern[bytes]:
    return _pattern(names)


Found = dict[bytes, list[bytes]]


def _scan(
    block: bytes, pattern: re.Pattern[bytes], keep: frozenset[bytes] = frozenset()
) -> tuple[bytes, Found]:
    """Cut the lines whose name ``pattern`` matches (except names in ``keep``) out of
    ``block``; return the rest and the values seen, by lower-case name, in order.

    A loop of ``search`` calls rather than ``finditer``: ~0.3 us per match instead of ~1 us for
    the iterator, on the hot path of every request and response.
    """
    low = block.lower()  # same offsets as block
    search = pattern.search
    m = search(low)
    if m is None:
        return block, {}
    found: Found = {}
    parts: list[bytes] = []
    pos = 0
    while m is not None:
        end = low.find(b"\r\n", m.end())
        if end < 0:  # a last line without its CRLF (callers pass one; never loop on it)
            end = len(low)
        name = m.group(1)
        value = block[m.end() : end].strip(b" \t")
        values = found.get(name)
        if values is None:
            found[name] = [value]
        else:
            values.append(value)
        if name not in keep:
            parts.append(block[pos : m.start()])
            pos = end
        m = search(low, end)
    if not parts:
        return block, found
    parts.append(block[pos:])
    return b"".join(parts), found


def connection_tokens(values: Iterable[bytes] | None) -> frozenset[bytes]:
    """Lower-case tokens listed in Connection header values."""
    if not values:
        return frozenset()
    tokens: set[bytes] = set()
    for value in values:
        for token in value.split(b","):
            token = token.strip().lower()
            if token:
                tokens.add(token)
    return frozenset(tokens)


_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close", b"upgrade"})


def _drop_named(block: bytes, values: list[bytes], already: frozenset[bytes]) -> bytes:
    """Drop the headers a Connection header names (hop-by-hop by declaration)."""
    if len(values) == 1 and values[0].lower() in _PLAIN_CONNECTION:
        return block  # the common case: nothing named
    tokens = connection_tokens(values)
    extra = frozenset(t for t in tokens if t not in already and _TOKEN.fullmatch(t))
    extra -= {b"close"}
    if not extra:
        return block
    return _scan(block, _named_pattern(extra))[0]


def coding_refusal(values: list[bytes], http11: bool) -> tuple[int, str] | None:
    """Why a request's Transfer-Encoding (its header lines' values) is refused: (status,
    detail), or None to carry the body. Both as nginx answers them:

    * on an HTTP/1.0 request, 400: its framing is faulty (RFC 9112 section 6.1, "MUST ...
      close the connection"). HTTP/1.0 has no transfer codings, so a proxy in front of the
      balancer may have framed the body otherwise (by its Content-Length, or as none) and
      sent on as this body what the balancer would take for a second request;
    * a coding other than chunked alone, 501: the chunks come off here and the header is
      dropped, so the replica would get the body still gzip'd (say) with nothing saying so.
    """
    if not http11:
        return 400, "an HTTP/1.0 request with Transfer-Encoding"
    if not only_chunked(values):
        return 501, "a transfer coding other than chunked is not supported"
    return None


def only_chunked(values: list[bytes]) -> bool:
    """A Transfer-Encoding (its header lines' values) that is ``chunked`` alone, the one
    coding the balancer carries (it takes the framing off and puts its own back)."""
    codings = [c.strip().lower() for value in values for c in value.split(b",") if c.strip()]
    return codings == [b"chunked"]


def scan_request(block: bytes) -> tuple[bytes, Found]:
    """The client's header block minus everything the replica must not get, and the values of
    the dropped headers (Host, Connection, Content-Length, Transfer-Encoding, X-Forwarded-For,
    Expect, Upgrade ...) for the balancer to act on."""
    kept, found = _scan(block, REQUEST_RE)
    tokens = found.get(b"connection")
    if tokens is not None:
        kept = _drop_named(kept, tokens, _REQUEST_DROP)
    return kept, found


def scan_response(block: bytes) -> tuple[bytes, Found]:
    """The replica's header block minus hop-by-hop headers (Content-Length kept), and the
    values seen of those and of Content-Length."""
    kept, found = _scan(block, RESPONSE_RE, _RESPONSE_KEEP)
    tokens = found.get(b"connection")
    if tokens is not None:
        kept = _drop_named(kept, tokens, _RESPONSE_NAMED)
    return kept, found


def forwarded(kept: bytes, xff_line: bytes, proto_line: bytes, host_line: bytes) -> bytes:
    """The header block sent to a replica after its Host line: what the client sent minus the
    dropped lines, then X-Forwarded-For (``xff_line``, this hop appended), X-Forwarded-Proto,
    and X-Forwarded-Host (``host_line``, from :func:`forwarded_host`)."""
    return b"".join((kept, xff_line, proto_line, host_line))


def forwarded_host(host: bytes | None) -> bytes:
    """The X-Forwarded-Host line for the client's Host value; empty when it sent none. The fast
    path keeps it with what it remembers of a request, so it is made once, not per request."""
    return b"" if host is None else b"X-Forwarded-Host: %b\r\n" % host


def header_line(block: bytes, low: bytes, name: bytes) -> bytes:
    """The first header line named ``name`` (``b"\\r\\nname:"``, lower case) in a header block
    that has one, with the CRLF before and after it, as the block spells it."""
    i = low.find(name)
    return block[i : low.find(_CRLF, i + len(name)) + 2]


def short_length(value: bytes) -> int:
    """A Content-Length value (stripped) as the fast path reads it: up to 15 digits; -1 for
    anything else, which the general path judges (a longer, zero-padded value included: it is
    read there by :func:`corral.balancer.http1.content_length`)."""
    return int(value) if value.isdigit() and len(value) <= 15 else -1


def scan_common_request(block: bytes, low: bytes) -> CommonScan | None:
    """For the balancer's fast path (``low`` is ``block`` lower-cased): the header lines to
    drop, when there is more than a Host line; None when one of them needs the general path
    (anything but one Host, one Content-Length, one X-Forwarded-For and ``Connection:
    keep-alive|close``)."""
    host: bytes | None = None
    xff: bytes | None = None
    token: bytes | None = None
    length = -1
    pieces = []
    pos = 0
    search = REQUEST_RE.search
    m = search(low)
    while m is not None:
        name = m.group(1)
        value_end = low.find(_CRLF, m.end())
        value = block[m.end() : value_end].strip(_STRIP)
        if name == b"host" and host is None:
            host = value
        elif name == b"content-length" and length < 0:
            length = short_length(value)
            if length < 0:
                return None
        elif name == b"connection" and token is None:
            token = value.lower()
            if token != b"keep-alive" and token != b"close":
                return None
        elif name == b"x-forwarded-for" and xff is None:
            xff = value
        else:
            return None
        pieces.append(block[pos : m.start()])
        pos = value_end
        m = search(low, value_end)
    pieces.append(block[pos:])
    return b"".join(pieces), host, length, token, xff


def drop_keep_alive(data: bytes, low: bytes) -> bytes | None:
    """For the balancer's fast path: the response head (to its last header line; ``low`` is it
    lower-cased) minus ``Connection: keep-alive`` and Keep-Alive; None if it has another
    hop-by-hop header (the general path's job)."""
    pieces = []
    pos = 0
    m = HOP_RE.search(low)
    while m is not None:
        value_end = low.find(_CRLF, m.end())
        name = m.group(1)
        if name != b"keep-alive" and (
            name != b"connection" or low[m.end() : value_end].strip(_STRIP) != b"keep-alive"
        ):
            return None
        pieces.append(data[pos : m.start()])
        pos = value_end
        m = HOP_RE.search(low, value_end)
    pieces.append(data[pos : len(low)])
    return b"".join(pieces)
