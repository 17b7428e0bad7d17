"""Routing for LLM engines: send a prompt where its prefix is cached, without hot spots.

An engine answers a prompt whose leading tokens are in its prefix (KV) cache many times faster
than one it must compute; each replica has its own cache. So a conversation's turns, each the
previous turn plus a little, should reach the replica that served the previous turn, and a
document many questions share should be cached on as few replicas as keep up with them.

How a replica is chosen (``prefix_affinity``; SGLang's and vLLM's routers call their kin
``cache_aware``, and that name is accepted too):

1. The prompt is read from the body (:func:`corral.balancer.prompt.extract_prompt`: the OpenAI
   APIs, SGLang's and TGI's ``/generate``, or a field the spec names). No prompt (not JSON, a
   body too big to hold, another API): the request goes by load (``least_load``).
2. Its **anchor** is the prompt's start that every later turn of the same conversation repeats:
   the rendering up to the first user message for chat, the first ``anchor_chars`` otherwise.
   Its hash is the same in every balancer worker (a stable hash, not Python's salted one), and
   so is the order of replicas it gives (rendezvous hashing): a replica that leaves moves only
   its own conversations.
3. **The shared table** (:mod:`corral.balancer.affinity`, a file every worker of the service
   maps): where each anchor's last request went. Read first, written after: a choice one
   worker made on what only it knew (its load, its index) is followed by all, so a new
   connection per turn, on whichever worker, reaches the same replica. A placed conversation
   stays up to STICKY requests past the bound; a placed document counts as a match past its
   anchor (step 5), so its questions meet on one replica whichever worker takes them.
   Without the file (it could not be created), rendezvous alone keeps a conversation
   together while its first choice is under the bound, and each worker places a document
   on its own.
4. **Bounded load**: a replica is skipped while its load (requests in flight from every worker
   of the service, :mod:`corral.balancer.load_board`, or from this one where they share no
   board; plus what its engine reports queued) is at ``balance`` times the mean or more (or
   the mean plus a slack at low load: DOC_SLACK for a document, whose move costs all of it
   computed again); the next in the anchor's order takes the request. A prompt family too
   hot for one replica spreads to the next ones in its order, and only to them (Mirrokni et
   al., consistent hashing with bounded loads): no replica carries more than ``balance``
   times its share.
5. Within those under the bound, a replica this worker knows holds a longer prefix of this
   prompt (its index of block hashes, :class:`corral.balancer.prefix.PrefixIndex`, bounded and
   LRU) wins over the anchor's first choice: a new conversation joins the replicas that hold
   its system prompt, and after a spill the next turn follows the cache. Of several that hold
   it as far, the least loaded wins, so the copies of a document share its questions. Without
   the table only a match past the anchor counts (the other workers could not follow).
6. A prompt that is not a chat, of which this worker has sent nothing anywhere and the table
   knows nothing (a one-off, a new document's first question) goes by load: new documents
   spread over the replicas instead of meeting by chance on one (measured: with rendezvous
   alone, a RAG workload's busiest replica took 38-46% of requests, and prompts sharing
   nothing waited 1.6x longer than under round robin). The next prompt sharing its blocks
   follows it there (step 5). It is hashed and recorded only one block past its anchor,
   which is all that prompt needs to find it; that prompt records the whole chain.
   Chats always take step 2, which keeps a conversation together across workers.
7. **A share of the requests** (:mod:`corral.balancer.recent_share`): a replica above
   SHARE_BALANCE times an even share of this worker's recent requests takes no new
   conversation or document question (a placed conversation's turns still go there): its
   cache makes it fast, so the load bound alone lets it serve more than its share.

Everything here is per worker and in memory, but for the table the workers share in the data
plane's directory: a daemon SIGKILL or upgrade changes nothing, and a worker restarted relearns
its index from traffic while the table and the anchors keep routing consistent meanwhile.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from corral.balancer.affinity import AffinityTable
from corral.balancer.load_board import LoadBoard
from corral.balancer.policies import (
    DEFAULT_BALANCE,
    EngineLoad,
    LeastLoad,
    RequestView,
    weigh_streams,
)
from corral.balancer.prefix import PrefixIndex, rendezvous_order, stable_key
from corral.balancer.prompt import Prompt, read_prompt
from corral.balancer.recent_share import RecentShare

__all__ = ["DEFAULT_BALANCE", "PrefixAffinity", "SessionAffinity"]

DEFAULT_ANCHOR_CHARS: Final = 1024
DEFAULT_BLOCK_CHARS: Final = 64
DEFAULT_INDEX_BLOCKS: Final = 1 << 16


# A replica is never passed over while its load is within this many requests of the mean: at
# low load ``balance`` times the mean is below one request, and a conversation would leave
# its replica whenever that replica had anything in flight. (A chat's, without the table;
# session affinity's.)
SLACK: Final = 2.0
# The slack where the shared table lets a new chat join the replicas holding its system prompt
# (a pull toward them that rendezvous alone does not have). Measured (bench/llm_routing.py,
# chat, 2 workers): with 2 a replica took 0.29-0.39 of the requests, with 1 0.26-0.29 at the
# same hit rate (again on 2026-12-05, answers cached, 200 conversations, 2 rounds: 1, 2 and
# 3 all gave a hit rate of 0.87-0.88, the busiest engine 0.26-0.29). Documents have their
# own, DOC_SLACK: with 1 they spilled sooner, and each spill computes a whole document again
# (RAG hit rate 0.85-0.89 against 0.88-0.90).
PULL_SLACK: Final = 1.0
# The slack for a prompt that is not a chat (a document's questions): its replica keeps them
# until it carries this many requests more than the mean. Moving a document makes another
# replica compute all of it (a 1500-token document: 300 ms of the simulator's engine time),
# where a few requests more in a batching engine cost a few ms a step. Measured
# (bench/llm_routing.py, RAG at 24 req/s, 4 documents, 2 workers, 8 rounds): with 2 the hit
# rate was 0.86-0.91 and TTFT p99 334-618 ms, each spill a copy of a document; with 8
# 0.91-0.93 and 323-333 ms (sglang-router's 0.92-0.93 and 323-332), the busiest engine
# 0.28-0.33 with either. The ratio (``balance``) governs once the mean is past 32. Where
# the spec limits a replica's requests in flight, the slack is at most that limit: past it
# the requests would queue, not batch.
DOC_SLACK: Final = 8.0
# A conversation already placed (the shared table) stays on its replica up to this many
# requests past the bound: moving it makes another replica compute its whole history. With 1
# (and PULL_SLACK 1) a conversation's turns stayed on one replica 0.98-0.99 of the time near
# saturation, against 0.91 with neither.
STICKY: Final = 1.0
# A replica whose share of the recent requests is above this many times an even share is
# passed over by all but the conversations placed on it (:mod:`corral.balancer.recent_share`).
# Measured (bench/llm_routing.py, RAG at 24 req/s, 400 questions, 4 and 10 documents, 2
# workers, docs/benchmarks.md): the busiest replica's share went from 0.30-0.43 to 0.26-0.30
# at a hit rate at most 0.01 lower; 1.25 left it at 0.29-0.33.
SHARE_BALANCE: Final = 1.15
CUTS: Final = 4096  # how many one-offs recorded short are remembered (``_credit_cut``)
_NONE: Final[frozenset[int]] = frozenset()


def bound(
    loads: Mapping[int, float], candidates: Sequence[int], balance: float, slack: float = SLACK
) -> float:
    """The load at which a replica is passed over: ``balance`` times the mean once this
    request is counted, or the mean plus ``slack`` requests, whichever is higher."""
    mean = (sum(loads.get(rid, 0.0) for rid in candidates) + 1.0) / len(candidates)
    return max(math.ceil(balance * mean), mean + slack)


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class _Record(NamedTuple):
    """What a request's prompt leaves where it is sent: its key in the shared table (and the
    replica the table named, if any), its blocks in the index."""

    key: int
    placed: int | None
    hashes: list[int]
    whole: int = 0  # a one-off recorded short: how many whole blocks it had


class PrefixAffinity:
    """See the module docstring."""

    reads_request = True
    # Its bound weighs a replica's requests by their plain counts (what a replica carries:
    # measured, weighing streams there let RAG's busiest engine take 0.28-0.32 of the requests
    # where counts kept it at 0.26-0.31); its choices by load weigh streams (``_weighed``).
    weighs_streams = False

    def __init__(
        self,
        *,
        prompt_field: str | None = None,
        balance: float = DEFAULT_BALANCE,
        anchor_chars: int = DEFAULT_ANCHOR_CHARS,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        index_blocks: int = DEFAULT_INDEX_BLOCKS,
        table: AffinityTable | None = None,
        board: LoadBoard | None = None,
        streams: Mapping[int, int] | None = None,
        stream_board: LoadBoard | None = None,
        share_balance: float = SHARE_BALANCE,
        doc_slack: float = DOC_SLACK,
        max_in_flight: int | None = None,
    ) -> None:
        if doc_slack < 0.0:
            raise ValueError(f"doc_slack must be 0 or more, not {doc_slack}")
        if balance < 1.0:
            raise ValueError(f"balance must be at least 1.0, not {balance}")
        if share_balance < 1.0:
            raise ValueError(f"share_balance must be at least 1.0, not {share_balance}")
        if anchor_chars < 1 or block_chars < 1 or index_blocks < 1:
            raise ValueError("anchor_chars, block_chars and index_blocks must be positive")
        self.prompt_field = prompt_field
        self.balance = balance
        self.share_balance = share_balance
        # Past the spec's limit per replica, a document's questions would wait in the balancer
        # for its replica, not share the engine's batch there.
        self.doc_slack = min(doc_slack, max_in_flight) if max_in_flight else doc_slack
        self.anchor_chars = anchor_chars
        self.table = table
        self.board = board
        self.streams: Mapping[int, int] = {} if streams is None else streams
        self.stream_board = stream_board
        self.index = PrefixIndex(block_chars=block_chars, max_blocks_per_replica=index_blocks)
        # What of a prompt is ever read: what is hashed, or the anchor if longer.
        self._read_limit = max(self.index.max_request_blocks * block_chars, anchor_chars)
        self._by_load = LeastLoad()
        self.preferred = False
        self.defer = False  # the balancer sets it (corral.balancer.policies.Policy.defer)
        self.pending: object | None = None  # a _Record, for commit
        self.recent = RecentShare()
        self._ready: frozenset[int] = frozenset()
        self._waiting: dict[int, float] = {}
        self._cuts: OrderedDict[int, tuple[int, int]] = OrderedDict()

    def update(self, ready: Sequence[int], engines: Mapping[int, EngineLoad]) -> None:
        now = frozenset(ready)
        for rid in self._ready - now:
            self.index.forget(rid)  # a replica that left: what it cached is gone with it
            self.recent.forget(rid)
        self._ready = now
        self._waiting = {rid: load.waiting for rid, load in engines.items()}

    def weigh(self, weights: Mapping[int, float]) -> None:
        return None

    def _weighed(self, candidates: Sequence[int], in_flight: Mapping[int, float]) -> int:
        """The choice by load: the least loaded, a stream under way weighing STREAM_WEIGHT
        (``corral.balancer.gate``, "What a load is"); every worker's streams where they share
        a board."""
        streams: Mapping[int, float] = self.streams
        if self.stream_board is not None and len(candidates) > 1:
            streams = self.stream_board.totals(candidates, self.streams)
        if any(streams.values()):
            in_flight = weigh_streams(candidates, in_flight, streams)
        return self._by_load.select(candidates, in_flight)

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        self.preferred = False  # until _choose says otherwise
        self.pending = None
        chosen = self._select(candidates, in_flight, request)
        if not self.defer:
            self.commit(chosen, self.pending)
        return chosen

    def commit(self, rid: int, record: object | None) -> None:
        """A request went to ``rid``: counted in its share, and its prompt (``record``, left
        by ``select``) recorded there: where the next request sharing it finds it."""
        self.recent.add(rid)
        self.pending = None
        if type(record) is not _Record:
            return
        if self.table is not None and rid != record.placed:
            self.table.put(record.key, rid)
        self.index.insert(rid, record.hashes)
        if record.whole > len(record.hashes):  # a one-off recorded short (_credit_cut)
            self._cuts[record.hashes[-1]] = (rid, record.whole)
            if len(self._cuts) > CUTS:
                self._cuts.popitem(last=False)

    def _select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None,
    ) -> int:
        if len(candidates) > 1 and self.board is not None:
            # Every worker's requests, not this one's alone (the load bound is by the mean).
            in_flight = self.board.totals(candidates, in_flight)
        if request is None or request.body is None or len(candidates) == 1:
            return self._weighed(candidates, in_flight)
        path = request.target.partition(b"?")[0].decode("latin-1")
        prompt = read_prompt(path, request.body, self.prompt_field, self._read_limit)
        if prompt is None:
            return self._weighed(candidates, in_flight)
        key, own, hashes, matched, placed = self._look_up(prompt, candidates)
        table = self.table
        sticky, slack, whole = None, SLACK if prompt.chat else self.doc_slack, 0
        if prompt.chat and table is not None:
            # Every worker follows the table, so a new conversation may go where a shared
            # system prompt is cached: its later turns will find it there from any worker.
            sticky, own, slack = placed, 0, PULL_SLACK
        elif placed is not None:
            # A document another worker (or this one) sent there: as good as this worker's
            # own match past the anchor, so every worker sends its questions to one replica
            # instead of each placing the document where its own view of the load says.
            matched = {**matched, placed: max(matched.get(placed, 0), own + 1)}
        if not matched and not prompt.chat:
            # Nothing of it sent anywhere yet, and no conversation to keep together: a one-off
            # (or a document's first question) goes by load, so new documents spread; the
            # next prompt that shares its blocks follows it here. Not bounded by share: no
            # cache pulls a one-off anywhere, and least load keeps such prompts' shares even.
            # It is recorded as far as one block past its anchor only (``first``): that is
            # what the next prompt sharing it needs to follow it (a match past the anchor
            # counts, step 5), and that prompt records the whole chain where it goes; if that
            # is elsewhere, the cut (``_cuts``) credits this replica as far as it. A one-off's
            # every block cost the index an insert and, once full, an eviction of a block that
            # some later prompt could have matched (measured: docs/benchmarks.md, "One-offs
            # recorded as far as their anchor").
            chosen = self._weighed(candidates, in_flight)
            size = _utf8_size(prompt.text) // self.index.block_chars
            whole = min(size, self.index.max_request_blocks)
        else:
            # Replicas over their share of recent requests take no new conversation or
            # document question; a placed conversation's turns pass (``sticky``). Without the
            # table a chat has no place but its anchor's order: not bounded there.
            bounded = table is not None or not prompt.chat
            hot = self.recent.over(candidates, self.share_balance) if bounded else _NONE
            order = rendezvous_order(key, candidates)
            self.preferred = bool(matched) or sticky is not None or table is None  # else a hash
            chosen = self._choose(order, in_flight, matched, own, sticky, slack, hot)
        self.pending = _Record(key, placed, hashes, whole)  # kept by commit, where it really goes
        return chosen

    def _look_up(
        self, prompt: Prompt, candidates: Sequence[int]
    ) -> tuple[int, int, list[int], dict[int, int], int | None]:
        """What is known of ``prompt``: its anchor's key, the anchor's whole blocks, its block
        hashes, how far each replica holds them, and where the table placed its anchor."""
        text = prompt.text
        anchor = text[: prompt.anchor_end if prompt.chat else self.anchor_chars]
        # A cached match no longer than the anchor may be another conversation's (a shared
        # system prompt): only one past it is this conversation's own.
        # In blocks, which are of UTF-8 bytes: a CJK anchor spans three times its characters.
        own = _utf8_size(anchor) // self.index.block_chars
        # A prompt that is not a chat is hashed at first only one block past its anchor (see
        # the one-off in _select): most such prompts share nothing, and their whole chain is
        # hashed, matched and recorded only when something of them was seen before.
        first = None if prompt.chat else min(own + 1, self.index.max_request_blocks)
        hashes = self.index.hashes(text, first)
        matched = self.index.match(hashes) if hashes else {}
        key = self.index.anchor_key(anchor, hashes)
        placed = self.table.get(key) if self.table is not None else None
        if placed is not None and placed not in candidates:
            placed = None  # a replica that left, or a collision's stale entry
        if first is not None and len(hashes) == first and (matched or placed is not None):
            hashes = self.index.hashes(text)
            if matched:
                matched = self._credit_cut(self.index.match(hashes), hashes, first)
        return key, own, hashes, matched, placed

    def _credit_cut(self, matched: dict[int, int], hashes: list[int], cut: int) -> dict[int, int]:
        """A replica whose match stops where a one-off sent there was recorded short (its
        ``cut`` blocks) may hold more: as far as the longest match, up to the one-off's length
        (else, after a spill, a document's copies no longer shared its questions)."""
        found = self._cuts.get(hashes[cut - 1]) if cut < len(hashes) else None
        if found is not None and matched.get(found[0]) == cut:
            matched[found[0]] = max(cut, min(found[1], max(matched.values())))
        return matched

    def _choose(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        matched: Mapping[int, int],
        anchor_blocks: int,
        sticky: int | None = None,
        slack: float = SLACK,
        hot: frozenset[int] = frozenset(),
    ) -> int:
        """Of ``candidates`` (in the conversation's order) under the load bound: where any
        worker sent the conversation's last turn (``sticky``, the shared table), else the
        first not ``hot`` (over its share of recent requests), unless some hold a longer
        prefix of it past ``anchor_blocks``: then the least loaded of those holding the
        longest."""
        waiting = self._waiting
        loads = {rid: in_flight.get(rid, 0) + waiting.get(rid, 0.0) for rid in candidates}
        limit = bound(loads, candidates, self.balance, slack)
        if sticky is not None and sticky in loads and loads[sticky] < limit + STICKY:
            return sticky
        order = [rid for rid in candidates if loads[rid] < limit and rid not in hot]
        if not order:
            self.preferred = False
            return self._weighed(candidates, in_flight)
        # Without the shared table only a match past the anchor (this conversation's own
        # cache) counts: a system prompt cached here must not pull the conversation away
        # from where the other workers, who cannot know, send its turns. With the table,
        # ``anchor_blocks`` is 0: the table tells them.
        longest = max(matched.get(rid, 0) for rid in order)
        if longest <= anchor_blocks:
            return order[0]
        # Several may hold it as far (a document or a system prompt that spilled once): the
        # least loaded of them, first in the order on a tie. Their copies then share its
        # requests, where the first would take them all until over a bound (measured: RAG's
        # busiest replica 0.27-0.31 in place of 0.27-0.40, docs/benchmarks.md).
        holders = [rid for rid in order if matched.get(rid, 0) == longest]
        return min(holders, key=loads.__getitem__)

    def __repr__(self) -> str:
        return f"PrefixAffinity(balance={self.balance})"


class SessionAffinity:
    """A session (a header or cookie the spec names) stays on one replica, the same from every
    balancer worker (rendezvous hashing on the session's value, under the same load bound); a
    request without one goes to ``inner``. A replica that leaves moves only its sessions.

    With the service's shared table (``table``, :mod:`corral.balancer.affinity`) a session
    goes where its last request went while that replica is ready and under the bound: by
    rendezvous alone a replica that joins (a scale-up, a replacement) took about 1/n of every
    session, each of which then computed its history again there, and a session one worker
    spilled went back once another worker took its next request."""

    reads_request = True

    def __init__(
        self,
        inner: Any,
        *,
        header: str | None = None,
        cookie: str | None = None,
        balance: float = DEFAULT_BALANCE,
        table: AffinityTable | None = None,
    ) -> None:
        if not header and not cookie:
            raise ValueError("session affinity needs a header or a cookie name")
        self.inner = inner
        self.table = table
        self.weighs_streams: bool = inner.weighs_streams  # the loads are the inner policy's
        self.header = b"\r\n" + header.lower().encode() + b":" if header else None
        self.cookie = cookie.encode() + b"=" if cookie else None
        self.balance = balance
        self.preferred = False
        self.pending: object | None = None

    @property
    def defer(self) -> bool:
        return bool(self.inner.defer)

    @defer.setter
    def defer(self, value: bool) -> None:
        self.inner.defer = value  # what keeps records is the inner policy

    def commit(self, rid: int, record: object | None) -> None:
        if isinstance(record, _Session):  # where the session went, for every worker
            if self.table is not None:
                self.table.put(record.key, rid)
        else:  # a choice of the inner policy's: its record
            self.inner.commit(rid, record)

    def update(self, ready: Sequence[int], engines: Mapping[int, EngineLoad]) -> None:
        self.inner.update(ready, engines)

    def weigh(self, weights: Mapping[int, float]) -> None:
        self.inner.weigh(weights)

    def select(
        self,
        candidates: Sequence[int],
        in_flight: Mapping[int, float],
        request: RequestView | None = None,
    ) -> int:
        session = self._session(request.headers) if request is not None else None
        if session is not None:
            key = stable_key(session)
            loads = {rid: float(in_flight.get(rid, 0)) for rid in candidates}
            limit = bound(loads, candidates, self.balance)
            placed = self.table.get(key) if self.table is not None else None
            order = rendezvous_order(key, candidates)
            if placed in loads:
                order.insert(0, placed)
            for rid in order:
                if loads[rid] < limit or len(candidates) == 1:
                    # Worth a wait where it went before; a new one's first choice is a hash
                    self.preferred = rid == placed or self.table is None
                    self.pending = _Session(key)
                    return rid
        chosen: int = self.inner.select(candidates, in_flight, request)
        self.preferred = self.inner.preferred
        self.pending = self.inner.pending
        return chosen

    def _session(self, headers: bytes) -> str | None:
        low = b"\r\n" + headers.lower()
        if self.header is not None:
            value = _header_value(low, headers, self.header)
            if value:
                return value
        if self.cookie is not None:
            cookies = _header_value(low, headers, b"\r\ncookie:")
            for part in (cookies or "").split(";"):
                name, _, value = part.strip().partition("=")
                if (name + "=").encode() == self.cookie and value:
                    return value
        return None

    def __repr__(self) -> str:
        return f"SessionAffinity({self.inner!r})"


class _Session(NamedTuple):
    """SessionAffinity's own choice (nothing of the inner policy's to record): the session's
    key, kept in the shared table with the replica it went to."""

    key: int


def _header_value(low: bytes, headers: bytes, name: bytes) -> str | None:
    """The value of header ``name`` (``\\r\\nname:``, lower case) in the block, or None."""
    i = low.find(name)
    if i < 0:
        return None
    start = i + len(name) - 2  # offsets in ``low`` are 2 past those in ``headers``
    end = headers.find(b"\r\n", start)
    value = headers[start : end if end >= 0 else len(headers)]
    return value.strip().decode("latin-1") or None
