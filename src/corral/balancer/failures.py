"""What an attempt on a replica can end with before the client got anything.

A :class:`Failure` carries the status the client would get, the metrics reason, and the two
facts the retry loop needs: may the request go to another replica (``retryable``: nothing of it
can have taken effect, or it is idempotent), and does the attempt count against
``max_attempts`` (a refused connection does not: the request provably reached no replica; nor
does an idempotent request whose pooled connection broke before any answer).
"""

from __future__ import annotations

import errno
from typing import Final

__all__ = ["CLIENT_FAULTS", "Failure", "describe", "refused"]

# Failures that are the client's doing: they do not count against the replica.
CLIENT_FAULTS: Final = frozenset(
    {"body_too_large", "bad_request", "client_timeout", "client_stalled"}
)


class Failure:
    """An attempt that ended before any response was sent to the client."""

    __slots__ = ("connect", "free", "message", "reason", "refused", "retryable", "status")

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        *,
        retryable: bool,
        refused: bool = False,
        connect: bool = False,
        free: bool = False,
    ) -> None:
        self.status = status
        self.message = message
        self.reason = reason  # a metrics.ERROR_REASONS key
        self.retryable = retryable
        self.refused = refused  # nothing listens: does not count against max_attempts
        self.connect = connect  # failed to connect: the replica is passed over a while
        # An idempotent request on a pooled connection that broke before any answer (a replica
        # killed, or closing an idle connection): immediate, so it costs the client nothing
        # and does not count either; several replicas killed at once otherwise used up every
        # attempt on dead ones while a live one was ready (tests/chaos/test_balancer_churn.py).
        self.free = free


def refused(exc: BaseException) -> bool:
    """The replica's host answered "nothing listens here" (ECONNREFUSED): the request reached
    no app, and the answer came at once. An unreachable host or a failed DNS lookup can take
    seconds each, so those still count against the attempts."""
    return isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED


def describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
