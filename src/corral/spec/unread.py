"""Warnings for settings a spec gives that nothing will act on: ``service.load_balancer``
settings its policy never reads, and autoscaling targets with no room to scale.

Each of these is read only under some policy or with another setting (docs/llm.md): a
``prompt_field`` only by ``prefix_affinity``, ``balance_factor`` only by ``prefix_affinity`` and
session affinity, the hold's bounds only with ``max_in_flight_per_replica``. Given anyway, they
were accepted in silence and did nothing, while docs/spec.md promises that a field without
effect is said by ``corral validate``. Only fields the spec wrote are judged: a default is
never a warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.spec.service import ServiceSection

__all__ = ["unread_balancer_settings", "unread_scaling_targets"]

# Autoscaling targets that act only between min_replicas and max_replicas. Not the per-accelerator
# map: instance_aware_least_load weighs replicas by it whatever the bounds.
_TARGETS = (
    "target_qps_per_replica",
    "target_queue_per_replica",
    "target_kv_cache_usage",
    "target_tokens_per_second_per_replica",
)


def unread_balancer_settings(service: ServiceSection) -> list[str]:
    """One warning per ``service.load_balancer`` field given that nothing will read."""
    lb = service.load_balancer
    given = lb.model_fields_set
    policy = service.load_balancing_policy
    prefix = policy == "prefix_affinity"
    prefers = prefix or bool(lb.session_header or lb.session_cookie)
    held = lb.max_in_flight_per_replica is not None
    unread: list[tuple[str, str]] = []
    if "prompt_field" in given and not prefix:
        unread.append(("prompt_field", f"only prefix_affinity reads prompts, not {policy}"))
    if "balance_factor" in given and not prefers:
        why = "it bounds prefix_affinity and session affinity (session_header/session_cookie)"
        unread.append(("balance_factor", f"{why}, not {policy}"))
    for field in ("hold_timeout_seconds", "hold_patience_seconds"):
        if field in given and not held:
            unread.append((field, "requests are held only with max_in_flight_per_replica set"))
    if "hold_patience_seconds" in given and held and not prefers:
        why = "a held request waits for a preferred replica only under prefix_affinity or"
        unread.append(("hold_patience_seconds", f"{why} session affinity, not {policy}"))
    return [f"service.load_balancer.{field}: has no effect: {why}" for field, why in unread]


def unread_scaling_targets(service: ServiceSection) -> list[str]:
    """A target with min_replicas equal to max_replicas scales nothing, and was accepted in
    silence (SkyServe is as silent). The form with no max_replicas at all is said by the
    service section itself (``ServiceSection._notes``)."""
    policy = service.replica_policy
    given = [name for name in _TARGETS if getattr(policy, name) is not None]
    if not given or policy.min_replicas != policy.max_replicas:
        return []
    scaling = service.autoscaling
    if scaling is not None and service.max_replicas is None and scaling.max_replicas is None:
        return []  # said already: no max_replicas
    where = "service.autoscaling" if scaling is not None else f"service.replica_policy.{given[0]}"
    return [
        f"{where}: has no effect: min_replicas and max_replicas are both "
        f"{policy.min_replicas}, so no target scales the service; raise max_replicas to let "
        "it grow"
    ]
