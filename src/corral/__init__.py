"""corral: keep N replicas of a service running behind its own load balancer."""

__version__ = "0.1.0"
