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
* **Hysteresis, SkyServe's at every phase of its clock**: SkyServe looks every 20 s from
  whenever its controller started, moves the target to a look's raw target at the
  ``int(delay / 20)``-th look in a row on one side of it (``upscale_delay_seconds`` above,
  ``downscale_delay_seconds`` below; a look equal or on the other side restarts the count),
  and from zero at its first look. When its clock falls (its *phase*) is an accident, and on
  the same load SkyServes a second apart move at different times and to different targets.
  corral runs those counters at every phase at once (:class:`corral.autoscale_phases.
  PhaseFamily`, a few intervals of phases sharing a state), following the raw target through
  every instant it changes (a request arriving, or leaving the window: the timestamps date both
  exactly), and its target follows each move any phase makes *past it in that move's
  direction*: up when some SkyServe moves up to more than corral's target, down when some
  SkyServe moves down to less. So each level is reached up and down no later than at any phase,
  never earlier than the earliest phase (whose delay ran on that load), and every move goes to
  a target some SkyServe moves to at that instant, with SkyServe's own formula over the window
  then. When a higher target becomes due while a lower one was just followed, corral moves on
  to it at once instead of holding from the lower one. :func:`hold_seconds`, ``20 *
  (int(delay / 20) - 1)``, is the shortest time from a crossing to a move.
  While a phase's move can be due, :attr:`Autoscaler.decision_interval` is cut so a decision
  falls when it is; while a phase is one look short of a move that a request yet to arrive may
  trigger, decisions come every second (``zero_decision_interval``). A move triggered by a
  single look (delays under 40 s) is seen at the next decision, within 5 s. From zero corral
  moves at once, on its own meter (a request is waiting), and takes every SkyServe to have left
  zero within its 5 s looks of the load's arrival. What this costs: where phases disagree (a
  raw target that flickers at a threshold), corral moves whenever some phase would, so it
  changes the target more often than one SkyServe does (``bench/autoscale_vs_skyserve.py``
  counts both); its counters before the first decision are unknown, and looks inside the first
  window see the raw target of the decision before.
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
exist so a service's autoscaler says at creation what kind of policy it was built for. An
update to another kind (the engines' signals, corral.autoscale_queue) starts the new autoscaler
at the old one's target too (:meth:`_PolicyAutoscaler.start_at`).

Size: one algorithm, SkyServe's counting at every phase, told in full above; its code is the
rest, and a split would leave each half's rules in the other's docstring.
"""

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from corral.arrivals import Arrivals, as_arrivals
from corral.autoscale_phases import PERIOD, PhaseFamily, PhaseMove, threshold
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
    "past",
]

DEFAULT_DECISION_INTERVAL = 5.0
DEFAULT_ZERO_DECISION_INTERVAL = 1.0
DEFAULT_QPS_WINDOW = 60.0
# Shortest span a QPS is measured over while the first window fills (see the module docstring).
MIN_QPS_SPAN = 1.0
# SkyServe's decision interval, the unit its upscale and downscale delays are counted in.
SKYSERVE_DECISION_INTERVAL = PERIOD
# SkyServe's decision interval at zero replicas.
SKYSERVE_ZERO_INTERVAL = 5.0
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

    def decide(self, now: float, request_times: Sequence[float] | Arrivals) -> Decision:
        """Target for ``now``, given the monotonic timestamps of recent requests (any order),
        or their runs (what the data plane reports)."""
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


def hold_seconds(delay: float) -> float:
    """How long a change must last before the target follows it (see the module docstring).

    ``int(delay / 20)`` decisions 20 s apart, the first included, span 20 s less than that
    many intervals: SkyServe's arithmetic exactly, so the same spec never waits longer here.
    """
    periods = int(delay / SKYSERVE_DECISION_INTERVAL)
    return SKYSERVE_DECISION_INTERVAL * max(0, periods - 1)


def hold_words(delay: float, kind: str) -> str:
    """A delay and the hold it makes, in a reason. A delay under two looks of SkyServe's 20 s
    clock makes no hold at all, which "the 0s hold of the 10s upscale delay" said oddly."""
    hold = hold_seconds(delay)
    if hold <= 0:
        return f"{_fmt_seconds(delay)} {kind} delay, under two of SkyServe's 20s looks (no hold)"
    return f"{_fmt_seconds(hold)} hold of the {_fmt_seconds(delay)} {kind} delay"


def past(held: float, delay: float) -> str:
    """What a reason adds once a change has lasted the hold without a move yet: the hold is
    the earliest a move can come, and it comes at a look of SkyServe's 20 s clock (a reason
    that said "until the hold of 0s is over (12s so far)" read as a hold ignored)."""
    if hold_seconds(delay) <= 0:
        return "; the target moves at the next look of SkyServe's 20s clock"
    if held < hold_seconds(delay):
        return ""
    return "; the hold has passed: the target moves at a look of SkyServe's 20s clock that sees it"


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
        # SkyServe's counters at every phase of its clock; made at the first decide.
        self._phases: PhaseFamily | None = None
        # The raw target seen at the previous decision, which holds until a change the request
        # timestamps date; None after a policy that measures differently, until one is seen.
        self._seen: int | None = None
        # (-1 / 0 / +1 for below / at / above the target, since when): for the reason's "for".
        self._run: tuple[int, float] | None = None
        # The next instant a phase would move the target if the raw target stays, or None;
        # and the first look of a phase one look short of a move (a request may make it).
        self._due: float | None = None
        self._alert: float | None = None
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
    def held_target(self) -> int:
        """The hysteresis target, without ``num_overprovision``."""
        return self._target

    def start_at(self, target: int) -> None:
        """Go on from ``target`` (clipped into the policy's bounds) instead of
        ``min_replicas``: the target of the autoscaler this one replaces, when a new spec
        version asks for another kind."""
        self._target = _clip(target, self._policy)
        self._forget()

    @property
    def decision_interval(self) -> float:
        """Faster while an autoscaled service is at zero: its first request is waiting. No
        later than the instant a phase of SkyServe's clock would move, so the move is not one
        interval late; as often as at zero while one is a look short of a move."""
        if self._policy.autoscaling and self._target == 0:
            return self._zero_interval
        out, due, alert, last = self._interval, self._due, self._alert, self._last_now
        if last is None:
            return out
        if alert is not None:
            out = min(out, max(alert - last, self._zero_interval))
        if due is not None and due > last:
            out = min(out, due - last)
        return out

    def lookback(self, now: float) -> float:
        """The QPS window, plus the time since the previous decision: a crossing first seen
        now happened after that decision, and dating it needs the window before it."""
        if self._last_now is None or now <= self._last_now:
            return self._window
        return self._window + (now - self._last_now)

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        """New bounds apply at once (clipping needs no delay: the user asked for them).

        SkyServe's counters at every phase go on when the raw target still means the same
        thing (same bounds and target QPS per replica) and the target stayed, as after an
        update that changed only the code or the delays; otherwise they restart, from the
        target. The QPS meter keeps its history: load did not change.
        """
        old, target = self._policy, self._target
        self._policy = policy
        self._target = _clip(self._target, policy)
        if self._target != target or (
            old.min_replicas,
            old.max_replicas,
            old.target_qps_per_replica,
        ) != (policy.min_replicas, policy.max_replicas, policy.target_qps_per_replica):
            self._forget()

    def decide(self, now: float, request_times: Sequence[float] | Arrivals) -> Decision:
        """See the module docstring; correct whenever called, at whatever interval."""
        # As runs, everything below bisects and loops over runs, never over each request.
        times = as_arrivals(request_times)
        qps = self._measure(now, times)
        if self._phases is None:
            self._phases = PhaseFamily(self._target, now)
        try:
            return self._decide(now, qps, times)
        finally:
            self._last_now = now

    def _decide(self, now: float, qps: float, request_times: Arrivals) -> Decision:
        policy = self._policy
        if not policy.autoscaling:
            # min == max here (the spec enforces it when target_qps_per_replica is unset).
            self._target = _clip(policy.min_replicas, policy)
            self._forget()
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
        raws = self._raws(now, request_times, raw)
        self._seen = raw
        if self._target == 0 and raw > 0:
            return self._decision(qps, raw, self._leave_zero(now, raws, want))
        return self._decision(qps, raw, self._follow(now, raws, want))

    def _leave_zero(self, now: float, raws: list[tuple[float, int | None]], want: str) -> str:
        """From zero at once: a request waiting on no replica cannot wait for a delay. Every
        SkyServe leaves zero too, within its 5 s looks of the load's arrival."""
        raw = raws[-1][1]
        assert raw is not None and self._phases is not None
        arrived = next((t for t, r in raws if r), now)
        self._target = raw
        self._forget()
        self._phases.leave_zero(raw, arrived, SKYSERVE_ZERO_INTERVAL)
        self._phases.skip(now + _HOLD_SLACK)
        delay = _fmt_seconds(self._policy.upscale_delay_seconds)
        return (
            f"{want} while at zero: scaling up to {raw} at once (scale from zero does not "
            f"wait for the {delay} upscale delay)"
        )

    def _follow(self, now: float, raws: list[tuple[float, int | None]], want: str) -> str:
        """Run SkyServe's looks at every phase up to ``now``; follow each move past the target
        in its direction (see the module docstring). The reason either way."""
        assert self._phases is not None
        policy, current, raw = self._policy, self._target, raws[-1][1]
        assert raw is not None
        up = threshold(policy.upscale_delay_seconds)
        down = threshold(policy.downscale_delay_seconds)
        for t, r in raws:
            self._observe(t, r, current)
        held = max(0.0, now - self._run[1]) if self._run is not None else 0.0
        followed: PhaseMove | None = None
        for move in self._phases.advance(now + _HOLD_SLACK, raws, up, down):
            if (move.after - move.before) * (move.after - self._target) > 0:
                self._target, followed = move.after, move
        if followed is not None:
            self._run = None
            self._observe(now, raw, self._target)
        self._due = self._phases.next_move(raw, self._target, up, down)
        self._alert = self._phases.one_look_short(
            self._target, policy.min_replicas, policy.max_replicas, up, down
        )
        return self._reason(want, current, raw, held, followed, now)

    def _reason(
        self, want: str, current: int, raw: int, held: float, moved: PhaseMove | None, now: float
    ) -> str:
        side = (raw > current) - (raw < current)
        if moved is not None:
            side = 1 if moved.after > moved.before else -1
        elif not side:
            return f"{want} (= current {current}): holding {current}"
        sign, kind, verb = (">", "upscale", "up") if side > 0 else ("<", "downscale", "down")
        p = self._policy
        delay = p.upscale_delay_seconds if side > 0 else p.downscale_delay_seconds
        of = hold_words(delay, kind)
        why = f"{want} ({sign} current {current})"
        if moved is None:
            return (
                f"{why} for {_fmt_seconds(held)} of the {of}: holding {current}{past(held, delay)}"
            )
        if moved.before != current or (raw - current) * side <= 0:
            return (
                f"{why}: scaling {verb} to {moved.after}, as SkyServe does from {moved.before} "
                f"at the phase of its 20s clock that looked {now - moved.at:.1f}s ago, "
                f"past the {of}"
            )
        why += f" for {_fmt_seconds(held)}"
        if hold_seconds(delay) <= 0:
            short = f"the {_fmt_seconds(delay)} {kind} delay is under two of SkyServe's 20s looks"
            return f"{why}: scaling {verb} to {moved.after} (no hold: {short})"
        if held + _HOLD_SLACK < hold_seconds(delay):
            why += " (and at every 20s look before, dips between looks aside)"
        return f"{why}, past the {of}: scaling {verb} to {moved.after}"

    def _forget(self) -> None:
        """After a move of corral's own (or a policy that measures differently): every phase
        of SkyServe's clock at the target, no count, and no raw target seen yet."""
        if self._phases is not None:
            self._phases.reset(self._target)
        self._seen, self._run, self._due, self._alert = None, None, None, None

    def _raws(
        self, now: float, request_times: Arrivals, raw_now: int
    ) -> list[tuple[float, int | None]]:
        """The raw target since the previous decision, piecewise: the one seen then, each
        change the requests date (a request arriving, or leaving the window), and ``now``'s."""
        assert self._phases is not None
        out: list[tuple[float, int | None]] = [(self._phases.until, self._seen)]
        for instant, count in self._count_changes(now, request_times):
            out.append((instant, _clip(self._wanted(count / self._window), self._policy)))
        out.append((now, raw_now))
        return out

    def _observe(self, t: float, raw: int | None, target: int) -> None:
        """The raw target from instant ``t`` on: a new run if it changed side of ``target``."""
        if raw is None:
            return
        side = (raw > target) - (raw < target)
        if self._run is None or self._run[0] != side:
            self._run = (side, t)

    def _wanted(self, qps: float) -> int:
        tq = self._policy.target_qps_per_replica
        assert tq is not None  # autoscaling implies it
        ratio = qps / tq
        return max(0, math.ceil(ratio - ratio * _CEIL_SLACK))

    def _count_changes(self, now: float, times: Arrivals) -> list[tuple[float, int]]:
        """(instant, windowed count from it on) at each instant strictly between the previous
        decision and ``now`` where a request arrived or left the window, in order, skipping the
        first window (the meter's span was still growing there, so counts are not rates).

        A request stamped ``s`` counts from ``s`` to ``s + window`` included, as in
        SkyServe's window; it leaves just after.
        """
        prev, window = self._last_now, self._window
        if prev is None or now <= prev or self._watched_since is None:
            return []
        count = times.count(times.left(prev - window), times.right(prev))
        changes: Counter[float] = Counter()
        for t, n in times.runs(times.right(prev), times.left(now)):
            changes[t] += n
        low, high = prev - window, now - window
        for t, n in times.runs(times.left(low), times.right(high)):
            gone = math.nextafter(t + window, math.inf)
            if prev < gone < now:
                changes[gone] -= n
        start = self._watched_since + window
        out: list[tuple[float, int]] = []
        for instant in sorted(changes):
            count += changes[instant]
            if instant >= start:
                out.append((instant, count))
        return out

    def _measure(self, now: float, times: Arrivals) -> float:
        """Requests per second over the last window, or over what has been watched of it."""
        low = times.right(now - self._window)
        count = times.count(low, times.right(now))
        oldest = times.times[low] if count else now
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
