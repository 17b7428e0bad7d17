"""Which build of the fast path's byte work runs: compiled (``_speedups``) or pure Python.

Why: per request, the balancer's own user-space time is CPython running the fast path. The
compiled build does in C, in one call each: the split of a request under a remembered lead
(:mod:`corral.balancer.lead`: a dozen bytes searches, slices and a regex), the fast path's common
request and answer (:mod:`corral.balancer.fast`'s ``try_request``, ``_send`` and
``try_response``, for a request whose bytes or lead are remembered and an answer whose head its
replica sent last time; anything else goes to the pure functions before anything is done),
``least_load``'s pick (:func:`corral.balancer.policies.least_loaded`, through :func:`twin`), and
a live stream's end of batch (``StreamBatch``, :mod:`corral.balancer.relay`), and a live
stream of plain chunks relayed as the replica framed them, each batch handled whole in C
(``LiveChunks`` on the replica's transport, ``ChunkScan`` following the framing; its pure twin
is the relay's general live path: httptools de-chunks, each batch is framed again), and a
prompt's chained block hashes for ``prefix_affinity`` (:func:`corral.balancer.prefix.block_hashes`,
through :func:`twin`, the same values) and their record in its index
(:func:`corral.balancer.prefix.insert_blocks`, the same changes in the same order), and the
board of counts the balancer workers share (:class:`corral.balancer.load_board.LoadBoard`,
read and written through a pointer into the map: the same cells). The pure
module stays the reference and the fallback; the tests run on both.

Compiling ``fast.py`` whole, as it was, ran *slower* than CPython 3.11: the compiled code read
the connections' state through Python's generic attribute lookup, where the interpreter's own
access is specialized (docs/benchmarks.md). So the fields the fast path reads are slots
(:mod:`corral.balancer.fast_state`): the compiled code takes their offsets from the classes at
wiring (:func:`wire_fast_path`) and reads them as struct fields, and an object of another class
takes the pure path.

At import the compiled build is taken when:

* it imports (it was built),
* ``CORRAL_BALANCER_PURE`` is unset, empty or ``0`` (``1`` forces the pure build: the tests run
  both, and a suspected compiler difference can be ruled out in production), and
* it was compiled from the very ``_speedups.pyx`` beside it (``SOURCE_SHA256``, stamped by
  ``setup.py``): an edited source whose build was not redone (``pip install -e .`` does it)
  runs pure rather than as stale code.

:func:`state` is the choice (``"compiled"`` or ``"pure"``) and why; a balancer worker reports it
to the daemon (``corral daemon status``). Imports nothing above the balancer.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from corral.balancer import lead
from corral.balancer.headers import REQUEST_DROP

__all__ = [
    "ACCELERATED",
    "PURE_ENV",
    "ChunkScan",
    "LiveChunks",
    "Pump",
    "StreamBatch",
    "lead_split",
    "source_digest",
    "state",
    "twin",
    "wire_fast_path",
]

PURE_ENV: Final = "CORRAL_BALANCER_PURE"
_COMPILED: Final = "corral.balancer._speedups"
_SOURCE: Final = Path(__file__).with_name("_speedups.pyx")


def source_digest(path: Path) -> str:
    """SHA-256 of a source file, as ``setup.py`` stamps it in the compiled module."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compiled() -> tuple[ModuleType | None, str]:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None, f"{PURE_ENV}={os.environ[PURE_ENV]}"
    try:
        module = importlib.import_module(_COMPILED)
    except ImportError:
        return None, "not built (no C compiler or Cython when corral was installed)"
    try:
        current = source_digest(_SOURCE)
    except OSError:
        current = None  # an install without the source: the build is what there is
    if current is not None and getattr(module, "SOURCE_SHA256", None) != current:
        return None, "stale: _speedups.pyx changed since it was built (pip install -e . rebuilds)"
    module.configure(REQUEST_DROP)
    return module, (
        "compiled (Cython): the fast path's request and answer, the request split under a"
        " remembered lead, a live stream's batches, chunks relayed as framed (long streams by an"
        " epoll set of their own), prompt block hashes and their index, the workers' shared counts"
    )


_module, _reason = _compiled()
ACCELERATED: Final = "pure" if _module is None else "compiled"
lead_split = lead.lead_split
# A live stream's end of batch (see the module docstring); None: the relay's method does it.
StreamBatch: Any = None
# A live chunked stream relayed as the replica framed it (corral.balancer.relay, _go_live):
# its framing followed (ChunkScan), and each batch handled in C (LiveChunks). None: httptools
# de-chunks it and StreamBatch (or the relay's method) frames each batch again.
ChunkScan: Any = None
LiveChunks: Any = None
# The epoll set that relays long live streams with no Python per batch (corral.balancer.pump).
Pump: Any = None
if _module is not None:
    lead_split = _module.lead_split
    StreamBatch = _module.StreamBatch
    ChunkScan = _module.ChunkScan
    LiveChunks = _module.LiveChunks
    Pump = _module.Pump


def wire_fast_path(
    classes: dict[str, type], pure: dict[str, Callable[..., bool]], constants: dict[str, Any]
) -> tuple[Callable[..., bool], Callable[..., bool]]:
    """The fast path's two entries to run, ``(try_request, try_response)``: ``pure``'s own, or
    their compiled twins once told where the state lives. ``classes``: the client and replica
    connections, the target, the balancer and the pool (``client``, ``upstream``, ``target``,
    ``balancer``, ``pool``), whose slots the compiled functions read at fixed offsets (objects
    of other classes take the pure functions); ``pure``: ``fast``'s ``try_request``, ``_send``,
    ``try_response`` and ``start_exchange``; ``constants``: see ``_speedups.wire``. Called by
    :mod:`corral.balancer.wiring`, which sees all those classes."""
    if _module is None:
        return pure["try_request"], pure["try_response"]
    _module.wire(classes, pure, constants)
    return _module.try_request, _module.try_response


def twin(name: str) -> Callable[..., Any] | None:
    """The compiled build's function ``name`` (a twin of a pure one the caller holds), or None
    on the pure build."""
    return None if _module is None else getattr(_module, name)


def state() -> dict[str, str]:
    """``{"accelerated": "compiled"|"pure", "reason": ...}``, for a worker's reports."""
    return {"accelerated": ACCELERATED, "reason": _reason}
