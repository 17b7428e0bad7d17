"""A `service.load_balancer` field the spec gives but its policy never reads is said by
`corral validate`, as docs/spec.md promises of every field without effect: `prompt_field`
under a load policy, `balance_factor` without prefix or session affinity, the hold's bounds
without `max_in_flight_per_replica`. They were accepted in silence and did nothing."""

from __future__ import annotations

from corral.spec import parse_spec

RUN = "run: python3 -m http.server $PORT\n"


def _unread(policy: str, balancer: str) -> list[str]:
    spec = parse_spec(
        f"{RUN}service:\n  load_balancing_policy: {policy}\n  load_balancer: {{{balancer}}}\n"
    )
    prefix = "service.load_balancer."
    return [w.split(":", 1)[0].removeprefix(prefix) for w in spec.warnings if w.startswith(prefix)]


def test_settings_no_policy_reads_are_warned() -> None:
    given = "prompt_field: input.text, balance_factor: 2, hold_timeout_seconds: 5, "
    assert _unread("round_robin", given + "hold_patience_seconds: 3") == [
        "prompt_field",
        "balance_factor",
        "hold_timeout_seconds",
        "hold_patience_seconds",
    ]
    # Held, but least_load prefers no replica: a held request takes the first with room.
    held = "max_in_flight_per_replica: 4, hold_patience_seconds: 1"
    assert _unread("least_load", held) == ["hold_patience_seconds"]
    spec = parse_spec(
        f"{RUN}service:\n  load_balancing_policy: round_robin\n"
        "  load_balancer: {prompt_field: input.text}\n"
    )
    assert "only prefix_affinity reads prompts, not round_robin" in " ".join(spec.warnings)


def test_settings_read_by_the_policy_are_not_warned() -> None:
    every = (
        "prompt_field: input.text, balance_factor: 2, hold_timeout_seconds: 5, "
        "hold_patience_seconds: 3, max_in_flight_per_replica: 4"
    )
    assert _unread("prefix_affinity", every) == []
    assert _unread("cache_aware", every) == []  # an alias of prefix_affinity
    # Session affinity wraps any policy: its bound and its held requests' patience are read.
    session = "session_header: X-Session-ID, balance_factor: 2, max_in_flight_per_replica: 4, "
    assert _unread("least_load", session + "hold_patience_seconds: 1") == []
    assert _unread("round_robin", "max_in_flight_per_replica: 4, hold_timeout_seconds: 5") == []
    assert _unread("round_robin", "stream_timeout_seconds: 60") == []  # defaults never warn


def test_a_target_with_no_room_to_scale_is_warned() -> None:
    """min_replicas equal to max_replicas leaves a target nothing to do (docs/spec.md: a field
    without effect is said); a range, a fixed size without a target, and the per-accelerator
    map (instance_aware_least_load's weights) are not warned."""

    def said(service: str) -> list[str]:
        spec = parse_spec(f"{RUN}service:\n  readiness_probe: /\n{service}")
        return [w.split(":", 1)[0] for w in spec.warnings if "no target scales" in w]

    fixed = "  replica_policy: {min_replicas: 2, max_replicas: 2, target_qps_per_replica: 3}\n"
    assert said(fixed) == ["service.replica_policy.target_qps_per_replica"]
    metrics = "  autoscaling:\n    metrics: [{type: queue_depth, target: 4}]\n"
    assert said(f"  replicas: 2\n  max_replicas: 2\n{metrics}") == ["service.autoscaling"]
    assert said(f"  replicas: 2\n  max_replicas: 3\n{metrics}") == []
    assert said("  replicas: 2\n") == []
    assert said(fixed.replace("max_replicas: 2", "max_replicas: 4")) == []
