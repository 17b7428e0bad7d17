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

A slot has two writers for a while when its balancer is replaced: a route change starts a new
balancer in the worker and retires the old one, and ``restart-workers`` starts a new worker
process beside the old. The successor takes the slot's row; the one retiring, whose requests
under way still load their replicas (and count against ``max_in_flight_per_replica``), moves
them to the slot's hand-over row (:func:`retired`), rows ``workers`` to ``2 * workers - 1``,
which every reader adds in, and takes back what it wrote on the slot's row (:func:`forget_own`).
Balancers of one process retiring in one slot write the hand-over row together, each cell
the sum of their counts; the last one's end zeroes it, and the daemon
zeroes a slot's hand-over rows once the slot's old process is gone
(:func:`clear_hand_over`), so a process killed while retiring leaves no counts behind. A
slot past the board's rows has no hand-over row: its retiring balancer's requests count
nowhere until they end.

**What a retiring balancer holds.** Under ``max_in_flight_per_replica`` a retiring balancer may
hold requests that no replica has seen (every replica was full). They are older than anything
its successor receives, so they should take the next room; but the successor may be another
process (``restart-workers``), or the same slot's successor in another worker after an update,
and neither is told of them in process. So the last cell of a hand-over row (:data:`MARK`)
carries how many requests that row's balancers hold, under an id no replica has (a reader of
counts takes it as 0), and a successor with a limit lets them go first while the fleet's spare
room is no more than what is marked (:class:`HeldMarks`). The mark shares a cell with the 64th
ready replica, whose count a retiring balancer then leaves off its row.
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

ROWS: Final = 16  # rows: a slot's row, then a slot's hand-over row; past them a worker is alone
COLUMNS: Final = 64  # ready replicas; past them a replica's load is this worker's alone
_ROW: Final = struct.Struct(f"<{COLUMNS}Q")
_CELL: Final = struct.Struct("<Q")
_COUNT_MASK: Final = (1 << 32) - 1
MARK: Final = COLUMNS - 1  # a hand-over row's cell of held requests (see the module docstring)
_MARK_ID: Final = _COUNT_MASK << 32  # the id in that cell: no replica's


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
        mapped = map_shared(path, ROWS * _ROW.size, "load board")
        if mapped is None:
            return None
        board: LoadBoard = _BUILD(mapped, slot, min(2 * workers, ROWS))
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


class RetiredRow(LoadBoard):
    """A retiring balancer's board: its counts go to its slot's hand-over row, each cell the
    sum of every balancer of this process that retires in the slot (see the module
    docstring). It reads as any board does."""

    # (board file, row): the counts of the balancers of this process writing that row, and
    # what each of them holds (by id of its counts).
    _writers: dict[tuple[str, int], list[Mapping[int, float]]] = {}
    _holding: dict[tuple[str, int], dict[int, int]] = {}

    def __init__(self, mapped: mmap.mmap, row: int, rows: int, key: tuple[str, int]) -> None:
        super().__init__(mapped, row, rows)
        self._key = key
        self._counts: Mapping[int, float] = {}

    def join(self, counts: Mapping[int, float], ready: Sequence[int]) -> None:
        """``counts``: the retiring balancer's own, live (the dict it keeps counting in)."""
        self._counts = counts
        self._writers.setdefault(self._key, []).append(counts)
        self.arrange(ready, counts)

    def _sum(self, rid: int) -> int:
        return int(sum(counts.get(rid, 0) for counts in self._writers.get(self._key, ())))

    def arrange(self, ready: Sequence[int], in_flight: Mapping[int, float]) -> None:
        super().arrange(ready[:MARK], {rid: self._sum(rid) for rid in ready[:MARK]})
        self._write_mark()

    def publish(self, rid: int, count: int) -> None:
        super().publish(rid, self._sum(rid))

    def hold(self, count: int) -> None:
        """This balancer now holds ``count`` requests (see "What a retiring balancer holds")."""
        holding = self._holding.setdefault(self._key, {})
        if holding.get(id(self._counts), 0) != count:
            holding[id(self._counts)] = count
            self._write_mark()

    def _write_mark(self) -> None:
        held = sum(self._holding.get(self._key, {}).values()) & _COUNT_MASK
        _CELL.pack_into(self._map, self._slot * _ROW.size + MARK * 8, _MARK_ID | held)

    def clear(self) -> None:
        """This balancer's requests are over: the row keeps the others' (zeroed by the last)."""
        writers = self._writers.get(self._key, [])
        writers[:] = [counts for counts in writers if counts is not self._counts]
        self._holding.get(self._key, {}).pop(id(self._counts), None)
        if writers:
            self.arrange(sorted(self._column, key=self._column.__getitem__), {})
        else:
            self._writers.pop(self._key, None)
            self._holding.pop(self._key, None)
            super().clear()


class HeldMarks:
    """What every retiring balancer of a service holds, read from the hand-over rows' marks
    (see "What a retiring balancer holds"); for a successor under a limit."""

    def __init__(self, mapped: mmap.mmap, workers: int) -> None:
        self._map = mapped
        self._offsets = [
            row * _ROW.size + MARK * 8 for row in range(workers, min(2 * workers, ROWS))
        ]

    @classmethod
    def open(cls, path: str | Path | None, workers: int) -> HeldMarks | None:
        """None where there are no hand-over rows (no board, a worker alone)."""
        if path is None or workers < 2:
            return None
        mapped = map_shared(path, ROWS * _ROW.size, "load board")
        return None if mapped is None else cls(mapped, workers)

    def total(self) -> int:
        held = 0
        for offset in self._offsets:
            (cell,) = _CELL.unpack_from(self._map, offset)
            if cell & ~_COUNT_MASK == _MARK_ID:
                held += cell & _COUNT_MASK
        return held

    def close(self) -> None:
        self._map.close()


def retired(
    path: str | Path | None,
    slot: int,
    workers: int,
    ready: Sequence[int],
    in_flight: Mapping[int, float],
    streams: Mapping[int, float] | None,
) -> tuple[RetiredRow | None, RetiredRow | None]:
    """The boards of counts and of streams (None: it had none) that a balancer retiring from
    ``slot`` writes to from now on: ``in_flight`` and ``streams`` are its own counts, live, and
    ``ready`` the ready set. None where the slot has no hand-over row."""
    row = workers + slot
    if path is None or workers < 2 or not 0 <= slot < workers or row >= ROWS:
        return None, None
    boards: list[RetiredRow | None] = []
    for file, counts in ((path, in_flight), (streams_path(path), streams)):
        board = None
        mapped = None if counts is None else map_shared(file, ROWS * _ROW.size, "load board")
        if counts is not None and mapped is not None:
            board = RetiredRow(mapped, row, min(2 * workers, ROWS), (str(file), row))
            board.join(counts, ready)
        boards.append(board)
    counted, streamed = boards
    if counted is not None:
        counted.streams = streamed
    return counted, streamed


def forget_own(
    path: str | Path | None,
    slot: int,
    workers: int,
    ready: Sequence[int],
    in_flight: Mapping[int, float],
) -> None:
    """A balancer leaves ``slot``'s row to its successor (``in_flight``: its own counts, now
    going to the hand-over row): each cell that still holds what it last wrote there goes
    back to 0. After restart-workers the old process went on writing the row after the new
    one had written it from its table, and those counts stayed until the old process was
    gone: a replica looked full under a limit, to the old process's own held requests too.
    A cell the successor wrote since is left alone (unless it wrote the same count: then it
    is off by that count until its next write for that replica)."""
    if path is None or workers < 2 or not 0 <= slot < workers:
        return
    mapped = map_shared(path, ROWS * _ROW.size, "load board")
    if mapped is None:
        return
    for i, rid in enumerate(ready[:COLUMNS]):
        count = int(in_flight.get(rid, 0)) & _COUNT_MASK
        offset = slot * _ROW.size + i * 8
        if count and _CELL.unpack_from(mapped, offset)[0] == rid << 32 | count:
            _CELL.pack_into(mapped, offset, rid << 32)
    mapped.close()


def clear_hand_over(directory: Path, slot: int, workers: int) -> None:
    """Zero ``slot``'s hand-over row on every board in ``directory``: the slot's old worker
    process is gone, and what it counted there with it."""
    row = workers + slot
    if workers < 2 or row >= ROWS:
        return
    for path in directory.glob("load-*.bin"):
        mapped = map_shared(path, ROWS * _ROW.size, "load board")
        if mapped is not None:
            _ROW.pack_into(mapped, row * _ROW.size, *([0] * COLUMNS))
            mapped.close()


# The class :meth:`LoadBoard.open` builds: the compiled twin where there is one (the same
# cells, without a row unpacked per read), which assumes the little-endian layout.
_BUILD: Any = (speedups.twin("LoadBoard") if sys.byteorder == "little" else None) or LoadBoard
