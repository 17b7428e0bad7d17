"""Request arrivals as runs of (time, count): what the daemon hands its autoscalers.

The workers report requests counted per 50 ms bucket; the daemon once expanded those counts
into one float per request for every decision (two million of them at 30k req/s)."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from corral.arrivals import Arrivals, as_arrivals
from corral.autoscale import make_autoscaler
from corral.autoscale_queue import EngineAutoscaler
from corral.dataplane.protocol import TIME_BUCKET
from corral.dataplane.route import recent_arrivals
from corral.spec import ReplicaPolicy, parse_spec


def test_runs_count_and_bisect_as_the_list_of_times_does() -> None:
    rng = random.Random(7)
    times = [round(rng.uniform(0, 100), 1) for _ in range(2000)]
    runs = Arrivals.of(times)
    ordered = sorted(times)
    assert len(runs) == len(times) and len(runs.times) == len(set(times))
    for low, high in [(0, 100), (10.05, 10.15), (50.0, 50.0), (-5, 3.3), (99.9, 200)]:
        expected = sum(1 for t in ordered if low < t <= high)
        assert runs.count(runs.right(low), runs.right(high)) == expected
        expected = sum(1 for t in ordered if low <= t < high)
        assert runs.count(runs.left(low), runs.left(high)) == expected
    assert sum(n for _, n in runs.runs(0, len(runs.times))) == len(times)
    assert runs.count(5, 3) == 0  # an empty range, not a negative count
    assert as_arrivals(runs) is runs
    with pytest.raises(ValueError, match="out of order"):
        Arrivals([(2.0, 1), (1.0, 1)])
    assert len(Arrivals([(1.0, 0), (2.0, 3)]).times) == 1  # empty runs left out


def test_the_data_plane_counts_decide_as_one_time_per_request_did() -> None:
    """The same bucketed load, as the workers report it (counts per bucket, each at the
    bucket's middle) and as the daemon used to expand it: every decision the same."""
    rng = random.Random(3)
    counts: dict[int, int] = {}
    base = int(time.monotonic() / TIME_BUCKET) - 4000  # 200 s of buckets up to now
    for i in range(4000):
        rate = 0 if i < 400 else (40 if i < 2400 else 4)  # per bucket: 0, 800, then 80 req/s
        if rate and rng.random() < 0.9:
            counts[base + i] = rng.randint(1, rate)
    arrivals = recent_arrivals(dict(counts), 600.0)
    floats = [t for t, n in arrivals.runs(0, len(arrivals.times)) for _ in range(n)]
    assert len(floats) == sum(counts.values())
    policy = ReplicaPolicy(
        min_replicas=1,
        max_replicas=10,
        target_qps_per_replica=100.0,
        upscale_delay_seconds=20,
        downscale_delay_seconds=40,
    )
    by_runs, by_floats = make_autoscaler(policy), make_autoscaler(policy)
    queue = parse_spec(
        "run: x\nservice:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 0\n"
        "    max_replicas: 4\n    target_queue_per_replica: 5\n"
    ).service.replica_policy
    queue_runs, queue_floats = EngineAutoscaler(queue), EngineAutoscaler(queue)
    start = base * TIME_BUCKET
    targets = set()
    for step in range(0, 205, 5):
        now = start + step
        a, b = by_runs.decide(now, arrivals), by_floats.decide(now, floats)
        targets.add(a.target)
        assert (a.target, a.qps, a.raw_target, a.reason) == (
            b.target,
            b.qps,
            b.raw_target,
            b.reason,
        )
        queue_runs.observe(step % 7)
        queue_floats.observe(step % 7)
        c, d = queue_runs.decide(now, arrivals), queue_floats.decide(now, floats)
        assert (c.target, c.qps, c.reason) == (d.target, d.qps, d.reason)
    assert len(targets) > 2, targets  # the load moved it, up and back down


def test_ten_million_requests_cost_one_run_per_bucket() -> None:
    """What the daemon builds for a decision is as large as the window's buckets, whatever the
    rate: ten million requests in a minute (1,200 buckets) in well under a megabyte."""
    now = int(time.monotonic() / TIME_BUCKET)
    counts = {now - i: 8334 for i in range(1200)}
    tracemalloc.start()
    try:
        arrivals = recent_arrivals(counts, 65.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(arrivals) == 1200 * 8334 and len(arrivals.times) == 1200
    assert peak < 1 << 20, peak
    old = {now - 13_000: 9}  # 650 s ago, older than anyone asks for: dropped
    recent_arrivals(old, 60.0)
    assert old == {}
