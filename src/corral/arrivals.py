"""Request arrival times as runs of (time, count): what the autoscalers read.

Why runs and not one time per request: the balancer workers report their requests counted per
50 ms bucket, and the daemon used to expand those counts back into one float per request for
every decision: at 30k req/s, two million floats and a sorted copy every 5 s (tens of MB, and
time on the event loop, both growing with the traffic). Runs keep one entry per bucket whatever
the rate. A list of times (tests, offline replays) becomes runs once, in ``Arrivals.of``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence


class Arrivals:
    """Arrivals in increasing time, ``times[i]`` having ``count(i, i + 1)`` requests. Indexes
    are of runs, found with :meth:`left` and :meth:`right` as ``bisect`` finds them in a
    sorted list of times."""

    __slots__ = ("_cum", "times")

    def __init__(self, runs: Iterable[tuple[float, int]] = ()) -> None:
        """``runs``: (time, requests), in strictly increasing time; empty runs are left out."""
        times: list[float] = []
        cum = [0]
        for t, n in runs:
            if n <= 0:
                continue
            if times and t <= times[-1]:
                raise ValueError(f"arrival runs out of order: {t} after {times[-1]}")
            times.append(t)
            cum.append(cum[-1] + n)
        self.times = times
        self._cum = cum  # requests before each run, and the total last

    @classmethod
    def of(cls, times: Iterable[float]) -> Arrivals:
        """From one time per request, in any order."""
        return cls(sorted(Counter(times).items()))

    def __len__(self) -> int:
        return self._cum[-1]

    def left(self, t: float) -> int:
        """The first run at ``t`` or later."""
        return bisect.bisect_left(self.times, t)

    def right(self, t: float) -> int:
        """The first run after ``t``."""
        return bisect.bisect_right(self.times, t)

    def count(self, start: int, end: int) -> int:
        """Requests in runs ``start`` to ``end`` (excluded)."""
        return self._cum[max(end, start)] - self._cum[start]

    def runs(self, start: int, end: int) -> Iterator[tuple[float, int]]:
        """(time, requests) of runs ``start`` to ``end`` (excluded)."""
        cum = self._cum
        for i in range(start, end):
            yield self.times[i], cum[i + 1] - cum[i]

    def __repr__(self) -> str:
        return f"Arrivals({len(self)} requests in {len(self.times)} runs)"


def as_arrivals(times: Sequence[float] | Arrivals) -> Arrivals:
    """Runs as they are; one time per request (any order) made into runs."""
    return times if isinstance(times, Arrivals) else Arrivals.of(times)
