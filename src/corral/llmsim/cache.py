"""Tokens and the prefix KV cache: what decides how much of a prompt an engine must compute.

* Tokens are 4 bytes of UTF-8 each (a text's last token padded with NULs): about what a BPE
  tokenizer averages on English, free to compute, and blind to whitespace. A prompt given as
  token ids is 4 bytes per id. A prompt is kept as those bytes (:func:`encode_text`), so a block
  of tokens is a slice of it.
* :class:`PrefixCache` is vLLM's automatic prefix caching: full blocks of ``block_size`` tokens,
  each block's hash chained to its parent's, so two prompts share cache exactly as far as their
  leading blocks agree; blocks no running sequence holds are evicted least recently used first.
* A finished answer's full blocks stay cached after its prompt's (:func:`answered`), as vLLM
  and SGLang keep the blocks of the tokens they generated: a chat's next turn, which repeats
  the answer, finds it on a replica that wrote it and on no other.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq

TOKEN_BYTES = 4


class Rejected(ValueError):
    """A request the engine will not take (a client's mistake): the HTTP layer answers 400."""


def encode_text(text: str) -> bytes:
    """A text as its tokens' bytes; padded so that a token never spans two blocks. A lone
    surrogate (valid JSON, ``"\\ud800"``) is kept as its bytes, as the balancer hashes it."""
    data = text.encode("utf-8", "surrogatepass")
    return data + b"\0" * (-len(data) % TOKEN_BYTES)


def encode_ids(ids: Seq[int]) -> bytes:
    """Token ids as 4 bytes each, so a prompt of ids is cached like a text of as many tokens."""
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error:
        raise Rejected("token ids must be integers from 0 to 2**32-1") from None


def token_count(prompt: bytes) -> int:
    return len(prompt) // TOKEN_BYTES


def block_hashes(prompt: bytes, block_size: int) -> list[bytes]:
    """Hashes of the prompt's full blocks, each over its parent's hash and its own tokens, so a
    block is found only under the very prefix it was computed after (a partial tail block is
    never shared, as in vLLM)."""
    width = block_size * TOKEN_BYTES
    parent, out = b"", []
    for start in range(0, len(prompt) - width + 1, width):
        parent = hashlib.blake2b(parent + prompt[start : start + width], digest_size=16).digest()
        out.append(parent)
    return out


def token_text(position: int) -> str:
    """The made-up text of output token ``position``: deterministic, so tests can expect it."""
    return f" tok{position}"


def answer_text(count: int) -> str:
    """The whole text of an answer of ``count`` tokens."""
    return "".join(token_text(position) for position in range(count))


def answered(prompt: bytes, count: int) -> bytes:
    """A text prompt followed by its answer of ``count`` tokens, as the next request that repeats
    both begins (a chat's next turn, a completion continued): the prompt's padding dropped, so
    the answer's blocks chain on exactly as that request's will (a tail short of a full block,
    never cached, is left unpadded)."""
    return prompt.rstrip(b"\0") + answer_text(count).encode()


class PrefixCache:
    """KV blocks: cached blocks by chained hash with a reference count per running sequence,
    plus the private blocks sequences reserve for their tail and output.

    Usage counts what running sequences hold, so idle cached blocks are free room (vLLM's
    ``kv_cache_usage_perc`` counts them so too). Idle blocks are reused oldest first; a released
    sequence's blocks go idle tail first, so its leading blocks, the ones others share, stay
    longest.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evictions = 0
        self._refs: dict[bytes, int] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        self._held = 0  # cached blocks with a reference
        self._private = 0

    @property
    def in_use(self) -> int:
        return self._held + self._private

    @property
    def usage(self) -> float:
        return self.in_use / self.capacity

    def __contains__(self, block: bytes) -> bool:
        return block in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def prefix_blocks(self, hashes: Seq[bytes], limit: int) -> int:
        """How many of the first ``limit`` blocks are cached without a gap: a prompt reuses the
        cache only up to its first missing block."""
        count = 0
        for block in hashes[:limit]:
            if block not in self._refs:
                break
            count += 1
        return count

    def fits(self, hashes: Seq[bytes], private: int) -> bool:
        """Whether :meth:`acquire` can take these blocks now (idle blocks being reusable)."""
        taken = private + sum(1 for block in hashes if self._refs.get(block, 0) == 0)
        return taken <= self.capacity - self.in_use

    def acquire(self, hashes: Seq[bytes], private: int) -> None:
        """Hold a sequence's blocks: cached ones gain a reference, missing ones are inserted,
        evicting idle blocks as room is needed. The caller has checked :meth:`fits`."""
        missing = []
        for block in hashes:
            refs = self._refs.get(block)
            if refs is None:
                missing.append(block)
                continue
            if refs == 0:
                del self._idle[block]
                self._held += 1
            self._refs[block] = refs + 1
        self._private += private
        while self._idle and len(self._refs) + self._private + len(missing) > self.capacity:
            self._refs.pop(self._idle.popitem(last=False)[0])
            self.evictions += 1
        for block in missing:
            self._refs[block] = 1
        self._held += len(missing)

    def release(self, hashes: Seq[bytes], private: int, answer: Seq[bytes] = ()) -> None:
        """Let a sequence's blocks go idle, and keep ``answer`` (the blocks its output filled
        past ``hashes``) cached idle too, in the room its private blocks gave back. Tail first:
        the answer's blocks are evicted before the prompt's, the prompt's leading ones last."""
        self._private -= private
        for block in reversed(answer):
            refs = self._refs.get(block)
            if refs is None:
                self._refs[block] = 0
                self._idle[block] = None
            elif refs == 0:
                self._idle.move_to_end(block)
        for block in reversed(hashes):
            refs = self._refs[block] - 1
            self._refs[block] = refs
            if refs == 0:
                self._idle[block] = None
                self._held -= 1
        while self._idle and len(self._refs) + self._private > self.capacity:
            self._refs.pop(self._idle.popitem(last=False)[0])
            self.evictions += 1
