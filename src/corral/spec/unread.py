"""Warnings for ``service.load_balancer`` settings a spec gives but its policy never reads.

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

__all__ = ["unread_balancer_settings"]


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
