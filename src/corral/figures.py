"""Numbers as a person reads them in a message: three significant digits, never an exponent.

Python's ``:.3g`` turns to an exponent from 1000 up, so a GPU server's 2 TiB read "2.05e+03
GiB" in refusals, warnings and `corral daemon status`, and a fleet's 2,500 tokens/s
"2.5e+03" in autoscaler reasons. One rule for every such figure.
"""

from __future__ import annotations


def figure(value: float) -> str:
    """Three significant digits below 1000 (0.0123, 4.56, 789), whole numbers from there."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def gib(size: float) -> str:
    """A size in bytes as GiB: "1.5 GiB", "2048 GiB"."""
    return f"{figure(size / 1024**3)} GiB"
