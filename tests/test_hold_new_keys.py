"""A held request waits for the replica its policy chose only when something of it is there.

Under prefix_affinity or session affinity with ``max_in_flight_per_replica``, a request whose
chosen replica is full waits for it (``hold_patience_seconds``) because its prompt's prefix is
cached there. A session never seen before, or a conversation whose every block is new, has
nothing cached anywhere: its choice is a hash. Measured on two simulated engines (one full,
one idle) before this: a quarter of new sessions and new conversations took 0.53-0.96 s in
place of 0.03 s, waiting out the patience while the other replica sat idle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.balancer import LoadBalancer
from corral.balancer.affinity import table_path
from corral.balancer.policies import RequestView

CHAT = b"/v1/chat/completions"


def _balancer(tmp_path: Path, policy: str, options: dict[str, str]) -> LoadBalancer:
    """Two replicas, a limit of 1 each, replica 1 full; the workers' shared table on, as a
    service's balancer has it."""
    routing = {
        "options": options,
        "max_in_flight_per_replica": 1,
        "hold_patience": 10,
        "affinity_file": str(table_path(tmp_path, "svc")),
    }
    lb = LoadBalancer(name="svc", policy=policy, routing=routing)
    lb.set_ready({1: "http://127.0.0.1:9", 2: "http://127.0.0.1:9"})
    return lb


def _chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


@pytest.mark.parametrize("policy", ["round_robin", "prefix_affinity"])
def test_a_new_session_does_not_wait_for_a_full_replica(tmp_path: Path, policy: str) -> None:
    lb = _balancer(tmp_path, policy, {"session_header": "X-Session"})
    lb._in_flight[1] = 1
    for session in range(20):
        headers = b"Host: x\r\nX-Session: new-%d\r\n" % session
        assert lb._pick((), RequestView(CHAT, _chat(f"hi {session}"), headers)) == 2


def test_a_known_session_still_waits_for_its_replica(tmp_path: Path) -> None:
    lb = _balancer(tmp_path, "round_robin", {"session_header": "X-Session"})
    views = [RequestView(CHAT, None, b"Host: x\r\nX-Session: s%d\r\n" % s) for s in range(20)]
    homes = [lb._pick((), v) for v in views]  # placed: recorded in the shared table
    assert set(homes) == {1, 2}
    lb._in_flight[1] = 1
    for v, home in zip(views, homes, strict=True):
        rid = lb._pick((), v)
        assert (rid, lb._want) == ((None, 1) if home == 1 else (2, None))
        lb._want = None


def test_a_new_conversation_does_not_wait_for_a_full_replica(tmp_path: Path) -> None:
    lb = _balancer(tmp_path, "prefix_affinity", {})
    lb._in_flight[1] = 1
    for conv in range(20):
        body = _chat(f"conversation {conv}: " + "a question that no one asked before " * 8)
        assert lb._pick((), RequestView(CHAT, body, b"Host: x\r\n")) == 2


def test_a_cached_system_prompt_is_still_waited_for(tmp_path: Path) -> None:
    lb = _balancer(tmp_path, "prefix_affinity", {})
    system = {"role": "system", "content": "You are the shared assistant. " * 20}

    def body(conv: int) -> bytes:
        messages = [system, {"role": "user", "content": f"question {conv}"}]
        return json.dumps({"messages": messages}).encode()

    first = lb._pick((), RequestView(CHAT, body(0), b"Host: x\r\n"))
    assert first is not None
    lb._in_flight[first] = 1
    assert lb._pick((), RequestView(CHAT, body(1), b"Host: x\r\n")) is None
    assert lb._want == first  # held for the replica that computed the system prompt
