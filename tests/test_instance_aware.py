"""Mixed-accelerator fleets: SkyServe's per-accelerator ``target_qps_per_replica`` and the
``instance_aware_least_load`` policy, from the spec through the route to a real balancer in
front of simulated engines placed on declared GPUs."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import CorralHome, spec_text, write_spec

from corral.autoscale_queue import InstanceAwareAutoscaler, fits, make_scaler
from corral.balancer.routing import make_policy
from corral.dataplane.protocol import Route
from corral.spec import SpecError, parse_spec

MIXED = """\
run: x
resources:
  accelerators: {H100: 1, A100: 1}
service:
  readiness_probe: /health
  load_balancing_policy: instance_aware_least_load
  replica_policy:
    min_replicas: 1
    max_replicas: 6
    upscale_delay_seconds: 40
    downscale_delay_seconds: 60
    target_qps_per_replica:
"""


def test_a_per_accelerator_target_is_read_with_its_policy() -> None:
    spec = parse_spec(MIXED + "      H100: 10\n      A100: 5\n")
    policy = spec.service.replica_policy
    assert policy.target_qps_per_accelerator == {"H100": 10, "A100": 5}
    assert policy.target_qps_per_replica is None and policy.autoscaling
    assert spec.summary()["service"]["replica_policy"]["target_qps_per_replica"]["H100"] == 10
    # SkyServe's `A100:1` keys, and accelerators named under resources.any_of
    any_of = MIXED.replace(
        "  accelerators: {H100: 1, A100: 1}\n",
        "  any_of:\n    - accelerators: H100:1\n    - {accelerators: A100}\n",
    )
    spec = parse_spec(any_of + "      h100: 10\n      A100:1: 5\n")
    assert spec.service.replica_policy.target_qps_per_accelerator == {"h100": 10, "A100:1": 5}


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        (
            MIXED + "      H100: 10\n      H200: 5\n",
            "target_qps_per_replica.H200",
            "'H200' is not an accelerator the spec asks for: resources ask A100, H100",
        ),
        (MIXED + "      H100: 0\n", "target_qps_per_replica.H100", "greater than 0"),
        (MIXED + "      H100: fast\n", "target_qps_per_replica.H100", "expected a number"),
        (MIXED + "      {}\n", "target_qps_per_replica", "empty mapping"),
        (
            MIXED.replace("instance_aware_least_load", "least_load") + "      H100: 10\n",
            "target_qps_per_replica",
            "goes with load_balancing_policy: instance_aware_least_load",
        ),
        (
            MIXED.replace("    target_qps_per_replica:\n", "    target_qps_per_replica: 4\n"),
            "load_balancing_policy",
            "needs replica_policy.target_qps_per_replica as a mapping",
        ),
        (
            MIXED.replace("  accelerators: {H100: 1, A100: 1}\n", "  cpus: 1\n")
            + "      H100: 10\n",
            "target_qps_per_replica",
            "asks for none",
        ),
        (
            MIXED.replace("    max_replicas: 6\n", "") + "      H100: 10\n",
            "max_replicas",
            "required when target_qps_per_replica is set",
        ),
        (
            MIXED + "      H100: 10\n    target_kv_cache_usage: 0.8\n",
            "target_qps_per_replica",
            "cannot be combined with target_kv_cache_usage",
        ),
    ],
    ids=["unknown", "zero", "text", "empty", "no-policy", "no-map", "no-gpu", "no-max", "mixed"],
)
def test_bad_per_accelerator_targets_name_their_field(text: str, field: str, says: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    assert any(
        issue.loc.endswith(field) and says in issue.message for issue in caught.value.issues
    ), str(caught.value)


def test_the_policy_weighs_in_flight_by_each_replicas_target() -> None:
    """An H100 replica worth 10 QPS carries twice the requests of an A100 worth 5 before the
    A100 is preferred; a replica without a weight weighs 1; ties rotate."""
    policy = make_policy("instance_aware_least_load")
    policy.update((1, 2), {})
    policy.weigh({1: 10.0, 2: 5.0})
    in_flight: Counter[int] = Counter()
    for _ in range(30):
        in_flight[policy.select((1, 2), in_flight)] += 1
    assert in_flight == Counter({1: 20, 2: 10})
    policy.weigh({1: 10.0})  # 2 unknown: weight 1
    assert policy.select((1, 2), {1: 5, 2: 1}) == 1  # 0.5 < 1.0
    policy.weigh({})
    assert {policy.select((1, 2), {}) for _ in range(4)} == {1, 2}  # idle ties rotate
    plain = make_policy("least_load")
    plain.weigh({1: 10.0, 2: 5.0})  # the load policies ignore weights
    counts: Counter[int] = Counter()
    for _ in range(30):
        counts[plain.select((1, 2), counts)] += 1
    assert counts == Counter({1: 15, 2: 15})


def test_the_route_carries_each_replicas_accelerator_and_weight() -> None:
    route = Route(
        port=1,
        ready={1: "http://a", 2: "http://b", 3: "http://c"},
        versions={1: 1, 2: 1, 3: 2},
        accelerators={1: "H100", 2: "A100"},
        weights={1: 10.0, 2: 5.0},
    )
    back = Route.from_json(json.loads(json.dumps(route.to_json())))
    assert back.accelerators == {1: "H100", 2: "A100"} and back.weights == {1: 10.0, 2: 5.0}
    assert back.ready == route.ready and back.versions == route.versions
    old = {"port": 1, "ready": {"1": {"url": "http://a", "version": 1}}}  # an older daemon's
    assert Route.from_json(old).weights == {} and Route.from_json(old).accelerators == {}


def scaler(least: int = 1) -> InstanceAwareAutoscaler:
    text = MIXED.replace("min_replicas: 1", f"min_replicas: {least}")
    spec = parse_spec(text + "      H100: 10\n      A100: 5\n")
    chosen = make_scaler(spec.service.replica_policy, decision_interval=5, qps_window=60)
    assert isinstance(chosen, InstanceAwareAutoscaler)
    return chosen


def times(qps: float, now: float) -> list[float]:
    """``qps`` requests per second over the minute before ``now``."""
    count = round(qps * 60)
    return [now - 60 + (i + 0.5) * 60 / count for i in range(count)]


def test_the_autoscaler_sums_capacity_by_accelerator() -> None:
    """SkyServe's instance-aware rules: capacity is the sum of the live replicas' targets;
    over it, the excess in replicas of the largest target; under it, the fewest READY replicas
    (largest first) that serve the rate. The holds as for every autoscaler."""
    s = scaler()
    s.observe_fleet([("READY", "H100"), ("READY", "A100")])  # serves 15
    assert s.decide(0.0, times(14, 0.0)).raw_target == 2
    d = s.decide(1.0, times(26, 1.0))  # 11 over: ceil(11 / 10) more
    assert d.raw_target == 4 and d.target == 1, d  # held: the upscale hold is 20 s
    assert s.decide(21.0, times(26, 21.0)).target == 4
    s.observe_fleet([("READY", "H100"), ("READY", "A100"), ("READY", "H100"), ("READY", "A100")])
    # 30 serves 14: H100 + A100 = 15 > 14, so 2 (largest first)
    assert s.decide(30.0, times(14, 30.0)).raw_target == 2
    assert s.decide(50.0, times(14, 50.0)).target == 4  # the downscale hold is 40 s
    # H100 alone serves 9, but SkyServe's looks 20 s apart saw 2 at 40 and 60 (the samples at
    # 30 and 50 stand until the next): no SkyServe at 4 has its third look below before 80.
    assert s.decide(71.0, times(9, 71.0)).target == 4
    assert s.decide(80.0, times(9, 80.0)).target == 1
    # a replica whose accelerator is unknown counts as the smallest target (5)
    s.observe_fleet([("READY", None), ("STARTING", "H100"), ("FAILED", "H100")])
    assert s.decide(101.0, times(20, 101.0)).raw_target == 2 + 1  # 15 served, 5 over
    assert fits(s, s.policy) and not fits(s, parse_spec("run: x\n").service.replica_policy)


def test_replicas_that_serve_nothing_do_not_raise_the_target_and_no_load_asks_for_none() -> None:
    """15 QPS on one READY H100 (10) asks for 2. The second waits PENDING for a GPU (or a
    replica is NOT_READY): it adds no capacity, so it must not count as one more replica on
    top of the excess, or each upscale hold asks for one more, up to max_replicas. And a
    minute without requests asks for no replica, so min_replicas: 0 is reached."""
    s = scaler()
    fleet = [("READY", "H100")]
    target = 1
    for step in range(40):  # 200 s, upscale holds of 20 s
        s.observe_fleet(fleet)
        target = s.decide(step * 5.0, times(15, step * 5.0)).target
        fleet += [("PENDING", None)] * (target - len(fleet))
    assert target == 2, fleet
    s.observe_fleet([("READY", "H100"), ("NOT_READY", "A100")])
    assert s.decide(205.0, times(15, 205.0)).raw_target == 2
    idle = scaler(least=0)
    idle.observe_fleet([("READY", "H100")])
    assert idle.decide(0.0, []).raw_target == 0


def test_a_replica_still_loading_that_the_rate_needs_is_not_scaled_away() -> None:
    """15 QPS: the READY H100 serves 10, the STARTING one (an LLM loads for minutes) is what
    serves the rest. Under the fleet's capacity (20), counting the READY replicas alone asked
    for 1, and after the 40 s downscale hold the loading replica was taken away (then asked
    for again: a replica that loads for longer than the hold never serves)."""
    s = scaler()
    s.observe_fleet([("READY", "H100")])
    assert s.decide(0.0, times(15, 0.0)).raw_target == 2
    assert s.decide(20.0, times(15, 20.0)).target == 2
    s.observe_fleet([("READY", "H100"), ("STARTING", "H100")])
    for step in range(5, 60):
        got = s.decide(step * 5.0, times(15, step * 5.0))
        assert (got.raw_target, got.target) == (2, 2), (step * 5.0, got.reason)


def test_from_zero_the_largest_target_sizes_the_fleet() -> None:
    s = scaler(least=0)
    s.observe_fleet([])
    assert s.decide(0.0, []).target == 0
    assert s.decide(1.0, times(25, 1.0)).target == 3  # ceil(25 / 10), at once from zero


# -- through a daemon on declared GPUs ------------------------------------------------------------

INVENTORY = """\
gpus:
  - {index: 0, name: NVIDIA H100 80GB HBM3, uuid: GPU-h100-0, memory: 80GB}
  - {index: 1, name: NVIDIA A100-SXM4-80GB, uuid: GPU-a100-1, memory: 80GB}
"""


def stream(url: str) -> Any:
    """A long streamed completion, open until closed; returns once its first bytes came."""
    body = {"model": "m", "prompt": "hello", "max_tokens": 4000, "stream": True}
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    answer = urllib.request.urlopen(request, timeout=30)
    assert answer.readline().startswith(b"data:")
    return answer


def running(endpoint: str) -> float:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def test_an_h100_replica_takes_twice_an_a100_replicas_share(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Two simulated engines, one placed on the declared H100 and one on the A100, behind one
    balancer worker: six long streams in flight end 4 on the H100 (10 QPS) and 2 on the A100
    (5 QPS), where least_load would split them 3 and 3."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    corral_home.env["CORRAL_INVENTORY"] = str(inventory)
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"
    run_line = f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT --speed 0.5"
    text = spec_text(
        "mixed", 2, run=run_line, extra="resources:\n  accelerators: {H100: 1, A100: 1}\n"
    ).replace(
        "  replicas: 2\n",
        "  load_balancing_policy: instance_aware_least_load\n"
        "  replica_policy:\n    min_replicas: 2\n    max_replicas: 2\n"
        "    target_qps_per_replica: {H100: 10, A100: 5}\n",
    )
    corral_home.run("up", str(write_spec(tmp_path / "mixed.yaml", text)), "-y", timeout=120)
    svc = corral_home.wait_replicas("mixed", 2, timeout=60)
    endpoints = {r["devices"]["gpus"][0]["name"]: r["endpoint"] for r in svc["replicas"]}
    assert set(endpoints) == {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"}, svc
    streams = []
    try:
        for _ in range(6):
            streams.append(stream(str(svc["endpoint"])))
        shares = {name: running(url) for name, url in endpoints.items()}
        assert shares == {"NVIDIA H100 80GB HBM3": 4, "NVIDIA A100-SXM4-80GB": 2}, shares
    finally:
        for answer in streams:
            answer.close()


def test_a_scale_down_takes_the_replicas_serving_least_first() -> None:
    """SkyServe's instance-aware order: among live replicas of the same version and status,
    the smallest target QPS goes first (one whose accelerator is unknown before any), then
    corral's usual newest-first."""
    from test_plan import facts, ready

    from corral import plan

    rows = [ready(1), ready(2), ready(3), ready(4)]

    def victims(worth: dict[int, float]) -> list[int]:
        actions = plan.toward_target(facts(rows, target=2, worth=worth), 100.0)
        return sorted(a.replica_id for a in actions if isinstance(a, plan.ScaleDown))

    assert victims({}) == [3, 4]  # newest first
    assert victims({1: 5.0, 2: 10.0, 3: 10.0, 4: 10.0}) == [1, 4]
    assert victims({1: 5.0, 2: 10.0, 3: 10.0}) == [1, 4]  # 4: not known, first
    assert victims({1: 10.0, 2: 5.0, 3: 5.0, 4: 10.0}) == [2, 3]


def test_a_mixed_fleet_scaled_down_keeps_its_h100(corral_home: CorralHome, tmp_path: Path) -> None:
    """Two simulated engines, the older on the A100 (5 QPS), the newer on the H100 (10 QPS);
    an update to min_replicas 1 with no traffic scales down to one: the A100 replica goes,
    where the usual order would have taken the newest."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    corral_home.env["CORRAL_INVENTORY"] = str(inventory)
    corral_home.env["CORRAL_DECISION_INTERVAL"] = "0.5"
    run_line = f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT --speed 5"

    def spec(least: int) -> Path:
        text = spec_text(
            "fleet", 2, run=run_line, extra="resources:\n  accelerators: {A100: 1, H100: 1}\n"
        ).replace(
            "  replicas: 2\n",
            "  load_balancing_policy: instance_aware_least_load\n"
            f"  replica_policy:\n    min_replicas: {least}\n    max_replicas: 2\n"
            "    downscale_delay_seconds: 0\n"
            "    target_qps_per_replica: {H100: 10, A100: 5}\n",
        )
        return write_spec(tmp_path / f"fleet-{least}.yaml", text)

    corral_home.run("up", str(spec(2)), "-y", timeout=120)
    svc = corral_home.wait_replicas("fleet", 2, timeout=60)
    by_gpu = {r["devices"]["gpus"][0]["name"]: r["id"] for r in svc["replicas"]}
    assert by_gpu["NVIDIA A100-SXM4-80GB"] < by_gpu["NVIDIA H100 80GB HBM3"], svc  # older
    corral_home.run("update", "fleet", str(spec(1)), timeout=60)
    left = corral_home.wait_replicas("fleet", 1, timeout=60)
    assert [r["id"] for r in left["replicas"] if r["status"] == "READY"] == [
        by_gpu["NVIDIA H100 80GB HBM3"]
    ], left
