"""Autoscaling on what LLM engines are carrying, and on mixed-accelerator fleets.

One LLM request can cost a hundred times another, so requests per second say little about
how loaded an LLM fleet is. Its engines know, and report it (``corral.dataplane.engines``):

* ``queue_depth`` (``replica_policy.target_queue_per_replica``): the requests waiting for a
  slot, in the engines' queues (their ``waiting`` gauges; the balancer's in-flight count where a
  replica publishes none) and held in the balancer: ``ceil(depth / target)``. As SkyServe v2
  reads it (``sum(vllm:num_requests_waiting) / target``): requests an engine is running are its
  batch at work, not a queue, and a vLLM engine runs hundreds at once, so counting them would
  scale a fleet that keeps up (SkyServe's ``target: 5`` would want a replica per 5 streams);
* ``kv_cache_usage`` (``target_kv_cache_usage``, 0..1): the KV-cache use the engines report,
  summed over the ready replicas (replicas' worth of cache in use): ``ceil(sum / target)``,
  so two replicas at 0.95 with a target of 0.8 want three;
* ``tokens_per_second`` (``target_tokens_per_second_per_replica``): generated tokens per second
  summed over the ready replicas: ``ceil(sum / target)``.

:class:`EngineAutoscaler` follows the highest of those set (and of ``ceil(qps / target)`` when
``target_qps_per_replica`` is set too), clipped to ``[min, max]``.

:class:`InstanceAwareAutoscaler` is SkyServe's for ``target_qps_per_replica: {H100: 10, A100:
5}``: the fleet's capacity is the sum of its live replicas' targets by their accelerator
(READY, STARTING, PROVISIONING, as SkyServe counts); request rate at or over it asks for those
replicas plus ``ceil(excess / the largest target)`` (not every live one, as SkyServe: a
replica PENDING for a GPU or NOT_READY adds nothing to the capacity, so counting it raised the
target by the excess again at every upscale hold, up to ``max_replicas``); under it, the fewest
READY replicas, largest targets first, whose sum exceeds the rate (then the STARTING and
PROVISIONING ones, where the READY ones do not serve it); no request in the window
asks for none (SkyServe's loop asks for one READY replica even then, so ``min_replicas: 0``
was never reached). A replica whose accelerator no key names counts as the smallest target.
From zero, ``ceil(rate / the largest target)``.

Both sample their signal at each decision and keep the request-rate autoscaler's rules as
SkyServe counts them: SkyServe looks every 20 s and moves at the ``int(delay / 20)``-th look in
a row on one side of its target (:mod:`corral.autoscale_phases`). A sample holds until the next
one, and corral runs those looks at every phase of SkyServe's clock at once, following each
move some phase makes past its target, as the request-rate autoscaler does: a look every 5 s
(every sample) would need four times the looks in a row SkyServe needs, and on a signal as
noisy as an engine's queue a single sample under the target would restart the count. At once
from zero (a request waiting for the first replica counts), and ``num_overprovision`` is added
last. Pure: the controller passes the engines' stats, the fleet and the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from corral.arrivals import Arrivals, as_arrivals
from corral.autoscale import (
    DEFAULT_DECISION_INTERVAL,
    DEFAULT_ZERO_DECISION_INTERVAL,
    Autoscaler,
    Decision,
    FixedAutoscaler,
    RequestRateAutoscaler,
    hold_words,
    make_autoscaler,
    past,
)
from corral.autoscale_phases import PhaseFamily, threshold
from corral.figures import figure
from corral.spec import ReplicaPolicy, qps_of_accelerator

__all__ = [
    "EngineAutoscaler",
    "InstanceAwareAutoscaler",
    "SampledAutoscaler",
    "engine_load",
    "fits",
    "make_scaler",
    "queue_depth",
]

# A replica's status and accelerator (None: not placed on a known GPU), as the controller sees.
Fleet = Sequence[tuple[str, str | None]]
# Statuses whose replicas count toward the fleet's capacity (SkyServe's).
CAPACITY = frozenset({"READY", "STARTING", "PROVISIONING"})
WINDOW = 60.0  # the request rate is over the last minute, as SkyServe's (CORRAL_QPS_WINDOW)
_SLACK = 1e-9  # float noise must not ask for one replica more
_LOOK_SLACK = 1e-6  # a look due at the instant of a decision is run by that decision


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
        # SkyServe's counters at every phase of its 20 s clock (made at the first decision),
        # and the previous sample, which stands for the raw target until the next one.
        self._phases: PhaseFamily | None = None
        self._last: tuple[float, int | None] | None = None

    @property
    def policy(self) -> ReplicaPolicy:
        return self._policy

    @property
    def decision_interval(self) -> float:
        return self._zero_interval if self._target == 0 else self._interval

    @property
    def held_target(self) -> int:
        """The hysteresis target, without ``num_overprovision``."""
        return self._target

    def start_at(self, target: int) -> None:
        """Go on from ``target`` (clipped into the bounds) instead of ``min_replicas``."""
        self._target = max(self._policy.min_replicas, min(self._policy.max_replicas, target))
        self._since = None

    def lookback(self, now: float) -> float:
        return self._window

    def sample(self, stats: Mapping[str, Any] | None, fleet: Callable[[], Fleet]) -> None:
        """What the balancer's merged stats and the replicas say now (before ``decide``)."""

    def reset_policy(self, policy: ReplicaPolicy) -> None:
        self._policy = policy
        self._target = max(policy.min_replicas, min(policy.max_replicas, self._target))
        self._since = None
        # The raw target may mean something else now: every phase restarts from the target.
        if self._phases is not None:
            self._phases.reset(self._target)
        self._last = None

    def _wanted(self, qps: float) -> tuple[int, str]:
        """The replicas the load asks for (before clipping) and what it is, in words."""
        raise NotImplementedError

    def decide(self, now: float, request_times: Sequence[float] | Arrivals) -> Decision:
        policy = self._policy
        times = as_arrivals(request_times)
        recent = times.count(times.right(now - self._window), times.right(now))
        qps = recent / self._window
        wanted, load = self._wanted(qps)
        raw = max(policy.min_replicas, min(policy.max_replicas, wanted))
        if recent:
            # A request in the window is demand for a replica, whatever the engines hold at
            # this instant: at zero, the request waiting for the first one (as with the
            # request-rate autoscaler, which leaves zero at once); above it, a light load whose
            # requests are all done by the sample (a depth of 0 at most samples) must not
            # take the last replica away, and the next request into a cold start.
            raw = max(raw, min(1, policy.max_replicas))
        reason = self._move(now, raw, load)
        final = self._target + policy.num_overprovision if self._target else 0
        return Decision(target=final, qps=qps, raw_target=raw, reason=reason)

    def _move(self, now: float, raw: int, load: str) -> str:
        policy = self._policy
        if self._phases is None:
            self._phases = PhaseFamily(self._target, now)
        phases, last = self._phases, self._last
        self._last = (now, raw)
        if self._target == 0 and raw > 0:
            self._target, self._since = raw, None
            phases.reset(raw)
            phases.skip(now + _LOOK_SLACK)
            return f"{load}: up from zero to {raw} at once"
        up = threshold(policy.upscale_delay_seconds)
        down = threshold(policy.downscale_delay_seconds)
        raws = [(now, raw)] if last is None else [last, (now, raw)]
        moved = None
        for move in phases.advance(now + _LOOK_SLACK, raws, up, down):
            if (move.after - move.before) * (move.after - self._target) > 0:
                self._target, moved = move.after, move
        if moved is not None:
            held = now - self._since[1] if self._since is not None else 0.0
            self._since = None
            if raw != self._target:
                self._since = (1 if raw > self._target else -1, now)
            return (
                f"{load}: {self._target} replica(s), held {held:.0f}s (SkyServe's looks "
                f"20s apart: the one {now - moved.at:.1f}s ago moved from {moved.before})"
            )
        if raw == self._target:
            self._since = None
            return f"{load}: {raw} replica(s)"
        direction = 1 if raw > self._target else -1
        if self._since is None or self._since[0] != direction:
            self._since = (direction, now)
        delay = policy.upscale_delay_seconds if direction > 0 else policy.downscale_delay_seconds
        held = now - self._since[1]
        kind = "upscale" if direction > 0 else "downscale"
        return (
            f"{load}: want {raw} replica(s) for {held:.0f}s of the {hold_words(delay, kind)}: "
            f"holding {self._target}{past(held, delay)}"
        )


class EngineAutoscaler(SampledAutoscaler):
    """See the module docstring; ``observe`` (or ``sample``) the engines before ``decide``."""

    def __init__(self, policy: ReplicaPolicy, **kwargs: float) -> None:
        super().__init__(policy, **kwargs)
        self._depth = 0.0
        self._kv = 0.0
        self._tokens = 0.0

    def observe(self, depth: float, kv_usage: float = 0.0, tokens_per_second: float = 0.0) -> None:
        """The requests waiting in the engines and balancer, the KV-cache use summed over the
        ready replicas, and the tokens per second they generate, now."""
        self._depth = max(0.0, float(depth))
        self._kv = max(0.0, float(kv_usage))
        self._tokens = max(0.0, float(tokens_per_second))

    def sample(self, stats: Mapping[str, Any] | None, fleet: Callable[[], Fleet]) -> None:
        self.observe(*engine_load(stats))

    def _wanted(self, qps: float) -> tuple[int, str]:
        p = self._policy
        signals = (
            (p.target_queue_per_replica, self._depth, "request(s) waiting in engines and balancer"),
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
            f"{figure(value)} {what} ({n} at {target:g} each)" for n, value, what, target in wants
        )
        return max(n for n, *_ in wants), words


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
        serving = [self._qps_of(a) for status, a in self._fleet if status in CAPACITY]
        capacity = sum(serving)
        load = f"QPS {figure(qps)} against {capacity:g} the fleet serves"
        if capacity <= 0 or qps <= 0:
            return _ceil(qps / best), load
        if qps >= capacity:
            return len(serving) + _ceil((qps - capacity) / best), load
        ready = sorted((self._qps_of(a) for s, a in self._fleet if s == "READY"), reverse=True)
        # Then those on their way (STARTING, PROVISIONING), when the READY ones do not serve
        # the rate: counting the READY ones alone asked to scale away the replica about to
        # serve the excess, and one that loads for longer than the downscale hold never did.
        coming = sorted(
            (self._qps_of(a) for s, a in self._fleet if s in CAPACITY and s != "READY"),
            reverse=True,
        )
        count, total = 0, 0.0
        for each in ready + coming or [best]:
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
    policy: ReplicaPolicy,
    *,
    decision_interval: float,
    qps_window: float,
    previous: Autoscaler | None = None,
    running: int | None = None,
) -> Autoscaler:
    """The autoscaler a policy asks for: instance-aware, on the engines, or on request rate
    (:func:`corral.autoscale.make_autoscaler`). With ``previous`` (the autoscaler of the
    version before, of another kind), it goes on from that one's target, clipped into the new
    bounds, as :meth:`reset_policy` does for one of the same kind: a spec update that adds or
    removes an engine target must not cut a loaded fleet to ``min_replicas`` at once. With
    ``running`` (a restarted daemon's first: the target its live replicas make), from that."""
    scaler: Autoscaler
    if policy.target_qps_per_accelerator:
        scaler = InstanceAwareAutoscaler(
            policy, decision_interval=decision_interval, qps_window=qps_window
        )
    elif policy.engine_targets:
        scaler = EngineAutoscaler(
            policy, decision_interval=decision_interval, qps_window=qps_window
        )
    else:
        scaler = make_autoscaler(policy, decision_interval=decision_interval, qps_window=qps_window)
    kinds = (SampledAutoscaler, RequestRateAutoscaler, FixedAutoscaler)
    if isinstance(previous, kinds) and isinstance(scaler, kinds):
        scaler.start_at(previous.held_target)
    elif running is not None and isinstance(scaler, kinds):
        scaler.start_at(running)
    return scaler


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
    """The requests waiting for a slot, from the balancer's merged stats
    (corral.dataplane.plane): in each ready engine's queue as it reports it (not those it
    runs), the balancer's in-flight count for a replica that reports neither, plus the requests
    held in the balancer and those waiting there for a first ready replica (at zero no engine
    reports a queue: without them a burst at zero asked for one replica, and the rest waited
    for it through the upscale hold)."""
    stats = stats or {}
    engines: Mapping[str, Mapping[str, Any]] = stats.get("engines") or {}
    depth = float(stats.get("held") or 0) + float(stats.get("awaiting") or 0)
    for rid, replica in (stats.get("replicas") or {}).items():
        if not replica.get("ready"):
            continue
        signals = engines.get(str(rid))
        if signals and ("waiting" in signals or "running" in signals):
            depth += float(signals.get("waiting", 0.0))
        else:
            depth += float(replica.get("in_flight") or 0)
    return depth
