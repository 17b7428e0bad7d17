"""Where replicas run: the :class:`~corral.infra.base.Infra` protocol and its backends."""
