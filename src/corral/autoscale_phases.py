"""SkyServe's hysteresis counters, run at every phase of its 20 s decision clock at once.

SkyServe looks at the load every 20 s from whenever its controller started. At each look it
compares the raw target with its target: one more look on the same side, and the
``int(delay / 20)``-th in a row moves the target to that look's raw target; a look on the other
side, or equal, restarts the count; from zero it moves at the first look. Where its clock
stands (its *phase*, ``start mod 20``) is an accident, and two SkyServes started a few seconds
apart can move at different times and to different targets on the same load.

:class:`PhaseFamily` keeps the state (target, count) of *every* phase in ``[0, 20)`` at once:
phases that have seen the same raw target at each of their looks share a state, so the family
is a short list of phase intervals, split where a change of the raw target fell between two
phases' looks and merged again when their states meet. :meth:`PhaseFamily.advance` runs the
looks of every phase over a stretch of time on which the raw target is given piecewise, and
returns each move in time order: these are exactly the moves some SkyServe, started at some
instant, makes on that load. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PERIOD", "PhaseFamily", "PhaseMove", "threshold"]

# SkyServe's decision interval: its looks, and the unit its delays are counted in.
PERIOD = 20.0
# Phase boundaries closer than this are the same boundary (float noise of t - origin - 20k).
_SNAP = 1e-9

State = tuple[int, int] | None
"""(target, count): count > 0 is the number of looks in a row above the target, < 0 below.
None: no SkyServe has that phase (see :meth:`PhaseFamily.leave_zero`)."""


def threshold(delay: float) -> int:
    """Looks in a row SkyServe needs to move: ``int(delay / 20)`` (0 and 1 both mean the first)."""
    return int(delay / PERIOD)


@dataclass(frozen=True)
class PhaseMove:
    """A move some phase made: at the look at ``at``, from ``before`` to ``after``."""

    at: float
    before: int
    after: int


def _step(state: State, raw: int, need_up: int, need_down: int) -> State:
    """One look of SkyServe's ``_set_target_num_replicas_with_hysteresis``."""
    if state is None:
        return None
    target, count = state
    if target == 0:
        return (raw, 0)
    if raw > target:
        up = max(count, 0) + 1
        return (raw, 0) if up >= need_up else (target, up)
    if raw < target:
        down = max(-count, 0) + 1
        return (raw, 0) if down >= need_down else (target, -down)
    return (target, 0)


class PhaseFamily:
    """The states of SkyServe's counters at every phase; a look at time ``t`` is phase
    ``(t - origin) mod 20``'s. Looks at times before :attr:`until` have been run."""

    def __init__(self, target: int, origin: float) -> None:
        self._origin = origin
        self._until = origin
        # Phase intervals: [starts[i], starts[i + 1]) (the last up to 20) have states[i].
        self._starts: list[float] = [0.0]
        self._states: list[State] = [(target, 0)]

    @property
    def until(self) -> float:
        return self._until

    def reset(self, target: int) -> None:
        """Every phase at ``target`` with no count: after a move nothing else can explain, or
        a policy that measures the load differently."""
        self._starts, self._states = [0.0], [(target, 0)]

    def skip(self, until: float) -> None:
        """Looks before ``until`` will not be run (a move made for reasons of corral's own)."""
        self._until = max(self._until, until)

    def leave_zero(self, target: int, at: float, width: float) -> None:
        """Every SkyServe at zero looks every ``width`` s (5), so after load arrives at ``at``
        each leaves zero within ``width`` s, and its 20 s looks start there: the phases of
        ``[at, at + width)`` at ``target``, no other."""
        x = (at - self._origin) % PERIOD
        y = x + width
        if y <= PERIOD:
            self._starts = [0.0, x, y] if x > 0 else [0.0, y]
            self._states = [None, (target, 0), None] if x > 0 else [(target, 0), None]
        else:
            self._starts, self._states = [0.0, y - PERIOD, x], [(target, 0), None, (target, 0)]
        self._merge()

    def advance(
        self, until: float, raws: Sequence[tuple[float, int | None]], need_up: int, need_down: int
    ) -> list[PhaseMove]:
        """Run every look at a time in ``[self.until, until)``. ``raws`` is the raw target
        piecewise, ``(from, raw)`` in time order, each holding until the next (the last until
        ``until``); ``None`` is unknown, and looks then change nothing. The moves, in order."""
        moves: list[PhaseMove] = []
        for i, (start, raw) in enumerate(raws):
            end = raws[i + 1][0] if i + 1 < len(raws) else until
            start, end = max(start, self._until), min(end, until)
            if raw is not None and start < end:
                self._run(start, end, raw, need_up, need_down, moves)
        self._until = max(self._until, until)
        self._merge()
        return moves

    def _run(
        self, start: float, end: float, raw: int, up: int, down: int, moves: list[PhaseMove]
    ) -> None:
        """The looks in ``[start, end)``, on a constant raw target, one round at a time."""
        while start < end:
            k = math.floor((start - self._origin) / PERIOD)
            base = self._origin + k * PERIOD
            x = min(max(start - base, 0.0), PERIOD)
            y = min(end - base, PERIOD)
            if y > x:
                self._apply(x, y, base, raw, up, down, moves)
            start = max(base + PERIOD, math.nextafter(start, math.inf))

    def _index(self, phase: float) -> int:
        """Index of the interval starting at ``phase``, splitting one there if needed."""
        starts = self._starts
        if phase >= PERIOD - _SNAP:
            return len(starts)
        lo, hi = 0, len(starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if starts[mid] <= phase + _SNAP:
                lo = mid + 1
            else:
                hi = mid
        i = lo - 1
        if abs(starts[i] - phase) <= _SNAP:
            return i
        starts.insert(i + 1, phase)
        self._states.insert(i + 1, self._states[i])
        return i + 1

    def _apply(
        self,
        x: float,
        y: float,
        base: float,
        raw: int,
        up: int,
        down: int,
        moves: list[PhaseMove],
    ) -> None:
        i, j = self._index(x), self._index(y)
        for n in range(i, j):
            before = self._states[n]
            after = _step(before, raw, up, down)
            self._states[n] = after
            if after is not None and before is not None and after[0] != before[0]:
                moves.append(PhaseMove(base + self._starts[n], before[0], after[0]))

    def _merge(self) -> None:
        starts, states = [self._starts[0]], [self._states[0]]
        for start, state in zip(self._starts[1:], self._states[1:], strict=True):
            if state != states[-1]:
                starts.append(start)
                states.append(state)
        self._starts, self._states = starts, states

    def _first_looks(self) -> list[float]:
        """For each interval, the time of its earliest next look (at or after ``until``)."""
        phase = (self._until - self._origin) % PERIOD
        base = self._until - phase
        ends = [*self._starts[1:], PERIOD]
        return [
            base + max(x, phase) if y > phase else base + PERIOD + x
            for x, y in zip(self._starts, ends, strict=True)
        ]

    def next_move(self, raw: int, target: int, need_up: int, need_down: int) -> float | None:
        """The first instant some phase would move past ``target`` (up above it, or down
        below it) if the raw target stayed ``raw``; None if none would."""
        if raw == target:
            return None
        best: float | None = None
        for first, state in zip(self._first_looks(), self._states, strict=True):
            if state is None:
                continue
            t, count = state
            if raw > target and (t < raw or t == 0):
                looks = 1 if t == 0 else max(1, need_up - max(count, 0))
            elif raw < target and t > raw:
                looks = max(1, need_down - max(-count, 0))
            else:
                continue
            when = first + PERIOD * (looks - 1)
            best = when if best is None else min(best, when)
        return best

    def one_look_short(
        self, target: int, low: int, high: int, need_up: int, need_down: int
    ) -> float | None:
        """The first next look of a phase one look short of a move (of a delay of at least two
        looks) that could pass ``target`` in ``[low, high]``, or None. Whether it moves depends
        on the raw target at that look, which a request yet to arrive may change."""
        best: float | None = None
        for first, state in zip(self._first_looks(), self._states, strict=True):
            if state is None:
                continue
            count = state[1]
            up = need_up >= 2 and count == need_up - 1 and target < high
            if up or (need_down >= 2 and -count == need_down - 1 and target > low):
                best = first if best is None else min(best, first)
        return best
