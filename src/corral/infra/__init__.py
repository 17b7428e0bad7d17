"""Where replicas run: the :class:`~corral.infra.base.Infra` protocol and its backends."""

from corral.infra.base import Infra, LaunchRequest, Liveness, ReplicaHandle

__all__ = ["Infra", "LaunchRequest", "Liveness", "ReplicaHandle"]
