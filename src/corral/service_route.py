"""A service's route in the data plane, from its spec: what every balancer worker is told.

Apart from :mod:`corral.controller` so what a spec means to the balancer (its policy and the
options of the LLM policies, timeouts, limits, TLS files) reads in one place.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from corral.dataplane.protocol import Route
from corral.infra.local_rules import fixed_port
from corral.spec import ServiceSpec, tls_paths


def route_of(
    spec: ServiceSpec,
    port: int,
    base_dir: str | None = None,
    tls_copy: tuple[str, str] | None = None,
    *,
    gave_up: bool = False,
) -> Route:
    """The data plane's route of a service (everything but the ready set) from its spec.

    The TLS files are the version's copies (``tls_copy``, :func:`corral.versionfiles.
    version_tls`); for a version made before corral copied them, the spec's paths, relative
    ones taken from the directory the CLI ran in (``base_dir``), as ``workdir`` is (SkyPilot's
    rule): the workers run elsewhere, and the path must mean the same file to them.
    ``gave_up``: the controller relaunches nothing (the version's replicas kept failing), so a
    request finds no replica to wait for."""
    lb = spec.service.load_balancer
    policy = spec.service.replica_policy
    files = tls_paths(spec, base_dir)
    cert, key = (str(files[0]), str(files[1])) if files is not None else (None, None)
    if files is not None and tls_copy is not None:
        cert, key = tls_copy
    return Route(
        port=port,
        tls_cert=cert,
        tls_key=key,
        tls_stamp=tls_stamp(cert, key) if cert and key else None,
        config={
            "policy": spec.service.load_balancing_policy,
            # At zero replicas a request waits for the first one instead of a 503; so it does
            # for a replica on a fixed port, which its successor can only replace in turn. Not
            # at a fixed size of 0 (`replicas: 0`), nor once the controller gave up: no replica
            # ever comes to wait for (a fixed port's successor included).
            "no_replica_wait": 60.0
            if (policy.min_replicas == 0 or fixed_port(spec) is not None)
            and policy.max_replicas > 0
            and not gave_up
            else 0.0,
            "connect_timeout": lb.connect_timeout_seconds,
            "first_byte_timeout": lb.first_byte_timeout_seconds or lb.stream_timeout_seconds,
            "idle_timeout": lb.stream_timeout_seconds,
            "max_body_bytes": lb.max_body_bytes,
            "max_header_bytes": lb.max_header_bytes,
            "header_timeout": lb.header_timeout_seconds,
            "max_connections": lb.max_connections,
            # A balancer retired by a route change lets its requests under way finish as long.
            "drain_timeout": lb.drain_timeout_seconds,
            **llm_settings(spec),
        },
    )


def tls_stamp(cert: str, key: str) -> str | None:
    """A digest of what the certificate and key files hold now (None: one cannot be read;
    loading them then fails, and says why)."""
    digest = hashlib.sha256()
    try:
        for file in (cert, key):
            digest.update(Path(file).read_bytes())
            digest.update(b"\0")
    except OSError:
        return None
    return digest.hexdigest()[:16]


def llm_settings(spec: ServiceSpec) -> dict[str, Any]:
    """What the balancer needs of the LLM knobs (docs/llm.md), only those a spec sets: a
    route without them reads the same to a worker that predates them."""
    lb = spec.service.load_balancer
    prefix = spec.service.load_balancing_policy == "prefix_affinity"
    named = {
        "prompt_field": lb.prompt_field,
        "session_header": lb.session_header,
        "session_cookie": lb.session_cookie,
    }
    options: dict[str, Any] = {k: v for k, v in named.items() if v}
    if options or prefix:
        options["balance"] = lb.balance_factor
    routing: dict[str, Any] = {"options": options} if options else {}
    if lb.max_in_flight_per_replica:
        routing["max_in_flight_per_replica"] = lb.max_in_flight_per_replica
        routing["hold_timeout"] = lb.hold_timeout_seconds
        routing["hold_patience"] = lb.hold_patience_seconds
    out: dict[str, Any] = {"routing": routing} if routing else {}
    # Read under prefix_affinity (the queue is part of a replica's load) and for an
    # autoscaler on the engines' signals (queue, KV-cache use, tokens per second).
    engine_scaled = bool(spec.service.replica_policy.engine_targets)
    metrics = lb.engine_metrics_path or ("/metrics" if prefix or engine_scaled else None)
    if metrics:
        out["engine_metrics_path"] = metrics
    return out
