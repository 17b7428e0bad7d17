"""Hands the fast path's compiled build the classes it runs on, and installs its entries.

Why a module of its own: the compiled twins in ``_speedups`` (chosen by
:mod:`corral.balancer.speedups`) read the state of the client and replica connections, their
target, the balancer and its pool at the offsets of those classes' slots
(:mod:`corral.balancer.fast_state`), so they can only be wired once every one of those classes
exists; this is the one module above them all but the proxy, and the package imports it right
after the proxy, before anything can serve a request. On the pure build the entries it installs
are the methods and functions as written.

Installed: ``ClientConnection.fast_request`` and ``fast_response``, the fast path's request and
answer, which the connections' ``data_received`` call. :data:`FAST_PATH_WIRING` keeps the pure
functions, the fallbacks, for a later wiring (the tests').
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from corral.balancer import fast, speedups
from corral.balancer.client import ClientConnection
from corral.balancer.exchange import DL_FIRST_BYTE, DL_HEAD, IDEMPOTENT, NONIDEMPOTENT_MAX_IDLE
from corral.balancer.fast_state import BalancerSlots
from corral.balancer.metrics import LATENCY_BUCKETS
from corral.balancer.pool import Pool
from corral.balancer.upstream import Target, UpstreamConnection

__all__ = ["FAST_PATH_WIRING"]

Wiring = tuple[dict[str, type], dict[str, Callable[..., bool]], dict[str, Any]]

FAST_PATH_WIRING: Final[Wiring] = (
    {
        "client": ClientConnection,
        "upstream": UpstreamConnection,
        "target": Target,
        "balancer": BalancerSlots,
        "pool": Pool,
    },
    {
        "try_request": fast.try_request,
        "_send": fast._send,
        "try_response": fast.try_response,
        "start_exchange": fast.start_exchange,
    },
    {
        "LATENCY_BUCKETS": LATENCY_BUCKETS,
        "DL_HEAD": DL_HEAD,
        "DL_FIRST_BYTE": DL_FIRST_BYTE,
        "IDEMPOTENT": IDEMPOTENT,
        "NONIDEMPOTENT_MAX_IDLE": NONIDEMPOTENT_MAX_IDLE,
    },
)

ClientConnection.fast_request, ClientConnection.fast_response = speedups.wire_fast_path(
    *FAST_PATH_WIRING
)
