"""Which balancer relays its long live streams through a stream pump, and the pump's end.

Why a pump: on uvloop each batch of a live stream costs a loop wake-up, a bytes object, a
protocol call and a transport write, about 1.8 us of user time per event against nginx's 1.0,
whatever the protocol does with it (docs/benchmarks.md). The compiled build's ``Pump``
(``_speedups.pyx``, "stream pump") takes a stream once it has relayed a few batches on the loop
and relays the rest with no Python at all: an epoll set of its own, which the loop watches as
one reader, then read, check the chunk framing, send. Whatever is not plain chunk data that the
client takes at once (the answer's end, an extension, a slow client, the replica's end) goes
back to the loop before it is relayed, and runs there as it always did, so the stream's end,
flow control and failures keep their one code path. It runs on the loop's thread: no lock, no
second thread to wake.

Not on the pure build, not for a balancer that speaks TLS to its clients (the pump writes to
the socket), not for a replica behind TLS (``UpstreamConnection.go_raw`` checks), and not
with ``CORRAL_BALANCER_PUMP=0`` (a way to compare, or to rule it out).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Final

from corral.balancer.speedups import Pump

__all__ = ["PUMP_ENV", "close_stream_pump", "stream_pump"]

PUMP_ENV: Final = "CORRAL_BALANCER_PUMP"
_ENABLED: Final = os.environ.get(PUMP_ENV, "1") not in ("0", "")


def stream_pump(lb: Any) -> Any:
    """``lb``'s pump, made on its first long stream; None where streams stay on the loop."""
    pump = getattr(lb, "_stream_pump", None)
    if pump is None and Pump is not None and _ENABLED:
        if lb._ssl_context is not None or lb._stopping:
            return None
        try:
            pump = Pump(asyncio.get_running_loop())
        except (RuntimeError, OSError):  # driven with no loop running (tests); out of fds
            return None
        lb._stream_pump = pump
    return pump


def close_stream_pump(lb: Any) -> None:
    """Close ``lb``'s pump, if it has one (the balancer stops; its clients are gone)."""
    pump = getattr(lb, "_stream_pump", None)
    if pump is not None:
        lb._stream_pump = None
        pump.close()
