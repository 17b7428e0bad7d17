"""A replica's share of the recent requests bounds what prefix_affinity sends it.

Why: a replica holding a hot prompt family in cache answers it faster, so a bound on requests
in flight alone let it take a third of a 4-replica fleet's requests (bench/llm_routing.py,
RAG near saturation). These tests pin the share's arithmetic and what the policy does with it:
a hot document spreads until no replica is over its share, while a placed conversation's turns
never move for it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from corral.balancer.policies import RequestView
from corral.balancer.prefix_policy import SHARE_BALANCE
from corral.balancer.recent_share import RecentShare
from corral.balancer.routing import make_policy


def test_shares_decay_toward_the_latest_requests() -> None:
    recent = RecentShare(window=10)
    assert recent.share(1) == 0.0
    for _ in range(100):
        recent.add(1)
    assert recent.share(1) == pytest.approx(1.0)
    for _ in range(100):
        recent.add(2)
    # 100 requests later, replica 1's weight is (1 - 1/11)**100 of replica 2's
    assert recent.share(1) < 1e-3 < 0.999 < recent.share(2)
    recent.forget(2)
    assert recent.share(1) == pytest.approx(1.0)
    assert recent.share(2) == 0.0


def test_the_weights_are_rescaled_before_they_overflow() -> None:
    recent = RecentShare(window=1)  # the weight doubles per request: overflow at ~1024
    for i in range(5000):
        recent.add(i % 4)
    assert sum(recent.share(r) for r in range(4)) == pytest.approx(1.0)
    assert 0.0 < recent.share(0) < 1.0


def test_nothing_is_over_before_a_window_of_requests() -> None:
    recent = RecentShare(window=20)
    for _ in range(19):
        recent.add(1)
    assert recent.over((1, 2, 3), 1.15) == frozenset()
    recent.add(1)
    assert recent.over((1, 2, 3), 1.15) == {1}
    assert recent.over((1,), 1.15) == frozenset()  # one replica: nothing to compare with
    for r in (2, 3) * 200:
        recent.add(r)
    assert recent.over((2, 3), 1.15) == frozenset()  # an even split is not over
    assert recent.over((1, 2, 3), 1.15) == {2, 3}  # 1 has had nothing lately
    with pytest.raises(ValueError, match="window"):
        RecentShare(window=0)


def _question(doc: str, q: int) -> RequestView:
    body = json.dumps({"model": "m", "prompt": f"{doc}Question {q}?"}).encode()
    return RequestView(b"/v1/completions", body, b"Host: x\r\n")


def test_a_hot_document_spreads_until_no_replica_is_over_its_share(tmp_path: Path) -> None:
    """One document, every question answered before the next (no load in flight, so the load
    bound never acts): without the share bound its replica would take every question. With
    it, past the first window, no replica takes more than SHARE_BALANCE x an even share, and
    each replica the document reached keeps serving it from cache (few distinct homes)."""
    policy = make_policy("prefix_affinity", affinity_file=str(tmp_path / "t.bin"))
    ready = (1, 2, 3, 4)
    policy.update(ready, {})
    doc = "The one shared document. " * 120
    chosen = [policy.select(ready, {}, _question(doc, q)) for q in range(2000)]
    assert Counter(chosen[:100]).most_common(1)[0][1] == 100  # computed once while cold
    late = Counter(chosen[1000:])
    assert len(late) == 4, late  # without the bound: one replica, the test fails
    assert max(late.values()) / 1000 <= SHARE_BALANCE / 4 + 0.03, late


def test_a_placed_conversation_is_not_moved_by_its_share(tmp_path: Path) -> None:
    """A single long conversation is all of a replica's recent requests: far over its share,
    its turns stay there (moving it recomputes its whole history). A new conversation of the
    same system prompt goes elsewhere."""
    policy = make_policy("prefix_affinity", affinity_file=str(tmp_path / "t.bin"))
    ready = (1, 2, 3, 4)
    policy.update(ready, {})
    system = "You are the assistant of the house. " * 40
    turns: list[str] = []
    homes = set()
    for t in range(300):
        turns.append(f"question {t}")
        messages = [{"role": "system", "content": system}]
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            if i < len(turns) - 1:
                messages.append({"role": "assistant", "content": f"answer {i}"})
        body = json.dumps({"model": "m", "messages": messages}).encode()
        homes.add(policy.select(ready, {}, RequestView(b"/v1/chat/completions", body, b"")))
    assert len(homes) == 1, homes
    other = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        }
    ).encode()
    assert policy.select(ready, {}, RequestView(b"/v1/chat/completions", other, b"")) not in homes


def test_a_share_bound_below_an_even_share_is_refused() -> None:
    with pytest.raises(ValueError, match="share_balance"):
        make_policy("prefix_affinity", share_balance=0.9)
