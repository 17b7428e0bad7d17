"""The data plane: balancer worker processes that outlive the daemon, fed by push.

Two planes, one channel between them:

* the control plane (the daemon: API, controllers, prober, jobs, SQLite) decides which replicas
  of each service are ready and with which settings; :class:`~corral.dataplane.plane.DataPlane`
  turns that into one routing table and pushes it, the moment anything changes, to every worker
  over a 0600 Unix socket in the home (``dataplane.sock``);
* the data plane (``corral.dataplane.worker``: N OS processes in their own session, sharing
  every service's port with SO_REUSEPORT) serves traffic from its last table, and reports back
  what the control plane needs: accepted-request times (autoscaler), in-flight counts
  (draining), counters (metrics), ports it could not bind.

Why processes apart from the daemon: a daemon that is killed, stopped, restarted or upgraded
must not be noticed by traffic (as in SkyServe, Ray Serve and Kubernetes, whose data planes
keep forwarding without their control planes), and traffic should use more than one core and
never share a GIL with SQLite calls and reconcile steps.

``protocol`` is the wire format (imports nothing of corral); ``worker`` is the worker process
(the balancer engine behind ``listeners``, the engines' readings, the slot locks); ``plane`` is
the daemon's side (``route`` per service, ``processes``, ``slots``, ``shared_ports``, ``carried``
and ``state``). What each imports is in docs/architecture.md's module table, which
tests/test_layers.py checks.
"""
