"""Autoscaling on what LLM engines are carrying, not on request rate.

One LLM request can cost a hundred times another, so requests per second say little about
how loaded an LLM fleet is. Its engines know: the requests in each one's batch and queue. The
spec's ``service.autoscaling.metrics: [{type: queue_depth, target: N}]`` (SkyServe's spelling)
asks for ``ceil(depth / N)`` replicas, clipped to ``[min, max]``, where depth is every request
the service's engines hold (running and waiting, as their metrics say; the balancer's in-flight
count where a replica publishes none) plus the requests held in the balancer waiting for room.

The same rules as the request-rate autoscaler, kept as SkyServe counts them
(:func:`corral.autoscale.hold_seconds`): a higher target is followed once it has lasted the
upscale hold, a lower one once it has lasted the downscale hold, at once from zero, and
``num_overprovision`` is added last. Pure: the controller passes the depth and the clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from corral.autoscale import (
    DEFAULT_DECISION_INTERVAL,
    DEFAULT_ZERO_DECISION_INTERVAL,
    Decision,
    hold_seconds,
)
from corral.spec import ReplicaPolicy


class QueueDepthAutoscaler:
    """See the module docstring; ``observe`` the depth before each ``decide``."""

    def __init__(
        self,
        policy: ReplicaPolicy,
        *,
        decision_interval: float = DEFAULT_DECISION_INTERVAL,
        zero_decision_interval: float = DEFAULT_ZERO_DECISION_INTERVAL,
    ) -> None:
        self._policy = policy
        self._interval = decision_interval
        self._zero_interval = zero_decision_interval
        self._target = policy.min_replicas
        self._depth = 0.0
        self._since: tuple[int, float] | None = None  # (direction, since when) of the raw target

    @property
    def policy(self) -> ReplicaPolicy:
        return self._policy

    @property
    def decision_interval(self) -> float:
        return self._zero_interval if self._target == 0 else self._interval

    def lookback(self, now: float) -> float:
        return 60.0  # the request rate is shown, not decided on

    def observe(self, depth: float) -> None:
        """The requests the service's engines and balancer hold now."""
        self._depth = max(0.0, float(depth))

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        self._policy = policy
        self._target = max(policy.min_replicas, min(policy.max_replicas, self._target))
        self._since = None

    def decide(self, now: float, request_times: Sequence[float]) -> Decision:
        policy = self._policy
        per = policy.target_queue_per_replica or 1.0
        raw = max(policy.min_replicas, min(policy.max_replicas, math.ceil(self._depth / per)))
        recent = [t for t in request_times if t > now - 60.0]
        qps = len(recent) / 60.0
        if self._target == 0 and recent:
            # At zero no engine holds anything: a request waiting for the first replica is
            # the demand (as with the request-rate autoscaler, which leaves zero at once).
            raw = max(raw, min(1, policy.max_replicas))
        reason = self._move(now, raw)
        final = self._target + policy.num_overprovision if self._target else 0
        return Decision(target=final, qps=qps, raw_target=raw, reason=reason)

    def _move(self, now: float, raw: int) -> str:
        policy = self._policy
        depth = f"{self._depth:g} request(s) in the engines and the balancer"
        per = f"{policy.target_queue_per_replica:g}"
        if raw == self._target:
            self._since = None
            return f"{depth}: {raw} replica(s) at {per} each"
        direction = 1 if raw > self._target else -1
        if self._target == 0:
            self._target, self._since = raw, None
            return f"{depth}: up from zero at once"
        if self._since is None or self._since[0] != direction:
            self._since = (direction, now)
        delay = policy.upscale_delay_seconds if direction > 0 else policy.downscale_delay_seconds
        held = now - self._since[1]
        if held >= hold_seconds(delay):
            self._target, self._since = raw, None
            return f"{depth}: {raw} replica(s) at {per} each, held {held:.0f}s"
        way = "up" if direction > 0 else "down"
        return (
            f"{depth} want {raw} replica(s); staying at {self._target} until the scale-{way} "
            f"hold of {hold_seconds(delay):.0f}s is over ({held:.0f}s so far)"
        )


def queue_depth(stats: Mapping[str, Any] | None) -> float:
    """The requests a service's engines and balancer hold, from the balancer's merged stats
    (corral.dataplane.plane): running plus waiting as each engine reports them, the balancer's
    in-flight count for a replica that reports nothing, plus the requests held in the balancer."""
    stats = stats or {}
    engines: Mapping[str, Mapping[str, Any]] = stats.get("engines") or {}
    depth = float(stats.get("held") or 0)
    for rid, replica in (stats.get("replicas") or {}).items():
        if not replica.get("ready"):
            continue
        signals = engines.get(str(rid))
        if signals and ("waiting" in signals or "running" in signals):
            depth += float(signals.get("waiting", 0.0)) + float(signals.get("running", 0.0))
        else:
            depth += float(replica.get("in_flight") or 0)
    return depth
