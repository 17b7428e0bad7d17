"""Autoscaling on what LLM engines are carrying, and on mixed-accelerator fleets.

One LLM request can cost a hundred times another, so requests per second say little about
how loaded an LLM fleet is. Its engines know, and report it (``corral.dataplane.engines``):

* ``queue_depth`` (``replica_policy.target_queue_per_replica``): every request the service's
  engines hold, running and waiting (the balancer's in-flight count where a replica publishes
  none), plus the requests held in the balancer waiting for room: ``ceil(depth / target)``;
* ``kv_cache_usage`` (``target_kv_cache_usage``, 0..1): the KV-cache use the engines report,
  summed over the ready replicas (replicas' worth of cache in use): ``ceil(sum / target)``,
  so two replicas at 0.95 with a target of 0.8 want three;
* ``tokens_per_second`` (``target_tokens_per_second_per_replica``): generated tokens per second
  summed over the ready replicas: ``ceil(sum / target)``.

:class:`EngineAutoscaler` follows the highest of those set (and of ``ceil(qps / target)`` when
``target_qps_per_replica`` is set too), clipped to ``[min, max]``.

:class:`InstanceAwareAutoscaler` is SkyServe's for ``target_qps_per_replica: {H100: 10, A100:
5}``: the fleet's capacity is the sum of its live replicas' targets by their accelerator
(READY, STARTING, PROVISIONING, as SkyServe counts); request rate at or over it asks for the
live replicas plus ``ceil(excess / the largest target)``; under it, the fewest READY replicas,
largest targets first, whose sum exceeds the rate. A replica whose accelerator no key names
counts as the smallest target. From zero, ``ceil(rate / the largest target)``.

Both sample their signal at each decision and keep the request-rate autoscaler's rules as
SkyServe counts them (:func:`corral.autoscale.hold_seconds`): a higher target is followed once
it has lasted the upscale hold, a lower one once it has lasted the downscale hold, at once from
zero (a request waiting for the first replica counts), and ``num_overprovision`` is added last.
Pure: the controller passes the engines' stats, the fleet and the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from corral.autoscale import (
    DEFAULT_DECISION_INTERVAL,
    DEFAULT_ZERO_DECISION_INTERVAL,
    Autoscaler,
    Decision,
    hold_seconds,
    make_autoscaler,
)
from corral.spec import ReplicaPolicy, qps_of_accelerator

__all__ = [
    "EngineAutoscaler",
    "InstanceAwareAutoscaler",
    "QueueDepthAutoscaler",
    "SampledAutoscaler",
    "engine_load",
    "fits",
    "make_scaler",
    "queue_depth",
]

# A replica's status and accelerator (None: not placed on a known GPU), as the controller sees.
Fleet = Sequence[tuple[str, str | None]]
# Statuses whose replicas count toward the fleet's capacity (SkyServe's), and live ones.
CAPACITY = frozenset({"READY", "STARTING", "PROVISIONING"})
LIVE = CAPACITY | {"PENDING", "NOT_READY"}
WINDOW = 60.0  # the request rate is over the last minute, as SkyServe's (CORRAL_QPS_WINDOW)
_SLACK = 1e-9  # float noise must not ask for one replica more


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - abs(value) * _SLACK))


class SampledAutoscaler:
    """The hold shared by the autoscalers here: the raw target is sampled at each decision."""

    def __init__(
        self,
        policy: ReplicaPolicy,
        *,
        decision_interval: float = DEFAULT_DECISION_INTERVAL,
        zero_decision_interval: float = DEFAULT_ZERO_DECISION_INTERVAL,
        qps_window: float = WINDOW,
    ) -> None:
        self._policy = policy
        self._window = qps_window
        self._interval = decision_interval
        self._zero_interval = zero_decision_interval
        self._target = policy.min_replicas
        self._since: tuple[int, float] | None = None  # (direction, since when) of the raw target

    @property
    def policy(self) -> ReplicaPolicy:
        return self._policy

    @property
    def decision_interval(self) -> float:
        return self._zero_interval if self._target == 0 else self._interval

    def lookback(self, now: float) -> float:
        return self._window

    def sample(self, stats: Mapping[str, Any] | None, fleet: Callable[[], Fleet]) -> None:
        """What the balancer's merged stats and the replicas say now (before ``decide``)."""

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        self._policy = policy
        self._target = max(policy.min_replicas, min(policy.max_replicas, self._target))
        self._since = None

    def _wanted(self, qps: float) -> tuple[int, str]:
        """The replicas the load asks for (before clipping) and what it is, in words."""
        raise NotImplementedError

    def decide(self, now: float, request_times: Sequence[float]) -> Decision:
        policy = self._policy
        recent = [t for t in request_times if now - self._window < t <= now]
        qps = len(recent) / self._window
        wanted, load = self._wanted(qps)
        raw = max(policy.min_replicas, min(policy.max_replicas, wanted))
        if self._target == 0 and recent:
            # At zero no engine holds anything: a request waiting for the first replica is
            # the demand (as with the request-rate autoscaler, which leaves zero at once).
            raw = max(raw, min(1, policy.max_replicas))
        reason = self._move(now, raw, load)
        final = self._target + policy.num_overprovision if self._target else 0
        return Decision(target=final, qps=qps, raw_target=raw, reason=reason)

    def _move(self, now: float, raw: int, load: str) -> str:
        policy = self._policy
        if raw == self._target:
            self._since = None
            return f"{load}: {raw} replica(s)"
        direction = 1 if raw > self._target else -1
        if self._target == 0:
            self._target, self._since = raw, None
            return f"{load}: up from zero to {raw} at once"
        if self._since is None or self._since[0] != direction:
            self._since = (direction, now)
        delay = policy.upscale_delay_seconds if direction > 0 else policy.downscale_delay_seconds
        held = now - self._since[1]
        if held >= hold_seconds(delay):
            self._target, self._since = raw, None
            return f"{load}: {raw} replica(s), held {held:.0f}s"
        way = "up" if direction > 0 else "down"
        return (
            f"{load}: want {raw} replica(s); staying at {self._target} until the scale-{way} "
            f"hold of {hold_seconds(delay):.0f}s is over ({held:.0f}s so far)"
        )


class EngineAutoscaler(SampledAutoscaler):
    """See the module docstring; ``observe`` (or ``sample``) the engines before ``decide``."""

    def __init__(self, policy: ReplicaPolicy, **kwargs: float) -> None:
        super().__init__(policy, **kwargs)
        self._depth = 0.0
        self._kv = 0.0
        self._tokens = 0.0

    def observe(self, depth: float, kv_usage: float = 0.0, tokens_per_second: float = 0.0) -> None:
        """The requests the engines and balancer hold, the KV-cache use summed over the ready
        replicas, and the tokens per second they generate, now."""
        self._depth = max(0.0, float(depth))
        self._kv = max(0.0, float(kv_usage))
        self._tokens = max(0.0, float(tokens_per_second))

    def sample(self, stats: Mapping[str, Any] | None, fleet: Callable[[], Fleet]) -> None:
        self.observe(*engine_load(stats))

    def _wanted(self, qps: float) -> tuple[int, str]:
        p = self._policy
        signals = (
            (p.target_queue_per_replica, self._depth, "request(s) in the engines and balancer"),
            (p.target_kv_cache_usage, self._kv, "replicas' worth of KV cache in use"),
            (p.target_tokens_per_second_per_replica, self._tokens, "tokens/s generated"),
            (p.target_qps_per_replica, qps, "requests/s"),
        )
        wants = [
            (_ceil(value / target), value, what, target)
            for target, value, what in signals
            if target
        ]
        if not wants:
            return p.min_replicas, "no target set"
        words = "; ".join(
            f"{value:.3g} {what} ({n} at {target:g} each)" for n, value, what, target in wants
        )
        return max(n for n, *_ in wants), words


# The name under which the queue-only autoscaler was introduced.
QueueDepthAutoscaler = EngineAutoscaler


class InstanceAwareAutoscaler(SampledAutoscaler):
    """See the module docstring; ``observe_fleet`` (or ``sample``) before ``decide``."""

    def __init__(self, policy: ReplicaPolicy, **kwargs: float) -> None:
        super().__init__(policy, **kwargs)
        self._fleet: list[tuple[str, str | None]] = []

    def observe_fleet(self, fleet: Fleet) -> None:
        """Every replica of the service: its status and its accelerator (None: not known)."""
        self._fleet = list(fleet)

    def sample(self, stats: Mapping[str, Any] | None, fleet: Callable[[], Fleet]) -> None:
        self.observe_fleet(fleet())

    def _qps_of(self, accelerator: str | None) -> float:
        targets = self._policy.target_qps_per_accelerator or {"": 1.0}
        qps = qps_of_accelerator(targets, accelerator)
        return qps if qps is not None else min(targets.values())

    def _wanted(self, qps: float) -> tuple[int, str]:
        targets = self._policy.target_qps_per_accelerator or {"": 1.0}
        best = max(targets.values())
        live = [accel for status, accel in self._fleet if status in LIVE]
        capacity = sum(self._qps_of(a) for status, a in self._fleet if status in CAPACITY)
        load = f"QPS {qps:.3g} against {capacity:g} the fleet serves"
        if capacity <= 0:
            return _ceil(qps / best), load
        if qps >= capacity:
            return len(live) + _ceil((qps - capacity) / best), load
        ready = sorted((self._qps_of(a) for s, a in self._fleet if s == "READY"), reverse=True)
        count, total = 0, 0.0
        for each in ready or [best]:
            count, total = count + 1, total + each
            if total > qps:
                break
        return count, load


def fits(scaler: Autoscaler, policy: ReplicaPolicy) -> bool:
    """Whether ``scaler`` is the kind ``policy`` needs (else :func:`make_scaler` anew)."""
    if policy.target_qps_per_accelerator:
        return isinstance(scaler, InstanceAwareAutoscaler)
    if policy.engine_targets:
        return isinstance(scaler, EngineAutoscaler)
    return not isinstance(scaler, SampledAutoscaler)


def make_scaler(
    policy: ReplicaPolicy, *, decision_interval: float, qps_window: float
) -> Autoscaler:
    """The autoscaler a policy asks for: instance-aware, on the engines, or on request rate
    (:func:`corral.autoscale.make_autoscaler`)."""
    if policy.target_qps_per_accelerator:
        return InstanceAwareAutoscaler(
            policy, decision_interval=decision_interval, qps_window=qps_window
        )
    if policy.engine_targets:
        return EngineAutoscaler(policy, decision_interval=decision_interval, qps_window=qps_window)
    return make_autoscaler(policy, decision_interval=decision_interval, qps_window=qps_window)


def engine_load(stats: Mapping[str, Any] | None) -> tuple[float, float, float]:
    """(queue depth, KV-cache use summed, tokens per second summed) of the ready replicas,
    from the balancer's merged stats (corral.dataplane.plane). A replica that reports no
    KV-cache use or token rate adds nothing to those."""
    stats = stats or {}
    engines: Mapping[str, Mapping[str, Any]] = stats.get("engines") or {}
    kv = tokens = 0.0
    for rid, replica in (stats.get("replicas") or {}).items():
        signals = engines.get(str(rid)) or {}
        if replica.get("ready"):
            kv += float(signals.get("kv_usage") or 0.0)
            tokens += float(signals.get("tokens_per_second") or 0.0)
    return queue_depth(stats), kv, tokens


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
