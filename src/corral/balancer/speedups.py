"""Which build of the fast path's byte work runs: compiled (``_speedups``) or pure Python.

Why: per request, the balancer's own user-space time is CPython running the fast path; the
largest piece of it that touches bytes only (no connection or balancer state) is the split of a
request under a remembered lead (:mod:`corral.balancer.lead`: a dozen bytes searches, slices
and a regex). ``_speedups.pyx`` does that in C, in one call; ``setup.py`` builds it with Cython
at install (optional: a machine without a compiler installs and runs the pure build). Measured
choice: Cython compiling ``fast.py`` whole ran *slower* than CPython 3.11 (its generic attribute
and method lookups against the interpreter's specialized ones; docs/benchmarks.md), so only
the bytes work is compiled and the state handling stays Python. The one exception is a live
stream's end of batch (``StreamBatch``, :mod:`corral.balancer.relay`): a handful of steps run once
per streamed event, where a Python call costs more than the work; it touches the exchange's
state through a few attributes only, and ``ResponseRelay.on_upstream_data_done`` is its twin.

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
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from corral.balancer import lead
from corral.balancer.headers import REQUEST_DROP

__all__ = ["ACCELERATED", "PURE_ENV", "StreamBatch", "lead_split", "source_digest", "state"]

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
        "compiled (Cython): the request split under a remembered lead, a live stream's batches"
    )


_module, _reason = _compiled()
ACCELERATED: Final = "pure" if _module is None else "compiled"
lead_split = lead.lead_split
# A live stream's end of batch (see the module docstring); None: the relay's method does it.
StreamBatch: Any = None
if _module is not None:
    lead_split = _module.lead_split
    StreamBatch = _module.StreamBatch


def state() -> dict[str, str]:
    """``{"accelerated": "compiled"|"pure", "reason": ...}``, for a worker's reports."""
    return {"accelerated": ACCELERATED, "reason": _reason}
