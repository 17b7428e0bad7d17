"""A service of `replicas: 0` (no autoscaling): up, serving nothing, and saying so.

Why: at `min_replicas: 0` a request waits up to 60 s for the replica the autoscaler starts,
and `up` says "the first request starts one". With a fixed size of 0 nothing ever starts: each
request hung 60 s for a 503, and `up` promised a replica that never came.
"""

from __future__ import annotations

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


def test_up_does_not_promise_a_replica_to_a_fixed_zero_service() -> None:
    fixed = zero_text("z", {"endpoint": "http://e", "policy": {"max_replicas": 0}})
    assert "starts one" not in fixed and "corral update z" in fixed
    scaling = zero_text("z", {"endpoint": "http://e", "policy": {"max_replicas": 2}})
    assert "the first request to http://e starts one" in scaling
