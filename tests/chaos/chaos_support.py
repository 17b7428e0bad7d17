"""What every chaos test shares: how long to run, which seeds, and where to report.

The default (CI) run is short: a few seeded rounds of each fault, so the suite stays within
minutes. ``CORRAL_CHAOS=long`` (``make chaos``) runs many more rounds and longer load. Rounds
are seeded from ``CORRAL_CHAOS_SEED`` (default 1) so a failing round can be replayed exactly:
the failure message of every test names its seed.

When ``CORRAL_CHAOS_REPORT`` names a file, each test appends one JSON line per fault class:
how many rounds ran and what was lost. docs/reliability.md is written from that file.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

LONG = os.environ.get("CORRAL_CHAOS", "").lower() == "long"
BASE_SEED = int(os.environ.get("CORRAL_CHAOS_SEED", "1"))


def rounds(short: int, long: int) -> int:
    """How many rounds of a fault to run in this mode."""
    return long if LONG else short


def seconds(short: float, long: float) -> float:
    """How long a timed chaos phase (load, churn) lasts in this mode."""
    return long if LONG else short


def rng(test: str, round_no: int = 0) -> random.Random:
    """A generator fixed by the base seed, the test and the round: replays are exact."""
    return random.Random(f"{BASE_SEED}:{test}:{round_no}")


def record(fault: str, *, rounds: int, lost: int, **details: Any) -> None:
    """Append one result line to the chaos report (if one is being written)."""
    path = os.environ.get("CORRAL_CHAOS_REPORT")
    if not path:
        return
    line = {
        "fault": fault,
        "rounds": rounds,
        "lost": lost,
        "mode": "long" if LONG else "short",
        "seed": BASE_SEED,
        "at": time.time(),
        **details,
    }
    # One write of one line with O_APPEND: lines from parallel workers never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
