"""Every balancer worker's requests in flight per replica, shared by the workers of a service.

A policy that weighs load (``least_load``, ``power_of_two``, ``instance_aware_least_load``, and
``prefix_affinity``'s bound: a replica is passed over at ``balance`` times the mean) sees, by
itself, only the requests of the worker it runs in: with two workers on a port, half of what
each replica carries, and a replica the other worker has just filled looks idle (two
concurrent requests accepted by different workers reached the same idle replica half the
time). The engines' own queue figures arrive once a second, which near saturation is too late.
So the workers of a service publish their counts in a file they all map, and a policy reads
the sum of every worker's (``round_robin`` reads no load and shares nothing). The compiled
build (``_speedups.LoadBoard``) reads and writes the same cells through a pointer, so plain
HTTP under a load policy pays a few stores and loads per request, not a row unpacked per
worker. A second board of the same layout (:func:`streams_path`) holds their
streamed answers under way, which a choice by load weighs less (``corral.balancer.gate``).

The layout is one row per worker slot and one column per ready replica (its rank among the
ready ids, which every worker derives from the same table), each cell one 64-bit word: the
replica id in the upper 32 bits and the count in the lower 32. A worker writes only its own
row, so there is no lock and no torn sum: a reader takes each cell as it finds it, and a cell
naming another replica (a worker that has not applied the latest table yet) counts as 0. A
worker rewrites its whole row when the ready set changes and zeroes it when it stops; a row
left by a worker that was killed is overwritten by its successor in the same slot. What can go
wrong is a load off by a few requests for a moment, never a wrong answer.
"""

from __future__ import annotations

import mmap
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from corral.balancer import speedups
from corral.balancer.policies import weigh_streams
from corral.balancer.shared_file import map_shared

ROWS: Final = 16  # worker slots a board has room for; a worker past them keeps its own view
COLUMNS: Final = 64  # ready replicas; past them a replica's load is this worker's alone
_ROW: Final = struct.Struct(f"<{COLUMNS}Q")
_CELL: Final = struct.Struct("<Q")
_COUNT_MASK: Final = (1 << 32) - 1


def board_path(directory: Path, service: str) -> Path:
    """Where the workers of ``service`` share their counts (the data plane's directory)."""
    return directory / f"load-{service}.bin"


def streams_path(board: str | Path) -> Path:
    """Where the workers that share ``board`` count their streamed answers under way: a board
    of its own, so a policy reads either count as it wants (``corral.balancer.gate``, "What a
    load is")."""
    board = Path(board)
    return board.with_name(f"{board.stem}-streams.bin")


def streams_board_path(directory: Path, service: str) -> Path:
    return streams_path(board_path(directory, service))


class LoadBoard:
    """One service's shared counts, as seen by the worker in ``slot``; see the module
    docstring."""

    def __init__(self, mapped: mmap.mmap, slot: int, rows: int) -> None:
        self._map = mapped
        self._slot = slot
        self._rows = rows
        self._column: dict[int, int] = {}
        self.streams: LoadBoard | None = None  # the board of streams beside this one

    @classmethod
    def open(cls, path: str | Path | None, slot: int, workers: int) -> LoadBoard | None:
        """The board at ``path``, created (0600) if missing, for the worker in ``slot`` of
        ``workers``; None with no path, a worker alone, a slot without a row, or a file that
        cannot be made (logged): the policy then weighs this worker's requests alone."""
        if path is None or workers < 2 or not 0 <= slot < ROWS:
            return None
        size = ROWS * _ROW.size
        mapped = map_shared(path, size, "load board")
        if mapped is None:
            return None
        board: LoadBoard = _BUILD(mapped, slot, min(workers, ROWS))
        return board

    def arrange(self, ready: Sequence[int], in_flight: Mapping[int, int]) -> None:
        """A new ready set (sorted ids, as every worker has them): each replica takes the
        column of its rank, and this worker's row is written anew from its counts."""
        self._column = {rid: i for i, rid in enumerate(ready[:COLUMNS])}
        cells = [0] * COLUMNS
        for rid, i in self._column.items():
            cells[i] = rid << 32 | (in_flight.get(rid, 0) & _COUNT_MASK)
        _ROW.pack_into(self._map, self._slot * _ROW.size, *cells)

    def publish(self, rid: int, count: int) -> None:
        """This worker now has ``count`` requests in flight to ``rid``."""
        i = self._column.get(rid)
        if i is not None:
            offset = self._slot * _ROW.size + i * 8
            _CELL.pack_into(self._map, offset, rid << 32 | (count & _COUNT_MASK))

    def totals(self, candidates: Sequence[int], own: Mapping[int, float]) -> dict[int, float]:
        """Each candidate's count (requests in flight, or streams under way) from every
        worker: ``own`` (this worker's, exact) plus what the other workers' rows say."""
        totals: dict[int, float] = {rid: own.get(rid, 0) for rid in candidates}
        column = self._column
        cells_of = [(rid, column[rid]) for rid in candidates if rid in column]
        for row in range(self._rows):
            if row == self._slot:
                continue
            cells = _ROW.unpack_from(self._map, row * _ROW.size)
            for rid, i in cells_of:
                cell = cells[i]
                if cell >> 32 == rid:
                    totals[rid] += cell & _COUNT_MASK
        return totals

    def loads(
        self, candidates: Sequence[int], own: Mapping[int, float], own_streams: Mapping[int, int]
    ) -> Mapping[int, float]:
        """What a load policy weighs (``corral.balancer.gate``, "What a load is"): each
        candidate's requests in flight from every worker, a stream under way (every worker's,
        from :attr:`streams`) weighing ``STREAM_WEIGHT``. ``own``, ``own_streams``: this
        worker's counts."""
        totals = self.totals(candidates, own)
        boards = self.streams
        counts = own_streams if boards is None else boards.totals(candidates, own_streams)
        if not any(counts.get(rid, 0) for rid in candidates):
            return totals
        return weigh_streams(candidates, totals, counts)

    def clear(self) -> None:
        """This worker stops: its requests no longer count anywhere."""
        _ROW.pack_into(self._map, self._slot * _ROW.size, *([0] * COLUMNS))
        self._column = {}

    def close(self) -> None:
        self._map.close()


# The class :meth:`LoadBoard.open` builds: the compiled twin where there is one (the same
# cells, without a row unpacked per read), which assumes the little-endian layout.
_BUILD: Any = (speedups.twin("LoadBoard") if sys.byteorder == "little" else None) or LoadBoard
