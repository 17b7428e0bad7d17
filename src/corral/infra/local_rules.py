"""What the local backend asks of a spec beyond the spec's own rules.

These rules live with the backend, not in :mod:`corral.spec`: they follow from how local replicas
run (many on one machine, each given a free port in ``$PORT``), and another backend that gives
each replica its own host or pod has no such rule. The CLI checks them before posting a spec and
the daemon again when it accepts one, both importing from here; the spec never imports a backend.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.spec import ServiceSpec

__all__ = ["local_port_problem"]

# $PORT or ${PORT...}: anything that hands the assigned port to the command.
_PORT_REF_RE = re.compile(r"\$\{?PORT(?![A-Za-z0-9_])")


def local_port_problem(spec: ServiceSpec) -> str | None:
    """Why this spec cannot run several replicas on one machine, or None if it can.

    Each local replica is given a free port in ``$PORT``. A ``run`` that binds a fixed port
    works for one replica and fails for the second (address in use), which otherwise shows up
    only later as a crash loop. A ``run`` that mentions ``$PORT`` is taken as using it. Only the
    local infra is checked: other infra give each replica its own host or pod.
    """
    if spec.infra != "local":
        return None
    port = spec.replica_port()
    policy = spec.service.replica_policy
    most = policy.max_replicas + policy.num_overprovision
    if port is None or most <= 1 or _PORT_REF_RE.search(spec.run or ""):
        return None
    return (
        f"the replicas serve on port {port} and this service may run up to {most} replicas on "
        f"this machine, but `run` never uses $PORT, so every replica would try to bind port "
        f"{port}. corral gives each local replica a free port in $PORT: start the server on it "
        "(e.g. `--port $PORT`). If the program already reads the PORT environment variable, "
        "say so in run (e.g. `PORT=$PORT python3 server.py`)."
    )
