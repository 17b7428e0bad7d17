"""How a spec's ``resources`` become a Ray actor's resource request and placement.

Kept apart from :mod:`corral.infra.ray` and free of Ray imports so the mapping is unit-tested
(and its errors shown) without a cluster. The rules, and why:

* ``cpus: 2`` -> ``num_cpus=2``. SkyPilot's ``"2+"`` ("at least 2") has no Ray equivalent, so
  the minimum is requested. Without ``cpus``, ``num_cpus=0.01`` (:data:`DEFAULT_CPUS`): next to
  nothing held, like Ray's actor default (1 CPU to be placed, 0 held), but placement never waits
  for a whole free CPU (measured: while other actors were being created, Ray moved replicas off
  their chosen node for want of one). Not 0: Ray ignored the soft node affinity of actors that
  ask for no resource at all (measured: 1 of 6 on the chosen node; 6 of 6 with 0.01). Nodes
  without any CPU (a head started with ``--num-cpus=0``) get no replica.
* ``memory: 16`` (GiB, as in SkyPilot), ``"512MB"``, ``"2GiB"``, ``"32+"`` -> ``memory=<bytes>``
  (Ray's logical memory resource: used for placement, not enforced).
* ``accelerators``: ``GPU:N`` -> ``num_gpus=N``; a known GPU model (``A100:2``) ->
  ``num_gpus=2`` plus ``accelerator_type="A100"`` (the label Ray puts on such nodes); any other
  name is a Ray **custom resource** (``node-2:1`` -> ``resources={"node-2": 1}``). That is how a
  replica is pinned: give the node a custom resource (``ray start --resources '{"node-2": 100}'``)
  and ask for a little of it. The spec's list holds alternatives (SkyPilot's any-of); Ray takes one
  request, so the first option is used and the others are reported.
* ``labels: {key: value}`` -> ``label_selector`` (node labels, Ray >= 2.49; ``ray start --labels``),
  the other way to choose nodes.
* Placement strategy: :class:`corral.infra.ray.RayInfra` prefers, by soft node affinity, the
  node holding the fewest replicas of the service (replicas on different nodes survive one
  node's loss); ``SPREAD``, set here, is the fallback when no node can be chosen up front.
* Cloud placement fields (``cloud``, ``region``, ``instance_type``, ``use_spot``, ...) mean
  nothing to a running cluster: reported as ignored, never silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_CPUS",
    "GPU_MODELS",
    "RayPlacement",
    "parse_cpus",
    "parse_memory",
    "ray_options",
]

# GPU models SkyPilot specs name and Ray labels nodes with (``accelerator_type:<model>``).
GPU_MODELS = frozenset(
    {
        "A10",
        "A100",
        "A100-80G",
        "A10G",
        "B200",
        "H100",
        "H200",
        "K80",
        "L4",
        "L40",
        "L40S",
        "P100",
        "P4",
        "T4",
        "V100",
    }
)

# CPUs requested for a replica whose spec says nothing (see the module docstring).
DEFAULT_CPUS = 0.01

_NUMBER_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)(B?)\+?", re.IGNORECASE)
_UNITS = {"": 1024**3, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}

# Resource fields this module interprets; ``ports`` is handled by the backend itself.
_HANDLED = frozenset({"cpus", "memory", "accelerators", "labels", "ports", "cpu_pinning"})


@dataclass(frozen=True)
class RayPlacement:
    """Keyword arguments for ``ActorClass.options()`` and what could not be honoured exactly."""

    options: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def parse_cpus(text: str) -> float:
    """``"2"``, ``"0.5"``, ``"4+"`` -> the CPU count to request (the minimum for ``N+``)."""
    value = text.strip().rstrip("+").strip()
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"cpus: expected a number like 2 or '4+', got {text!r}") from None
    if number <= 0:
        raise ValueError(f"cpus: expected a positive number, got {text!r}")
    return number


def parse_memory(text: str) -> int:
    """A memory size in bytes: a bare number is GiB (SkyPilot's unit), units are binary."""
    match = _NUMBER_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"memory: expected a size like 16, '16GB' or '512MiB', got {text!r}")
    number = float(match.group(1))
    unit = match.group(2).upper()
    scale = 1 if not unit and match.group(4) else _UNITS[unit]  # "512B": bytes
    size = int(number * scale)
    if size <= 0:
        raise ValueError(f"memory: expected a positive size, got {text!r}")
    return size


def _accelerator(option: str) -> tuple[str, float]:
    name, _, count = option.partition(":")
    try:
        number = float(count) if count else 1.0
    except ValueError:
        raise ValueError(f"accelerators: bad count in {option!r}") from None
    if not name or number <= 0:
        raise ValueError(f"accelerators: expected NAME or NAME:COUNT, got {option!r}")
    return name, number


def ray_options(resources: Mapping[str, Any]) -> RayPlacement:
    """Map a spec's ``resources`` (``Resources.model_dump(exclude_none=True)``) to Ray options.

    Raises ValueError for values Ray cannot express, before anything is created on the cluster.
    """
    options: dict[str, Any] = {"scheduling_strategy": "SPREAD"}
    notes: list[str] = []
    custom: dict[str, float] = {}

    cpus = resources.get("cpus")
    options["num_cpus"] = DEFAULT_CPUS
    if cpus is not None:
        options["num_cpus"] = parse_cpus(str(cpus))
        if str(cpus).strip().endswith("+"):
            notes.append(f"cpus {cpus!r}: Ray cannot ask for 'at least'; asking the minimum")
    if resources.get("cpu_pinning") == "exclusive":
        # Ray's num_cpus is already a reservation on the node; nothing pins the actor to cores.
        notes.append("cpu_pinning 'exclusive': Ray reserves num_cpus but pins no CPU")
    memory = resources.get("memory")
    if memory is not None:
        options["memory"] = parse_memory(str(memory))
        if str(memory).strip().endswith("+"):
            notes.append(f"memory {memory!r}: Ray cannot ask for 'at least'; asking the minimum")

    accelerators = list(resources.get("accelerators") or [])
    if accelerators:
        if len(accelerators) > 1:
            notes.append(
                f"accelerators {accelerators}: Ray takes one request; using {accelerators[0]!r}"
            )
        name, count = _accelerator(str(accelerators[0]))
        if name.upper() == "GPU":
            options["num_gpus"] = count
        elif name.upper() in GPU_MODELS:
            options["num_gpus"] = count
            options["accelerator_type"] = name.upper()
        else:
            custom[name] = count
    if custom:
        options["resources"] = custom

    labels = resources.get("labels")
    if labels is not None:
        if not isinstance(labels, Mapping) or not labels:
            raise ValueError(f"labels: expected a mapping of node labels, got {labels!r}")
        options["label_selector"] = {str(k): str(v) for k, v in labels.items()}

    ignored = sorted(k for k in resources if k not in _HANDLED and resources[k] not in (None, []))
    if ignored:
        notes.append(f"ignored on Ray (they choose machines, not nodes): {', '.join(ignored)}")
    return RayPlacement(options, notes)
