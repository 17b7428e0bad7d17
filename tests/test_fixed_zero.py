"""A service of `replicas: 0` (no autoscaling): up, serving nothing, and saying so.

Why: at `min_replicas: 0` a request waits up to 60 s for the replica the autoscaler starts,
and `up` says "the first request starts one". With a fixed size of 0 nothing ever starts: each
request hung 60 s for a 503, and `up` promised a replica that never came.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from conftest import CorralHome, http, write_spec

from corral.cli_wait import zero_text
from corral.service_route import route_of
from corral.spec import parse_spec

FIXED_ZERO = "service:\n  replicas: 0\nrun: exec python3 -m http.server $PORT\n"
SCALES_FROM_ZERO = (
    "service:\n  replica_policy:\n    min_replicas: 0\n    max_replicas: 2\n"
    "    target_qps_per_replica: 1\nrun: exec python3 -m http.server $PORT\n"
)


def test_a_fixed_zero_service_answers_503_at_once() -> None:
    assert route_of(parse_spec(FIXED_ZERO), 8080).config["no_replica_wait"] == 0.0
    assert route_of(parse_spec(SCALES_FROM_ZERO), 8080).config["no_replica_wait"] == 60.0
    gave_up = route_of(parse_spec(SCALES_FROM_ZERO), 8080, gave_up=True)
    assert gave_up.config["no_replica_wait"] == 0.0  # nothing will be relaunched


def test_a_fixed_zero_service_on_a_fixed_port_answers_503_at_once() -> None:
    """A fixed port keeps a request waiting for the successor of the replica on it; at
    `replicas: 0` there is none, and each request waited 60 s for a 503."""
    text = (
        "service:\n  replicas: 0\n  readiness_probe: /\nresources:\n  ports: 8081\n"
        "run: exec python3 -m http.server 8081\n"
    )
    assert route_of(parse_spec(text), 8080).config["no_replica_wait"] == 0.0
    fixed_one = text.replace("replicas: 0", "replicas: 1")
    assert route_of(parse_spec(fixed_one), 8080).config["no_replica_wait"] == 60.0


def test_up_does_not_promise_a_replica_to_a_fixed_zero_service() -> None:
    fixed = zero_text("z", {"endpoint": "http://e", "policy": {"max_replicas": 0}})
    assert "starts one" not in fixed and "corral update z" in fixed
    scaling = zero_text("z", {"endpoint": "http://e", "policy": {"max_replicas": 2}})
    assert "the first request to http://e starts one" in scaling


def test_a_scale_to_zero_service_that_gave_up_answers_503_at_once(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A request to a service at zero waits for the replica the autoscaler starts, up to 60 s.
    Once the controller gave up on the version (its replicas kept failing: nothing will be
    relaunched), there is nothing to wait for: every request waited the 60 s for a 503."""
    corral_home.env["CORRAL_DECISION_INTERVAL"] = "0.3"
    text = (
        'name: gone\nrun: "test -n $PORT && exit 3"\nservice:\n  readiness_probe: /\n'
        "  replica_policy:\n    min_replicas: 0\n    max_replicas: 2\n"
        "    target_qps_per_replica: 1\n"
    )
    corral_home.run("up", str(write_spec(tmp_path / "gone.yaml", text)))
    endpoint = corral_home.status("gone")["endpoint"]
    address = urlsplit(endpoint)
    # The first request asks for a replica (each one launched exits at once); left waiting.
    first = socket.create_connection((address.hostname, address.port), timeout=10)
    try:
        first.sendall(b"GET / HTTP/1.1\r\nHost: gone\r\n\r\n")
        corral_home.wait_for(
            lambda: corral_home.status("gone")["status"] == "FAILED", 60, "the controller gives up"
        )
        # Within its socket timeout, not after the 60 s wait for a replica that never comes.
        assert http(endpoint, timeout=20).status == 503
    finally:
        first.close()


def test_a_request_waits_for_the_fallback_replica_after_an_update_gave_up(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """An update that gave up is not a service that relaunches nothing: the version that
    served before it is relaunched (corral.fallback). A replica on a fixed port is retired
    before its successor starts, so after a bad update the service has no replica until the
    fallback's is READY; a request meanwhile waits for it, as at any other replacement on that
    port, not a 503 at once."""
    from corral.ports import free_port

    corral_home.env["CORRAL_DECISION_INTERVAL"] = "0.3"
    port = free_port()
    # Only a relaunch is slow: the fallback's replica takes 8 s to listen, the first at once.
    launched = tmp_path / "launched"
    serve = (
        f"if test -e {launched}; then sleep 8; fi; touch {launched}; "
        f"exec python3 -m http.server {port} --bind 127.0.0.1"
    )
    good = (
        f"name: fb\nresources:\n  ports: {port}\nservice:\n  readiness_probe: /\n"
        f"  replicas: 1\nrun: {serve}\n"
    )
    corral_home.run("up", str(write_spec(tmp_path / "v1.yaml", good)))
    endpoint = corral_home.status("fb")["endpoint"]
    bad = good.replace(serve, "exit 3")
    # Returns once version 2 is given up; the fallback's replica then takes 8 s to listen.
    corral_home.run("update", "fb", str(write_spec(tmp_path / "v2.yaml", bad)), check=False)
    time.sleep(1.0)  # the route follows the failure at the next step (0.3 s)
    replicas = corral_home.status("fb")["replicas"]
    assert not any(r["status"] == "READY" for r in replicas), replicas
    assert http(endpoint, timeout=40).status == 200
