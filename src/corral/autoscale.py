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
* **Hysteresis**: the target moves up only once the raw target has been above it continuously for
  ``upscale_delay_seconds``, and down only once it has been below it continuously for
  ``downscale_delay_seconds``; it then moves straight to the raw target of that moment (as
  SkyServe does), not one step at a time. Any decision that sees the raw target equal to the
  target, or on the other side of it, restarts the clock. The clock starts at the first
  ``decide`` call that sees the crossing, so with calls every few seconds the effective delay is
  the configured one plus at most one interval (SkyServe counts decision intervals, which has the
  same granularity). From zero the target moves at once: a request waiting on a service with no
  replica cannot wait for an upscale delay.
* **Overprovision**: the final target is the hysteresis target plus ``num_overprovision``, so it
  stays within ``[min_replicas, max_replicas + num_overprovision]``, except that a target of 0
  stays 0: spare capacity for no load would make scale-to-zero (``min_replicas: 0``) impossible.
  The same rule holds for a fixed ``replicas: 0`` (a paused service), which is the one place this
  differs from "fixed target = min + overprovision".
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

import math
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
    "make_autoscaler",
]

DEFAULT_DECISION_INTERVAL = 5.0
DEFAULT_ZERO_DECISION_INTERVAL = 1.0
DEFAULT_QPS_WINDOW = 60.0
# Shortest span a QPS is measured over while the first window fills (see the module docstring).
MIN_QPS_SPAN = 1.0
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

    @property
    def decision_interval(self) -> float:
        """Seconds the caller should wait before the next :meth:`decide`."""
        ...


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
        # (+1 up / -1 down, time of the first decide that saw the raw target on that side).
        self._pending: tuple[int, float] | None = None
        # Start of the period the QPS meter has watched; None until the first decide.
        self._watched_since: float | None = None

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
        """Faster while an autoscaled service is at zero: its first request is waiting."""
        if self._policy.autoscaling and self._target == 0:
            return self._zero_interval
        return self._interval

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        """New bounds apply at once (clipping needs no delay: the user asked for them).

        A pending up or down clock is kept; the next decision restarts it if the new policy puts
        the raw target on the other side. The QPS meter keeps its history: load did not change.
        """
        self._policy = policy
        self._target = _clip(self._target, policy)

    def decide(self, now: float, request_times: Sequence[float]) -> Decision:
        """See the module docstring; correct whenever called, at whatever interval."""
        qps = self._measure(now, request_times)
        policy = self._policy
        if not policy.autoscaling:
            # min == max here (the spec enforces it when target_qps_per_replica is unset).
            self._pending = None
            self._target = _clip(policy.min_replicas, policy)
            n = self._target
            size = "no replicas" if n == 0 else f"{n} replica{'s' if n != 1 else ''}"
            reason = f"fixed size of {size} (autoscaling is off); QPS {_fmt_qps(qps)}"
            return self._decision(qps, self._target, reason)

        tq = policy.target_qps_per_replica
        assert tq is not None  # autoscaling implies it
        ratio = qps / tq
        wanted = max(0, math.ceil(ratio - ratio * _CEIL_SLACK))
        raw = _clip(wanted, policy)
        want = f"QPS {_fmt_qps(qps)} wants {wanted}"
        if wanted > raw:
            want += f", capped at max_replicas {raw}"
        elif wanted < raw:
            want += f", raised to min_replicas {raw}"

        current = self._target
        if raw == current:
            self._pending = None
            reason = f"{want} (= current {current}): holding {current}"
        elif current == 0:
            self._pending = None
            self._target = raw
            reason = (
                f"{want} while at zero: scaling up to {raw} at once (scale from zero does not "
                f"wait for the {_fmt_seconds(policy.upscale_delay_seconds)} upscale delay)"
            )
        else:
            direction = 1 if raw > current else -1
            delay = (
                policy.upscale_delay_seconds if direction > 0 else policy.downscale_delay_seconds
            )
            if self._pending is None or self._pending[0] != direction:
                self._pending = (direction, now)
            held = max(0.0, now - self._pending[1])
            sign, kind, verb = (
                (">", "upscale", "up") if direction > 0 else ("<", "downscale", "down")
            )
            if held >= delay:
                self._pending = None
                self._target = raw
                reason = (
                    f"{want} ({sign} current {current}) for {_fmt_seconds(held)}, past the "
                    f"{_fmt_seconds(delay)} {kind} delay: scaling {verb} to {raw}"
                )
            else:
                reason = (
                    f"{want} ({sign} current {current}) for {_fmt_seconds(held)} of "
                    f"{_fmt_seconds(delay)} {kind} delay: holding {current}"
                )
        return self._decision(qps, raw, reason)

    def _measure(self, now: float, request_times: Sequence[float]) -> float:
        """Requests per second over the last window, or over what has been watched of it."""
        low = now - self._window
        count = 0
        oldest = now
        for stamp in request_times:
            if low < stamp <= now:
                count += 1
                oldest = min(oldest, stamp)
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
