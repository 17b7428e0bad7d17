"""A policy from its name in the spec and its options.

Apart from :mod:`corral.balancer.policies` because the LLM policies
(:mod:`corral.balancer.prefix_policy`) build on the load policies there: this module is above
both, so neither imports the other's users.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from corral.balancer.policies import (
    DEFAULT_BALANCE,
    InstanceAwareLeastLoad,
    LeastLoad,
    Policy,
    PowerOfTwo,
    RoundRobin,
)

if TYPE_CHECKING:
    from corral.balancer.load_board import LoadBoard

__all__ = ["ALIASES", "POLICY_NAMES", "make_policy", "shares_load"]

POLICY_NAMES: Final = (
    "round_robin",
    "least_load",
    "power_of_two",
    "prefix_affinity",
    "instance_aware_least_load",
)
# Other routers' names for the same thing (SGLang's and vLLM's routers: ``cache_aware``).
ALIASES: Final = {"cache_aware": "prefix_affinity", "prefix_aware": "prefix_affinity"}


def shares_load(name: str) -> bool:
    """Whether the policy ``name`` weighs a replica's load (choosing by it, or bounding it by
    the fleet's mean), and so every balancer worker's counts
    (:mod:`corral.balancer.load_board`) where they share one: every policy but round robin."""
    return ALIASES.get(name, name) in POLICY_NAMES and name != "round_robin"


def make_policy(
    name: str,
    *,
    prompt_field: str | None = None,
    balance: float = DEFAULT_BALANCE,
    session_header: str | None = None,
    session_cookie: str | None = None,
    affinity_file: str | None = None,
    load_board: LoadBoard | None = None,
    streams: Mapping[int, int] | None = None,
    stream_board: LoadBoard | None = None,
    share_balance: float | None = None,
    max_in_flight: int | None = None,
) -> Policy:
    """Build a fresh policy from its service-YAML name and options.

    Raises ValueError for an unknown name, listing the valid ones, so a typo in the YAML is
    reported at validation rather than silently falling back to a default. A session header or
    cookie wraps any policy in session affinity. ``max_in_flight`` is the spec's limit per
    replica (``prefix_affinity`` caps its DOC_SLACK there).
    """
    name = ALIASES.get(name, name)
    if name == "prefix_affinity" or session_header or session_cookie:
        # Imported here: a service under a load policy never loads the prompt readers.
        from corral.balancer.affinity import AffinityTable
        from corral.balancer.prefix_policy import SHARE_BALANCE, PrefixAffinity, SessionAffinity
    policy: Policy
    if name == "round_robin":
        policy = RoundRobin()
    elif name == "least_load":
        policy = LeastLoad()
    elif name == "power_of_two":
        policy = PowerOfTwo()
    elif name == "instance_aware_least_load":
        policy = InstanceAwareLeastLoad()
    elif name == "prefix_affinity":
        table = AffinityTable.open(Path(affinity_file)) if affinity_file else None
        policy = PrefixAffinity(
            prompt_field=prompt_field,
            balance=balance,
            table=table,
            board=load_board,
            streams=streams,
            stream_board=stream_board,
            # Not a spec field: bench/llm_routing.py compares settings with it.
            share_balance=SHARE_BALANCE if share_balance is None else share_balance,
            max_in_flight=max_in_flight,
        )
    else:
        raise ValueError(
            f"unknown load balancing policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}"
        )
    if session_header or session_cookie:
        table = AffinityTable.open(Path(affinity_file)) if affinity_file else None
        policy = SessionAffinity(
            policy, header=session_header, cookie=session_cookie, balance=balance, table=table
        )
    return policy
