"""The machine's capacity shared by every service of one daemon: who holds which GPU, CPUs and
memory, on the local backend.

One :class:`Capacity` per daemon, handed to every controller. Its facts live in SQLite
(``placements``: one claim per replica, see :meth:`corral.state.Store.claim`), written in one
transaction with the check against every other claim and before the replica is launched, so a
daemon killed at any point restarts into the same assignment: a replica relaunched after a
restart gets the claim it already had, and a new one only what no live claim holds. A claim is
held until its replica's teardown succeeded (a process that is still stopping may still hold
GPU memory), and goes with the replica's row.

What is enforced and what only accounted (docs/gpus.md says the same):

* GPUs: enforced as far as CUDA goes: a replica's ``CUDA_VISIBLE_DEVICES`` and
  ``NVIDIA_VISIBLE_DEVICES`` name only its devices (by UUID where known), and a replica that
  asked for none sees none while the inventory has GPUs. A process that ignores the variables
  (opens ``/dev/nvidia*`` itself) is not stopped.
* CPUs and memory: a soft ask, a share of the machine (SkyPilot's ``cpus: 2+`` sizes a VM):
  recorded and shown, never a reason to wait; asks beyond the machine are warned about
  (``validate``, the DEVICES column of status, ``corral daemon status``). Only
  ``resources.cpu_pinning: exclusive`` reserves CPUs: whole CPUs of the replica's own, pinned
  (``sched_setaffinity`` before it runs), and it waits while they are taken.

Waiting is visible: :attr:`Capacity.waiting` holds why each replica that does not fit waits
(shown in status), and every controller is woken when a claim is freed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corral.infra.inventory import Inventory
from corral.infra.placement import (
    Ask,
    AskError,
    Claim,
    Holder,
    NoFit,
    ask_of,
    misfits,
    place,
    share_warnings,
)
from corral.replicas import ReplicaStatus, is_live, replica_status, scale_down_victims
from corral.state import HeldClaim, ReplicaRow, Store

__all__ = ["Capacity", "Grant", "fit_problem", "fit_problems", "fit_warnings", "replica_env"]

log = logging.getLogger("corral.capacity")

_EPS = 1e-9


@dataclass(frozen=True)
class Grant:
    """What a replica may launch with: its claim and the environment that tells it so."""

    claim: Claim = field(default_factory=Claim)
    env: Mapping[str, str] = field(default_factory=dict)


def replica_env(claim: Claim, inventory: Inventory) -> dict[str, str]:
    """The device variables of a replica. Devices are listed in NVML index order; a device
    without a known UUID is named by index, and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` then makes
    CUDA count the way NVML does."""
    if not claim.gpus:
        if not inventory.gpus and not inventory.selected:
            return {}  # no GPU seen, none set aside: nothing to hide
        # Asked for none on a machine that has some (or whose GPUs were all left to other work
        # by ``--gpus none``): it must not grab GPU 0 from its owner.
        return {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}
    gpus = sorted(
        (g for g in inventory.gpus if g.address in claim.gpus),
        key=lambda g: g.index,
    )
    names = ",".join(g.address for g in gpus)
    env = {"CUDA_VISIBLE_DEVICES": names, "NVIDIA_VISIBLE_DEVICES": names}
    if any(g.uuid is None for g in gpus):
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def fit_problems(resources: Mapping[str, Any], inventory: Inventory) -> list[AskError]:
    """Why a local spec's ``resources`` can never run on this machine: each resource that
    cannot fit (its field, with what the machine has of it), or the value placement cannot
    read; empty when they can."""
    try:
        ask = ask_of(resources)
    except AskError as exc:
        return [exc]  # malformed: whatever the machine has
    return misfits(ask, inventory)


def fit_problem(resources: Mapping[str, Any], inventory: Inventory) -> str | None:
    """:func:`fit_problems` as one line (the daemon's refusal), or None."""
    return "; ".join(str(problem) for problem in fit_problems(resources, inventory)) or None


def fit_warnings(resources: Mapping[str, Any], replicas: int, inventory: Inventory) -> list[str]:
    """What ``replicas`` replicas of a spec get less of than they ask (shared CPUs or memory
    beyond the machine, exclusive CPUs for fewer of them): they run, but the user should know."""
    try:
        return share_warnings(ask_of(resources), replicas, inventory)
    except AskError:
        return []  # fit_problem reports it


class Capacity:
    """The inventory and the claims on it, for every controller of one daemon."""

    def __init__(self, store: Store, inventory: Inventory) -> None:
        self.store = store
        self.inventory = inventory
        # replica id -> why it waits (the newest reason); shown by status and /v1/daemon.
        self.waiting: dict[int, str] = {}
        self._watchers: dict[str, Callable[[], None]] = {}

    # -- controllers --------------------------------------------------------------------------

    def watch(self, service: str, wake: Callable[[], None]) -> None:
        self._watchers[service] = wake

    def unwatch(self, service: str) -> None:
        self._watchers.pop(service, None)

    def freed(self) -> None:
        """A claim was let go: every controller looks at its waiting replicas now."""
        for wake in list(self._watchers.values()):
            wake()

    def holders(self, *, without: int | None = None) -> list[Holder]:
        return [
            Holder(service, rid, Claim.from_json(data), number)
            for service, rid, number, data in self.store.held_claims()
            if rid != without
        ]

    def grant(
        self, replica_id: int, resources: Mapping[str, Any], *, making_room: int | None = None
    ) -> Grant | str:
        """The replica's claim (stored before its launch), or why it waits.

        ``making_room``: a replica being retired to make room (a rolling update on a full
        machine): the new claim may take what it holds, and the launch then waits for its
        teardown (:meth:`_contended`), so the device goes to this replica and no other.
        """
        try:
            ask = ask_of(resources)
        except AskError as exc:
            return f"cannot be placed: {exc}"
        if ask.empty:
            self.waiting.pop(replica_id, None)
            return Grant(Claim(), replica_env(Claim(), self.inventory))
        why: list[str] = []

        def choose(held: list[HeldClaim]) -> dict[str, Any] | None:
            holders = [
                Holder(s, rid, Claim.from_json(d), number)
                for s, rid, number, d in held
                if rid != making_room
            ]
            outcome = place(ask, self.inventory, holders)
            if isinstance(outcome, NoFit):
                why.append(outcome.reason)
                return None
            return outcome.to_json()

        data = self.store.claim(replica_id, choose)
        if data is None:
            return why[0] if why else "its row is gone"
        claim = Claim.from_json(data)
        busy = self._contended(replica_id, claim)
        if busy is not None:
            return busy
        self.waiting.pop(replica_id, None)
        return Grant(claim, replica_env(claim, self.inventory))

    def _contended(self, replica_id: int, claim: Claim) -> str | None:
        """Why a stored claim cannot be used yet: something in it is still held by a replica
        being torn down (a claim handed over by :meth:`grant` with ``making_room``)."""
        blockers = _blockers(claim, self.holders(without=replica_id))
        if not blockers:
            return None
        return _making_room(blockers)

    def room(
        self, replica_id: int, resources: Mapping[str, Any], candidates: list[int]
    ) -> int | None:
        """The first of ``candidates`` (replica ids, in the order to prefer) whose claim, once
        free, lets this replica fit; its claim is handed over at once (see :meth:`grant`).

        A replica that holds a claim already gets no second one: if a candidate still holds
        part of it, that is a handover whose retire was lost (a daemon killed between the two
        writes), and that candidate, never another, is the one to retire."""
        try:
            ask = ask_of(resources)
        except AskError:
            return None
        holders = self.holders()
        mine = next((h.claim for h in holders if h.replica_id == replica_id), None)
        if mine is not None:
            others = [h for h in holders if h.replica_id != replica_id]
            held = {h.replica_id for h in _blockers(mine, others)}
            return next((c for c in candidates if c in held), None)
        for candidate in candidates:
            rest = [h for h in holders if h.replica_id != candidate]
            if isinstance(place(ask, self.inventory, rest), Claim):
                granted = self.grant(replica_id, resources, making_room=candidate)
                if isinstance(granted, Grant) or "to make room for it" in granted:
                    # status says so until it launches
                    self.waiting[replica_id] = _making_room(
                        [h for h in holders if h.replica_id == candidate]
                    )
                    return candidate
        return None

    def room_beside(self, resources: Mapping[str, Any], count: int) -> str | None:
        """Why ``count`` more replicas asking ``resources`` cannot all be placed now, next to
        every claim held (None: they can). A blue-green update needs this much room: its old
        replicas keep their claims until enough new ones are READY, so a new version that
        cannot start beside them would wait for ever."""
        try:
            ask = ask_of(resources)
        except AskError as exc:
            return str(exc)
        if ask.empty:
            return None
        holders = self.holders()
        for n in range(count):
            outcome = place(ask, self.inventory, holders)
            if isinstance(outcome, NoFit):
                return f"new replica {n + 1} of {count} {outcome.reason}"
            holders.append(Holder("(new version)", -1 - n, outcome))
        return None

    def room_in_turn(self, service: str, resources: Mapping[str, Any], count: int) -> str | None:
        """Why a rolling update of ``service`` could never bring ``count`` replicas asking
        ``resources`` up on this machine, even retiring its old replicas one at a time before
        each successor (what :meth:`make_room` does when there is no spare room), or None.
        A new replica that needs more than one old replica's devices, or devices another
        service holds, would wait for ever while the old ones serve: the update is refused
        instead, before anything changes."""
        try:
            ask = ask_of(resources)
        except AskError as exc:
            return str(exc)
        if ask.empty:
            return None
        live = [r for r in self.store.replicas(service) if is_live(r)]
        # The old replicas in the order make_room retires them (any version is older).
        order = scale_down_victims(
            live, len(live), current_version=1 + max((r.version for r in live), default=0)
        )
        held = {h.replica_id: h for h in self.holders()}
        gone = {h.replica_id for h in held.values() if h.service == service} - {
            r.id for r in live
        }  # being torn down: their claims are freed whatever the update does
        holders = [h for rid, h in held.items() if rid not in gone]
        old = [held[r.id] for r in order if r.id in held]
        return _in_turn(ask, self.inventory, holders, old, count)

    def note_wait(self, service: str, replica_id: int, reason: str) -> bool:
        """Remember why a replica waits; True when the caller should record the one event of
        this wait (not when the event log has it already: a daemon restarted meanwhile)."""
        first = replica_id not in self.waiting
        self.waiting[replica_id] = reason
        wake = self._watchers.get(service)
        if first and wake is not None:
            wake()  # its controller's next step now: a rolling update may make room for it
        return first and not any(
            e.replica_id == replica_id and e.action == "replica.waiting"
            for e in self.store.events(service)
        )

    def make_room(
        self,
        rows: Sequence[ReplicaRow],
        version: int,
        target: int,
        ready_new: int,
        resources: Mapping[str, Any],
    ) -> tuple[ReplicaRow, ReplicaRow] | None:
        """(old replica to retire, new replica it makes room for) in a rolling update to
        ``version`` on a full machine, or None.

        When a new replica waits for capacity and no other replacement is under way (no
        replica starting, none of the old ones being torn down), the first old replica whose
        claim lets it fit is picked, and that claim is handed over at once (:meth:`room`).
        Surging is impossible without spare capacity; this never deadlocks, and READY is at
        least target - 1 while each replacement starts. Until the new version has a READY
        replica only one old replica is replaced, so a version that never becomes READY
        leaves the others serving.
        """
        waiting = [r for r in rows if r.version == version and r.id in self.waiting]
        starting = [
            r
            for r in rows
            if is_live(r)
            and replica_status(r) is not ReplicaStatus.READY
            and r.id not in self.waiting
        ]
        stopping = [
            r for r in rows if r.version != version and r.teardown_state not in (None, "succeeded")
        ]
        if not waiting or starting or stopping:
            return None
        old = scale_down_victims(
            [r for r in rows if r.version != version and is_live(r)],
            len(rows),
            current_version=version,
        )
        if ready_new == 0 and len(old) < target:
            return None  # one replaced already; the next once the new version proved itself
        new = waiting[0]
        # What it waits for (a device, CPUs, the fixed port it binds): "no spare capacity"
        # alone read as a full machine when a port was the reason.
        why = self.waiting.get(new.id)
        victim = self.room(new.id, resources, [r.id for r in old])
        if victim is None:
            return None
        gone = next(r for r in old if r.id == victim)
        self.store.event(
            gone.service,
            "update.no_room",
            f"no room for version {version} beside the old replicas"
            + (f" ({why})" if why else "")
            + f": replica {gone.seq or gone.id} stops first, then replica {new.seq or new.id} "
            f"starts in its place; {max(0, target - 1)} of {target} serve meanwhile",
            replica_id=gone.id,
        )
        return gone, new

    # -- views --------------------------------------------------------------------------------

    def oversubscribed(self, holders: Sequence[Holder]) -> str | None:
        """``6 CPUs asked of 2``: what live replicas ask beyond the machine in shared CPUs (they
        share the cores; shown by status next to each such replica), or None."""
        asked = sum(h.claim.cpus for h in holders if not h.claim.exclusive)
        reserved = sum(h.claim.cpus for h in holders if h.claim.exclusive)
        if asked + reserved <= self.inventory.cpus + _EPS:
            return None
        return f"{asked + reserved:g} CPUs asked of {self.inventory.cpus:g}"

    def devices(self) -> dict[int, dict[str, Any]]:
        """Per replica id, what it holds or (shared CPUs, memory) asked, for status."""
        out = {}
        holders = self.holders()
        over = self.oversubscribed(holders)
        for h in holders:
            gpus = []
            for address, share in h.claim.gpus.items():
                gpu = self.inventory.gpu(address)
                gpus.append(
                    {
                        "index": gpu.index if gpu else None,
                        "uuid": gpu.uuid if gpu else None,
                        "name": gpu.name if gpu else address,
                        "share": share,
                    }
                )
            out[h.replica_id] = {
                "gpus": sorted(gpus, key=lambda g: (g["index"] is None, g["index"] or 0)),
                "cpus": h.claim.cpus,
                "cpu_ids": list(h.claim.cpu_ids),
                "memory": h.claim.memory,
                "exclusive": h.claim.exclusive,
                "oversubscribed": over if h.claim.cpus and not h.claim.exclusive else None,
            }
        return out

    def view(self) -> dict[str, Any]:
        """The inventory and what holds each part of it (for /v1/daemon)."""
        holders = self.holders()
        gpus = []
        for gpu in self.inventory.gpus:
            held = [
                {"service": h.service, "replica": h.shown, "share": h.claim.gpus[gpu.address]}
                for h in holders
                if gpu.address in h.claim.gpus
            ]
            gpus.append({**gpu.to_json(), "held_by": held})
        pending = {r.id: r for r in self.store.replicas() if r.launch_state == "pending"}
        for rid in [rid for rid in self.waiting if rid not in pending]:
            self.waiting.pop(rid, None)
        waiting = [
            {
                "service": pending[rid].service,
                "replica": pending[rid].seq or rid,  # as status numbers it
                "reason": reason,
            }
            for rid, reason in sorted(self.waiting.items())
        ]
        return {
            **self.inventory.to_json(),
            "gpus": gpus,
            "cpus_held": sum(h.claim.cpus for h in holders if h.claim.exclusive),
            "cpus_asked": sum(h.claim.cpus for h in holders if not h.claim.exclusive),
            "memory_asked": sum(h.claim.memory for h in holders),
            "warnings": [w for w in (self.oversubscribed(holders),) if w],
            "waiting": waiting,
        }

    def metrics(self) -> bytes:
        """``corral_gpu_held`` per device and holder, and ``corral_gpu_free`` per device."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_GpuCollector(self.inventory, self.holders()))
        return generate_latest(registry)


def _making_room(blockers: Sequence[Holder]) -> str:
    """Why a replica waits for what an old replica retired for it holds."""
    names = ", ".join(f"{h.service} replica {h.shown}" for h in blockers)
    return (
        f"no spare room: waits for {names} to stop (retired to make room for it: a rolling "
        "update on a full machine replaces one replica at a time)"
    )


def _in_turn(
    ask: Ask, inventory: Inventory, holders: list[Holder], old: list[Holder], count: int
) -> str | None:
    """A rolling update played out on the claims: before each new replica, the old ones beyond
    ``count`` minus the new ones already up are retired (as the plan does once they are READY);
    a new replica that does not fit beside the rest takes the claim of the first old replica
    whose claim is enough. Why the n-th new replica could not be placed that way, or None."""
    holders, old = list(holders), list(old)
    for n in range(count):
        while len(old) > count - n:
            holders.remove(old.pop(0))
        outcome = place(ask, inventory, holders)
        if isinstance(outcome, NoFit):
            for victim in old:
                rest = [h for h in holders if h is not victim]
                if isinstance(place(ask, inventory, rest), Claim):
                    old.remove(victim)
                    holders = rest
                    break
            else:
                # What it would meet with one old replica retired: that is all a rolling
                # update frees before a successor starts.
                rest = [h for h in holders if not old or h is not old[0]]
                best = place(ask, inventory, rest)
                why = best.reason if isinstance(best, NoFit) else outcome.reason
                return f"new replica {n + 1} of {count} {why}"
            outcome = place(ask, inventory, holders)
            assert isinstance(outcome, Claim)
        holders.append(Holder("(new version)", -1 - n, outcome))
    return None


def _blockers(claim: Claim, others: Sequence[Holder]) -> list[Holder]:
    """The holders that keep ``claim`` from being used: a device shared beyond its whole, a
    pinned CPU or a fixed port held twice (only a handed-over claim overlaps a live one)."""
    used: dict[str, float] = {}
    for h in others:
        for address, share in h.claim.gpus.items():
            used[address] = used.get(address, 0.0) + share
    return [
        h
        for h in others
        if any(
            a in h.claim.gpus and used[a] + share > 1.0 + _EPS for a, share in claim.gpus.items()
        )
        or set(h.claim.cpu_ids) & set(claim.cpu_ids)
        or set(h.claim.ports) & set(claim.ports)
    ]


class _GpuCollector(Collector):
    def __init__(self, inventory: Inventory, holders: list[Holder]) -> None:
        self.inventory = inventory
        self.holders = holders

    def collect(self) -> Iterator[Metric]:
        labels = ["gpu", "uuid", "model"]
        held = GaugeMetricFamily(
            "corral_gpu_held",
            "Share of a GPU held by a replica (1: the whole device).",
            labels=[*labels, "service", "replica"],
        )
        free = GaugeMetricFamily(
            "corral_gpu_free", "Share of a GPU no replica holds.", labels=labels
        )
        for gpu in self.inventory.gpus:
            device = [str(gpu.index), gpu.uuid or "", gpu.name]
            used = 0.0
            for h in self.holders:
                share = h.claim.gpus.get(gpu.address)
                if share:
                    used += share
                    held.add_metric([*device, h.service, str(h.shown)], share)
            free.add_metric(device, max(0.0, 1.0 - used))
        yield from (held, free)
