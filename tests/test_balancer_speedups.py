"""The compiled request split (corral.balancer._speedups) against its pure-Python twin.

Why: the compiled build replaces a regex and a dozen bytes operations with hand-written C; a
byte it lets through that the pure build refuses would pass a header line llhttp never judged.
Both builds must give the same answer to every input: the same split, or both None. The fast
path's own tests (tests/test_balancer_fastpath.py) run on whichever build is installed; where
that is the compiled one, a test here runs them again on the pure build. The compiled fast
path reads the connections' and the balancer's slots at offsets it is given once: the last
tests check that wiring (the build chosen is the one installed, a class without a slot is
refused and changes nothing, an object of another class gets the pure answer).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.balancer import lead, speedups
from corral.balancer.headers import REQUEST_DROP

try:
    compiled: Any = importlib.import_module("corral.balancer._speedups")
    compiled.configure(REQUEST_DROP)
except ImportError:  # the pure build only (no compiler when installed)
    compiled = None

needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled build is not built")
# What corral.balancer.wiring gives the compiled module (bucket bounds, the classes whose slots
# it reads) only when the build in use is the compiled one: not with CORRAL_BALANCER_PURE=1.
needs_wired = pytest.mark.skipif(
    speedups.ACCELERATED != "compiled", reason="the compiled build is not the one in use"
)

HOST = b"\r\nHost: h.example\r\n"
LEADS = [
    (b"GET /poll HTTP/1.1\r\n", b"GET", b"/poll", HOST, None, b"\r\nContent-Length:", b"F"),
    (
        b"POST /api HTTP/1.1\r\n",
        b"POST",
        b"/api",
        HOST,
        b"\r\nConnection: keep-alive\r\n",
        b"\r\ncontent-length:",
        b"F",
    ),
    (b"GET / HTTP/1.1\r\n", b"GET", b"/", None, None, b"\r\nContent-Length:", b""),
]
LIMITS = [(8190, 65536, None), (8190, 4, 3), (60, 65536, None)]


def both(data: bytes, lead_: Any, limits: tuple[int, int, int | None]) -> Any:
    pure = lead.lead_split(data, lead_, *limits)
    fast = compiled.lead_split(data, lead_, *limits)
    assert fast == pure, (data, lead_, limits)
    return pure


REQUESTS = [
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id: 1\r\n\r\n",
    b"GET /item/7?q=1#f HTTP/1.1\r\nHost: h.example\r\nX-Id: 1\r\n\r\n",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nConnection: keep-alive\r\nX-Id: 2\r\n"
    b"content-length: 3\r\n\r\nabc",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length:  3 \r\n\r\nabc",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 03\r\n\r\nabc",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 4\r\n\r\nabc",
    b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 0\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: other\r\nX-Id: 1\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nHost: h.example\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Forwarded-FOR: 1.2.3.4\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id : 1\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id: 1\r\n folded\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id: 1\nX: 2\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\n\r\nGET / HTTP/1.1\r\n\r\n",
    b"GET /poll HTTP/1.0\r\nHost: h.example\r\n\r\n",
    b"get /poll HTTP/1.1\r\nHost: h.example\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: h.example\r\n\r\n",
    b"GET http://x/ HTTP/1.1\r\nHost: h.example\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\n",
    b"GET /poll HTTP/1.1\r\nHost: h.example\r\n" + b"X: y\r\n" * 140 + b"\r\n",
    b"",
]


@needs_compiled
@pytest.mark.parametrize("data", REQUESTS)
def test_the_builds_split_the_same(data: bytes) -> None:
    for lead_ in LEADS:
        for limits in LIMITS:
            both(data, lead_, limits)


@needs_compiled
def test_every_byte_in_a_name_a_value_and_a_target() -> None:
    for b in range(256):
        c = bytes([b])
        for data in (
            b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-I" + c + b"d: 1\r\n\r\n",
            b"GET /poll HTTP/1.1\r\nHost: h.example\r\nX-Id: a" + c + b"b\r\n\r\n",
            b"GET /p" + c + b"q HTTP/1.1\r\nHost: h.example\r\n\r\n",
            b"GE" + c + b" /poll HTTP/1.1\r\nHost: h.example\r\n\r\n",
            b"POST /api HTTP/1.1\r\nHost: h.example\r\nContent-Length: 1" + c + b"\r\n\r\nab",
        ):
            for lead_ in LEADS:
                both(data, lead_, LIMITS[0])


@needs_compiled
def test_every_header_the_balancer_acts_on_is_refused_in_any_case() -> None:
    for name in REQUEST_DROP:
        for spelled in (name, name.upper(), name.title()):
            data = b"GET /poll HTTP/1.1\r\nHost: h.example\r\n%b: v\r\n\r\n" % spelled
            for lead_ in LEADS:
                assert both(data, lead_, LIMITS[0]) is None


lines = st.lists(
    st.binary(max_size=24).map(lambda b: b.replace(b"\r\n\r\n", b"")), min_size=0, max_size=4
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(
    target=st.binary(max_size=12),
    fields=lines,
    body=st.binary(max_size=6),
    length=st.sampled_from(
        [b"", b"Content-Length: %d", b"content-length:%d ", b"Content-Length: x"]
    ),
)
def test_arbitrary_requests_split_the_same(
    target: bytes, fields: list[bytes], body: bytes, length: bytes
) -> None:
    head = b"POST /" + target + b" HTTP/1.1\r\nHost: h.example"
    for field in fields:
        head += b"\r\n" + field
    if length:
        head += b"\r\n" + (length % len(body) if b"%d" in length else length)
    data = head + b"\r\n\r\n" + body
    for lead_ in LEADS:
        for limits in LIMITS:
            both(data, lead_, limits)


@needs_compiled
@given(st.binary(max_size=70000))
@settings(max_examples=200, deadline=None)
def test_a_chunk_is_framed_as_the_pure_relay_frames_it(data: bytes) -> None:
    assert compiled.chunk_frame(data) == b"%x\r\n%b\r\n" % (len(data), data)


@needs_compiled
def test_chunk_sizes_at_every_hex_width() -> None:
    for n in (0, 1, 15, 16, 255, 256, 4095, 4096, 65535, 65536, 1 << 20):
        data = bytes(n)
        assert compiled.chunk_frame(data) == b"%x\r\n%b\r\n" % (n, data)


def test_the_choice_is_reported_and_the_env_forces_the_pure_build() -> None:
    assert speedups.state()["accelerated"] in ("compiled", "pure")
    code = "from corral.balancer import speedups; print(speedups.state()['accelerated'])"
    env = {**os.environ, "CORRAL_BALANCER_PURE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "pure"
    if compiled is not None and os.environ.get("CORRAL_BALANCER_PURE", "") in ("", "0"):
        assert speedups.state()["accelerated"] == "compiled"
        assert speedups.lead_split is compiled.lead_split
        assert speedups.StreamBatch is compiled.StreamBatch
        assert speedups.LiveChunks is compiled.LiveChunks
        assert speedups.ChunkScan is compiled.ChunkScan


@needs_compiled
def test_the_fast_path_tests_pass_on_the_pure_build_too() -> None:
    if os.environ.get("CORRAL_BALANCER_PURE", "") not in ("", "0"):
        pytest.skip("this whole run is on the pure build")
    env = {**os.environ, "CORRAL_BALANCER_PURE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    # test_shared_load's in-process tests: its daemon test would add a whole service's start.
    args += [
        "tests/test_balancer_fastpath.py",
        "tests/test_shared_load.py",
        "-k",
        "not two_workers",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# ------------------------------------------------------------------ the compiled fast path


def _wiring() -> tuple[dict[str, type], dict[str, Any], dict[str, Any]]:
    """The classes, pure functions and constants corral.balancer.wiring wired the build with."""
    from corral.balancer.wiring import FAST_PATH_WIRING

    return FAST_PATH_WIRING


def test_the_client_connection_runs_the_chosen_build() -> None:
    from corral.balancer import fast
    from corral.balancer.client import ClientConnection

    _, pure, _ = _wiring()
    if speedups.ACCELERATED == "compiled":
        assert ClientConnection.fast_request is compiled.try_request
        assert ClientConnection.fast_response is compiled.try_response
    else:
        assert ClientConnection.fast_request is fast.try_request
        assert ClientConnection.fast_response is fast.try_response
    # the fallbacks are the functions as written, never a compiled twin
    assert pure["try_request"] is fast.try_request and pure["try_response"] is fast.try_response


@needs_wired
def test_latencies_land_in_the_buckets_bisect_gives() -> None:
    import bisect
    import random

    from corral.balancer.metrics import LATENCY_BUCKETS

    rng = random.Random(7)
    values = [0.0, -1.0, 1e9, *LATENCY_BUCKETS]
    values += [math.nextafter(b, math.inf) for b in LATENCY_BUCKETS]
    values += [math.nextafter(b, -math.inf) for b in LATENCY_BUCKETS]
    values += [rng.uniform(0, 2 * LATENCY_BUCKETS[-1]) for _ in range(5000)]
    for seconds in values:
        assert compiled.latency_bucket(seconds) == bisect.bisect_left(LATENCY_BUCKETS, seconds)


@needs_compiled
def test_a_class_without_a_slot_is_refused_and_the_wiring_stays() -> None:
    classes, pure, constants = _wiring()

    class Loose:  # a balancer whose fields are in its __dict__: no offsets to read
        pass

    with pytest.raises(TypeError, match="_board is not a slot"):
        compiled.wire({**classes, "balancer": Loose}, pure, constants)
    with pytest.raises(KeyError):
        compiled.wire(classes, pure, {})  # no constants: refused after the offsets were read
    # The refused calls changed nothing: a request still takes the compiled path, whole.
    from test_balancer_fastpath import REQUESTS as FAST_REQUESTS
    from test_balancer_fastpath import RESPONSES, Rig

    async def go() -> None:
        rig = Rig()
        for _ in range(3):  # the second and third reuse the memos the compiled path reads
            sent, got = rig.exchange(FAST_REQUESTS[0], RESPONSES[0])
            assert sent.startswith(b"1:GET / HTTP/1.1\r\n") or sent.startswith(b"2:GET /pre/")
            assert got == RESPONSES[0][0]
        assert rig.lb.in_flight() == 0 and rig.lb.stats()["requests"] == 3

    asyncio.run(go())


@needs_wired
def test_objects_of_other_classes_take_the_pure_functions() -> None:
    from types import SimpleNamespace

    # Not a ClientConnection: the compiled entries must not read slots it does not have; the
    # pure functions answer (nothing in flight: not the fast path's answer; no lead, no memo, a
    # balancer that is stopping: not the fast path's request).
    client = SimpleNamespace(
        fast=None, memo=None, lead=None, lb=SimpleNamespace(_stopping=True, _max_header_bytes=8190)
    )
    conn = SimpleNamespace(_head=b"")
    assert compiled.try_response(client, conn, b"HTTP/1.1 200 OK\r\n\r\n") is False
    assert compiled.try_request(client, b"GET / HTTP/1.1\r\n\r\n") is False


# ------------------------------------------------------------------ least load


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=8),
    loads=st.dictionaries(
        st.integers(min_value=0, max_value=40),
        st.one_of(st.integers(min_value=0, max_value=5), st.sampled_from([0.0, 0.0625, 1.5, 2.0])),
        max_size=10,
    ),
    last=st.one_of(st.none(), st.integers(min_value=-1, max_value=41)),
    as_tuple=st.booleans(),
)
def test_least_loaded_picks_as_its_pure_twin(
    ids: list[int], loads: dict[int, float], last: int | None, as_tuple: bool
) -> None:
    from corral.balancer import policies

    candidates = tuple(ids) if as_tuple else ids
    assert compiled.least_loaded(candidates, loads, last) == policies.least_loaded(
        candidates, loads, last
    )


@needs_compiled
def test_least_loaded_refuses_no_candidates_as_its_twin() -> None:
    from corral.balancer import policies

    with pytest.raises(ValueError, match="no candidate"):
        policies.least_loaded((), {}, None)
    with pytest.raises(ValueError, match="no candidate"):
        compiled.least_loaded((), {}, None)


def test_least_load_runs_the_chosen_build() -> None:
    from corral.balancer import policies

    expected = compiled.least_loaded if speedups.ACCELERATED == "compiled" else None
    assert policies._least_loaded is (expected or policies.least_loaded)


# ------------------------------------------------------------------ prefix blocks

# Text that reaches every case of the twin: ASCII (read where it lies) and not (encoded), lone
# surrogates (as a JSON body may carry them), 4-byte characters (words near 2**64), blocks of
# whole words, of a partial word and of less than one.
_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from("abc xyz\n\x1d\x1f\x7f"),
        st.sampled_from("\u00e9\u4e2d\ud800\udfff\U0010ffff\U0001f600"),
    ),
    max_size=700,
)


@needs_compiled
@settings(max_examples=600, deadline=None)
@given(
    text=_TEXT,
    block=st.sampled_from([1, 2, 3, 7, 8, 9, 13, 16, 63, 64, 65, 100, 256]),
    limit=st.one_of(st.none(), st.integers(min_value=-2, max_value=40)),
)
def test_block_hashes_are_their_pure_twins(text: str, block: int, limit: int | None) -> None:
    from corral.balancer import prefix

    assert compiled.block_hashes(text, block, limit) == prefix.block_hashes(text, block, limit)


@needs_compiled
def test_block_hashes_agree_on_long_prompts_and_refuse_empty_blocks() -> None:
    from corral.balancer import prefix

    prompt = "You are a helpful assistant. " * 400 + "\u00e9" * 3000
    assert compiled.block_hashes(prompt, 256, 1024) == prefix.block_hashes(prompt, 256, 1024)
    assert compiled.block_hashes(prompt, 64, 1024) == prefix.block_hashes(prompt, 64, 1024)
    with pytest.raises(ValueError, match="positive"):
        compiled.block_hashes("abc", 0)


def test_prefix_index_runs_the_chosen_build() -> None:
    from corral.balancer import prefix

    expected = compiled.block_hashes if speedups.ACCELERATED == "compiled" else None
    assert prefix._block_hashes is (expected or prefix.block_hashes)
    assert prefix._insert_blocks is (
        compiled.insert_blocks if speedups.ACCELERATED == "compiled" else prefix.insert_blocks
    )


# Chains of block hashes as prompts make them: several families sharing leading blocks, each
# prompt a family's prefix plus blocks of its own (so inserts find runs already held).
_CHAINS = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=3),  # the family
        st.integers(min_value=0, max_value=12),  # how many of its blocks
        st.lists(st.integers(min_value=0, max_value=5), max_size=6),  # its own
        st.integers(min_value=0, max_value=3),  # the replica
    ),
    max_size=40,
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(chains=_CHAINS, bound=st.integers(min_value=1, max_value=30))
def test_insert_blocks_changes_the_index_as_its_pure_twin(
    chains: list[tuple[int, int, list[int], int]], bound: int
) -> None:
    from collections import OrderedDict

    from corral.balancer import prefix

    states: list[tuple[dict[int, OrderedDict[int, None]], dict[int, int]]] = [({}, {}), ({}, {})]
    for family, length, own, replica in chains:
        hashes, parent = [], 0
        for block in [family * 100 + i for i in range(length)] + own:
            parent = hash((parent, block))  # chained: one hash names the whole prefix
            hashes.append(parent)
        builds = (prefix.insert_blocks, compiled.insert_blocks)
        for (lrus, owners), insert in zip(states, builds, strict=True):
            lru = lrus.setdefault(replica, OrderedDict())
            insert(lru, owners, hashes, min(len(hashes), bound), 1 << replica, bound)
    (pure_lrus, pure_owners), (fast_lrus, fast_owners) = states
    assert fast_owners == pure_owners
    assert {r: list(lru) for r, lru in fast_lrus.items()} == {
        r: list(lru) for r, lru in pure_lrus.items()
    }


@needs_compiled
def test_insert_blocks_takes_any_sequence_and_refuses_a_limit_past_it() -> None:
    from collections import OrderedDict

    lru: OrderedDict[int, None] = OrderedDict()
    owners: dict[int, int] = {}
    compiled.insert_blocks(lru, owners, (3, 4, 5), 2, 1, 10)
    assert list(lru) == [4, 3] and owners == {3: 1, 4: 1}
    with pytest.raises(ValueError, match="past"):
        compiled.insert_blocks(lru, owners, [3], 2, 1, 10)


# ------------------------------------------------------------------ the load board


@needs_compiled
@settings(max_examples=60, deadline=None)
@given(
    ready=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=70, unique=True),
    writes=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 69), st.integers(0, 40)), max_size=30
    ),
    own=st.dictionaries(st.integers(1, 300), st.integers(0, 9), max_size=8),
    streams=st.dictionaries(st.integers(1, 300), st.integers(0, 9), max_size=8),
    stale=st.booleans(),
)
def test_the_load_board_reads_and_writes_as_its_pure_twin(
    ready: list[int],
    writes: list[tuple[int, int, int]],
    own: dict[int, int],
    streams: dict[int, int],
    stale: bool,
) -> None:
    """A pure worker (slot 0) and a compiled one (slot 1) write the same board and its streams
    board; a third worker (slot 2) reads both through either build and gets the same totals
    and the same weighed loads: one layout, whichever build wrote or reads it."""
    import tempfile

    from corral.balancer import load_board
    from corral.balancer.shared_file import map_shared

    ids = tuple(sorted(ready))
    size = load_board.ROWS * load_board.COLUMNS * 8
    with tempfile.TemporaryDirectory() as d:

        def pair(build: Any, slot: int) -> list[Any]:
            """A worker's board of counts and board of streams, each on a map of its own."""
            return [build(map_shared(Path(d) / f, size, "test"), slot, 3) for f in ("c", "s")]

        builds = (load_board.LoadBoard, compiled.LoadBoard)
        writers = [pair(build, slot) for slot, build in enumerate(builds)]
        readers = [pair(build, 2) for build in builds]
        for slot, (counts, stream_counts) in enumerate(writers):
            # a worker that has not applied the latest table names other replicas
            counts.arrange(ids[1:] if stale and slot else ids, {})
            stream_counts.arrange(ids, {})
        for slot, column, count in writes:
            rid = ids[column % len(ids)]
            writers[slot][0].publish(rid, count)
            writers[slot][1].publish(rid, min(count, 3))
        answers = []
        for counts, stream_counts in readers:
            counts.arrange(ids, own)
            counts.streams = stream_counts
            candidates = ids[: len(ids) // 2 + 1]
            answers.append((counts.totals(candidates, own), counts.loads(candidates, own, streams)))
        assert answers[1] == answers[0]
        for boards in [*writers, *readers]:
            for board in boards:
                board.close()


@needs_compiled
def test_a_closed_compiled_board_refuses_to_be_written() -> None:
    import tempfile

    from corral.balancer import load_board

    with tempfile.TemporaryDirectory() as d:
        board = load_board.LoadBoard.open(Path(d) / "b.bin", 0, 2)
        assert board is not None
        board.arrange((1, 2), {1: 1})
        board.close()
        with pytest.raises(ValueError, match="closed"):
            board.publish(1, 2)
        with pytest.raises(ValueError, match="closed"):
            board.totals((1,), {})


def test_the_load_board_runs_the_chosen_build(tmp_path: Path) -> None:
    from corral.balancer import load_board

    board = load_board.LoadBoard.open(tmp_path / "b.bin", 0, 2)
    expected = compiled.LoadBoard if speedups.ACCELERATED == "compiled" else load_board.LoadBoard
    assert type(board) is expected
    assert board is not None
    board.close()
