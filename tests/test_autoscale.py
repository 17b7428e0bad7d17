"""Tests for corral.autoscale: load over a simulated clock in, replica targets out.

Most tests replay a table: a request trace built from constant-rate segments, a ``decide`` call
every simulated second, and a table of (time, expected target). Requests of a rate ``r`` segment
sit at the middle of their 1/r slots (t0 + 0.5/r, t0 + 1.5/r, ...), so no request lands exactly
on a window edge and the expected counts can be worked out by hand; the comments show the sums.

Delays are held for ``hold_seconds(delay)`` = 20 * (int(delay / 20) - 1), SkyServe's count
(upscale 60 -> 40 s, downscale 120 -> 100 s), from the instant the windowed count crossed: a
request arriving (at its stamp) or leaving the window (at its stamp + window). A dip restarts a
hold only if SkyServe's 20 s looks could not have missed it.
"""

import bisect
import math
import random
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.autoscale import (
    DEFAULT_DECISION_INTERVAL,
    DEFAULT_ZERO_DECISION_INTERVAL,
    Autoscaler,
    Decision,
    FixedAutoscaler,
    RequestRateAutoscaler,
    hold_seconds,
    make_autoscaler,
)
from corral.spec import ReplicaPolicy


def policy(
    min_replicas: int = 1,
    max_replicas: int = 5,
    target_qps: float | None = 1.0,
    up: float = 30.0,
    down: float = 60.0,
    over: int = 0,
) -> ReplicaPolicy:
    return ReplicaPolicy(
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_qps_per_replica=target_qps,
        upscale_delay_seconds=up,
        downscale_delay_seconds=down,
        num_overprovision=over,
    )


def rate(per_second: float, t0: float, t1: float) -> list[float]:
    """Request timestamps at ``per_second`` from t0 (inclusive) to t1 (exclusive)."""
    out: list[float] = []
    i = 0
    while (stamp := t0 + (i + 0.5) / per_second) < t1:
        out.append(stamp)
        i += 1
    return out


def trace(*segments: Iterable[float]) -> list[float]:
    return sorted(stamp for segment in segments for stamp in segment)


def simulate(
    scaler: Autoscaler, requests: Sequence[float], until: int, start: int = 0, step: int = 1
) -> dict[int, Decision]:
    """``decide`` every ``step`` seconds from start to until (inclusive), with the whole trace:
    requests after ``now`` must be ignored, as the real caller's list would not hold them yet."""
    return {now: scaler.decide(float(now), requests) for now in range(start, until + 1, step)}


def follow(
    scaler: Autoscaler, requests: Sequence[float], until: float, start: float = 0.0
) -> list[tuple[float, Decision]]:
    """``decide`` when the scaler asks to (its ``decision_interval``), as the controller does."""
    out: list[tuple[float, Decision]] = []
    now = start
    while now <= until:
        out.append((now, scaler.decide(now, requests)))
        now += scaler.decision_interval
    return out


def first_move(decisions: Sequence[tuple[float, Decision]], to: int) -> float | None:
    return next((now for now, d in decisions if d.target == to), None)


def check_table(decisions: dict[int, Decision], table: Sequence[tuple[int, int]]) -> None:
    for now, expected in table:
        got = decisions[now]
        assert got.target == expected, f"t={now}: wanted {expected}, got {got}"


def scaler_for(p: ReplicaPolicy, window: float = 10.0) -> Autoscaler:
    return make_autoscaler(p, qps_window=window)


# --------------------------------------------------------------------------------------------
# Tables of load over time


def test_steady_load_reaches_its_target_once_and_stays() -> None:
    # 2 req/s wants 2 from t=1 (0.25 and 0.75 over the 1 s minimum span); the initial target is
    # min_replicas 1. Inside the first window a crossing is not dated back (the meter's span was
    # still growing), so the 40 s hold runs from the decision at t=1 and the target rises at 41.
    decisions = simulate(scaler_for(policy(up=60)), rate(2, 0, 700), until=600)
    check_table(decisions, [(0, 1), (1, 1), (40, 1), (41, 2), (42, 2), (600, 2)])
    assert all(d.target == 2 and d.raw_target == 2 for t, d in decisions.items() if t >= 41)
    assert all(d.qps == pytest.approx(2.0) for t, d in decisions.items() if t >= 1)


def test_step_up_rises_one_hold_after_the_load_crossed() -> None:
    # 1 req/s, then 3 req/s from t=100. At t=100 the 10 s window holds 10 requests (wants 1);
    # the first new request, at 100 + 1/6, makes 11: 1.1 QPS wants 2 > 1. The decision at 101
    # dates the crossing there, so the 40 s hold of the 60 s upscale delay ends at 140.17 and
    # the decision at 141 moves, to that moment's raw target (the window is all new load: 3).
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    decisions = simulate(scaler_for(policy(up=60)), requests, until=300)
    check_table(decisions, [(100, 1), (101, 1), (115, 1), (140, 1), (141, 3), (300, 3)])
    assert decisions[100].raw_target == 1
    assert decisions[101].raw_target == 2
    assert decisions[140].raw_target == 3


def test_step_down_falls_one_hold_after_the_load_crossed() -> None:
    # 3 req/s (reached at t=1: an upscale delay of 0 holds 0 s), then 1 req/s from t=100. The
    # window is 30 requests at t=100; 94 + 5/6 leaving it at 104.83 leaves 15 old + 5 new = 20:
    # 2 QPS wants 2 < 3 (at 104.5 it was 16 + 5 = 21). The 100 s hold of the 120 s downscale
    # delay ends at 204.83, so the decision at 205 falls, to that moment's raw target, 1.
    requests = trace(rate(3, 0, 100), rate(1, 100, 400))
    decisions = simulate(scaler_for(policy(up=0, down=120)), requests, until=300)
    check_table(decisions, [(1, 3), (100, 3), (104, 3), (105, 3), (204, 3), (205, 1), (300, 1)])
    assert decisions[104].raw_target == 3
    assert decisions[105].raw_target == 2


def test_spikes_shorter_than_the_hold_change_nothing() -> None:
    # A 4 req/s burst on top of 1 req/s during [100, 110) keeps the raw target above 1 from
    # t=100.125 to about t=119.5: under the 40 s hold of a 60 s upscale delay.
    requests = trace(rate(1, 0, 400), rate(4, 100, 110))
    decisions = simulate(scaler_for(policy(up=60)), requests, until=300)
    assert max(d.raw_target for d in decisions.values()) == 5
    assert {d.target for d in decisions.values()} == {1}

    # A 30 s lull in 3 req/s keeps the raw target below 3 from 104.83 to about 137: under the
    # 40 s hold of a 60 s downscale delay.
    requests = trace(rate(3, 0, 100), rate(3, 130, 400))
    decisions = simulate(scaler_for(policy(up=0, down=60)), requests, until=300)
    assert min(d.raw_target for d in decisions.values()) == 1
    assert {d.target for t, d in decisions.items() if t >= 1} == {3}


def test_spike_that_outlasts_the_hold_scales_up_then_back_down() -> None:
    # The same burst for 50 s: raw above 1 from its first request at 100.125, so the SkyServe
    # whose looks fall at 100.125, 120.125 and 140.125 moves to 5 there (hold 40 s), and the
    # target follows at 141. When the burst ends at 150 the window holds 10 + the burst's
    # requests after t - 10: 40 (4 QPS, wants 4) once 142.375 leaves it at 152.375. No SkyServe
    # at 5 looks at 152.375 (the one looking then moves up, to 4): the first at 5 to look below
    # it looks at 160.125 (the one that moved at 140.125), so 100 s later, at 260.125, is the
    # earliest any moves down, and the target is back to 1 at 261, not at 253.
    requests = trace(rate(1, 0, 400), rate(4, 100, 150))
    decisions = simulate(scaler_for(policy(up=60, down=120)), requests, until=300)
    check_table(decisions, [(140, 1), (141, 5), (152, 5), (153, 5), (253, 5), (260, 5), (261, 1)])
    assert decisions[152].raw_target == 5
    assert decisions[153].raw_target == 4


def test_scale_from_zero_is_immediate_and_polled_faster() -> None:
    scaler = scaler_for(policy(min_replicas=0, max_replicas=3, up=300))
    assert scaler.decision_interval == DEFAULT_ZERO_DECISION_INTERVAL
    decisions = simulate(scaler, [50.5], until=50)
    assert decisions[50].target == 0
    assert scaler.decision_interval == DEFAULT_ZERO_DECISION_INTERVAL

    # One request in the window is 0.1 QPS, which wants 1: no 300 s wait.
    first = scaler.decide(51.0, [50.5])
    assert (first.target, first.raw_target) == (1, 1)
    assert "at once" in first.reason
    assert scaler.decision_interval == DEFAULT_DECISION_INTERVAL

    # A burst from zero goes straight to what it wants (25 requests / 10 s = 2.5 -> 3).
    burst = scaler_for(policy(min_replicas=0, max_replicas=5, up=300))
    simulate(burst, [], until=50)
    assert burst.decide(51.0, [50.1] * 25).target == 3


def test_scale_to_zero_after_the_downscale_hold() -> None:
    # The one request leaves the 10 s window at 60.5: raw 0 from then. Every SkyServe left zero
    # at a look (every 5 s there) in [50.5, 55.5) and looks every 20 s from it, so the first look
    # that sees 0 is in [70.5, 75.5) and the 40 s hold of the 60 s downscale delay ends in
    # [110.5, 115.5): the target is 0 from the decision at 111 (not at 101, a hold after 60.5,
    # which no SkyServe's looks could have counted).
    scaler = scaler_for(policy(min_replicas=0, max_replicas=3, up=300, down=60))
    decisions = simulate(scaler, [50.5], until=200)
    check_table(decisions, [(50, 0), (51, 1), (61, 1), (101, 1), (110, 1), (111, 0), (200, 0)])
    assert decisions[61].raw_target == 0
    assert scaler.decision_interval == DEFAULT_ZERO_DECISION_INTERVAL


def test_raw_target_is_clipped_to_max_and_min() -> None:
    high = simulate(scaler_for(policy(max_replicas=5, up=0)), rate(100, 0, 100), until=50)
    assert (high[50].target, high[50].raw_target) == (5, 5)
    assert high[50].reason.startswith("QPS 100.0 wants 100, capped at max_replicas 5")

    low = simulate(scaler_for(policy(min_replicas=2, down=0)), [], until=50)
    assert {(d.target, d.raw_target) for d in low.values()} == {(2, 2)}
    assert "wants 0, raised to min_replicas 2" in low[50].reason


def test_overprovision_is_added_on_top_but_not_at_zero() -> None:
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    decisions = simulate(scaler_for(policy(over=2, up=60)), requests, until=200)
    check_table(decisions, [(100, 3), (140, 3), (141, 5)])
    assert decisions[141].raw_target == 3  # raw excludes the overprovision
    assert decisions[141].reason.endswith("(+2 overprovisioned = 5)")

    capped = simulate(scaler_for(policy(max_replicas=4, over=2, up=0)), rate(50, 0, 60), until=5)
    assert capped[5].target == 6  # max_replicas + num_overprovision

    zero = scaler_for(policy(min_replicas=0, max_replicas=3, over=1, down=60))
    check_table(simulate(zero, [50.5], until=200), [(50, 0), (51, 2), (110, 2), (111, 0)])


# --------------------------------------------------------------------------------------------
# num_overprovision on a diurnal day, against a model of SkyServe's counters
#
# SkyServe (sky/serve/autoscalers.py, 0.14.1): the raw target is ceil(QPS / target) clipped to
# [min, max] (RequestRateAutoscaler._calculate_target_num_replicas); its hysteresis compares
# that with target_num_replicas, which never includes the overprovision
# (_set_target_num_replicas_with_hysteresis); get_final_target_num_replicas adds
# num_overprovision last. So overprovision comes after the clip and after the counters.


def diurnal_day() -> list[float]:
    """Two hours of "day" from 1 to 22 req/s and back, then half a night: a constant rate
    per minute (so crossings are sharp), high enough to reach max_replicas 10 at 2 QPS each."""
    return trace(
        *(rate(11.5 - 10.5 * math.cos(2 * math.pi * m / 120), 60.0 * m, 60.0 * (m + 1))
          for m in range(150))
    )  # fmt: skip


DAY = diurnal_day()
DAY_END = 150 * 60.0
Move = tuple[float, int, int]  # (time, final target before, after)


def controller_moves(p: ReplicaPolicy, stamps: Sequence[float], until: float) -> list[Move]:
    """corral's target changes, deciding as the controller does (``lookback`` of requests)."""
    scaler, out, now, last = make_autoscaler(p), [], 0.0, None
    while now <= until:
        low = bisect.bisect_right(stamps, now - scaler.lookback(now))
        target = scaler.decide(now, stamps[low : bisect.bisect_right(stamps, now)]).target
        if last is not None and target != last:
            out.append((now, last, target))
        last, now = target, now + scaler.decision_interval
    return out


def skyserve_raw(p: ReplicaPolicy, stamps: Sequence[float], now: float) -> int:
    """SkyServe's raw target at ``now``: it keeps the requests stamped in [now - 60, now]."""
    count = bisect.bisect_right(stamps, now) - bisect.bisect_left(stamps, now - 60)
    assert p.target_qps_per_replica is not None
    wanted = math.ceil(count / 60 / p.target_qps_per_replica)
    return max(p.min_replicas, min(p.max_replicas, wanted))


def skyserve_moves(
    p: ReplicaPolicy, stamps: Sequence[float], until: float, phase: float
) -> list[Move]:
    """SkyServe's counters as its controller runs them, looking every 20 s from ``phase``:
    ``int(delay / 20)`` looks in a row on one side move the target to that look's raw target;
    a look on the other side or equal resets; the final target adds the overprovision."""
    need = {1: int(p.upscale_delay_seconds / 20), -1: int(p.downscale_delay_seconds / 20)}
    target, counts, over, out, now = p.min_replicas, {1: 0, -1: 0}, p.num_overprovision, [], phase
    while now <= until:
        raw, before = skyserve_raw(p, stamps, now), target
        side = (raw > target) - (raw < target)
        counts = {d: counts[d] + 1 if d == side else 0 for d in counts}
        if target == 0 or (side and counts[side] >= need[side]):
            target, counts = raw, {1: 0, -1: 0}
        if target != before:
            out.append((now, before + over, target + over))
        now += 20.0
    return out


@pytest.mark.parametrize(("up", "down"), [(300, 1200), (60, 120)])
def test_overprovision_moves_every_target_up_by_itself_and_no_move_in_time(
    up: float, down: float
) -> None:
    plain = controller_moves(policy(max_replicas=10, target_qps=2, up=up, down=down), DAY, DAY_END)
    over = controller_moves(
        policy(max_replicas=10, target_qps=2, up=up, down=down, over=2), DAY, DAY_END
    )
    assert over == [(t, a + 2, b + 2) for t, a, b in plain]
    assert max(b for _, _, b in over) == 12  # clipped to max_replicas 10 first, then + 2
    assert any(b < a for _, a, b in over)  # the night scales down too


def test_diurnal_moves_with_overprovision_targets_and_times() -> None:
    # Default delays (holds of 280 s up, 1180 s down), num_overprovision 2. SkyServe's moves
    # depend on the phase of its 20 s clock: near 1230 s the raw target flickers between 5 and
    # 6 as requests come and leave, and SkyServes whose 15th look falls a second apart go 4 -> 5
    # or 4 -> 6 (and from 5 reach 7 only near 1530 s). corral follows the earliest of each: to
    # 5 at 1227.7, to 6 a second later, when a phase's look saw 6 (the 1 s poll while some phase
    # is one look short), and not 280 s later, held at 5.
    p = policy(max_replicas=10, target_qps=2, up=300, down=1200, over=2)
    got = [(round(t, 1), a, b) for t, a, b in controller_moves(p, DAY, DAY_END)]
    assert got == [
        (845.4, 3, 4), (1227.7, 4, 5), (1228.7, 5, 6), (1527.7, 6, 7), (1750.9, 7, 8),
        (1987.7, 8, 9), (2194.6, 9, 10), (2427.7, 10, 11), (2648.2, 11, 12), (5871.5, 12, 6),
        (7270.0, 6, 3), (8045.4, 3, 4), (8427.7, 4, 5), (8428.7, 5, 6), (8727.7, 6, 7),
        (8950.9, 7, 8),
    ]  # fmt: skip


def test_a_move_made_from_another_phase_s_state_says_so() -> None:
    # The 5 -> 6 of the diurnal day: the SkyServe that moved is one still at 2 (+2), whose look
    # at 1228.2 s saw 4 (+2) after its 15 looks above 2; corral, at 3 (+2), follows it.
    p = policy(max_replicas=10, target_qps=2, up=300, down=1200, over=2)
    scaler, now, reasons = make_autoscaler(p), 0.0, {}
    while now <= 1230:
        low = bisect.bisect_right(DAY, now - scaler.lookback(now))
        d = scaler.decide(now, DAY[low : bisect.bisect_right(DAY, now)])
        reasons[d.target] = reasons.get(d.target, d.reason)
        now += scaler.decision_interval
    assert reasons[5].startswith("QPS 6 wants 3 (> current 2) for 277.5s (and at every 20s look")
    assert reasons[6] == (
        "QPS 6.02 wants 4 (> current 3): scaling up to 4, as SkyServe does from 2 at the phase "
        "of its 20s clock that looked 0.5s ago, past the 280s hold of the 300s upscale delay "
        "(+2 overprovisioned = 6)"
    )


@pytest.mark.parametrize(("up", "down"), [(300, 1200), (60, 120)])
def test_each_diurnal_move_with_overprovision_is_one_skyserve_makes_at_some_phase(
    up: float, down: float
) -> None:
    # Each move of corral's is one that a SkyServe started at some instant makes, in the same
    # direction and to the same target, no later than corral and at most the 1 s poll before
    # it: not earlier than that SkyServe's delay allows, nor elsewhere.
    p = policy(max_replicas=10, target_qps=2, up=up, down=down, over=2)
    moves = controller_moves(p, DAY, DAY_END)
    assert len(moves) > 10
    for t, a, b in moves:
        side = 1 if b > a else -1
        found = [
            (at, before, after)
            for k in range(41)
            for at, before, after in skyserve_moves(p, DAY, t + 1e-6, (t - 0.025 * k) % 20)
            if t - 1 - 1e-6 <= at <= t + 1e-6 and after == b and (after - before) * side > 0
        ]
        assert found, (t, a, b)


def first_reach(moves: Sequence[Move], level: int, side: int) -> float | None:
    return next((t for t, a, b in moves if (b - level) * side >= 0 > (a - level) * side), None)


@pytest.mark.parametrize(("up", "down", "over"), [(300, 1200, 2), (300, 1200, 0), (60, 120, 2)])
def test_on_a_diurnal_day_each_level_is_reached_no_later_than_skyserve_at_any_phase(
    up: float, down: float, over: int
) -> None:
    # Up and down: corral follows the earliest phase of SkyServe's clock to each level. (The
    # rule that followed only the first phase to move, then held from its target, reached 6
    # at 1507.8 s, 260-278 s after 18 of these 20 phases.)
    p = policy(max_replicas=10, target_qps=2, up=up, down=down, over=over)
    mine = controller_moves(p, DAY, DAY_END)
    for phase in range(20):
        theirs = skyserve_moves(p, DAY, DAY_END, float(phase))
        for level in range(over + 2, over + 11):
            for side in (1, -1):
                when = first_reach(theirs, level, side)
                ours = first_reach(mine, level, side)
                if when is not None:
                    assert ours is not None and ours <= when + 1e-6, (phase, level, side)


# --------------------------------------------------------------------------------------------
# The hold: SkyServe's count, from the instant the load crossed


@pytest.mark.parametrize(
    ("delay", "hold"),
    [
        (0, 0),
        (19.9, 0),
        (20, 0),
        (39.9, 0),
        (40, 20),
        (59.9, 20),
        (60, 40),
        (300, 280),
        (1200, 1180),
    ],
)
def test_hold_is_skyserves_count_of_20s_decisions_the_first_included(
    delay: float, hold: float
) -> None:
    # SkyServe moves at the int(delay / 20)-th consecutive decision that sees the change, 20 s
    # apart: 20 * (int(delay / 20) - 1) s after the first, and at once below 2 decisions.
    assert hold_seconds(delay) == hold


def test_with_5s_decisions_the_move_comes_exactly_one_hold_after_the_crossing() -> None:
    # Decisions every 5 s see the crossing of the step-up table (at 100 + 1/6) first at 105,
    # date it back, and cut the interval so one falls when the 40 s hold ends: at 140.17, not
    # at 145 (the next 5 s decision) nor 150 (a hold counted from the first sighting).
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    scaler = scaler_for(policy(up=60))
    decisions = follow(scaler, requests, until=200)
    times = [now for now, _ in decisions]
    assert 105 in times and 100 in times and not [t for t in times if 100 < t < 105]
    assert first_move(decisions, 3) == pytest.approx(100 + 0.5 / 3 + 40)
    assert first_move(decisions, 2) is None
    assert scaler.decision_interval == DEFAULT_DECISION_INTERVAL  # no hold runs any more


def batch(at: float, n: int) -> list[float]:
    return [at] * n


@pytest.mark.parametrize("delay", [60, 300, 1200])
@pytest.mark.parametrize("slack", [0.5, -0.5])
def test_an_upscale_that_lasts_the_hold_moves_and_a_shorter_one_does_not(
    delay: float, slack: float
) -> None:
    # A batch of requests at t=a wants 3 for exactly one window, [a, a + window): with the window
    # half a second longer than the hold the target moves at a + hold exactly; half a second
    # shorter, never.
    hold = hold_seconds(delay)
    window = hold + slack
    a = window + 7.3  # after the first window: the crossing is dated
    requests = batch(a, int(2.5 * window))
    scaler = scaler_for(policy(max_replicas=5, up=delay), window=window)
    decisions = follow(scaler, requests, until=a + 2 * window + 60)
    if slack > 0:
        assert first_move(decisions, 3) == pytest.approx(a + hold)
    else:
        assert {d.target for _, d in decisions} == {1}
        assert max(d.raw_target for _, d in decisions) == 3


@pytest.mark.parametrize("delay", [60, 300, 1200])
@pytest.mark.parametrize("slack", [0.5, -0.5])
def test_a_downscale_that_lasts_the_hold_moves_and_a_shorter_one_does_not(
    delay: float, slack: float
) -> None:
    # At 3 (min 3 lowered to 1 keeps it; watched since -100, so the first window is over), a
    # batch at 0.5 wants 3 until it leaves the window at b = 0.5 + window; a second batch at
    # b + hold + slack wants 3 again. A lull half a second longer than the hold: the target
    # falls at b + hold; half a second shorter: never.
    window = 30.0
    hold = hold_seconds(delay)
    scaler = make_autoscaler(policy(min_replicas=3, max_replicas=5), qps_window=window)
    assert scaler.decide(-100.0, []).target == 3
    scaler.reset_policy(policy(min_replicas=1, max_replicas=5, down=delay))
    b = 0.5 + window
    requests = batch(0.5, 75) + batch(b + hold + slack, 75)
    decisions = follow(scaler, requests, start=1.0, until=b + hold + 2 * window)
    if slack > 0:
        assert first_move(decisions, 1) == pytest.approx(b + hold)
    else:
        assert {d.target for _, d in decisions} == {3}
        assert min(d.raw_target for _, d in decisions) == 1


def test_a_crossing_is_dated_no_earlier_than_the_previous_decision() -> None:
    # The decision at 100 saw 1 QPS (= current 1); one at 130 sees 3 QPS. The load crossed at
    # 100 + 1/6, which the requests show: held 29.8 s, not 0 s, and not 30 s either.
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    scaler = scaler_for(policy(up=60))
    simulate(scaler, requests, until=100, step=10)
    assert scaler.lookback(130.0) == 10 + 30  # the window, and the 30 s since the last decision
    d = scaler.decide(130.0, [s for s in requests if 90 < s <= 130])
    assert "for 29.8s of the 40s hold" in d.reason
    assert scaler.decision_interval == DEFAULT_DECISION_INTERVAL  # 10.2 s of hold left
    assert scaler.decide(136.0, requests).target == 1
    assert scaler.decision_interval == pytest.approx(100 + 0.5 / 3 + 40 - 136)  # not 5 s


# --------------------------------------------------------------------------------------------
# QPS measurement


def test_qps_over_the_default_60s_window() -> None:
    scaler = make_autoscaler(policy())
    requests = rate(2, 0, 500)
    decisions = simulate(scaler, requests, until=300, step=10)
    assert decisions[300].qps == pytest.approx(2.0)
    # Half a window of 2 req/s after a quiet start: 60 requests / 60 s, not / 30 s.
    late = make_autoscaler(policy())
    simulate(late, [], until=100, step=10)
    assert late.decide(130.0, rate(2, 100, 200)).qps == pytest.approx(1.0)


def test_a_burst_right_after_start_is_not_under_estimated() -> None:
    scaler = scaler_for(policy(), window=60.0)
    burst = [0.1, 0.2, 0.3] * 10  # 30 requests in the first 0.3 s
    assert scaler.decide(0.0, []).qps == 0.0
    assert scaler.decide(0.5, burst).qps == pytest.approx(30.0)  # over the 1 s minimum span
    assert scaler.decide(5.0, burst).qps == pytest.approx(6.0)  # over the 5 s watched
    assert scaler.decide(60.0, burst).qps == pytest.approx(0.5)  # over the full window
    assert scaler.decide(61.0, burst).qps == 0.0


def test_requests_seen_before_the_first_decision_count_as_watched_time() -> None:
    # The first decide at t=100 sees 1 req/s since t=70.5: 30 requests over 29.5 s, not 30
    # requests over the 1 s floor.
    scaler = scaler_for(policy(), window=60.0)
    assert scaler.decide(100.0, rate(1, 70, 100)).qps == pytest.approx(30 / 29.5)


def test_request_order_and_future_requests_do_not_matter() -> None:
    # The caller passes the last ``lookback(now)`` seconds of requests (the window and the time
    # since the last decision, which dating a crossing needs), in whatever order.
    requests = trace(rate(1, 0, 100), rate(3, 100, 250), rate(1, 250, 400))
    shuffled = list(requests)
    random.Random(7).shuffle(shuffled)
    in_order = scaler_for(policy(up=60, down=120))
    scrambled = scaler_for(policy(up=60, down=120))
    for now in range(0, 400, 3):
        past = [s for s in requests if now - in_order.lookback(now) < s <= now]
        assert in_order.decide(float(now), past) == scrambled.decide(float(now), shuffled)
    assert in_order.decide(400.0, []).target == 1


# --------------------------------------------------------------------------------------------
# Reasons


def test_reason_names_the_qps_the_delay_and_the_outcome() -> None:
    # The held time counts from the crossing (100 + 1/6 up, 104 + 5/6 down; see the tables).
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    up = simulate(scaler_for(policy(up=60)), requests, until=141)
    assert up[100].reason == "QPS 1 wants 1 (= current 1): holding 1"
    assert up[101].reason == (
        "QPS 1.2 wants 2 (> current 1) for 0.8s of the 40s hold of the 60s upscale delay: holding 1"
    )
    assert up[110].reason == (
        "QPS 3 wants 3 (> current 1) for 9.8s of the 40s hold of the 60s upscale delay: holding 1"
    )
    assert up[141].reason == (
        "QPS 3 wants 3 (> current 1) for 40.8s, past the 40s hold of the 60s upscale delay: "
        "scaling up to 3"
    )

    requests = trace(rate(3, 0, 100), rate(1, 100, 400))
    down = simulate(scaler_for(policy(up=0, down=60)), requests, until=145)
    assert down[125].reason == (
        "QPS 1 wants 1 (< current 3) for 20.2s of the 40s hold of the 60s downscale delay: "
        "holding 3"
    )
    assert down[145].reason.endswith(
        "past the 40s hold of the 60s downscale delay: scaling down to 1"
    )

    # A delay under two of SkyServe's 20 s looks holds nothing; the reason says so (it said
    # "past the 0s hold of the 10s upscale delay").
    short = simulate(scaler_for(policy(up=10)), trace(rate(1, 0, 100), rate(3, 100, 400)), 101)
    assert short[101].reason == (
        "QPS 1.2 wants 2 (> current 1) for 0.8s: scaling up to 2 "
        "(no hold: the 10s upscale delay is under two of SkyServe's 20s looks)"
    )

    tiny = make_autoscaler(policy(min_replicas=0, up=300))
    tiny.decide(0.0, [])
    assert tiny.decide(100.0, [99.0]).reason == (
        "QPS 0.0167 wants 1 while at zero: scaling up to 1 at once (scale from zero does not "
        "wait for the 300s upscale delay)"
    )


# --------------------------------------------------------------------------------------------
# Policy updates and the fixed autoscaler


def test_reset_policy_clips_into_new_bounds_and_keeps_a_target_that_fits() -> None:
    scaler = scaler_for(policy(max_replicas=5, up=0))
    requests = rate(4, 0, 1000)  # wants 4
    assert simulate(scaler, requests, until=20)[20].target == 4

    scaler.reset_policy(policy(min_replicas=2, max_replicas=8, up=60))
    assert scaler.decide(21.0, requests).target == 4  # still within bounds: kept

    scaler.reset_policy(policy(max_replicas=3, up=60))
    shrunk = scaler.decide(22.0, requests)
    assert (shrunk.target, shrunk.raw_target) == (3, 3)  # clipped at once, no delay

    # Widening again does not jump: the load's 4 must wait out the new upscale hold (40 s),
    # dated from the first request after the previous decision (22.125), not before it.
    scaler.reset_policy(policy(max_replicas=8, up=60))
    check_table(simulate(scaler, requests, start=23, until=70), [(23, 3), (62, 3), (63, 4)])

    scaler.reset_policy(policy(min_replicas=2, max_replicas=2, target_qps=None, over=1))
    fixed = scaler.decide(61.0, requests)
    assert (fixed.target, fixed.raw_target) == (3, 2)
    assert fixed.reason.startswith("fixed size of 2 replicas")


def test_an_update_that_keeps_the_bounds_keeps_a_running_hold() -> None:
    # The step-up table: the hold runs from 100 + 1/6. A new version with the same bounds and
    # target QPS (new code, another downscale delay) does not restart it; new bounds do.
    requests = trace(rate(1, 0, 100), rate(3, 100, 400))
    same = scaler_for(policy(up=60))
    simulate(same, requests, until=120)
    same.reset_policy(policy(up=60, down=300))
    check_table(simulate(same, requests, start=121, until=141), [(140, 1), (141, 3)])

    wider = scaler_for(policy(up=60))
    simulate(wider, requests, until=120)
    wider.reset_policy(policy(max_replicas=6, up=60))
    check_table(simulate(wider, requests, start=121, until=170), [(141, 1), (160, 1), (161, 3)])


def test_turning_autoscaling_on_keeps_the_fixed_size_as_the_starting_target() -> None:
    scaler = make_autoscaler(policy(min_replicas=3, max_replicas=3, target_qps=None))
    assert isinstance(scaler, FixedAutoscaler)
    assert scaler.decide(0.0, []).target == 3
    scaler.reset_policy(policy(min_replicas=1, max_replicas=5, down=60))
    # No load wants 1, but that is a downscale: it waits, from 3, like any other (the 40 s hold
    # from the first decision that sees it: no request dates it earlier).
    check_table(simulate(scaler, [], start=1, until=70), [(1, 3), (40, 3), (41, 1)])


def test_fixed_autoscaler_ignores_load() -> None:
    scaler = make_autoscaler(policy(min_replicas=3, max_replicas=3, target_qps=None, over=1))
    assert isinstance(scaler, FixedAutoscaler)
    decisions = simulate(scaler, rate(1000, 0, 100), until=100, step=10)
    assert {(d.target, d.raw_target) for d in decisions.values()} == {(4, 3)}
    assert decisions[100].qps == pytest.approx(1000.0, rel=1e-3)  # measured all the same
    assert "autoscaling is off" in decisions[100].reason
    assert scaler.decision_interval == DEFAULT_DECISION_INTERVAL

    # target_qps_per_replica with min == max is still a fixed size.
    assert isinstance(make_autoscaler(policy(min_replicas=2, max_replicas=2)), FixedAutoscaler)

    # replicas: 0 (a paused service) stays at 0, overprovision or not, and is not polled fast.
    paused = make_autoscaler(policy(min_replicas=0, max_replicas=0, target_qps=None, over=2))
    assert paused.decide(1.0, [0.5] * 100).target == 0
    assert paused.decision_interval == DEFAULT_DECISION_INTERVAL


def test_construction_checks() -> None:
    assert isinstance(make_autoscaler(policy()), RequestRateAutoscaler)
    assert isinstance(make_autoscaler(policy()), Autoscaler)
    assert make_autoscaler(policy(min_replicas=2)).decide(0.0, []).target == 2  # starts at min
    with pytest.raises(ValueError, match="FixedAutoscaler needs a fixed policy"):
        FixedAutoscaler(policy())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="qps_window"):
            make_autoscaler(policy(), qps_window=bad)
        with pytest.raises(ValueError, match="decision_interval"):
            make_autoscaler(policy(), decision_interval=bad)
    custom = make_autoscaler(
        policy(min_replicas=0), decision_interval=2.0, zero_decision_interval=0.5
    )
    assert custom.decision_interval == 0.5


# --------------------------------------------------------------------------------------------
# Property


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ReplicaPolicy, float, list[float], list[float]]:
    """A policy, and a window, requests and decision times on a quarter-second grid: requests
    at odd eighths (0.125 + 0.25 k), decisions and window at quarters, so the raw target
    changes only at odd eighths and the phases 0.25 s apart stand for every phase."""
    low = draw(st.integers(1, 3))
    p = policy(
        min_replicas=low,
        max_replicas=low + draw(st.integers(1, 4)),
        target_qps=draw(st.sampled_from([0.3, 0.5, 1.0, 2.0])),
        up=draw(st.floats(0.0, 100.0)),
        down=draw(st.floats(0.0, 100.0)),
        over=draw(st.integers(0, 2)),
    )
    window = 0.25 * draw(st.integers(2, 80))
    requests = sorted(0.125 + 0.25 * k for k in draw(st.lists(st.integers(0, 1600), max_size=400)))
    steps = draw(st.lists(st.integers(1, 60), min_size=1, max_size=60))
    times = [0.25 * sum(steps[: i + 1]) for i in range(len(steps))]
    return p, window, requests, times


def reference_targets(
    p: ReplicaPolicy, window: float, requests: Sequence[float], start: float, times: Sequence[float]
) -> list[int]:
    """SkyServe's counters at 80 phases 0.25 s apart from ``start`` (the model of
    ``skyserve_moves``), and the rule corral keeps: follow each move, in time order, that goes
    past the target in its direction. The target (no overprovision) at each of ``times``."""
    assert p.target_qps_per_replica is not None
    need = {1: int(p.upscale_delay_seconds / 20), -1: int(p.downscale_delay_seconds / 20)}
    states = [(p.min_replicas, 0)] * 80  # (target, count: > 0 above, < 0 below)
    looks = sorted(
        (start + 0.25 * i + 20 * k, i) for i in range(80) for k in range(int(times[-1] / 20) + 4)
    )
    target, out, n = p.min_replicas, [], 0
    for now in times:
        while looks[n][0] <= now:
            at, i = looks[n]
            n += 1
            count = bisect.bisect_right(requests, at) - bisect.bisect_left(requests, at - window)
            ratio = count / window / p.target_qps_per_replica
            raw = max(p.min_replicas, min(p.max_replicas, math.ceil(ratio - ratio * 1e-9)))
            held, was = states[i]
            side = (raw > held) - (raw < held)
            was = was * side + 1 if was * side > 0 else (1 if side else 0)
            states[i] = (raw, 0) if side and was >= need[side] else (held, was * side)
            if (states[i][0] - held) * (states[i][0] - target) > 0:
                target = states[i][0]
        out.append(target)
    return out


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_each_target_is_the_one_skyserves_counters_at_every_phase_lead_to(
    scenario: tuple[ReplicaPolicy, float, list[float], list[float]],
) -> None:
    # corral keeps SkyServe's counters at every phase at once, as intervals of phases; on a
    # grid-aligned trace the 80 phases of the reference stand for all of them, so the targets
    # must be the same at every decision, whatever its timing.
    p, window, requests, times = scenario
    over = p.num_overprovision
    scaler = make_autoscaler(p, qps_window=window)
    scaler.decide(-40.0, [])  # the first window is over before the first request
    expected = reference_targets(p, window, requests, -40.0, times)
    for now, want in zip(times, expected, strict=True):
        d = scaler.decide(now, requests)
        assert p.min_replicas <= d.target <= p.max_replicas + over
        assert p.min_replicas <= d.raw_target <= p.max_replicas
        assert d.target - over == want, (now, d.reason)


# --------------------------------------------------------------------------------------------
# The delay clock, decision by decision


def at_three_with_delays(delay: float) -> tuple[Autoscaler, Callable[[float, float], Decision]]:
    """A scaler holding 3 in [1, 6] (min 3 first, then lowered: the target is kept), and a
    ``load(now, qps)`` that decides with ``qps`` worth of requests just before ``now``."""
    scaler = make_autoscaler(policy(min_replicas=3, max_replicas=6), qps_window=10)
    assert scaler.decide(0.0, []).target == 3
    scaler.reset_policy(policy(min_replicas=1, max_replicas=6, up=delay, down=delay))

    def load(now: float, qps: float) -> Decision:
        return scaler.decide(now, [now - 0.5] * round(qps * 10))

    return scaler, load


def test_the_clock_restarts_when_the_raw_target_jumps_to_the_other_side() -> None:
    _, load = at_three_with_delays(60)  # holds 40 s
    assert load(10, 5).target == 3  # up clock from 10 (inside the first window: not dated back)
    assert load(20, 5).target == 3
    assert load(25, 0).raw_target == 1  # straight to below: the down clock starts at 25, not 10
    assert load(50, 0).target == 3
    assert load(60, 0).target == 3
    assert load(65, 0).target == 1


def test_a_dip_shorter_than_skyserves_interval_does_not_restart_the_clock() -> None:
    # SkyServe looks every 20 s, so a shorter dip can fall between two looks; corral, looking
    # every 5 s, must not lose the hold to it either.
    _, load = at_three_with_delays(60)  # holds 40 s
    assert load(10, 5).target == 3  # up clock from 10
    assert load(30, 5).target == 3
    assert load(35, 3).reason == "QPS 3 wants 3 (= current 3): holding 3"
    assert load(40, 5).target == 3  # the dip lasted 34.5 -> 39.5: looks at 10, 30, 50 miss it
    moved = load(50, 5)
    assert moved.target == 5
    assert moved.reason == (
        "QPS 5 wants 5 (> current 3) for 10.5s (and at every 20s look before, dips between "
        "looks aside), past the 40s hold of the 60s upscale delay: scaling up to 5"
    )


def test_delays_under_40s_move_at_the_first_decision_that_sees_the_change() -> None:
    # int(30 / 20) = 1 look: SkyServe moves at its first look, and so does corral, both ways.
    _, load = at_three_with_delays(30)
    assert load(10, 5).target == 5
    assert load(15, 0).target == 1


def test_a_dip_of_skyserves_interval_restarts_the_clock() -> None:
    _, load = at_three_with_delays(60)  # holds 40 s
    assert load(10, 5).target == 3  # up clock from 10
    assert load(30, 3).target == 3  # dip from 29.5...
    assert load(45, 3).target == 3
    assert load(50, 3).target == 3  # ...20.5 s long: the up clock is gone
    assert load(55, 5).target == 3  # a new one from 54.5
    assert load(90, 5).target == 3
    assert load(95, 5).target == 5


def test_float_noise_does_not_ask_for_an_extra_replica() -> None:
    # 21 requests / 10 s = 2.1 QPS; 2.1 / 0.3 is 7.000000000000001 in floats.
    scaler = make_autoscaler(policy(max_replicas=20, target_qps=0.3, up=0), qps_window=10)
    scaler.decide(0.0, [])
    assert scaler.decide(20.0, [19.5] * 21).raw_target == 7
    assert scaler.decide(21.0, [19.5] * 21 + [20.5]).raw_target == 8
