"""Per-service load balancer: a lean streaming reverse proxy fed the ready set in-process.

Imports nothing else from corral. A host process runs one :class:`LoadBalancer` per service (or
one per worker process, several sharing a port with ``reuse_port=True``); the control plane sums
their ``stats()`` with :func:`merge_stats` and serves :func:`render` as Prometheus text.
"""

from corral.balancer.metrics import CONTENT_TYPE_LATEST, merge_stats, render
from corral.balancer.proxy import LoadBalancer
from corral.balancer.routing import make_policy
from corral.balancer.wiring import FAST_PATH_WIRING  # noqa: F401  (installs the fast path)

__all__ = [
    "CONTENT_TYPE_LATEST",
    "LoadBalancer",
    "make_policy",
    "merge_stats",
    "render",
]
