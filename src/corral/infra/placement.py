"""Where a replica fits on this machine: a spec's ``resources`` against the inventory and what
the other replicas hold. Pure (no I/O, no clock), so every rule is tested from a table.

Matching a model name (``A100:1``) to a device (NVML's "NVIDIA A100-SXM4-80GB"):

* Both are cut into tokens at spaces, ``-``, ``_`` and ``/``, upper-cased; sizes are written
  one way (``80G``, ``80GiB`` -> ``80GB``). Every token of the ask must be a token of the device
  name, or two neighbouring tokens joined (``RTX4090`` is "GeForce RTX 4090"). So ``H100``
  matches "NVIDIA H100 80GB HBM3", ``A100-80GB`` matches "NVIDIA A100-SXM4-80GB" and "NVIDIA
  A100 80GB PCIe" but not "NVIDIA A100-SXM4-40GB", and ``A10`` never matches an ``A10G`` or an
  ``A100``. A size the device name lacks is compared with the device's memory (within 10 %).
* ``A100`` (no size) matches every A100. Among the free devices that match, the smallest memory
  is taken first, so a plain ``A100`` ask takes a 40 GB card before an 80 GB one and leaves the
  80 GB cards to the asks that need them; when only 80 GB cards are free, it takes one.
* ``GPU:N`` matches any device.

Counts: a whole number takes that many devices nobody else holds; a fraction below 1
(``A100:0.5``) takes that share of one device, next to other fractional asks (the fullest
device that still has room first, so whole devices stay whole). Anything else (``A100:1.5``) is
refused. A set or list of options (``{L4, A100}:1``, ``[A100:1, L4:2]``) is tried in the order
written; the first that fits now is taken.

``cpus`` and ``memory`` are soft asks, a share of the machine: SkyPilot's ``cpus: 2+`` sizes a
VM ("at least 2"), and on one machine replicas share its cores and memory the way processes
do, so these asks never make a replica wait and are never pinned; what the replicas ask beyond
the machine is a warning (:func:`share_warnings`), not a refusal. Only memory one replica asks
beyond the whole machine is refused: it could never have it. Reserved CPUs are corral's
explicit extension, ``resources.cpu_pinning: exclusive``: that many whole CPUs no other
exclusive replica holds (pinned to their ids when the inventory has real ones), and the
replica waits until they are free.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.figures import gib
from corral.infra._ray_resources import parse_cpus, parse_memory
from corral.infra.inventory import Gpu, Inventory

__all__ = [
    "Ask",
    "AskError",
    "Claim",
    "Holder",
    "NoFit",
    "Option",
    "ask_of",
    "misfits",
    "model_matches",
    "place",
    "share_warnings",
]

ANY_GPU = "GPU"
_EPS = 1e-9
_SIZE_RE = re.compile(r"(\d+)G(?:I?B)?")


class AskError(ValueError):
    """A ``resources`` value placement cannot use; ``field`` is its path in the spec."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class Option:
    model: str  # as the spec writes it ("A100-80GB"), or "GPU" for any device
    count: float

    def describe(self) -> str:
        model = "GPU (any model)" if self.model.upper() == ANY_GPU else self.model
        if self.count < 1:
            return f"{self.count:g} of one {model}"
        return f"{self.count:g}x {model}"


@dataclass(frozen=True)
class Ask:
    options: tuple[Option, ...] = ()
    cpus: float = 0.0
    memory: int = 0
    exclusive: bool = False  # cpus are reserved (resources.cpu_pinning: exclusive), not shared
    ports: tuple[int, ...] = ()  # bound by the replica itself (a fixed port): one holder each

    @property
    def empty(self) -> bool:
        return not self.options and not self.cpus and not self.memory and not self.ports


@dataclass(frozen=True)
class Claim:
    """What one replica holds; stored as JSON with its row before it is launched."""

    gpus: Mapping[str, float] = field(default_factory=dict)  # device address -> share (1: whole)
    cpus: float = 0.0
    memory: int = 0
    cpu_ids: tuple[int, ...] = ()
    option: str | None = None  # the option that was taken, as the spec wrote it
    exclusive: bool = False  # ``cpus`` reserved; otherwise cpus and memory are only asked
    ports: tuple[int, ...] = ()  # fixed ports it binds, no other replica's meanwhile

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": dict(self.gpus),
            "cpus": self.cpus,
            "memory": self.memory,
            "cpu_ids": list(self.cpu_ids),
            "option": self.option,
            "exclusive": self.exclusive,
            "ports": list(self.ports),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Claim:
        cpu_ids = tuple(int(c) for c in data.get("cpu_ids") or ())
        return cls(
            gpus={str(k): float(v) for k, v in dict(data.get("gpus") or {}).items()},
            cpus=float(data.get("cpus") or 0.0),
            memory=int(data.get("memory") or 0),
            cpu_ids=cpu_ids,
            option=data.get("option"),
            # A claim stored before the flag existed was exclusive when it was pinned.
            exclusive=bool(data.get("exclusive", bool(cpu_ids))),
            ports=tuple(int(p) for p in data.get("ports") or ()),
        )


@dataclass(frozen=True)
class Holder:
    """A replica that holds a claim (alive, or not yet torn down)."""

    service: str
    replica_id: int
    claim: Claim
    number: int | None = None  # its number within the service, what users see

    @property
    def shown(self) -> int:
        return self.number if self.number is not None else self.replica_id


@dataclass(frozen=True)
class NoFit:
    reason: str


def ask_of(resources: Mapping[str, Any]) -> Ask:
    """A spec's ``resources`` (``Resources.model_dump()``) as an :class:`Ask`; AskError names
    the field of a value placement cannot use."""
    options = []
    for text in resources.get("accelerators") or ():
        name, _, count_text = str(text).partition(":")
        try:
            count = float(count_text) if count_text else 1.0
        except ValueError:
            raise AskError("resources.accelerators", f"bad count in {text!r}") from None
        if not (0 < count < math.inf) or (count > 1 and not count.is_integer()):
            raise AskError(
                "resources.accelerators",
                f"{text!r}: a count is a whole number of devices, or a fraction below 1 of "
                "one device (A100:0.5)",
            )
        options.append(Option(name.strip(), count))
    cpus = 0.0
    if resources.get("cpus") is not None:
        try:
            cpus = parse_cpus(str(resources["cpus"]))
        except ValueError as exc:
            raise AskError("resources.cpus", str(exc).partition(": ")[2]) from None
    memory = 0
    if resources.get("memory") is not None:
        try:
            memory = parse_memory(str(resources["memory"]))
        except ValueError as exc:
            raise AskError("resources.memory", str(exc).partition(": ")[2]) from None
    exclusive = _exclusive(resources.get("cpu_pinning"), cpus)
    port = resources.get("fixed_port")  # corral.infra.local_rules.claim_resources adds it
    return Ask(tuple(options), cpus, memory, exclusive, (int(port),) if port else ())


def _exclusive(pinning: Any, cpus: float) -> bool:
    """Whether ``cpus`` are reserved: only when the spec says so, and then in whole CPUs (a
    fraction of a CPU cannot be anyone's alone)."""
    if pinning in (None, "shared"):
        return False
    if pinning != "exclusive":
        raise AskError("resources.cpu_pinning", f"expected shared or exclusive, got {pinning!r}")
    if not cpus:
        raise AskError("resources.cpu_pinning", "exclusive needs `cpus`: how many whole CPUs")
    if not cpus.is_integer():
        raise AskError("resources.cpus", f"exclusive CPUs are whole CPUs, got {cpus:g}")
    return True


@functools.lru_cache(maxsize=4096)
def _tokens(text: str) -> tuple[str, ...]:
    """Cached: placement asks the same few names again on every reconcile step."""
    out = []
    for token in re.split(r"[\s\-_/]+", text.upper()):
        if not token:
            continue
        size = _SIZE_RE.fullmatch(token)
        out.append(f"{size.group(1)}GB" if size else token)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _name_pool(name: str) -> tuple[frozenset[str], bool]:
    """A device name's tokens and neighbouring pairs, and whether it names a size."""
    have = _tokens(name)
    pool = frozenset(have) | {a + b for a, b in itertools.pairwise(have)}
    return pool, any(_SIZE_RE.fullmatch(t) for t in have)


def model_matches(model: str, gpu: Gpu) -> bool:
    """Whether an ask's model name (``H100``, ``A100-80GB``, ``GPU``) names this device."""
    if model.strip().upper() == ANY_GPU:
        return True
    pool, named_size = _name_pool(gpu.name)
    for token in _tokens(model):
        if token in pool:
            continue
        size = _SIZE_RE.fullmatch(token)
        if size and not named_size and gpu.memory:
            wanted = float(size.group(1))
            if abs(gpu.memory / 1024**3 - wanted) <= 0.1 * wanted:
                continue
        return False
    return True


def _used(holders: Iterable[Holder]) -> dict[str, float]:
    used: dict[str, float] = {}
    for holder in holders:
        for address, share in holder.claim.gpus.items():
            used[address] = used.get(address, 0.0) + share
    return used


def _choose(option: Option, gpus: Sequence[Gpu], used: Mapping[str, float]) -> dict[str, float]:
    """The devices this option takes now, or {} when it does not fit."""
    matching = sorted(
        (g for g in gpus if model_matches(option.model, g)),
        key=lambda g: (g.memory or 0, g.index),
    )
    if option.count < 1:
        room = [g for g in matching if 1.0 - used.get(g.address, 0.0) >= option.count - _EPS]
        if not room:
            return {}
        fullest = min(room, key=lambda g: 1.0 - used.get(g.address, 0.0))
        return {fullest.address: option.count}
    free = [g for g in matching if used.get(g.address, 0.0) <= _EPS]
    wanted = int(option.count)
    return {g.address: 1.0 for g in free[:wanted]} if len(free) >= wanted else {}


def place(ask: Ask, inventory: Inventory, holders: Sequence[Holder]) -> Claim | NoFit:
    """What ``ask`` gets now, next to ``holders``, or why it must wait (naming who holds what).

    Only GPUs, exclusive CPUs and a fixed port can make it wait: shared ``cpus`` and
    ``memory`` are recorded (shown in status) but hold nothing back (module docstring)."""
    bound = [h for h in holders if set(h.claim.ports) & set(ask.ports)]
    if bound:
        ports = ", ".join(
            str(p) for p in sorted(set(ask.ports) & {p for h in bound for p in h.claim.ports})
        )
        return NoFit(
            f"binds port {ports} itself (its `run` ignores $PORT), which {_replicas(bound)} "
            "holds: one process at a time can bind it"
        )
    reserved = [h for h in holders if h.claim.exclusive and h.claim.cpus]
    cpus_used = sum(h.claim.cpus for h in reserved)
    if ask.exclusive and cpus_used + ask.cpus > inventory.cpus + _EPS:
        return NoFit(
            f"needs {ask.cpus:g} CPUs of its own; the machine has {inventory.cpus:g}, "
            f"{max(0.0, inventory.cpus - cpus_used):g} not reserved "
            f"({_held_by(reserved, lambda h: f'{h.claim.cpus:g}')})"
        )
    gpus: dict[str, float] = {}
    taken: Option | None = None
    if ask.options:
        used = _used(holders)
        for option in ask.options:
            gpus = _choose(option, inventory.gpus, used)
            if gpus:
                taken = option
                break
        else:
            wants = " or ".join(o.describe() for o in ask.options)
            why = "; ".join(_why_not(o, inventory, holders) for o in ask.options)
            return NoFit(f"needs {wants}; {why}")
    return Claim(
        gpus=gpus,
        cpus=ask.cpus,
        memory=ask.memory,
        cpu_ids=_pin(ask.cpus, inventory, reserved) if ask.exclusive else (),
        option=f"{taken.model}:{taken.count:g}" if taken else None,
        exclusive=ask.exclusive,
        ports=ask.ports,
    )


def _pin(cpus: float, inventory: Inventory, holders: Sequence[Holder]) -> tuple[int, ...]:
    """CPU ids for an exclusive ``cpus`` ask (none on a declared CPU count: it names no CPU)."""
    if not cpus or not cpus.is_integer() or not inventory.cpu_ids:
        return ()
    pinned = {c for h in holders for c in h.claim.cpu_ids}
    free = [c for c in inventory.cpu_ids if c not in pinned]
    return tuple(free[: int(cpus)]) if len(free) >= cpus else ()


def _why_not(option: Option, inventory: Inventory, holders: Sequence[Holder]) -> str:
    matching = [g for g in inventory.gpus if model_matches(option.model, g)]
    model = option.model
    if option.model.upper() == ANY_GPU:
        model = "GPU" if len(matching) == 1 else "GPUs"
    if not matching:
        return f"the machine has no {model}"
    if option.count > len(matching):
        return f"the machine has {len(matching)} {model}"
    addresses = {g.address for g in matching}
    holding = [h for h in holders if addresses & set(h.claim.gpus)]
    used = _used(holding)
    busy = sum(1 for a in addresses if used.get(a, 0.0) > _EPS)
    if busy == len(matching):
        every = {1: "it is", 2: "both"}.get(len(matching), f"all {len(matching)}")
        return f"the machine has {len(matching)} {model}, {every} held by {_replicas(holding)}"
    return (
        f"the machine has {len(matching)} {model}, {len(matching) - busy} free, "
        f"{busy} held by {_replicas(holding)}"
    )


def _replicas(holders: Sequence[Holder]) -> str:
    """``svc-a replicas 1 and 2, svc-b replica 5``"""
    by_service: dict[str, list[int]] = {}
    for h in holders:
        by_service.setdefault(h.service, []).append(h.shown)
    parts = []
    for service, ids in by_service.items():
        ids = sorted(ids)
        if len(ids) == 1:
            parts.append(f"{service} replica {ids[0]}")
        else:
            shown = ", ".join(map(str, ids[:-1])) + f" and {ids[-1]}"
            parts.append(f"{service} replicas {shown}")
    return ", ".join(parts) if parts else "nobody"


def _held_by(holders: Sequence[Holder], amount: Any) -> str:
    if not holders:
        return "nothing held"
    return "held: " + ", ".join(f"{amount(h)} by {h.service} replica {h.shown}" for h in holders)


def misfits(ask: Ask, inventory: Inventory) -> list[AskError]:
    """Why ``ask`` cannot fit even on this machine with nothing running, each naming the field
    and what the machine has of that resource (not every device: a refusal stays one line), and
    which inventory that was; empty when it can.

    Every resource that cannot fit, not the first: a spec that asks too much memory and a GPU
    the machine lacks must hear both at once, or fixing the memory only reveals the GPU at the
    next `validate` (SkyServe's llama2 example asks `memory: 32+` and a T4)."""
    source = f"(inventory from {inventory.source})"
    problems = []
    if ask.exclusive and ask.cpus > inventory.cpus + _EPS:
        problems.append(
            AskError(
                "resources.cpus",
                f"needs {ask.cpus:g} CPUs of its own; the machine has {inventory.cpus:g} {source}",
            )
        )
    if ask.memory > inventory.memory:
        problems.append(
            AskError(
                "resources.memory",
                f"needs {gib(ask.memory)}; the machine has {gib(inventory.memory)} {source}",
            )
        )
    if ask.options and not any(_choose(o, inventory.gpus, {}) for o in ask.options):
        wants = " or ".join(o.describe() for o in ask.options)
        # Once each: `{A100:4, A100:8}` lacks the same model twice, and says it once.
        why = "; ".join(dict.fromkeys(_why_not(o, inventory, ()) for o in ask.options))
        problems.append(
            AskError(
                "resources.accelerators",
                f"needs {wants}: {why}; its GPUs: {inventory.gpu_summary()} {source}",
            )
        )
    return problems


def share_warnings(ask: Ask, replicas: int, inventory: Inventory) -> list[str]:
    """What ``replicas`` replicas asking ``ask`` will get, where it is less than they ask: shared
    CPUs or memory asked beyond the machine (they share what there is), or exclusive CPUs for
    fewer replicas than asked (the others wait). Warnings, shown by ``validate``: the spec runs."""
    out = []
    count = f"{replicas} replica{'s' if replicas != 1 else ''}"
    if ask.cpus and ask.exclusive and replicas * ask.cpus > inventory.cpus + _EPS:
        fit = int((inventory.cpus + _EPS) // ask.cpus)
        out.append(
            f"resources.cpus: {count} x {ask.cpus:g} CPUs of their own, the machine has "
            f"{inventory.cpus:g}: {fit} run at once, the others wait for CPUs"
        )
    elif ask.cpus and replicas * ask.cpus > inventory.cpus + _EPS:
        out.append(
            f"resources.cpus: {count} x {ask.cpus:g} CPUs asked, the machine has "
            f"{inventory.cpus:g}: they share them (a soft ask, not reserved; "
            "`resources.cpu_pinning: exclusive` reserves whole CPUs, and then replicas wait)"
        )
    if ask.memory and replicas * ask.memory > inventory.memory:
        out.append(
            f"resources.memory: {count} x {gib(ask.memory)} asked, the machine has "
            f"{gib(inventory.memory)}: they share it (a soft ask: nothing reserves or limits it)"
        )
    return out
