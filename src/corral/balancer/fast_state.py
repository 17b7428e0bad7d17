"""The balancer's state that the compiled fast path reads and writes, as slots.

Why slots: the compiled twins of :mod:`corral.balancer.fast` (``_speedups.pyx``, chosen by
:mod:`corral.balancer.speedups`) read the state of a request's client connection, replica
connection, target and balancer on every request. Through Python's generic attribute lookup
that cost more than the interpreter's own specialised access, and compiling ``fast.py`` whole
made it slower (docs/benchmarks.md). A slot sits at a fixed offset in its object, which the
compiled code takes from the slot's descriptor once, at wiring, and then reads like a C struct
field; Python code reads a slot as fast as an instance attribute. So the classes declare the
fields the fast path touches as slots and keep the rest in their ``__dict__``.

:class:`BalancerSlots` is the balancer's share, a base of
:class:`~corral.balancer.proxy.LoadBalancer` kept here so that the modules below the proxy can
name the type the compiled code checks; the connections declare theirs in their own classes.
The shapes of what the fast path keeps in those fields (one tuple each, not objects) are here
too. Imports nothing at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.balancer.upstream import UpstreamConnection

__all__ = ["BalancerSlots", "Blocks", "FastState", "Lead", "Memo"]

# (replica connection, replica id, t0, method, origin-form target, client is HTTP/1.1, keep the
#  client connection alive, kept header block, X-Forwarded-For line, X-Forwarded-Host line or
#  b"", Content-Length body or None): one tuple, not an object, per request.
FastState = tuple[
    "UpstreamConnection",
    int,
    float,
    bytes,
    bytes,
    bool,
    bool,
    bytes,
    bytes,
    bytes,
    "bytes | None",
]
# A client connection's last fast request: its bytes (head only, no body), method, origin-form
# target, HTTP/1.1, kept header block, X-Forwarded-Host line (b"": no Host), Connection token.
Memo = tuple[bytes, bytes, bytes, bool, bytes, bytes, "bytes | None"]
# A client connection's last header block with no header but Host to drop: the block, what is
# kept of it, its X-Forwarded-Host line.
Blocks = tuple[bytes, bytes, bytes]
# What a client connection's last HTTP/1.1 request with no header to drop but Host,
# ``Connection: keep-alive`` (which an HTTP/1.1 request means anyway) and Content-Length shares
# with the next ones from a client that varies other headers (a request or trace id, a cookie),
# its request line or its body: its request line (CRLF included), method, origin-form target,
# its Host line and its Connection line (each with the CRLF before and after it) or None, how it
# spells ``\r\nContent-Length:`` (as written, if it had one), its X-Forwarded-Host line.
Lead = tuple[bytes, bytes, bytes, "bytes | None", "bytes | None", bytes, bytes]


class BalancerSlots:
    """The balancer fields the fast path reads per request; each is set by the class (or mixin)
    that owns it, as before: only where the value lives changes."""

    __slots__ = (
        "_board",
        "_codes",
        "_drained",
        "_ejected",
        "_first_byte_timeout",
        "_gated",
        "_header_timeout",
        "_held",
        "_in_flight",
        "_latency",
        "_latency_sum",
        "_max_body",
        "_max_buffered_body",
        "_max_header_bytes",
        "_policy",
        "_pool",
        "_proto_line",
        "_ready",
        "_ready_ids",
        "_requests",
        "_served",
        "_stopping",
        "_streaming",
        "_timestamps",
    )
