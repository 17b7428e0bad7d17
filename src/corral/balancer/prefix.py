"""Which replica has a prompt's prefix cached, and which replica a key belongs to.

Two building blocks of prefix-aware routing, both pure and in memory.

**PrefixIndex**: per replica, an approximate record of the prompts this balancer sent there,
as vLLM's prefix cache keys them: the text cut into blocks of ``block_chars`` bytes of UTF-8,
each block's hash chained to its parent's, so one hash names a whole prefix and two prompts
share hashes exactly as far as their leading whole blocks agree. A request's hashes are
computed once and matched against every replica in one walk (one dict from block hash to a
bitmask of the replicas holding it). Each replica keeps at most ``max_blocks_per_replica``
blocks, least recently used out first.

Why blocks and not a character radix tree like SGLang router's (``bench/prefix_index.py``
measures both on the same requests): the tree is faster on long prompts of few turns
(16k-character chat: ~7 us a request against ~52), but its cost and memory grow with the
number of branch points on a prompt's path, one per turn: with many short agent steps it held
3x the memory per cached character, on prompts growing by a few characters (autocomplete) it
was 3-4x slower (84 us against 29 at 16k) and held 12x the memory, and its leaf eviction scans
the tree in one go. The hashes cost in proportion to the prompt's length (capped at
``max_request_blocks``) whatever the history, take ~140-160 KiB per 1,000 blocks held, and
evict in O(1) per block: a bounded cost on the event loop for any traffic.

The index stays *prefix-closed* (a replica holding a block holds all its ancestors): an insert
touches a chain from its last block back to its first, so a block is never more recently used
than its parent, and LRU eviction only ever takes leaves. The match relies on it, jumping over
runs of blocks held by the same replicas instead of looking each one up. What breaks it is only
a hash collision, which costs a mismatched route, never a wrong answer. The hashes are not
cryptographic (a block's int hashes to its value modulo 2**61 - 1, then mixed with its
parent's): blocks made on purpose can collide; ordinary text, with odds of about 2**-61 a pair.

**Choice across processes**: several balancer workers route independently with no shared
state, and a conversation must reach the same replica whichever worker takes its turn.
:func:`rendezvous_order` (highest random weight) orders replicas by a stable mix of (key,
replica), so every worker computes the same order and a replica that leaves moves only the keys
it had first; :func:`bounded_choice` walks that order past replicas over a load bound
(consistent hashing with bounded loads, Mirrokni et al.).

What is stable across processes (never Python's ``hash()`` of a str or bytes, which
PYTHONHASHSEED salts per process):

* :func:`stable_key` and :func:`rendezvous_order`: blake2b and a fixed 64-bit integer mix, the
  same on every machine and Python version.
* The block hashes (:func:`block_hashes`, :meth:`PrefixIndex.hashes`): Python's ``hash`` of a
  tuple of ints, which no seed salts, so the same in every process of one CPython build (all
  workers run the daemon's interpreter); not promised across Python versions or 32/64-bit. A
  block's hash names the whole prefix up to it, so ``hashes[k - 1]`` is a conversation anchor
  key every worker agrees on (:meth:`PrefixIndex.anchor_key`, the policy's key). Chosen over
  blake2b for speed (about 2.5x faster per block). The compiled build
  (:mod:`corral.balancer.speedups`) computes the same values in C, CPython's int and tuple
  hashes written out, with no Python object per block: the policy runs this once a request, and
  in a router on a busy machine from cold caches, where the loop cost about 30 us of a
  3,400-character prompt's ~150 (``bench/prefix_select.py``)."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Final

from corral.balancer import speedups

__all__ = [
    "PrefixIndex",
    "block_hashes",
    "bounded_choice",
    "insert_blocks",
    "rendezvous_order",
    "stable_key",
]

_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd


def stable_key(text: str) -> int:
    """A 64-bit key for ``text``, the same in every process (blake2b; lone surrogates, which a
    JSON body may carry, are hashed as they are)."""
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a fixed bijection on 64 bits whose output bits each depend on
    every input bit, so nearby keys and replica ids give unrelated scores."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def rendezvous_order(key: int, replicas: Sequence[int]) -> list[int]:
    """``replicas`` ordered by their score for ``key``, highest first (rendezvous hashing).

    A replica's score depends only on (key, replica), so removing a replica leaves the others'
    relative order as it was: only the keys it came first for move, each to its runner-up.
    Ties (for 64-bit scores, a duplicate id) fall back to the smaller id, so the order is total.
    """
    k = _mix64(key & _MASK64)
    # The id times an odd constant (a bijection on 64 bits) spreads small consecutive ids.
    return sorted(replicas, key=lambda rid: (-_mix64(k ^ (rid * _GOLDEN & _MASK64)), rid))


def bounded_choice(
    order: Sequence[int], loads: Mapping[int, float], capacity_factor: float = 1.25
) -> int:
    """The first replica in ``order`` whose load is under ``ceil(capacity_factor * (total + 1)
    / n)``: the request counted, no replica takes more than ``capacity_factor`` times its share.

    With ``capacity_factor >= 1`` one always is (if all were at the bound they would carry more
    than the total). A missing load is 0.
    """
    if not order:
        raise ValueError("no replica to choose from")
    if capacity_factor < 1.0:
        raise ValueError(f"capacity_factor must be at least 1.0, not {capacity_factor}")
    total = sum(loads.get(rid, 0) for rid in order)
    bound = math.ceil(capacity_factor * (total + 1) / len(order))
    for rid in order:
        if loads.get(rid, 0) < bound:
            return rid
    return min(order, key=lambda rid: loads.get(rid, 0))  # pragma: no cover - float rounding


def block_hashes(text: str, block_chars: int = 64, limit_blocks: int | None = None) -> list[int]:
    """The chained hashes of ``text``'s whole blocks of ``block_chars`` UTF-8 bytes (a partial
    last block is left out, as vLLM leaves it), at most ``limit_blocks`` of them.

    Each block is read as one integer and hashed in a tuple with its parent's hash: ints and
    tuples hash the same in every process (see the module docstring).
    """
    if block_chars < 1:
        raise ValueError("block_chars must be positive")
    data = text.encode("utf-8", "surrogatepass")
    end = len(data) - len(data) % block_chars
    if limit_blocks is not None:
        end = min(end, max(limit_blocks, 0) * block_chars)
    out = []
    parent = 0
    from_bytes = int.from_bytes
    for i in range(0, end, block_chars):
        parent = hash((parent, from_bytes(data[i : i + block_chars], "little")))
        out.append(parent)
    return out


# The compiled twin where built (corral.balancer.speedups): the same values.
_block_hashes = speedups.twin("block_hashes") or block_hashes


def _held(lru: Mapping[int, None], hashes: Sequence[int], limit: int) -> int:
    """How many leading blocks of ``hashes[:limit]`` a replica holds: its blocks are
    prefix-closed, so a binary search finds the end of the run."""
    lo, hi = 0, limit  # the first lo are held; beyond hi none is
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hashes[mid - 1] in lru:
            lo = mid
        else:
            hi = mid - 1
    return lo


def insert_blocks(
    lru: OrderedDict[int, None],
    owners: dict[int, int],
    hashes: Sequence[int],
    limit: int,
    bit: int,
    bound: int,
) -> None:
    """:meth:`PrefixIndex.insert`'s work on one replica's blocks (``lru``, its ``bit`` in the
    ``owners`` masks): the first ``limit`` of ``hashes`` recorded most recently used, then
    its oldest blocks beyond ``bound`` evicted. A function of its own so that the compiled
    build can run its twin (the same changes in the same order)."""
    held = _held(lru, hashes, limit)
    # Last block first, so that every block ends up more recently used than its children:
    # the new ones (the chain's end), then those held, moved in one pass in C.
    for i in range(limit - 1, held - 1, -1):
        h = hashes[i]
        lru[h] = None
        owners[h] = owners.get(h, 0) | bit
    if held:
        deque(map(lru.move_to_end, hashes[held - 1 :: -1]), maxlen=0)
    extra = len(lru) - bound
    for _ in range(extra):
        h = lru.popitem(last=False)[0]
        left = owners[h] & ~bit
        if left:
            owners[h] = left
        else:
            del owners[h]


_insert_blocks = speedups.twin("insert_blocks") or insert_blocks


class PrefixIndex:
    """Per replica, the chained block hashes of the prompts sent there, LRU-bounded.

    ``max_request_blocks`` caps the blocks hashed per request (the default, 1024 blocks of 64,
    is 64 KiB of prompt): beyond it a longer match changes no routing decision worth its cost.
    Replica ids are any ints; each replica present gets one bit of the masks. Memory: about
    150 KiB per 1,000 blocks held (measured), so the default bound is ~10 MiB per replica.
    """

    def __init__(
        self,
        block_chars: int = 64,
        max_blocks_per_replica: int = 1 << 16,
        max_request_blocks: int = 1024,
    ) -> None:
        if block_chars < 1 or max_blocks_per_replica < 1 or max_request_blocks < 1:
            raise ValueError("block_chars and the block limits must be positive")
        self.block_chars = block_chars
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_request_blocks = max_request_blocks
        self._owners: dict[int, int] = {}  # block hash -> bitmask of the replicas holding it
        self._lru: dict[int, OrderedDict[int, None]] = {}  # replica -> its blocks, oldest first
        self._bit: dict[int, int] = {}  # replica -> its mask bit
        self._rid: dict[int, int] = {}  # bit index -> replica
        self._free: list[int] = []  # bit indexes given back by forget

    def hashes(self, text: str, limit_blocks: int | None = None) -> list[int]:
        """The request's chained block hashes, computed once and passed to match and insert."""
        limit = self.max_request_blocks if limit_blocks is None else limit_blocks
        return _block_hashes(text, self.block_chars, limit)

    def anchor_key(self, anchor: str, hashes: Sequence[int]) -> int:
        """A 64-bit key for ``anchor``, a prefix of the text whose block hashes are ``hashes``:
        the hash of its last whole block (which names all of them) mixed with the bytes past
        it. As stable as the block hashes (the same in every process of one build: see the
        module docstring); :func:`stable_key` where ``hashes`` stop short of the anchor. Why
        not :func:`stable_key` always: blake2b over an anchor the block hashes already
        covered cost about 36 us a request from cold caches (a router's case), a quarter of
        the policy's choice (``bench/prefix_select.py``)."""
        block = self.block_chars
        if anchor.isascii():
            whole = len(anchor) // block
            tail = anchor[whole * block :].encode("ascii")
        else:
            data = anchor.encode("utf-8", "surrogatepass")
            whole = len(data) // block
            tail = data[whole * block :]
        if whole > len(hashes):
            return stable_key(anchor)
        key = hashes[whole - 1] if whole else 0
        if tail:  # its length too: a tail's trailing zero bytes add nothing to its int
            key = hash((key, int.from_bytes(tail, "little"), len(tail)))
        return key & _MASK64

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """For each replica holding at least the first block: how many leading blocks of
        ``hashes`` it holds.

        The replicas holding block ``i`` are a subset of those holding block ``i - 1`` (the
        index is prefix-closed), so the set changes at most once per replica along the chain:
        each run of an unchanged set is found by galloping and binary search, a handful of
        lookups for a long shared prefix instead of one per block.
        """
        get = self._owners.get
        n = len(hashes)
        alive = get(hashes[0], 0) if n else 0
        result: dict[int, int] = {}
        pos = 0  # blocks [0, pos] are held by every replica in ``alive``
        while alive:
            step = 1
            while pos + step < n and get(hashes[pos + step], 0) & alive == alive:
                step <<= 1
            lo, hi = pos + (step >> 1), min(pos + step, n)  # held up to lo; not at hi (or end)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if get(hashes[mid], 0) & alive == alive:
                    lo = mid
                else:
                    hi = mid
            pos = lo + 1  # blocks held by every replica in ``alive``
            still = get(hashes[pos], 0) & alive if pos < n else 0
            gone = alive & ~still
            while gone:
                low = gone & -gone
                result[self._rid[low.bit_length() - 1]] = pos
                gone ^= low
            alive = still
        return result

    def insert(self, replica: int, hashes: Sequence[int]) -> None:
        """Record that ``replica`` was sent a prompt with these hashes (the first
        ``max_blocks_per_replica`` of them), most recently used, evicting its oldest blocks
        beyond the bound."""
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
            index = self._free.pop() if self._free else len(self._bit)
            self._bit[replica] = 1 << index
            self._rid[index] = replica
        limit = min(len(hashes), self.max_blocks_per_replica)
        _insert_blocks(
            lru, self._owners, hashes, limit, self._bit[replica], self.max_blocks_per_replica
        )

    def forget(self, replica: int) -> None:
        """Drop everything recorded for ``replica`` (it left the ready set, or restarted with an
        empty cache) and free its bit."""
        lru = self._lru.pop(replica, None)
        if lru is None:
            return
        bit = self._bit.pop(replica)
        owners = self._owners
        for h in lru:
            left = owners[h] & ~bit
            if left:
                owners[h] = left
            else:
                del owners[h]
        index = bit.bit_length() - 1
        del self._rid[index]
        self._free.append(index)

    def size(self, replica: int) -> int:
        """How many blocks are recorded for ``replica`` (fewer: more of its cache is free)."""
        lru = self._lru.get(replica)
        return 0 if lru is None else len(lru)

    def replicas(self) -> list[int]:
        """The replicas with anything recorded."""
        return list(self._lru)

    def __repr__(self) -> str:
        sizes = {rid: len(lru) for rid, lru in self._lru.items()}
        return f"PrefixIndex(block_chars={self.block_chars}, sizes={sizes})"
