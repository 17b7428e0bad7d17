"""The balancer's settings that have defaults of their own, and the check of them all.

Kept apart from :mod:`corral.balancer.proxy` so the checks (each a ValueError naming its
setting) read as one list, not as the first screen of the balancer's constructor.

Timeouts, in seconds:

* ``connect_timeout``: to open a connection to a replica. A replica that cannot be
  reached is retried on another one (the request never reached it).
* ``first_byte_timeout``: from the request (body included) being sent to the replica's
  response headers; 504, not retried (the replica may be working on it).
* ``idle_timeout``: longest silence between two chunks of a response once its headers
  are out (the response is then cut, as it cannot become an error any more); also the
  deadline for reading a buffered request body from the client (408).
* ``request_timeout``: the former single timeout, kept as the default of both
  ``first_byte_timeout`` and ``idle_timeout``; 120 s when neither is given.
* ``header_timeout``: a client connection that has not sent a whole request head this
  long after connecting, or after its previous response, is closed (slowloris, or an
  idle keep-alive connection).

``max_attempts`` bounds the attempts that may have reached a replica; refused
connections are not counted, so a request is never failed while an untried ready
replica is left. ``max_header_bytes`` is the longest request line and header field
accepted (431 beyond); ``max_body_bytes`` the largest request body (413 beyond, whether
announced by Content-Length or streamed chunked; None = no limit: bodies above
``max_buffered_body`` are streamed, not held in memory).

``max_connections``: client connections this balancer keeps open at once (None: no
cap); one more is answered 503 and closed at once. Every connection costs a file
descriptor (two while proxied), and a process's descriptors are shared by all the
services it serves: without a cap, one service's idle connections could leave none
for the others.

``reuse_port``: bind with SO_REUSEPORT, so several processes serve one port.
``on_drained(rid)`` is called on the loop when the in-flight count of a replica that
is not in the ready set reaches 0.
"""

from __future__ import annotations

from typing import Final

# The longest request line / header field by default (aiohttp's, so the limit did not change).
DEFAULT_HEADER_BYTES: Final = 8190
# Seconds a client has to send a whole request head (and longest idle keep-alive); above the
# 15 s an aiohttp client keeps a pooled connection, so such a client closes an idle one first.
DEFAULT_HEADER_TIMEOUT: Final = 30.0


def check_settings(
    *,
    max_attempts: int,
    connect_timeout: float,
    first_byte_timeout: float | None,
    idle_timeout: float | None,
    request_timeout: float | None,
    no_replica_wait: float,
    max_buffered_body: int,
    max_body_bytes: int | None,
    max_header_bytes: int,
    header_timeout: float,
    max_connections: int | None,
) -> tuple[float, float]:
    """The first-byte and idle timeouts to use, once every setting was checked (a ValueError
    naming the setting otherwise; what each means is in this module's docstring)."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError("request_timeout must be > 0")
    default_timeout = request_timeout if request_timeout is not None else 120.0
    first_byte = first_byte_timeout if first_byte_timeout is not None else default_timeout
    idle = idle_timeout if idle_timeout is not None else default_timeout
    if connect_timeout <= 0 or first_byte <= 0 or idle <= 0:
        raise ValueError("connect_timeout, first_byte_timeout and idle_timeout must be > 0")
    if no_replica_wait < 0:
        raise ValueError("no_replica_wait must be >= 0")
    if max_buffered_body < 0:
        raise ValueError("max_buffered_body must be >= 0")
    if max_body_bytes is not None and max_body_bytes < 0:
        raise ValueError("max_body_bytes must be >= 0 or None")
    if max_header_bytes < 256:
        raise ValueError("max_header_bytes must be >= 256")
    if header_timeout <= 0:
        raise ValueError("header_timeout must be > 0")
    if max_connections is not None and max_connections < 1:
        raise ValueError("max_connections must be >= 1 or None")
    return first_byte, idle


def head_limit(max_header_bytes: int) -> int:
    """The longest whole request head: every line may be long, but not all of them."""
    return max(64 * 1024, 2 * max_header_bytes)


def ticks(header_timeout: float, first_byte: float, idle: float) -> tuple[float, float]:
    """How late a deadline may fire (a fraction of the shortest timeout), and the longest the
    ticker may sleep while clients are connected: a second, or the shortest timeout, so a
    deadline set after a tick (now plus a timeout; a closing client's linger is 2 s) is never
    earlier than the next tick. Between those, the ticker sleeps until the nearest deadline
    (:meth:`corral.balancer.ticker.Ticker._tick`)."""
    timeouts = min(header_timeout, first_byte, idle)
    return max(0.01, min(0.1, timeouts / 4)), min(1.0, timeouts)
