"""Autoscaling: request load in, replica target out.

This module is pure on purpose: no I/O, no asyncio, no clock. The controller passes ``now`` (a
``time.monotonic()`` reading) and the request timestamps the load balancer recorded, and gets a
:class:`Decision` back. Keeping time out of the component is what lets the tests replay hours of
load against a simulated clock in milliseconds, and makes every decision reproducible from its
inputs.

The semantics follow SkyServe's request-rate autoscaler (see skyserve-facts.md, Autoscaling):

* **QPS** is the number of requests in the last ``qps_window`` seconds (60 by default) divided by
  the window. Until the autoscaler has watched a whole window it divides by the time it has
  watched instead, but by at least :data:`MIN_QPS_SPAN` (1 s): dividing 30 requests from the
  first 2 s by 60 would read a burst right after start as 0.5 QPS and leave a scaled-to-zero or
  freshly started service starved, while a span under a second would turn the first request or
  two into an absurd rate. "Watched since" is the first ``decide`` call, moved back to the oldest
  request seen, because requests the balancer recorded before the first decision were load too.
  Requests stamped after ``now`` are ignored (they have not happened yet from the decision's
  point of view), so a caller may pass a whole recorded trace.
* **Raw target** = ``ceil(QPS / target_qps_per_replica)`` clipped to ``[min_replicas,
  max_replicas]``. The division is ceiled with a relative slack of 1e-9 so float noise
  (3 / 0.3 = 10.000000000000002) does not ask for an 11th replica.
* **Hysteresis, never slower than SkyServe's**: the target moves up only once the raw target
  has been above it for the *hold* of ``upscale_delay_seconds``, and down only once it has been
  below it for the hold of ``downscale_delay_seconds``; it then moves straight to the raw target
  of that moment (as SkyServe does), not one step at a time. From zero the target moves at once:
  a request waiting on a service with no replica cannot wait for an upscale delay.

  The hold is :func:`hold_seconds`: ``20 * (int(delay / 20) - 1)``, at least 0 (280 s for the
  default 300 s upscale delay, 1180 s for the 1200 s downscale delay). That is SkyServe's own
  count: it looks every 20 s and moves once ``int(delay / 20)`` consecutive looks, the first
  included, have seen the raw target on that side; any look that sees it equal or on the other
  side restarts the count. corral follows the raw target through every instant it changes (a
  request arriving, or leaving the window: the request timestamps date both exactly) and moves
  as soon as the raw target has been on that side at ``t``, ``t - 20``, ... ``t - hold``
  (:func:`_hold_ends`), i.e. at the first instant at which SkyServe, whatever the phase of its
  20 s clock, could have moved on the same load. So a change that lasts the hold moves at the
  crossing + the hold; a single shorter one moves nothing; a dip that could fall between two of
  SkyServe's looks does not restart the hold, and one that lasts 20 s does. While a hold can
  end, :attr:`Autoscaler.decision_interval` is cut so that a decision falls when it does. The
  timeline starts at the previous decision (the caller passes :meth:`Autoscaler.lookback`
  seconds of requests for that) and never inside the first window, where the meter's span still
  grows; a hold of 0 (delays under 40 s) moves at the first decision that sees the change,
  within 5 s of it, SkyServe's within 20 s. What this costs: on load that hovers at a threshold
  corral moves whenever some phase of SkyServe's clock would, so it changes the target more
  often than one SkyServe does (``bench/autoscale_vs_skyserve.py`` counts both).
* **Overprovision**: the final target is the hysteresis target plus ``num_overprovision``, added
  last as SkyServe does (the hold compares raw and target without it: it shifts every target and
  no move in time), so it stays within ``[min_replicas, max_replicas + num_overprovision]``,
  except that a target of 0 stays 0: spare capacity for no load would make scale-to-zero
  (``min_replicas: 0``) impossible. The same rule holds for a fixed ``replicas: 0`` (a paused
  service), which is the one place this differs from "fixed target = min + overprovision".
* **Initial target** is ``min_replicas``.
* **Decision interval**: corral decides every 5 s (SkyServe: 20 s) and every 1 s while an
  autoscaled service sits at zero (SkyServe: 5 s), because deciding is a cheap in-process
  computation and a cold start is what the first user waits for. The interval is only advice to
  the caller; :meth:`Autoscaler.decide` is correct whenever it is called.

Fixed and request-rate policies share one implementation, whose behaviour follows the *policy*
rather than the class: a spec update that turns autoscaling on or off goes through
:meth:`Autoscaler.reset_policy` on the object the controller already holds, and keeps the current
target (clipped into the new bounds) instead of jumping back to ``min_replicas``. The two classes
exist so a service's autoscaler says at creation what kind of policy it was built for.
"""

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from corral.spec import ReplicaPolicy

__all__ = [
    "DEFAULT_DECISION_INTERVAL",
    "DEFAULT_QPS_WINDOW",
    "DEFAULT_ZERO_DECISION_INTERVAL",
    "MIN_QPS_SPAN",
    "Autoscaler",
    "Decision",
    "FixedAutoscaler",
    "RequestRateAutoscaler",
    "hold_seconds",
    "make_autoscaler",
]

DEFAULT_DECISION_INTERVAL = 5.0
DEFAULT_ZERO_DECISION_INTERVAL = 1.0
DEFAULT_QPS_WINDOW = 60.0
# Shortest span a QPS is measured over while the first window fills (see the module docstring).
MIN_QPS_SPAN = 1.0
# SkyServe's decision interval, the unit its upscale and downscale delays are counted in.
SKYSERVE_DECISION_INTERVAL = 20.0
# A hold that ends within this many seconds of a decision has ended: a caller that sleeps
# exactly the advised interval should not need a second, nanosecond-long wait for float noise.
_HOLD_SLACK = 1e-6
# Relative slack when ceiling QPS / target_qps_per_replica, so float noise does not add a replica.
_CEIL_SLACK = 1e-9


@dataclass(frozen=True)
class Decision:
    """One autoscaling decision, with what it was based on so status and logs can explain it."""

    target: int
    """Replicas wanted now, ``num_overprovision`` included."""
    qps: float
    """The measured load the decision is based on, in requests per second."""
    raw_target: int
    """``ceil(qps / target_qps_per_replica)`` clipped to ``[min, max]``, before hysteresis."""
    reason: str
    """One human sentence saying why ``target`` is what it is."""


@runtime_checkable
class Autoscaler(Protocol):
    """What the controller needs: a target from load, a policy swap, and how often to ask."""

    def decide(self, now: float, request_times: Sequence[float]) -> Decision:
        """Target for ``now``, given the monotonic timestamps of recent requests (any order)."""
        ...

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        """Apply a new spec version's policy, keeping the current target if it still fits."""
        ...

    def lookback(self, now: float) -> float:
        """Seconds of request history ``decide(now, ...)`` needs to date a crossing."""
        ...

    @property
    def decision_interval(self) -> float:
        """Seconds the caller should wait before the next :meth:`decide`."""
        ...


def _hold_ends(spans: Sequence[tuple[float, float]], hold: float) -> list[tuple[float, float]]:
    """The instants at which a hold of ``hold`` is over: those ``t`` at which the raw target
    was on the side at ``t``, ``t - 20``, ... ``t - hold`` (within ``spans``, sorted and
    disjoint), i.e. at which SkyServe's looks, if one fell at ``t``, would have counted the
    whole delay. As spans.

    Each step keeps what survives of the previous one, found by bisecting ``spans``, so the
    work shrinks with the answer instead of growing with every span times every step.
    """
    out = list(spans)
    starts = [start for start, _ in spans]
    steps = round(hold / SKYSERVE_DECISION_INTERVAL)
    for k in range(1, steps + 1):
        if not out:
            break
        shift = k * SKYSERVE_DECISION_INTERVAL
        kept: list[tuple[float, float]] = []
        for a, b in out:
            i = max(0, bisect.bisect_right(starts, a - shift) - 1)
            while i < len(spans) and spans[i][0] + shift < b:
                start, end = max(a, spans[i][0] + shift), min(b, spans[i][1] + shift)
                if start < end:
                    kept.append((start, end))
                i += 1
        out = kept
    return out


def hold_seconds(delay: float) -> float:
    """How long a change must last before the target follows it (see the module docstring).

    ``int(delay / 20)`` decisions 20 s apart, the first included, span 20 s less than that
    many intervals: SkyServe's arithmetic exactly, so the same spec never waits longer here.
    """
    periods = int(delay / SKYSERVE_DECISION_INTERVAL)
    return SKYSERVE_DECISION_INTERVAL * max(0, periods - 1)


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _clip(value: int, policy: ReplicaPolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, value))


def _fmt_qps(qps: float) -> str:
    """Three significant digits below 10 (so 1/60 reads 0.0167, not 0.0), one decimal above."""
    return f"{qps:.3g}" if qps < 10 else f"{qps:.1f}"


def _fmt_seconds(seconds: float) -> str:
    if float(seconds).is_integer() and abs(seconds) < 1e15:
        return f"{int(seconds)}s"
    return f"{seconds:.1f}s"


class _PolicyAutoscaler:
    """The shared engine: QPS meter, raw target and hysteresis (see the module docstring)."""

    def __init__(
        self,
        policy: ReplicaPolicy,
        *,
        decision_interval: float = DEFAULT_DECISION_INTERVAL,
        zero_decision_interval: float = DEFAULT_ZERO_DECISION_INTERVAL,
        qps_window: float = DEFAULT_QPS_WINDOW,
    ) -> None:
        self._interval = _positive("decision_interval", decision_interval)
        self._zero_interval = _positive("zero_decision_interval", zero_decision_interval)
        self._window = _positive("qps_window", qps_window)
        self._policy = policy
        # The hysteresis target, without overprovision: what the raw target is compared with.
        self._target = policy.min_replicas
        # By direction (+1 up, -1 down), the spans [start, end) since the last move in which the
        # raw target was on that side of the target; ``inf`` ends the one still going on.
        self._spans: dict[int, list[tuple[float, float]]] = {1: [], -1: []}
        # The next instant a hold can be over if the raw target stays where it is (on the side
        # ``_due_side``), or None.
        self._due: float | None = None
        self._due_side = 0
        # A hold was over while the raw target was off its side: look again soon.
        self._overdue = False
        # (-1 / 0 / +1 for below / at / above the target, since when), for a new hold's start.
        self._run: tuple[int, float] | None = None
        # Start of the period the QPS meter has watched; None until the first decide.
        self._watched_since: float | None = None
        # ``now`` of the previous decide: how far back a newly seen crossing may be dated.
        self._last_now: float | None = None

    @property
    def policy(self) -> ReplicaPolicy:
        """The policy decisions are currently made under."""
        return self._policy

    @property
    def qps_window(self) -> float:
        """Seconds of requests the QPS is averaged over (once that much has been watched)."""
        return self._window

    @property
    def decision_interval(self) -> float:
        """Faster while an autoscaled service is at zero: its first request is waiting. While a
        hold runs, no later than its end, so the move is not one interval late; once it has
        run out during a dip, as often as at zero, so the move follows the dip's end."""
        if self._policy.autoscaling and self._target == 0:
            return self._zero_interval
        due, last = self._due, self._last_now
        if due is not None and last is not None and due > last:
            return min(self._interval, due - last)
        if not self._overdue:
            return self._interval
        return min(self._interval, self._zero_interval)

    def lookback(self, now: float) -> float:
        """The QPS window, plus the time since the previous decision: a crossing first seen
        now happened after that decision, and dating it needs the window before it."""
        if self._last_now is None or now <= self._last_now:
            return self._window
        return self._window + (now - self._last_now)

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        """New bounds apply at once (clipping needs no delay: the user asked for them).

        Running holds go on when the raw target still means the same thing (same bounds and
        target QPS per replica) and the target stayed, as after an update that changed only
        the code or the delays; otherwise they restart. The QPS meter keeps its history: load
        did not change.
        """
        old, target = self._policy, self._target
        self._policy = policy
        self._target = _clip(self._target, policy)
        if self._target != target or (
            old.min_replicas,
            old.max_replicas,
            old.target_qps_per_replica,
        ) != (policy.min_replicas, policy.max_replicas, policy.target_qps_per_replica):
            self._forget(None)

    def decide(self, now: float, request_times: Sequence[float]) -> Decision:
        """See the module docstring; correct whenever called, at whatever interval."""
        # Callers pass them oldest first (sorting a sorted list is one linear pass in C), so
        # everything below bisects instead of looping over tens of thousands of requests.
        times = sorted(request_times)
        qps = self._measure(now, times)
        try:
            return self._decide(now, qps, times)
        finally:
            self._last_now = now

    def _decide(self, now: float, qps: float, request_times: list[float]) -> Decision:
        policy = self._policy
        if not policy.autoscaling:
            # min == max here (the spec enforces it when target_qps_per_replica is unset).
            self._forget(None)
            self._target = _clip(policy.min_replicas, policy)
            n = self._target
            size = "no replicas" if n == 0 else f"{n} replica{'s' if n != 1 else ''}"
            reason = f"fixed size of {size} (autoscaling is off); QPS {_fmt_qps(qps)}"
            return self._decision(qps, self._target, reason)

        wanted = self._wanted(qps)
        raw = _clip(wanted, policy)
        want = f"QPS {_fmt_qps(qps)} wants {wanted}"
        if wanted > raw:
            want += f", capped at max_replicas {raw}"
        elif wanted < raw:
            want += f", raised to min_replicas {raw}"

        current = self._target
        if current == 0 and raw > 0:
            self._forget(None)
            self._target = raw
            reason = (
                f"{want} while at zero: scaling up to {raw} at once (scale from zero does not "
                f"wait for the {_fmt_seconds(policy.upscale_delay_seconds)} upscale delay)"
            )
        else:
            self._track(now, request_times, raw)
            reason = self._hold_or_move(now, want, raw)
        return self._decision(qps, raw, reason)

    def _hold_or_move(self, now: float, want: str, raw: int) -> str:
        """Move if SkyServe's looks, at some phase, would have seen the raw target's side for
        the whole hold by now; the reason either way."""
        current, policy = self._target, self._policy
        side = (raw > current) - (raw < current)
        # Spans no hold ending after the previous decision can reach back to are dropped.
        last = self._last_now if self._last_now is not None else now
        for direction, spans in self._spans.items():
            horizon = last - self._hold(direction)
            spans[:] = [span for span in spans if span[1] > horizon]
        # A hold predicted to end by now, and the raw target off its side: it may be over
        # already and wait only for the raw target's return, so look again soon.
        due, was = self._due, self._due_side
        self._overdue = due is not None and due <= now + _HOLD_SLACK and side != was
        self._due, self._due_side = None, 0
        if not side:
            return f"{want} (= current {current}): holding {current}"
        if side > 0:
            sign, kind, verb, delay = ">", "upscale", "up", policy.upscale_delay_seconds
        else:
            sign, kind, verb, delay = "<", "downscale", "down", policy.downscale_delay_seconds
        assert self._run is not None  # _track(now) set it
        held = max(0.0, now - self._run[1])
        of = f"{_fmt_seconds(self._hold(side))} hold of the {_fmt_seconds(delay)} {kind} delay"
        ends = _hold_ends(self._spans[side], self._hold(side))
        why = f"{want} ({sign} current {current}) for {_fmt_seconds(held)}"
        if ends and ends[0][0] <= now + _HOLD_SLACK:
            self._forget((0, now))
            self._target = raw
            if held + _HOLD_SLACK < self._hold(side):
                why += " (and at every 20s look before, dips between looks aside)"
            return f"{why}, past the {of}: scaling {verb} to {raw}"
        self._due = next((start for start, _ in ends if start > now), None)
        self._due_side = side
        return f"{why} of the {of}: holding {current}"

    def _hold(self, direction: int) -> float:
        p = self._policy
        return hold_seconds(p.upscale_delay_seconds if direction > 0 else p.downscale_delay_seconds)

    def _forget(self, run: tuple[int, float] | None) -> None:
        """After a move (or a policy that measures differently): no hold runs."""
        self._spans = {1: [], -1: []}
        self._due, self._overdue, self._run = None, False, run

    def _track(self, now: float, request_times: list[float], raw_now: int) -> None:
        """Follow the raw target through every instant its count changed since the previous
        decision, then ``now``: holds start where a crossing happened, not where it was seen."""
        for instant, count in self._count_changes(now, request_times):
            self._observe(instant, _clip(self._wanted(count / self._window), self._policy))
        self._observe(now, raw_now)

    def _observe(self, t: float, raw: int) -> None:
        """The raw target from instant ``t`` on: close the span of the side it left, open one
        for the side it is on."""
        side = (raw > self._target) - (raw < self._target)
        if self._run is not None and self._run[0] == side:
            return
        for spans in self._spans.values():
            if spans and spans[-1][1] == math.inf:
                spans[-1] = (spans[-1][0], t)
        if side:
            self._spans[side].append((t, math.inf))
        self._run = (side, t)

    def _wanted(self, qps: float) -> int:
        tq = self._policy.target_qps_per_replica
        assert tq is not None  # autoscaling implies it
        ratio = qps / tq
        return max(0, math.ceil(ratio - ratio * _CEIL_SLACK))

    def _count_changes(self, now: float, times: list[float]) -> list[tuple[float, int]]:
        """(instant, windowed count from it on) at each instant strictly between the previous
        decision and ``now`` where a request arrived or left the window, in order, skipping the
        first window (the meter's span was still growing there, so counts are not rates).

        ``times`` is sorted. Only requests arriving in (prev, now) and those leaving the window
        then (stamped in (prev - window, now - window)) change the count.
        """
        prev, window = self._last_now, self._window
        if prev is None or now <= prev or self._watched_since is None:
            return []
        count = bisect.bisect_right(times, prev) - bisect.bisect_right(times, prev - window)
        changes: Counter[float] = Counter()
        for t in times[bisect.bisect_right(times, prev) : bisect.bisect_left(times, now)]:
            changes[t] += 1
        low, high = prev - window, now - window
        for t in times[bisect.bisect_left(times, low) : bisect.bisect_right(times, high)]:
            if prev < t + window < now:
                changes[t + window] -= 1
        start = self._watched_since + window
        out: list[tuple[float, int]] = []
        for instant in sorted(changes):
            count += changes[instant]
            if instant >= start:
                out.append((instant, count))
        return out

    def _measure(self, now: float, times: list[float]) -> float:
        """Requests per second over the last window, or over what has been watched of it
        (``times`` sorted)."""
        low = bisect.bisect_right(times, now - self._window)
        count = bisect.bisect_right(times, now) - low
        oldest = times[low] if count else now
        if self._watched_since is None or oldest < self._watched_since:
            self._watched_since = oldest
        floor = min(MIN_QPS_SPAN, self._window)
        span = min(self._window, max(now - self._watched_since, floor))
        return count / span

    def _decision(self, qps: float, raw: int, reason: str) -> Decision:
        over = self._policy.num_overprovision
        final = self._target + over if self._target > 0 else 0
        if over and final:
            reason += f" (+{over} overprovisioned = {final})"
        elif over:
            reason += " (no overprovision at zero)"
        return Decision(target=final, qps=qps, raw_target=raw, reason=reason)


class FixedAutoscaler(_PolicyAutoscaler):
    """For ``replicas: N`` or ``min == max``: the target is N (+ overprovision) whatever the load.

    It still measures QPS, so status can show the load a fixed service carries. A later
    :meth:`reset_policy` with an autoscaling policy makes it autoscale (see the module docstring).
    """

    def __init__(
        self,
        policy: ReplicaPolicy,
        *,
        decision_interval: float = DEFAULT_DECISION_INTERVAL,
        zero_decision_interval: float = DEFAULT_ZERO_DECISION_INTERVAL,
        qps_window: float = DEFAULT_QPS_WINDOW,
    ) -> None:
        if policy.autoscaling:
            raise ValueError(
                f"FixedAutoscaler needs a fixed policy, got min_replicas {policy.min_replicas}, "
                f"max_replicas {policy.max_replicas} and target_qps_per_replica "
                f"{policy.target_qps_per_replica}: use RequestRateAutoscaler or make_autoscaler"
            )
        super().__init__(
            policy,
            decision_interval=decision_interval,
            zero_decision_interval=zero_decision_interval,
            qps_window=qps_window,
        )


class RequestRateAutoscaler(_PolicyAutoscaler):
    """SkyServe's request-rate autoscaler: QPS over a window, ceil to replicas, hysteresis.

    Like SkyServe's, it also accepts a fixed policy (the target then stays at min_replicas).
    """


def make_autoscaler(
    policy: ReplicaPolicy,
    *,
    decision_interval: float = DEFAULT_DECISION_INTERVAL,
    zero_decision_interval: float = DEFAULT_ZERO_DECISION_INTERVAL,
    qps_window: float = DEFAULT_QPS_WINDOW,
) -> Autoscaler:
    """The autoscaler for ``policy``: request-rate when ``policy.autoscaling``, else fixed."""
    kind = RequestRateAutoscaler if policy.autoscaling else FixedAutoscaler
    return kind(
        policy,
        decision_interval=decision_interval,
        zero_decision_interval=zero_decision_interval,
        qps_window=qps_window,
    )
