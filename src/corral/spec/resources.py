"""``resources:``: what one replica needs, in every form SkyPilot accepts."""

import math
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from corral.spec.section import Section
from corral.spec.values import PortRange, positive_number, show

_CPUS_RE = re.compile(r"\d+(?:\.\d+)?\+?")
_MEMORY_RE = re.compile(r"\d+(?:\.\d+)?\s*(?:[KMGTP]i?B?|B)?\+?", re.IGNORECASE)
_ACCEL_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)(?::(\d+(?:\.\d+)?))?")


class Resources(Section):
    """What one replica needs: ``ports``, and ``accelerators``/``cpus``/``memory`` placed on the
    local machine's inventory (docs/gpus.md) or asked of Ray."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "cloud",
        "region",
        "zone",
        "infra",
        "instance_type",
        "use_spot",
        "disk_size",
        "disk_tier",
        "network_tier",
        "local_disk",
        "image_id",
        "any_of",
        "ordered",
        "labels",
        "autostop",
        "job_recovery",
        "spot_recovery",
        "volumes",
        "max_hourly_cost",
        "accelerator_args",
        "priority",
        "priority_class",
        "ephemeral_storage",
    )

    ports: list[PortRange] = Field(default_factory=list)
    cpus: str | None = None
    memory: str | None = None
    accelerators: list[str] = Field(default_factory=list)
    # corral's own: ``cpus`` is a share of the machine (SkyPilot's sizing ask) unless this says
    # ``exclusive``: whole CPUs reserved and pinned, the replica waiting until they are free.
    cpu_pinning: Literal["shared", "exclusive"] | None = None

    cloud: Any = None
    region: Any = None
    zone: Any = None
    infra: Any = None
    instance_type: Any = None
    use_spot: Any = None
    disk_size: Any = None
    disk_tier: Any = None
    network_tier: Any = None
    local_disk: Any = None
    image_id: Any = None
    any_of: Any = None
    ordered: Any = None
    labels: Any = None
    autostop: Any = None
    job_recovery: Any = None
    spot_recovery: Any = None
    volumes: Any = None
    max_hourly_cost: Any = None
    accelerator_args: Any = None
    priority: Any = None
    priority_class: Any = None
    ephemeral_storage: Any = None

    @field_validator("ports", mode="before")
    @classmethod
    def _one_port_is_a_list(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus_text(cls, value: Any) -> Any:
        # SkyPilot writes "2+" for "at least 2"; keep that form so a backend can honour it.
        if positive_number(value):
            return str(value)
        if isinstance(value, str) and _CPUS_RE.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(
            f"expected a CPU count like 2, 0.5 or '4+' (at least 4), got {show(value)}"
        )

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_text(cls, value: Any) -> Any:
        if positive_number(value):
            return str(value)
        if isinstance(value, str) and _MEMORY_RE.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(
            "expected a memory size in GB like 16, '32+' (at least 32) or '16GB', "
            f"got {show(value)}"
        )

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerator_options(cls, value: Any) -> Any:
        """Every SkyPilot form ("A100:1", {A100: 1}, a set, a list) -> ["NAME:COUNT", ...].

        A list keeps all options; a dict would lose SkyPilot's ``{A100:4, A100:8}`` choices.
        """
        items: list[tuple[Any, Any]]
        if isinstance(value, str):
            text = value.strip()
            shared = None  # "{L4, A10G}:1": one count for every model of the set
            grouped = re.fullmatch(r"([{\[].*[}\]])\s*:\s*([^\s:]+)", text)
            if grouped:
                text, shared = grouped.group(1), grouped.group(2)
            if text[:1] in "{[" and text[-1:] in "}]":
                text = text[1:-1]
            items = [(part.strip().strip("'\""), None) for part in text.split(",") if part.strip()]
            if shared is not None:
                items = [(f"{name}:{shared}", None) for name, _ in items]
        elif isinstance(value, list):
            items = [(item, None) for item in value]
        elif isinstance(value, dict):
            items = list(value.items())
        else:
            raise ValueError(
                "expected an accelerator like 'A100:1', a list or a mapping of them, "
                f"got {show(value)}"
            )
        options: list[str] = []
        for name, count in items:
            match = _ACCEL_RE.fullmatch(name) if isinstance(name, str) else None
            if match is None:
                raise ValueError(
                    f"expected an accelerator like 'A100' or 'A100:2', got {show(name)}"
                )
            given = match.group(2)
            if count is not None and given is not None:
                raise ValueError(f"{show(name)} already has a count; got a second one")
            number: float
            if count is None:
                number = float(given) if given is not None else 1.0
            elif positive_number(count) and count < 1e300:
                number = float(count)
            else:
                raise ValueError(f"accelerator counts are positive numbers, got {show(count)}")
            if not (0 < number < math.inf):  # "A100:" + 400 digits reads as inf
                raise ValueError(f"accelerator counts are positive numbers, got {show(name)}")
            shown = str(int(number)) if number.is_integer() else str(number)
            options.append(f"{match.group(1)}:{shown}")
        return options

    @field_validator("image_id")
    @classmethod
    def _no_container(cls, value: Any) -> Any:
        """``docker:IMAGE`` says what runs (SkyPilot runs ``setup`` and ``run`` inside that
        image), not where: kept as a note, ``run`` ran on the host with whatever the host has
        under those names. No backend here runs containers, so it is refused; a cloud VM
        image (any other value) is a where-to-run note like ``cloud``."""
        if isinstance(value, str) and value.strip().lower().startswith("docker:"):
            raise ValueError(
                f"{value.strip()} runs each replica inside that container image; corral's "
                "backends (local processes, Ray) run `setup` and `run` on the machine itself, "
                "without Docker. Remove image_id to run them with what this machine has"
            )
        return value

    @field_validator("any_of", "ordered")
    @classmethod
    def _alternatives(cls, value: Any) -> Any:
        """SkyPilot's alternatives: a list of resource mappings, each one's ``accelerators`` in
        the normal form (placement reads them: :meth:`_place_alternatives`)."""
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(e, dict) for e in value):
            got = "an empty list" if value == [] else show(value)
            if isinstance(value, list) and value:  # "got a list" would be no reason: say which
                bad = [(n, e) for n, e in enumerate(value, 1) if not isinstance(e, dict)]
                number, entry = bad[0]
                got = f"a list whose alternative {number} is {show(entry)}"
            raise ValueError(
                f"expected a list of resource mappings, one per alternative, got {got}"
            )
        entries = []
        for number, entry in enumerate(value, 1):
            if entry.get("accelerators") is not None:
                try:
                    own = Resources(accelerators=entry["accelerators"]).accelerators
                except ValidationError as exc:
                    message = exc.errors()[0]["msg"].removeprefix("Value error, ")
                    raise ValueError(f"alternative {number}'s accelerators: {message}") from None
                entry = {**entry, "accelerators": own}
            entries.append(entry)
        return entries

    @model_validator(mode="before")
    @classmethod
    def _place_alternatives(cls, data: Any) -> Any:
        """The GPUs of ``any_of`` / ``ordered`` are asked as ``accelerators`` options are: any
        one of them (in order for ``ordered``, as placement tries options). They were kept as
        where-to-run notes, so a GPU asked this way was dropped and the replica ran with none,
        while the same ask written as ``accelerators: {H100: 1, A100: 1}`` was placed or
        refused. An alternative without its own takes the base ``accelerators`` (SkyPilot's
        override); one that asks none at all means no GPU is needed. The rest of each entry
        (clouds, regions, zones) says where to run and stays a note. Malformed alternatives
        are left to :meth:`_alternatives`, which names them."""
        if not isinstance(data, dict):
            return data
        alternatives = data.get("any_of") if data.get("any_of") is not None else data.get("ordered")
        if not isinstance(alternatives, list) or not alternatives:
            return data
        try:
            base = Resources(accelerators=data.get("accelerators") or []).accelerators
            options: dict[str, None] = {}
            for entry in alternatives:
                own = entry.get("accelerators") if isinstance(entry, dict) else None
                chosen = base if own is None else Resources(accelerators=own).accelerators
                if not chosen:
                    return data  # an alternative with no GPU: the replica needs none
                options.update(dict.fromkeys(chosen))
        except ValidationError:
            return data
        return {**data, "accelerators": list(options)}

    def gpus_from_alternatives(self) -> bool:
        """Whether ``accelerators`` holds the GPUs of ``any_of`` / ``ordered`` (see
        :meth:`_place_alternatives`): their note then says so."""
        return bool(self.any_of or self.ordered) and bool(self.accelerators)

    def port_numbers(self) -> list[int]:
        """Every port opened, ranges expanded, in the order given (duplicates dropped)."""
        seen: dict[int, None] = {}
        for first, last in self.ports:
            for port in range(first, last + 1):
                seen.setdefault(port, None)
        return list(seen)
