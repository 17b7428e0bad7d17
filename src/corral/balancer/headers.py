"""Header rewriting between client, balancer and replica.

Hop-by-hop headers describe one TCP connection (RFC 9110 section 7.6.1), so they must not cross
the proxy: forwarding ``Connection: close`` or ``Transfer-Encoding: chunked`` from one side to the
other would make the other connection lie about its own framing. Everything else passes through
unchanged, including repeated headers such as ``Set-Cookie``, which is why these functions work on
multidicts and keep every value.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["HOP_BY_HOP", "request_headers", "response_headers"]

HOP_BY_HOP: frozenset[str] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",  # not standard, but sent by old clients and means the same
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Request headers the balancer drops on top of the hop-by-hop ones:
# - host: the client's Host names the balancer; the replica gets its own (aiohttp sets it from
#   the upstream URL), and the original goes into X-Forwarded-Host.
# - expect: the balancer has already answered "100 Continue" and holds the body.
# - x-forwarded-proto / x-forwarded-host: always set by the balancer from what it saw, so a
#   client cannot claim the request came over https.
_REQUEST_DROP: frozenset[str] = HOP_BY_HOP | {
    "host",
    "expect",
    "x-forwarded-proto",
    "x-forwarded-host",
}


def _connection_tokens(values: Iterable[str]) -> frozenset[str]:
    """Header names listed in Connection values; those are hop-by-hop too."""
    tokens: set[str] = set()
    for value in values:
        for token in value.split(","):
            token = token.strip().lower()
            if token:
                tokens.add(token)
    return frozenset(tokens)


def request_headers(
    incoming: CIMultiDictProxy[str],
    *,
    peer: str | None,
    scheme: str,
    keep_content_length: bool,
) -> CIMultiDict[str]:
    """Headers to send to the replica for a client request.

    ``keep_content_length`` is True when the body is streamed: the replica should see the
    client's length instead of a chunked body. For a buffered body aiohttp computes the length
    from the bytes, so the client's value is dropped to avoid sending it twice.
    """
    named = _connection_tokens(incoming.getall("Connection", ()))
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        lower = key.lower()
        if lower in _REQUEST_DROP or lower in named:
            continue
        if lower == "content-length" and not keep_content_length:
            continue
        if lower == "x-forwarded-for":
            continue  # rebuilt below, appending this hop
        out.add(key, value)
    previous = ", ".join(incoming.getall("X-Forwarded-For", ()))
    if peer:
        out["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    elif previous:
        out["X-Forwarded-For"] = previous
    out["X-Forwarded-Proto"] = scheme
    host = incoming.get("Host")
    if host:
        out["X-Forwarded-Host"] = host
    return out


def response_headers(incoming: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Headers to send back to the client for a replica response.

    Content-Length is kept: with auto-decompression off the bytes pass through unchanged, so the
    replica's length is still right, and keeping it spares the client chunked framing.
    """
    named = _connection_tokens(incoming.getall("Connection", ()))
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in named:
            continue
        out.add(key, value)
    return out
