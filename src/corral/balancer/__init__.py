"""Per-service load balancer: a streaming reverse proxy fed the ready set in-process.

Imports nothing else from corral; the controller owns one :class:`LoadBalancer` per service, and
the daemon may share one :class:`BalancerMetrics` (one Prometheus registry) between all of them.
"""

from corral.balancer.metrics import CONTENT_TYPE_LATEST, BalancerMetrics, render
from corral.balancer.policies import LeastLoad, Policy, PowerOfTwo, RoundRobin, make_policy
from corral.balancer.proxy import LoadBalancer

__all__ = [
    "CONTENT_TYPE_LATEST",
    "BalancerMetrics",
    "LeastLoad",
    "LoadBalancer",
    "Policy",
    "PowerOfTwo",
    "RoundRobin",
    "make_policy",
    "render",
]
