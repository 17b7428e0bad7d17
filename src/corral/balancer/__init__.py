"""Per-service load balancer: a streaming reverse proxy fed the ready set in-process.

Imports nothing else from corral; the controller owns one :class:`LoadBalancer` per service.
"""

from corral.balancer.policies import LeastLoad, Policy, PowerOfTwo, RoundRobin, make_policy
from corral.balancer.proxy import LoadBalancer

__all__ = ["LeastLoad", "LoadBalancer", "Policy", "PowerOfTwo", "RoundRobin", "make_policy"]
