"""What the machine the daemon runs on has to give replicas: GPUs, CPUs and memory.

Read once when the daemon starts (and by ``corral validate``, the same way), from:

* NVML (``nvidia-ml-py``, imported as ``pynvml``): each GPU's index, UUID, product name and
  memory. A machine without the library, the driver or a GPU is a machine with no GPU: every
  ``NVMLError`` and a missing module end in "no GPUs seen" with the reason kept for display,
  never in a daemon that does not start.
* A declared file, ``CORRAL_INVENTORY=/path/inventory.yaml`` (YAML or JSON), that replaces what
  NVML sees: for devices NVML cannot see (a container without the driver mounted, a test
  machine) or to describe the machine differently. Its GPUs, ``cpus`` and ``memory`` are all
  optional; what it leaves out is read from the machine.
* A selection, ``CORRAL_GPUS`` (``corral daemon run --gpus``): ``0,1,4`` (indices or UUIDs of
  the GPUs seen) keeps only those for corral, so the rest stay free for other work;
  ``none`` gives corral no GPU at all.

CPUs are the daemon's own affinity set (what its replicas may run on), memory is psutil's
total. A declared ``cpus`` count is for accounting only: it may not name real CPUs, so replicas
are then not pinned (see :mod:`corral.infra.placement`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from corral.infra._ray_resources import parse_memory

__all__ = ["Gpu", "Inventory", "InventoryError", "load_inventory", "read_nvml"]

ENV_FILE = "CORRAL_INVENTORY"
ENV_SELECT = "CORRAL_GPUS"


class InventoryError(ValueError):
    """A declared inventory or GPU selection that cannot be used (named in the message)."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str  # the product name NVML reports, e.g. "NVIDIA A100-SXM4-80GB"
    uuid: str | None = None
    memory: int | None = None  # bytes

    @property
    def address(self) -> str:
        """How a replica is told about this device (``CUDA_VISIBLE_DEVICES``): the UUID when
        known, because CUDA's indices follow NVML's only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
        while a UUID names the same device to every library."""
        return self.uuid or str(self.index)

    def describe(self) -> str:
        size = f", {self.memory / 1024**3:.0f} GiB" if self.memory else ""
        return f"{self.index}: {self.name}{size}"

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "memory": self.memory}


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    cpus: float
    memory: int  # bytes
    # Real CPU ids replicas can be pinned to; empty when ``cpus`` was declared (accounting only).
    cpu_ids: tuple[int, ...] = ()
    source: str = "machine"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # A GPU selection was given (``CORRAL_GPUS``, ``--gpus``; ``none`` too): the machine has GPUs
    # that are not corral's, so a replica without a claim must be told it has none.
    selected: bool = False

    def gpu(self, address: str) -> Gpu | None:
        return next((g for g in self.gpus if g.address == address), None)

    def gpu_summary(self) -> str:
        """``2x NVIDIA A100-SXM4-80GB 80 GiB, 2x NVIDIA L4 24 GiB``: the models, for a refusal
        that needs them (one entry per model and size, not per device: a refusal stays a line)."""
        counts: dict[str, int] = {}
        for g in self.gpus:
            size = f" {g.memory / 1024**3:.0f} GiB" if g.memory else ""
            counts[g.name + size] = counts.get(g.name + size, 0) + 1
        return ", ".join(f"{n}x {model}" for model, n in counts.items()) or "none"

    def describe(self) -> str:
        """One line for the daemon's log: every device, what a spec is checked against."""
        gpus = "; ".join(g.describe() for g in self.gpus) if self.gpus else "none"
        return (
            f"GPUs: {gpus}; CPUs: {self.cpus:g}; memory: {self.memory / 1024**3:.1f} GiB "
            f"(inventory from {self.source})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gpus": [g.to_json() for g in self.gpus],
            "cpus": self.cpus,
            "cpu_ids": list(self.cpu_ids),
            "memory": self.memory,
            "notes": list(self.notes),
        }


def read_nvml() -> tuple[list[Gpu], str]:
    """The GPUs NVML sees, and where they came from (or why there are none)."""
    try:
        import pynvml
    except ImportError as exc:
        return [], f"no NVML library ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable ({exc})"
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            device = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                Gpu(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(device)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(device)),
                    memory=int(pynvml.nvmlDeviceGetMemoryInfo(device).total),
                )
            )
        return gpus, "NVML"
    except pynvml.NVMLError as exc:
        return [], f"NVML failed while listing devices ({exc})"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load_inventory(environ: Mapping[str, str] | None = None) -> Inventory:
    """The inventory the daemon (or ``corral validate``) works with; InventoryError names what
    in ``CORRAL_INVENTORY`` / ``CORRAL_GPUS`` is wrong."""
    env = os.environ if environ is None else environ
    cpu_ids = tuple(sorted(os.sched_getaffinity(0)))
    cpus: float = float(len(cpu_ids))
    memory = int(psutil.virtual_memory().total)
    notes: list[str] = []
    path = env.get(ENV_FILE)
    declared: dict[str, Any] = {}
    if path:
        declared = _read_file(Path(path))
    if "gpus" in declared:
        gpus = _declared_gpus(declared["gpus"], path or "")
        source = f"{ENV_FILE}={path}"
    else:
        gpus, seen = read_nvml()
        source = f"{ENV_FILE}={path} (GPUs: {seen})" if path else f"this machine (GPUs: {seen})"
    if "cpus" in declared:
        cpus = _positive(declared["cpus"], f"{path}: cpus")
        cpu_ids = ()
        notes.append("cpus declared: accounted only, replicas are not pinned")
    if "memory" in declared:
        try:
            memory = parse_memory(str(declared["memory"]))
        except ValueError as exc:
            raise InventoryError(f"{path}: {exc}") from None
    selection = (env.get(ENV_SELECT) or "").strip() or None
    if selection is not None:
        gpus = _select(gpus, selection)
        source += f", {ENV_SELECT}={selection}"
    return Inventory(
        tuple(gpus), cpus, memory, cpu_ids, source, tuple(notes), selected=selection is not None
    )


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open() as stream:  # a stream, so YAML's errors name the file's path
            data = yaml.safe_load(stream)
    except OSError as exc:
        raise InventoryError(f"{ENV_FILE}: cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{ENV_FILE}: {path} is not YAML or JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InventoryError(f"{path}: expected a mapping with gpus, cpus, memory")
    unknown = sorted(set(data) - {"gpus", "cpus", "memory"})
    if unknown:
        shown = ", ".join(unknown)
        raise InventoryError(f"{path}: unknown field(s) {shown}; use gpus, cpus, memory")
    return data


def _declared_gpus(items: Any, path: str) -> list[Gpu]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise InventoryError(f"{path}: gpus: expected a list of devices, got {items!r}")
    gpus: list[Gpu] = []
    for position, item in enumerate(items):
        where = f"{path}: gpus[{position}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InventoryError(f"{where}: expected a device with a name, got {item!r}")
        unknown = sorted(set(item) - {"name", "index", "uuid", "memory"})
        if unknown:
            raise InventoryError(f"{where}: unknown field(s) {', '.join(unknown)}")
        index = item.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise InventoryError(f"{where}.index: expected a whole number >= 0, got {index!r}")
        uuid = item.get("uuid")
        if uuid is not None and not (isinstance(uuid, str) and uuid.strip()):
            raise InventoryError(f"{where}.uuid: expected text, got {uuid!r}")
        memory = None
        if item.get("memory") is not None:
            try:
                memory = parse_memory(str(item["memory"]))
            except ValueError as exc:
                raise InventoryError(f"{where}.{exc}") from None
        gpus.append(Gpu(index, item["name"].strip(), uuid.strip() if uuid else None, memory))
    addresses = [g.address for g in gpus]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise InventoryError(f"{path}: gpus: the same device twice: {', '.join(duplicates)}")
    return gpus


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
        raise InventoryError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _select(gpus: list[Gpu], selection: str) -> list[Gpu]:
    """``CORRAL_GPUS``: ``none``, or indices/UUIDs of the GPUs seen, comma-separated."""
    if selection.lower() == "none":
        return []
    wanted = [part.strip() for part in selection.split(",") if part.strip()]
    chosen: list[Gpu] = []
    for part in wanted:
        gpu = next((g for g in gpus if part in (str(g.index), g.uuid)), None)
        if gpu is None:
            seen = ", ".join(g.describe() for g in gpus) or "none"
            raise InventoryError(
                f"{ENV_SELECT} (--gpus): no GPU {part!r} on this machine; seen: {seen}"
            )
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen
