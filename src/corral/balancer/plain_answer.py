"""Whether a replica's answer is one the fast path relays whole, as it came.

Why a module of its own: the fast path (:mod:`corral.balancer.fast`) takes an answer only when
it is a plain HTTP/1.1 answer whose body is all in the bytes at hand, and anything else goes to
the general path. This is the check, and what it remembers per replica of the heads it turned
down: a stream's head (chunked, no Content-Length) is the same each time but for a Date, and
the general path takes it every time, so turning it down again needs no parse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import httptools

from corral.balancer.headers import HOP_RE, drop_keep_alive

if TYPE_CHECKING:
    from corral.balancer.upstream import UpstreamConnection

__all__ = ["REMEMBER_MAX", "Checked", "check_head", "turned_down"]

# Status, Content-Length and the head rewritten (None: as it came).
Checked = tuple[int, int, "bytes | None"]
# Heads up to this size are remembered (longer ones are parsed each time).
REMEMBER_MAX: Final = 2048
_LENGTH: Final = b"\r\ncontent-length:"
_CRLF: Final = b"\r\n"


def turned_down(conn: UpstreamConnection, data: bytes) -> bool:
    """``data`` starts with a head this replica sent last time and ``check_head`` turned down
    for the head alone (its verdict would be the same)."""
    head = conn.target.turned_down
    return head is not None and data.startswith(head)


def check_head(conn: UpstreamConnection, data: bytes, end: int) -> Checked | None:
    """Status, Content-Length and rewritten head (None: unchanged) of a whole plain response
    (``data`` holds it whole when the length matches); None when the general path must
    handle it. A head turned down for what it says (not for a body still to come) is
    remembered on the replica (``turned_down``)."""
    if data[:9] != b"HTTP/1.1 ":
        return _turn_down(conn, data, end)
    status = data[9:12]
    if status[:1] not in b"23456789" or status in (b"204", b"304"):
        return _turn_down(conn, data, end)  # 1xx, 204, 304: the general path's framing
    low = data[: end + 2].lower()  # same offsets as data
    head = None
    if HOP_RE.search(low) is not None:  # the common case has none
        head = drop_keep_alive(data, low)
        if head is None:
            return _turn_down(conn, data, end)  # chunked, an upgrade, a named header ...
    i = low.find(_LENGTH)
    if i < 0:
        return _turn_down(conn, data, end)
    try:
        length = int(low[i + 17 : low.find(_CRLF, i + 17)])
    except ValueError:
        return _turn_down(conn, data, end)
    if len(data) != end + 4 + length:
        return None  # not fed: the parser must see whole messages only
    try:
        conn.check.feed_data(data)  # same checks as the general path's parser
    except httptools.HttpParserError:
        conn.check = httptools.HttpResponseParser(None)
        return None  # the general path reports it (its parser sees the same error)
    return int(status), length, head


def _turn_down(conn: UpstreamConnection, data: bytes, end: int) -> Checked | None:
    """None, with the head remembered as one the fast path does not take."""
    if end + 4 <= REMEMBER_MAX:
        conn.target.turned_down = data[: end + 4]
    return None
