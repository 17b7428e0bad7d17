"""Which replica may take a request now, and holding requests while none may.

An LLM engine takes every request it is sent and queues what its batch cannot run; a request
queued there waits behind that replica's work even when another replica frees up first. With a
per-replica limit (``max_in_flight``: the spec's ``load_balancing.max_in_flight_per_replica``,
this worker's share of it), a request that finds every replica at its limit waits here instead,
first in, first out, and goes out the moment any replica has room (SkyWalker's "selective
pushing"). The wait is bounded: past ``hold_timeout`` the client gets a 503 with Retry-After,
never a hang. Without a limit nothing here runs, and plain HTTP pays one attribute test.

**Waiting for the replica that has the cache.** Under a policy that reads the request
(``prefix_affinity``, session affinity) the replica it prefers is worth waiting for: the
prompt's prefix is cached there, and elsewhere it is computed again. So with a limit, the
policy chooses among all replicas (not only those with room); when its choice is at the limit,
the request waits for that replica (its *home*), and goes out the moment the home has room,
ahead of the requests waiting for any replica. A home's waiting requests count as its load in
the policy's bound, so a hot prompt family that piles up behind one replica spills to the next
of its order. A request waits for its home at most ``patience`` seconds (the spec's
``hold_patience_seconds``, HOLD_PATIENCE by default: a slot frees every few tens of
milliseconds on a busy engine, while recomputing a long prompt costs hundreds), then goes to
whichever replica has room first, as a blind policy's requests do.

**What a load is.** A policy weighs each replica by its requests in flight, but in a choice by
load a request whose streamed answer has begun weighs ``policies.STREAM_WEIGHT`` (1/16) of one
still waiting for its first bytes (:meth:`Gate._loads`; ``prefix_affinity`` weighs streams so
in its choices by load only, and bounds a replica's load by the plain counts). On an LLM engine
the two cost a new request very different waits: one in its prefill holds the engine's next
step for up to hundreds of milliseconds, while one decoding adds about a millisecond to each
step, and a plain count weighs them alike. Measured on unshared prompts (docs/benchmarks.md, "A
streamed answer under way weighs less"): ``least_load``'s TTFT p99 was 13-22% above round
robin's; with the weight it is 3-13% above it. Only the general path sees a stream begin (the
fast path's answers are whole, so their load is their count): plain HTTP pays one truth test of
an empty dict per pick.

A mixin of :class:`~corral.balancer.proxy.LoadBalancer`, like its counters: the state stays
plain attributes of the balancer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from corral.balancer.load_board import (
    HeldMarks,
    RetiredRow,
    forget_own,
    retired,
    streams_path,
)
from corral.balancer.policies import weigh_streams

if TYPE_CHECKING:
    from corral.balancer.load_board import LoadBoard
    from corral.balancer.policies import Policy, RequestView
    from corral.balancer.roles import Held, Pending

# Retry-After on a 503 for a request held past its bound.
HELD_RETRY_AFTER: Final = 1
# How long a held request waits for the replica its policy chose before taking any with room.
HOLD_PATIENCE: Final = 0.5
# The longest a replaced worker (restart-workers) holds requests on: the daemon kills it at
# most 61 s after telling it to exit (dataplane.processes.MAX_OLD_WORKER_GRACE), and a request
# still held then is cut unsent. Half of that, so the request has the other half to finish.
REPLACED_HOLD_CAP: Final = 30.0


class Gate:
    """The picking and holding half of the balancer (see the module docstring)."""

    _in_flight: dict[int, int]
    _ready_ids: tuple[int, ...]
    _ejected: dict[int, float]
    _policy: Policy
    _streaming: dict[int, int]
    _stream_board: LoadBoard | None
    _board: LoadBoard | None
    _ready_event: asyncio.Event
    _stopping: bool
    _hand_over_row: tuple[str | None, int, int]

    def _init_gate(
        self,
        max_in_flight: int | None,
        hold_timeout: float,
        workers: int,
        patience: float = HOLD_PATIENCE,
    ) -> None:
        # This worker's share of the limit: each balancer worker counts only its own requests.
        self._limit = math.ceil(max_in_flight / max(1, workers)) if max_in_flight else 0
        # ... but where the workers share their counts (the load board), the whole limit
        # against every worker's requests: connections reach the workers unevenly, and a
        # share alone held (and turned away at the hold's bound) requests the fleet had room
        # for, while letting a replica past the limit once in a while (3 workers, N = 8).
        self._fleet_limit = max_in_flight or 0
        self._hold_timeout = hold_timeout
        # Whether a request must be looked at before a replica is picked: a policy reads it,
        # or a limit may hold it. Plain HTTP under a load policy tests this one flag.
        self._gated = self._policy.reads_request or bool(self._limit)
        # Whether a held request waits for the replica its policy prefers (see above).
        self._affine = self._policy.reads_request and bool(self._limit) and patience > 0
        self._patience = patience
        self._held: deque[Held] = deque()
        self._homes: Counter[int] = Counter()  # held requests waiting for each replica
        self._want: int | None = None  # the full home _pick chose, for the _hold that follows
        self._want_record: object | None = None  # ... and what its policy keeps if it goes
        # A policy that keeps what it sent where learns where each request really went
        # (Policy.defer): its choice may be full, and the request go elsewhere or wait.
        self._policy.defer = self._gated
        self._anywhere = False  # _pick for a request past its patience: any replica with room
        self._held_total = 0
        self._held_expired = 0
        # Requests waiting for a first ready replica (no_replica_wait): the queue an engine
        # autoscaler scales on from zero, where no engine has a queue to report yet.
        self._awaiting = 0
        self._handed_over = False  # stopped for a successor: held requests go out (stop)
        self._release_at = 0.0  # ... past the limit from then on (_hand_over_held)
        # Retired balancers of this service in this worker still holding requests: they go
        # first (_hand_over_held). And the successor of this one, once it retires.
        self._elders: list[Gate] = []
        self._heir: Gate | None = None
        # What retiring balancers in other processes or slots hold, for a successor under a
        # limit (load_board, "What a retiring balancer holds"); the mark this one writes once
        # it retires.
        path = self._hand_over_row[0]
        self._marks = HeldMarks.open(path, workers) if self._limit and self._board else None
        self._held_mark: RetiredRow | None = None
        self._wake_scheduled = False
        self._weighs = self._policy.weighs_streams

    def _loads(self, candidates: Sequence[int]) -> Mapping[int, float]:
        """Each candidate's load as the policy weighs it (see "What a load is" above): every
        worker's where they share a board; the counts in flight themselves while no stream
        is under way."""
        board = self._board
        if board is not None and self._weighs:
            return board.loads(candidates, self._in_flight, self._streaming)
        if not self._streaming or not self._weighs:
            return self._in_flight
        return weigh_streams(candidates, self._in_flight, self._streaming)

    def _stream_began(self, rid: int) -> None:
        """The first bytes of a streamed answer from ``rid`` went to its client."""
        streaming = self._streaming
        count = streaming[rid] = streaming.get(rid, 0) + 1
        if self._stream_board is not None:
            self._stream_board.publish(rid, count)

    def _stream_ended(self, rid: int) -> None:
        """A stream counted by :meth:`_stream_began` ends (``_release`` follows at once)."""
        streaming = self._streaming
        count = streaming.get(rid, 0) - 1
        if count > 0:
            streaming[rid] = count
        else:
            count = 0
            streaming.pop(rid, None)
        if self._stream_board is not None:
            self._stream_board.publish(rid, count)

    def _pick(self, tried: Sequence[int], request: RequestView | None = None) -> int | None:
        """Choose a ready replica not tried yet (with room, under a limit); None when there
        is none, or when the policy's choice is full and worth waiting for (``_full`` is
        then true). ``request`` goes to a policy that reads requests."""
        self._want = self._want_record = None
        ids = self._ready_ids
        candidates: Sequence[int] = ids if not tried else [r for r in ids if r not in tried]
        if not candidates:
            return None
        policy = self._policy
        if not self._gated:
            return policy.select(self._healthy(candidates), self._loads(candidates))
        if (self._elders or self._marks) and self._elders_wait():
            return None  # a retired balancer's held requests go first (``_full`` says wait)
        record = None
        if self._affine and not self._anywhere and request is not None:
            loads = self._loads(candidates)
            if self._homes:  # those waiting for a replica are its load too
                loads = {rid: loads.get(rid, 0) + self._homes[rid] for rid in candidates}
            rid = policy.select(self._healthy(candidates), loads, request)
            record = policy.pending
            if not self._at_limit(rid):
                policy.commit(rid, record)
                return rid
            if policy.preferred:
                self._want, self._want_record = rid, record  # worth waiting for
                return None
            # a choice by load, full: any replica with room serves it as well
        candidates = self._room(candidates)
        if not candidates:
            return None
        rid = policy.select(self._healthy(candidates), self._loads(candidates), request)
        # A policy asked about one candidate may not read the request: what it read above.
        policy.commit(rid, policy.pending if policy.pending is not None else record)
        return rid

    def _healthy(self, candidates: Sequence[int]) -> Sequence[int]:
        """Candidates minus recently unreachable ones (all of them if every one is)."""
        if not self._ejected:
            return candidates
        now = time.monotonic()
        for rid, until in list(self._ejected.items()):
            if until <= now:
                del self._ejected[rid]
        healthy = [rid for rid in candidates if rid not in self._ejected]
        return healthy or candidates

    def _room(self, candidates: Sequence[int]) -> Sequence[int]:
        """Candidates below this worker's share of the limit (all of them without one)."""
        limit = self._limit
        if not limit:
            return candidates
        board = self._board
        if board is not None:
            totals = board.totals(candidates, self._in_flight)
            fleet = self._fleet_limit
            return [rid for rid in candidates if totals[rid] < fleet]
        get = self._in_flight.get
        return [rid for rid in candidates if get(rid, 0) < limit]

    def _at_limit(self, rid: int) -> bool:
        """``rid`` takes no request from this worker now: every worker's requests to it
        reach the limit (where they share their counts), else this worker's reach its share."""
        board = self._board
        if board is None:
            return self._in_flight.get(rid, 0) >= self._limit
        return board.totals((rid,), self._in_flight)[rid] >= self._fleet_limit

    def _full(self, tried: Sequence[int]) -> bool:
        """The request must wait: its home is full (``_pick`` said so), or every untried
        ready replica is at its limit (and there is one)."""
        if not self._limit:
            return False
        return self._want is not None or self._elders_wait() or self._full_for_any(tried)

    def _elders_wait(self) -> bool:
        """A retired balancer of this service still holds requests, older than any of this
        one's: they take the room first (:meth:`_hand_over_held`). One in this worker holds
        any; those of other processes or slots (their marks) hold as much room as the fleet
        has spare."""
        if any(elder._held for elder in self._elders):
            return True
        marks = self._marks
        if marks is None or self._handed_over or not (marked := marks.total()):
            return False
        ids = self._ready_ids
        if self._board is None or not ids:
            return False
        totals = self._board.totals(ids, self._in_flight)
        spare = sum(max(0, self._fleet_limit - int(totals[rid])) for rid in ids)
        return spare <= marked

    def leave_boards(self) -> None:
        """A successor in this slot (a new balancer after a route change, a new worker process
        after restart-workers) writes the slot's rows of the shared boards from now on; this
        balancer's requests under way still load their replicas, so they go on counting on
        the slot's hand-over row (``load_board.retired``), which also marks what it holds. Its
        policy may still read."""
        if self._board is not None and not isinstance(self._board, RetiredRow):
            streams = self._streaming if self._stream_board is not None else None
            where, ready = self._hand_over_row, self._ready_ids
            forget_own(*where, ready, self._in_flight)
            if streams is not None and where[0] is not None:
                forget_own(streams_path(where[0]), *where[1:], ready, streams)
            self._board, self._stream_board = retired(*where, ready, self._in_flight, streams)
            self._held_mark = self._board

    def _mark(self) -> None:
        """What this retired balancer holds, for its successors elsewhere (``_elders_wait``)."""
        if self._held_mark is not None:
            self._held_mark.hold(self.held())

    def _hold(self, ex: Pending) -> None:
        now = time.monotonic()
        home, self._want = self._want, None
        ex.placing, self._want_record = self._want_record, None
        if self._stopping and now >= self._release_at:  # no room will come here: at once
            self._held_total += 1
            if self._handed_over:  # a successor serves the service: no limit here any more
                self._release_held()
                ex.next_attempt()
            else:
                self._refuse_at_stop(ex)  # as stop() answered the others
            return
        if home is not None:
            self._homes[home] += 1
        # At most half the hold's bound waiting for the home: a patience as long as the bound
        # turned the wait for the cache into a 503 while another replica sat idle.
        patience = min(self._patience, self._hold_timeout / 2)
        self._held.append((now + self._hold_timeout, now + patience, home, ex))
        self._held_total += 1
        self._mark()

    def _readiness(self, any_ready: bool) -> None:
        """The ready set changed (``any_ready``: it has a replica): what waits for one is
        woken, and a replica that joined has room for what is held."""
        if any_ready:
            self._ready_event.set()
            self._room_freed()
        else:
            self._ready_event.clear()

    def _room_freed(self) -> None:
        """A request to some replica ended: send held requests soon (not from inside the
        callback that ended it), a retired balancer's first (:meth:`_hand_over_held`)."""
        for elder in self._elders:
            elder._room_freed()
        if self._held and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_held)

    def _send_held(self) -> None:
        """Send what can go: a request waiting for its home once the home has room, one
        waiting for any replica (or past its patience) once any has room; oldest first."""
        self._wake_scheduled = False
        ids = self._ready_ids
        if (ids and not self._room(ids)) or ((self._elders or self._marks) and self._elders_wait()):
            return  # every replica full (a wake from the ticker, say), or older ones go first
        held = self._held
        waiting = list(held)
        held.clear()
        keep: list[Held] = []
        now = time.monotonic()
        for i, entry in enumerate(waiting):
            if ids and not self._room(ids):  # every replica full: nothing more can go now
                keep.extend(waiting[i:])
                break
            _, until, home, ex = entry
            if not ex.done:
                if home is not None and now < until and home in ids:
                    if self._at_limit(home):
                        keep.append(entry)
                        continue
                    ex.picked = home
                    self._policy.commit(home, ex.placing)
                elif self._full_for_any(ex.tried):
                    keep.append(entry)
                    continue
            self._unwait(home)
            if ex.done:
                continue
            self._anywhere = True  # past its patience (or no home): any with room
            try:
                ex.next_attempt()  # room now, so it goes out (a new hold lands in ``held``)
            finally:
                self._anywhere = False
        again = list(held)
        held.clear()
        held.extend(keep)
        held.extend(again)
        self._mark()

    def _full_for_any(self, tried: Sequence[int]) -> bool:
        """Every untried ready replica is at its limit (and there is one)."""
        untried = [rid for rid in self._ready_ids if rid not in tried]
        return bool(untried) and not self._room(untried)

    def _unwait(self, home: int | None) -> None:
        """A request that waited for ``home`` left the hold."""
        if home is not None:
            self._homes[home] -= 1
            if self._homes[home] <= 0:
                del self._homes[home]

    def _expire_held(self, now: float) -> None:
        """Answer 503 to what waited past its bound, and send on what waited past its
        patience (called by the balancer's ticker)."""
        held = self._held
        if self._release_at and now >= self._release_at:
            self._release_held()
        while held and (held[0][0] <= now or held[0][3].done):
            _, _, home, ex = held.popleft()
            self._unwait(home)
            if ex.done:
                continue
            self._held_expired += 1
            if self._board is not None:
                full = f"{self._fleet_limit} request(s) in flight"
            else:
                full = f"{self._limit} request(s) in flight from this balancer worker"
            ex.respond_error(
                503,
                f"every replica had {full} for {self._hold_timeout:g}s",
                "held_too_long",
                extra=b"Retry-After: %d\r\n" % HELD_RETRY_AFTER,
            )
        if self._homes and any(entry[3].done for entry in held):
            self._drop_gone()
        self._mark()
        if self._homes or (held and self._board is not None):
            # a patience may have ended: it may go anywhere now; or another worker's request
            # ended, which frees room this worker is not told of
            self._room_freed()

    def _drop_gone(self) -> None:
        """Requests held for a replica whose clients left wait for nothing: they stop counting
        as its load at once, not when they reach the head of the queue (behind a request that
        waits on, with every replica full, their weight pushed the replica's next requests
        past the bound, to a replica without their cache)."""
        kept = [entry for entry in self._held if not entry[3].done]
        for _, _, home, ex in self._held:
            if ex.done:
                self._unwait(home)
        self._held.clear()
        self._held.extend(kept)

    def _answer_held(self) -> None:
        """The balancer stops: each held request (it reached no replica) gets 503 with
        Retry-After at once, not the cut at the end of the stop's grace. A retired balancer
        waiting on this one's limit has nothing to wait on any more: what it holds goes out."""
        for elder in self._elders:
            elder._release_held()
        held = self._held
        while held:
            _, _, home, ex = held.popleft()
            self._unwait(home)
            self._refuse_at_stop(ex)

    def _hand_over_held(self, bound: float, heir: Gate | None) -> None:
        """The balancer stops because the service has a successor: ``heir`` after a route change (an
        update of a balancer setting) in this worker, None when the worker itself is replaced. What
        it holds is not to get a 503, as a request no replica has seen. With a heir and boards on
        both sides (its counts on its slot's hand-over row, ``load_board.retired``, so the two see
        each other's requests), what it holds waits on under the heir's limit (an update may change
        it), ahead of the heir's own (an elder of the heir: it is woken as the heir's requests end,
        and the heir holds its own while an elder holds any), for at most ``bound`` seconds and
        never past a held request's own hold, since its requests need the rest of the drain to
        finish. Then, or in any other case at once (no limit any more, say), it goes out past the
        limit (:meth:`_release_held`). A worker replaced (restart-workers) gives no heir: the
        successor is another process, so what is held here waits under this balancer's own
        limit, marked on the hand-over row for that process to let it go first
        (``_elders_wait``), and so do this worker's elders, each within its own bound."""
        self._handed_over = True
        elders, self._elders = self._elders, []
        marked = self._held_mark is not None and self._limit
        if heir is None and marked:
            bound = min(bound, REPLACED_HOLD_CAP)  # before the daemon kills this process
            cap = time.monotonic() + bound
            for elder in elders:  # no heir to wait on here: each waits on the fleet's room
                elder._heir = None
                if elder._release_at:  # nor past the kill (its bound was its own drain's)
                    elder._release_at = min(elder._release_at, cap)
        elif heir is None or heir._board is None or self._board is None or not heir._limit:
            for elder in [*elders, self]:  # nothing is left to wait on: theirs go out too
                elder._release_held()
            return
        else:
            for elder in [*elders, self]:  # the older first, all of them now the heir's elders
                elder._heir = heir
                heir._elders.append(elder)
                elder._limit, elder._fleet_limit = heir._limit, heir._fleet_limit
        # The ticker runs every tick while anything is held, and releases it then.
        self._release_at = min([time.monotonic() + bound, *(entry[0] for entry in self._held)])
        self._mark()
        self._room_freed()  # a limit raised by the update: room at once

    def _leave_heir(self) -> None:
        """This balancer stopped: its heir no longer waits for it, and it reads no marks."""
        marks, self._marks = self._marks, None
        if marks is not None:
            marks.close()
        heir, self._heir = self._heir, None
        if heir is not None and self in heir._elders:
            heir._elders.remove(self)

    def _release_held(self) -> None:
        """What is held goes out now, past the limit (see :meth:`_hand_over_held`): the limit
        is over by at most what was held, once."""
        self._handed_over = True
        self._release_at = 0.0
        self._limit = 0
        self._affine = False
        waiting = list(self._held)
        self._held.clear()
        self._mark()
        for _, _, home, ex in waiting:
            self._unwait(home)
            if not ex.done:
                ex.next_attempt()

    def _refuse_at_stop(self, ex: Pending) -> None:
        if not ex.done:
            ex.respond_error(
                503,
                "the balancer is stopping before a replica had room for this request",
                "held_at_stop",
                extra=b"Retry-After: %d\r\n" % HELD_RETRY_AFTER,
            )

    def held(self) -> int:
        """Requests waiting here now."""
        return sum(1 for *_, ex in self._held if not ex.done)
