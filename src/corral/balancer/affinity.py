"""Where each conversation went, shared by every balancer worker of a service.

Rendezvous hashing alone keeps a conversation on one replica from any worker only while its
first choice is under the load bound: a turn that spilled to the next replica (its first
choice was busy, as seen by the worker that took that turn) is not known to the other workers,
and the next turn, taken by another worker that sees the first choice free, goes back there and
computes the whole history again. So the workers of one service share a small table, a file
they all map: conversation key -> the replica its last turn went to. A worker reads it before
choosing and writes what it chose, so a spill is followed by every worker. A document and
its questions (a prompt that is not a chat) are keyed the same way, by the prompt's anchor:
where one worker placed a new document, every worker sends its questions.

The table is approximate on purpose, like a CPU cache: ``slots`` entries, each one 64-bit word
(the upper 40 bits of the key as a tag, the replica id in the lower 24), direct-mapped by the
key's low bits; a collision overwrites, and a torn or stale entry names a replica the policy
checks against the ready set and the load bound like any other choice. What can go wrong is a
conversation routed as if new, never a wrong answer. It lives in the data plane's directory,
so a daemon restart or upgrade keeps it, as it keeps the workers.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Final

from corral.balancer.shared_file import map_shared

DEFAULT_SLOTS: Final = 1 << 16  # 512 KiB a service: 64k conversations in flight or recent
_WORD: Final = struct.Struct("<Q")
_REPLICA_BITS: Final = 24
_REPLICA_MASK: Final = (1 << _REPLICA_BITS) - 1
_TAG_MASK: Final = (1 << (64 - _REPLICA_BITS)) - 1


def table_path(directory: Path, service: str) -> Path:
    """Where the workers of ``service`` share its table (the data plane's directory)."""
    return directory / f"affinity-{service}.bin"


class AffinityTable:
    """A file-backed map from conversation key to replica id; see the module docstring."""

    def __init__(self, mapped: mmap.mmap, slots: int) -> None:
        self._map = mapped
        self._mask = slots - 1

    @classmethod
    def open(cls, path: Path, slots: int = DEFAULT_SLOTS) -> AffinityTable | None:
        """The table at ``path``, created (0600) if missing; None (logged) when it cannot be:
        routing then goes on as if every worker were alone."""
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, not {slots}")
        size = slots * _WORD.size
        mapped = map_shared(path, size, "conversation table")
        if mapped is None:
            return None
        return cls(mapped, slots)

    def get(self, key: int) -> int | None:
        word: int = _WORD.unpack_from(self._map, (key & self._mask) * 8)[0]
        if word and word >> _REPLICA_BITS == (key >> _REPLICA_BITS) & _TAG_MASK:
            return word & _REPLICA_MASK
        return None

    def put(self, key: int, replica: int) -> None:
        if 0 < replica <= _REPLICA_MASK:
            tag = (key >> _REPLICA_BITS) & _TAG_MASK
            _WORD.pack_into(self._map, (key & self._mask) * 8, tag << _REPLICA_BITS | replica)

    def close(self) -> None:
        self._map.close()
