"""The building blocks of prefix-aware routing: prompt extraction, the prefix index, and the
cross-process replica choice (corral.balancer.prompt, corral.balancer.prefix).

Why: a prompt read wrong sends every turn of a conversation away from its cache; an index that
answers a longer match than a replica holds, or grows without bound, misroutes or eats the
worker's memory; and balancer workers that disagree on a key's replica split a conversation
across caches. Each is checked against a property or a brute-force reference, not examples
alone.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.balancer import prompt as prompt_module
from corral.balancer.prefix import (
    PrefixIndex,
    block_hashes,
    bounded_choice,
    rendezvous_order,
    stable_key,
)
from corral.balancer.prompt import extract_prompt, read_prompt

SRC = Path(__file__).resolve().parent.parent / "src"
CHAT = "/v1/chat/completions"


def _body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# -- prompt extraction -------------------------------------------------------------------------


def test_completions_prompt_shapes() -> None:
    path = "/v1/completions"
    assert extract_prompt(path, _body({"prompt": "Once upon"})) == "Once upon"
    joined = extract_prompt(path, _body({"prompt": ["a", "b"]}))
    assert joined is not None and joined.startswith("a") and "b" in joined
    ids = extract_prompt(path, _body({"prompt": [1, 2, 3]}))
    longer = extract_prompt(path, _body({"prompt": [1, 2, 3, 4]}))
    other = extract_prompt(path, _body({"prompt": [1, 23]}))
    assert ids and longer and other
    assert longer.startswith(ids) and not other.startswith(ids)
    assert extract_prompt(path, _body({"prompt": [[1, 2], [3]]}))
    for bad in ("", [], [1, "a"], [True, 2], {"a": 1}, 5, [[]], None):
        assert extract_prompt(path, _body({"prompt": bad})) is None, bad


def test_generate_and_other_apis() -> None:
    assert extract_prompt("/generate", _body({"text": "sglang"})) == "sglang"
    assert extract_prompt("/generate", _body({"inputs": "tgi", "parameters": {}})) == "tgi"
    assert extract_prompt("/generate", _body({"input_ids": [5, 6]})) == "\x025,6,"
    # Any path: a known field is found; a spec's field (dotted) is read first.
    assert extract_prompt("/custom", _body({"prompt": "p"})) == "p"
    doc = {"input": {"text": "mine"}, "prompt": "p"}
    assert extract_prompt("/custom", _body(doc), field="input.text") == "mine"
    assert extract_prompt("/custom", _body({"inputs": ["x", "y"]}), field="inputs.1") == "y"
    assert extract_prompt("/custom", _body({"prompt": "p"}), field="input.text") == "p"
    assert extract_prompt("/custom", _body({"other": "p"})) is None


def test_chat_reads_every_message_and_tools_first() -> None:
    doc = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
    }
    text = extract_prompt(CHAT + "?stream=true", _body(doc))
    assert text is not None
    order = ["function", "Be brief.", "Look", "image_url", "c1", "42"]
    places = [text.find(word) for word in order]
    assert -1 not in places and places == sorted(places)
    # Key order and spacing in the client's JSON change nothing.
    reordered = {"messages": doc["messages"], "tools": doc["tools"][::-1]}
    assert extract_prompt(CHAT, json.dumps(reordered, indent=3).encode()) == text
    assert extract_prompt(CHAT, _body({"messages": [{"role": "user", "content": 3}]})) is None
    assert extract_prompt(CHAT, _body({"messages": [{"content": "no role"}]})) is None
    for bad in ([], "a string", [{"role": "user", "content": "x"}, "x"], {"role": "user"}):
        assert extract_prompt(CHAT, _body({"messages": bad})) is None, bad
    assert extract_prompt("/v1/completions", _body({"prompt": [{"role": "user"}]})) is None
    messages = [{"role": "user", "content": "x"}]
    assert extract_prompt("/api", _body({"input": messages}), field="input")


_text = st.text(max_size=30)
_part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _text),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, _text),
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(_text, st.lists(_part, max_size=3), st.none()),
    },
    optional={"name": _text, "tool_calls": st.lists(st.dictionaries(_text, _text, max_size=2))},
)
_tools = st.one_of(st.none(), st.lists(st.dictionaries(_text, _text, max_size=2), max_size=2))


@given(st.lists(_message, min_size=1, max_size=6), st.lists(_message, max_size=4), _tools)
def test_a_later_turn_starts_with_the_earlier_turn(
    earlier: list[dict[str, Any]], new: list[dict[str, Any]], tools: Any
) -> None:
    first = {"messages": earlier, **({"tools": tools} if tools is not None else {})}
    later = {**first, "messages": earlier + new, "max_tokens": 5}
    body_a, body_b = _body(first), _body(later)
    a, b = extract_prompt(CHAT, body_a), extract_prompt(CHAT, body_b)
    assert a is not None and b is not None
    assert b.startswith(a)
    pa, pb = read_prompt(CHAT, body_a), read_prompt(CHAT, body_b)
    assert pa is not None and pb is not None and pa.chat and pb.chat
    if any(m["role"] == "user" for m in earlier):  # the anchor is fixed by then
        assert pa.text[: pa.anchor_end] == pb.text[: pb.anchor_end]


def test_the_anchor_tells_conversations_apart() -> None:
    system = {"role": "system", "content": "You are a helpful assistant. " * 10}
    one = read_prompt(
        CHAT, _body({"messages": [system, {"role": "user", "content": "Plan a trip"}]})
    )
    two = read_prompt(
        CHAT, _body({"messages": [system, {"role": "user", "content": "Fix my code"}]})
    )
    assert one is not None and two is not None and one.chat and two.chat
    a1, a2 = one.text[: one.anchor_end], two.text[: two.anchor_end]
    assert a1 != a2 and a1.endswith("Plan a trip\n")
    plain = read_prompt("/v1/completions", _body({"prompt": "x" * 50}))
    assert plain == ("x" * 50, 50, False)  # no turns: the whole text, for a policy to cut


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_paths = st.sampled_from([CHAT, "/v1/completions", "/generate", "/x?y=1", ""])
_fields = st.sampled_from([None, "input", "input.text", "a.0.b", ".", ""])


def _is_prompt(result: str | None) -> bool:
    return result is None or (type(result) is str and result != "")


@given(st.binary(max_size=200), _paths, _fields)
def test_any_bytes_give_none_or_a_prompt_never_an_error(
    body: bytes, path: str, field: str | None
) -> None:
    assert _is_prompt(extract_prompt(path, body, field))


@given(_json, _paths, _fields, st.sampled_from(["messages", "prompt", "text", "inputs", "x"]))
def test_any_json_gives_none_or_a_prompt_never_an_error(
    value: Any, path: str, field: str | None, key: str
) -> None:
    for doc in (value, {key: value}, {key: value, "tools": value}, {"input": {"text": value}}):
        body = json.dumps(doc).encode()
        assert _is_prompt(extract_prompt(path, body, field))
        prompt = read_prompt(path, body, field)
        if prompt is not None:
            assert 0 <= prompt.anchor_end <= len(prompt.text)


def test_pathological_bodies() -> None:
    for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000, b"\xff\xfe", b"", b"null"):
        assert extract_prompt("/v1/completions", body) is None
    lone = extract_prompt("/v1/completions", b'{"prompt": "\\ud800 x"}')
    assert lone is not None
    assert stable_key(lone) == stable_key(lone) and block_hashes(lone * 40, 8)


# -- the prefix index --------------------------------------------------------------------------


class Reference:
    """The index's promise, the slow way: per replica, an LRU list of prefixes (tuples of block
    strings) touched last block first; a match is the longest run of leading prefixes held."""

    def __init__(self, block: int, limit: int) -> None:
        self.block, self.limit = block, limit
        self.held: dict[int, list[tuple[str, ...]]] = {}

    def prefixes(self, text: str) -> list[tuple[str, ...]]:
        blocks = [text[i : i + self.block] for i in range(0, len(text), self.block)]
        blocks = [b for b in blocks if len(b) == self.block]
        return [tuple(blocks[: k + 1]) for k in range(len(blocks))]

    def insert(self, rid: int, text: str) -> None:
        lru = self.held.setdefault(rid, [])
        for prefix in reversed(self.prefixes(text)[: self.limit]):
            if prefix in lru:
                lru.remove(prefix)
            lru.append(prefix)
        del lru[: max(0, len(lru) - self.limit)]

    def match(self, text: str) -> dict[int, int]:
        out = {}
        for rid, lru in self.held.items():
            k = 0
            for prefix in self.prefixes(text):
                if prefix not in lru:
                    break
                k += 1
            if k:
                out[rid] = k
        return out


_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "match", "forget"]),
        st.integers(0, 4),
        st.text(alphabet="ab", max_size=24),
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(_ops, st.integers(1, 3), st.integers(1, 8))
def test_index_matches_a_brute_force_reference(
    ops: list[tuple[str, int, str]], block: int, limit: int
) -> None:
    index = PrefixIndex(block_chars=block, max_blocks_per_replica=limit)
    ref = Reference(block, limit)
    seen: set[str] = set()
    for op, rid, text in ops:
        if op == "insert":
            index.insert(rid, index.hashes(text))
            ref.insert(rid, text)
        elif op == "forget":
            index.forget(rid)
            ref.held.pop(rid, None)
        seen.add(text)
        for probe in seen:
            assert index.match(index.hashes(probe)) == ref.match(probe), probe
        for r in range(5):
            assert index.size(r) == len(ref.held.get(r, [])) <= limit


def test_index_shapes_and_forget() -> None:
    index = PrefixIndex(block_chars=4, max_blocks_per_replica=100)
    system = "You are helpful. " * 4  # 68 chars: 17 whole blocks
    turn1 = index.hashes(system + "Hi")
    turn2 = index.hashes(system + "Hi there, how are you?")
    assert len(turn1) == 17 and turn2[:17] == turn1 and len(turn2) == 22
    index.insert(7, turn1)
    index.insert(1000, turn2)
    assert index.match(turn2) == {7: 17, 1000: 22}
    assert index.match(index.hashes("other text entirely")) == {}
    assert index.match([]) == {}
    index.forget(7)
    index.forget(7)
    assert index.size(7) == 0 and index.match(turn2) == {1000: 22}
    index.insert(8, turn1[:3])  # takes the freed bit
    assert index.match(turn2) == {1000: 22, 8: 3} and sorted(index.replicas()) == [8, 1000]
    assert len(index.hashes("x" * 400, limit_blocks=10)) == 10
    capped = PrefixIndex(block_chars=4, max_blocks_per_replica=5)
    capped.insert(1, turn2)
    assert capped.size(1) == 5 and capped.match(turn2) == {1: 5}


def test_eviction_takes_the_least_recently_used_conversation() -> None:
    index = PrefixIndex(block_chars=8, max_blocks_per_replica=12)
    old, hot, new = (index.hashes(c * 48) for c in "abc")  # 6 blocks each
    index.insert(1, old)
    index.insert(1, hot)
    index.insert(1, hot[:2])  # a shorter turn of the same conversation: it is still in use
    index.insert(1, new)
    assert index.match(old) == {} and index.match(new) == {1: 6}
    assert index.match(hot) == {1: 6} and index.size(1) == 12


def test_eviction_takes_leaves_so_a_prefix_stays_matchable() -> None:
    index = PrefixIndex(block_chars=1, max_blocks_per_replica=3)
    index.insert(1, index.hashes("abc"))
    index.insert(1, index.hashes("x"))  # one block out: the chain's last, not its first
    assert index.match(index.hashes("abc")) == {1: 2}


# -- choosing a replica across processes -------------------------------------------------------

_PROBE = """
import json, sys
from corral.balancer.prefix import PrefixIndex, block_hashes, rendezvous_order, stable_key
keys = [stable_key(f"conversation {i}") for i in range(200)]
orders = [rendezvous_order(k, [3, 1, 4, 15, 9, 2, 6]) for k in keys]
hashes = block_hashes("You are a helpful assistant. " * 40 + "\\u00e9\\ud800", 16)
index = PrefixIndex(block_chars=16)
anchors = [index.anchor_key(a, index.hashes(a)) for a in ("", "ab", "\\u00e9" * 30, "x" * 64)]
print(json.dumps([keys, orders, hashes, anchors]))
"""


def test_an_anchor_key_names_the_anchor_from_the_hashes_of_any_text_it_starts() -> None:
    """The policy keys an anchor from the block hashes of the prompt it starts (no second
    hash over it): the same key whatever follows the anchor, and a different one for any
    other anchor, its bytes past the last whole block included (trailing zero bytes too)."""
    index = PrefixIndex(block_chars=16)
    anchors = ["", "a", "a\x00", "a\x00\x00", "b", "x" * 16, "x" * 17, "x" * 32, "é" * 9, "é" * 8]
    keys = {}
    for anchor in anchors:
        key = index.anchor_key(anchor, index.hashes(anchor))
        assert 0 <= key < 1 << 64
        for rest in ("", "y" * 5, "more text " * 20):
            assert index.anchor_key(anchor, index.hashes(anchor + rest)) == key, (anchor, rest)
        keys[key] = anchor
    assert len(keys) == len(anchors)
    # Hashes that stop short of the anchor (a bounded request): its stable key.
    assert index.anchor_key("x" * 40, index.hashes("x" * 40, 1)) == stable_key("x" * 40)


def test_choices_and_hashes_agree_across_processes() -> None:
    def run(seed: str) -> Any:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(SRC)}
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)

    mine = run("1")
    assert run("4242") == mine
    assert len(set(mine[3])) == 4
    assert mine[2] == block_hashes("You are a helpful assistant. " * 40 + "\u00e9\ud800", 16)
    keys = [stable_key(f"conversation {i}") for i in range(200)]
    assert mine[1] == [rendezvous_order(k, [3, 1, 4, 15, 9, 2, 6]) for k in keys]


def test_rendezvous_spreads_keys_and_moves_only_the_removed_replicas() -> None:
    replicas = list(range(10))
    keys = [stable_key(f"k{i}") for i in range(5000)]
    firsts = Counter(rendezvous_order(k, replicas)[0] for k in keys)
    assert all(400 <= firsts[r] <= 600 for r in replicas), firsts
    for gone in (0, 4, 9):
        rest = [r for r in replicas if r != gone]
        for key in keys:
            before = rendezvous_order(key, replicas)
            after = rendezvous_order(key, rest)
            assert after == [r for r in before if r != gone]  # first changes only if it was gone


@given(st.integers(), st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=12, unique=True))
def test_rendezvous_is_a_permutation_in_any_input_order(key: int, replicas: list[int]) -> None:
    order = rendezvous_order(key, replicas)
    assert sorted(order) == sorted(replicas)
    assert rendezvous_order(key, replicas[::-1]) == order


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=10, unique=True),
    st.dictionaries(st.integers(0, 30), st.integers(0, 50) | st.floats(0, 50)),
    st.floats(1.0, 3.0),
)
def test_bounded_choice_never_picks_over_the_bound_when_one_is_under(
    order: list[int], loads: dict[int, float], factor: float
) -> None:
    chosen = bounded_choice(order, loads, factor)
    total = sum(loads.get(r, 0) for r in order)
    limit = math.ceil(factor * (total + 1) / len(order))
    assert loads.get(chosen, 0) < limit
    before = order[: order.index(chosen)]
    assert all(loads.get(r, 0) >= limit for r in before)


def test_bounded_choice_spills_a_hot_key_in_order() -> None:
    order = [2, 0, 1]
    assert bounded_choice(order, {}) == 2
    assert bounded_choice(order, {2: 3, 0: 0, 1: 0}) == 0  # bound ceil(1.25 * 4 / 3) = 2
    assert bounded_choice(order, {2: 1, 0: 0, 1: 0}) == 0  # bound ceil(1.25 * 2 / 3) = 1
    assert bounded_choice(order, {2: 1, 0: 1, 1: 1}) == 2  # bound ceil(1.25 * 4 / 3) = 2


def _stdlib_prompt(path: str, body: bytes, field: str | None) -> Any:
    """read_prompt with the standard library's parser alone (what it was before orjson)."""
    with mock.patch.object(prompt_module, "_parse", json.loads):
        return read_prompt(path, body, field)


# Integers within 64 bits: past them orjson reads a float (prompt._parse says so).
_json64 = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@given(_json64, _paths, _fields, st.sampled_from(["messages", "prompt", "text", "x"]))
def test_the_prompt_is_the_one_the_standard_parser_gives(
    value: Any, path: str, field: str | None, key: str
) -> None:
    """orjson reads the body first; whatever it reads, the prompt is the standard library's."""
    for doc in (value, {key: value}, {key: value, "tools": value}):
        body = json.dumps(doc).encode()
        assert read_prompt(path, body, field) == _stdlib_prompt(path, body, field)


def test_what_orjson_refuses_the_standard_parser_reads() -> None:
    """Bodies the standard library takes and orjson does not: the same prompt as before."""
    bodies = [
        b'{"prompt": "\\ud800 lone"}',  # a lone surrogate in an escape
        b'{"prompt": "p", "temperature": NaN}',
        '{"prompt": "utf-16"}'.encode("utf-16"),
    ]
    for body in bodies:
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(body)
        got = read_prompt("/v1/completions", body)
        assert got is not None and got == _stdlib_prompt("/v1/completions", body, None)


def test_the_rendering_stops_past_its_limit_and_keeps_turns_prefixes() -> None:
    """With a limit, a body of many tiny parts renders no further than one part past it (so
    a million one-token lists cost their parse, not a Python step each), and a later turn's
    text still starts with the earlier turn's."""
    limit = 200
    ids = [[7]] * 100_000
    got = read_prompt("/v1/completions", json.dumps({"prompt": ids}).encode(), None, limit)
    assert got is not None and limit < len(got.text) <= limit + 8
    assert (
        got.text
        == read_prompt("/v1/completions", _body({"prompt": ids[:60]})).text[: len(got.text)]
    )
    parts = [{"type": "image_url", "image_url": {"url": "x"}}] * 10_000
    many = {"messages": [{"role": "user", "content": parts}]}
    text = read_prompt(CHAT, _body(many), None, limit)
    assert text is not None and len(text.text) < 2 * limit
    turns = [{"role": "system", "content": "s" * 50}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i} " * 10} for i in range(40)
    ]
    earlier = read_prompt(CHAT, _body({"messages": turns[:10]}), None, limit)
    later = read_prompt(CHAT, _body({"messages": turns}), None, limit)
    assert earlier is not None and later is not None
    assert later.text.startswith(earlier.text) or earlier.text.startswith(later.text)


def test_a_prompt_of_token_ids_renders_no_further_than_its_limit() -> None:
    """A flat list of token ids (vLLM's ``prompt: [1, 2, ...]``, a long-context prompt as
    ids) renders no further than the limit either: every id was rendered, one str() each on
    the event loop (66 ms for 1 MiB of them), for a policy that hashes the first ``limit``
    characters. What is rendered is the start of the whole rendering."""
    limit = 200
    ids = list(range(10, 100)) * 5_000
    body = json.dumps({"prompt": ids}).encode()
    got = read_prompt("/v1/completions", body, None, limit)
    whole = read_prompt("/v1/completions", body)
    assert got is not None and whole is not None
    assert limit < len(got.text) <= 4 * limit + 2, len(got.text)
    assert whole.text.startswith(got.text)


@pytest.mark.parametrize("user", ["none", "last"])
def test_a_chat_with_no_early_user_message_is_rendered_only_so_far(user: str) -> None:
    """A chat whose first user message never comes, or comes last, was rendered whole to find
    its anchor: a 1.2 MiB body of tool calls cost the event loop twice what it costs with its
    user message first. It stops ANCHOR_LIMITS limits in, the same place for every turn of it."""
    from corral.balancer.prompt import ANCHOR_LIMITS

    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages: list[dict[str, object]] = [
        {"role": "assistant", "content": f"step {i}", "tool_calls": call} for i in range(8500)
    ]
    if user == "last":
        messages.append({"role": "user", "content": "and now?"})
    body = _body({"messages": messages})
    assert len(body) > 900_000
    got = read_prompt(CHAT, body, None, 65536)
    assert got is not None and got.chat
    piece = max(len(json.dumps(m)) for m in messages[:10]) * 2  # one message's rendering, roomy
    assert len(got.text) <= ANCHOR_LIMITS * 65536 + piece, len(got.text)
    assert got.anchor_end == len(got.text)
    again = read_prompt(
        CHAT, _body({"messages": [*messages[:-1], {"role": "user", "content": "x"}]}), None, 65536
    )
    assert again is not None and again.text[: again.anchor_end] == got.text[: got.anchor_end]


def test_a_system_prompt_longer_than_the_limit_keeps_each_conversations_anchor() -> None:
    """The rendering may stop past its limit, but not before the first user message: the
    anchor (through it) tells conversations apart even under a system prompt longer than
    all that is hashed (they all had the system prompt's anchor)."""
    system = "You are a careful assistant. " * 2500  # ~72,000 characters
    anchors = set()
    for user in ("hello A", "hello B"):
        doc = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
        }
        got = read_prompt(CHAT, _body(doc), None, 65536)
        assert got is not None and got.chat
        anchors.add(got.text[: got.anchor_end])
    assert len(anchors) == 2
