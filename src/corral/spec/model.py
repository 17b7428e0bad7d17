"""The whole service spec: top-level fields, warnings, the view ``corral validate`` prints."""

from typing import Any, ClassVar, Self

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from corral.spec.resources import Resources
from corral.spec.section import Section
from corral.spec.service import ServiceSection
from corral.spec.unread import unread_balancer_settings, unread_scaling_targets
from corral.spec.values import (
    EnvName,
    EnvValue,
    InfraName,
    env_name_ok,
    format_range,
    name_problem,
    show,
)


class ServiceSpec(Section):
    """A whole service spec, validated and normalised; see the module docstring for defaults."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = ("file_mounts", "volumes", "config")

    name: str | None = None
    # SkyServe's model-first specs: the model to serve, with no `run` (corral picks the engine:
    # corral.model_engines). Declared before `run`, whose check reads it.
    model: str | None = Field(default=None, min_length=1, max_length=500)
    run: str | None = Field(default=None, validate_default=True)
    setup: str | None = None
    envs: dict[EnvName, EnvValue] = Field(default_factory=dict)
    # SkyPilot's secrets: env vars whose values never show (state, status, logs, events).
    secrets: dict[EnvName, EnvValue] = Field(default_factory=dict)
    workdir: str | None = None
    infra: InfraName = "local"
    num_nodes: int = 1
    resources: Resources = Field(default_factory=Resources)
    service: ServiceSection = Field(default_factory=ServiceSection)

    file_mounts: Any = None
    volumes: Any = None
    config: Any = None

    # "envs.NAME" / "secrets.NAME" of keys written without a value -> their line in the file.
    _unset: dict[str, int | None] = PrivateAttr(default_factory=dict)
    # Lines of the top-level keys, for problems found after parsing (a missing workdir).
    _lines: dict[str, int | None] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_unset(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        # ``HF_TOKEN:`` with no value is how SkyPilot says "give it at launch" (``--env``,
        # ``--secret``): such keys are left out here and must be given at up/update.
        unset: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            for section in ("envs", "secrets"):
                values = data.get(section)
                if isinstance(values, dict):
                    # Only a valid name: another (``bad name:``, a null key) stays in, so its
                    # own check refuses it instead of asking for ``--env bad name=VALUE``.
                    names = [k for k, v in values.items() if v is None and env_name_ok(k)]
                    unset += [f"{section}.{k}" for k in names]
                    data[section] = {k: v for k, v in values.items() if k not in names}
        spec = handler(data)
        spec._unset = dict.fromkeys(unset)
        return spec

    @field_validator("secrets")
    @classmethod
    def _secrets_apart(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # Checked on the field, not the whole spec: the error then names `secrets` and its
        # line, and comes with the spec's other problems rather than only once they are fixed.
        both = sorted(set(info.data.get("envs") or {}) & set(value))
        if both:
            raise ValueError(
                f"{', '.join(both)} given in both envs and secrets: a name is one or the other"
            )
        return value

    def unset_values(self) -> dict[str, int | None]:
        """``envs.NAME``/``secrets.NAME`` left without a value in the file, with their line."""
        return dict(self._unset)

    def line_of(self, key: str) -> int | None:
        """The line of field ``key`` in the file it was read from, if known: a top-level one,
        or a nested one the checks after parsing name (``service.tls.keyfile``), else the
        line of its top-level field."""
        if key in self._lines:
            return self._lines[key]
        return self._lines.get(key.partition(".")[0])

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("run")
    @classmethod
    def _has_command(cls, value: str | None, info: ValidationInfo) -> str | None:
        if (value is None or not value.strip()) and not info.data.get("model"):
            raise ValueError(
                "is required: the shell command that starts one replica, "
                "e.g. `python3 -m http.server $PORT` (or `model:` for an LLM corral starts)"
            )
        return value or None

    @field_validator("model", mode="before")
    @classmethod
    def _model_id(cls, value: Any) -> Any:
        # SkyServe v2 also writes the model as a mapping of its id alone: `model: {id: ORG/NAME}`.
        if isinstance(value, dict) and set(value) == {"id"}:
            return value["id"]
        if isinstance(value, dict) and "id" in value:
            others = ", ".join(repr(str(k)) for k in value if k != "id")
            raise ValueError(
                f"takes the model's id alone ({{id: ...}}), not {others}: corral serves the "
                "model as its engine loads it by default"
            )
        if isinstance(value, dict):
            raise ValueError(f"expected the model's id as text, or {{id: ...}}; got {show(value)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _model_first_defaults(cls, data: Any) -> Any:
        """A model-first spec says little: the engines corral starts answer /health, and
        route best by prompt prefix (docs/llm.md). What the spec does say wins."""
        if not isinstance(data, dict) or not data.get("model") or data.get("run"):
            return data
        service = data.get("service")
        if service is None:
            service = {}
        if not isinstance(service, dict):
            return data  # its own error says what is wrong with it
        defaults = {"readiness_probe": "/health", "load_balancing_policy": "prefix_affinity"}
        # `key:` with no value means "the default" (Section._null_means_not_given): here the
        # model-first default. A probe given as a mapping without `path` (only its delays, as
        # LLM specs write it) keeps the engines' /health too, not the generic "/".
        given = {k: v for k, v in service.items() if v is not None or k not in defaults}
        probe = given.get("readiness_probe")
        if isinstance(probe, dict) and probe.get("path") is None:
            given["readiness_probe"] = {**probe, "path": defaults["readiness_probe"]}
        return {**data, "service": {**defaults, **given}}

    @field_validator("workdir", mode="before")
    @classmethod
    def _local_workdir(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError("a git workdir (url, ref) is not supported: give a local directory")
        return value

    @field_validator("file_mounts")
    @classmethod
    def _mount_mapping(cls, value: Any) -> Any:
        # SkyPilot's shape on every infra: kept-only elsewhere, `file_mounts: 0` or a list
        # was accepted in silence (the local check skipped anything falsy) and mounted nothing.
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "expected a mapping of destination: source (`/data: ./data`, or a storage "
                f"mapping as the source), got {show(value)}"
            )
        for dest, src in value.items():
            if not isinstance(src, str | dict):
                raise ValueError(
                    f"{show(dest)}: expected a local path, a bucket URL or a storage mapping "
                    f"as the source, got {show(src)}"
                )
        return value

    @field_validator("infra", mode="before")
    @classmethod
    def _infra_case(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("num_nodes")
    @classmethod
    def _single_node(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"must be 1, got {value}: corral runs each replica on one node; "
                "multi-node replicas are not supported"
            )
        return value

    @property
    def warnings(self) -> list[str]:
        """Fields kept but without effect here, old spellings read, values filled in."""
        meaningless = f"has no meaning on infra {self.infra}; kept but not used"
        # On local, file_mounts is honoured (relative destinations) or an error, not a note.
        top = [
            p for p in self._placement_set("") if not (p == "file_mounts" and self.infra == "local")
        ]
        notes = [f"{path}: {meaningless}" for path in top]
        placed = self.resources.gpus_from_alternatives()
        # On Ray, labels select the nodes (label_selector, corral.infra._ray_resources).
        honoured = {"resources.labels"} if self.infra == "ray" else set()
        notes += [
            f"{path}: its accelerators are asked as alternatives ({self._options_asked()}); "
            f"the rest {meaningless}"
            if placed and path in ("resources.any_of", "resources.ordered")
            else f"{path}: {meaningless}"
            for path in self.resources._placement_set("resources.")
            if path not in honoured
        ]
        notes += self.service._notes(meaningless)
        notes += unread_balancer_settings(self.service)
        notes += unread_scaling_targets(self.service)
        notes += [
            f"{field}: has no value in the spec: give it at `corral up`/`update` with "
            f"{value_flag(field)} {field.split('.', 1)[1]}=VALUE"
            for field in self._unset
        ]
        if self.model and self.run:
            # `run:` is what starts each replica; the model-first path (the engine corral
            # picks, /health readiness, prefix_affinity) is not taken, and nothing else reads
            # `model:`. Said, so a spec that meant the model-first defaults is not served
            # silently without them.
            notes.append(
                "model: not used: `run:` starts each replica, so corral neither picks an "
                "engine for the model nor applies the model-first defaults (readiness_probe "
                "/health, load_balancing_policy prefix_affinity); remove `run:` to have "
                "corral start the model, or `model:` to silence this"
            )
        options = self.resources.accelerators
        if self.infra == "ray" and len(options) > 1 and not placed:
            notes.append(f"resources.accelerators: {self._options_asked()}")
        if self.infra == "kubernetes":  # read, as SkyPilot's, but no backend runs it yet
            notes.append(
                "infra: kubernetes has no corral backend yet: `corral up` refuses it (infra "
                "'kubernetes' is not available in this daemon); use local or ray"
            )
        return notes

    def _options_asked(self) -> str:
        """Which accelerator options a replica is placed on: any one of them locally; on Ray the
        first alone (an actor is one request: corral.infra._ray_resources), which validate
        called "any one of" them, so a Ray node with only the second never got a replica."""
        options = self.resources.accelerators
        if self.infra == "ray" and len(options) > 1:
            rest = ", ".join(options[1:])
            first = f"on infra ray only the first, {options[0]}, is asked"
            return f"{first}; {rest} never (a Ray actor is one request)"
        return f"any one of {', '.join(options)}"

    def replica_port(self) -> int | None:
        """The port a replica serves on: ``service.ports``, else the one ``resources`` port."""
        if self.service.ports is not None:
            return self.service.ports
        ranges = self.resources.ports
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return ranges[0][0]
        return None

    def summary(self) -> dict[str, Any]:
        """A JSON-able, normalised view for ``corral validate``.

        Env values and probe header values are left out (names only): they are where tokens
        live, and this view is printed to terminals and logs.
        """
        probe = self.service.readiness_probe
        policy = self.service.replica_policy
        tls = self.service.tls
        return {
            "name": self.name,
            "infra": self.infra,
            "model": self.model,
            "run": self.run,
            "setup": self.setup,
            "workdir": self.workdir,
            "envs": sorted(self.envs),
            "secrets": sorted(self.secrets),
            "unset": sorted(self._unset),
            "resources": {
                "ports": [format_range(r) for r in self.resources.ports],
                "cpus": self.resources.cpus,
                "memory": self.resources.memory,
                "accelerators": list(self.resources.accelerators),
            },
            "service": {
                "replica_port": self.replica_port(),
                "readiness_probe": {
                    "method": "GET" if probe.post_data is None else "POST",
                    "path": probe.path,
                    "post_data": probe.post_data,
                    "headers": sorted(probe.headers),
                    "initial_delay_seconds": probe.initial_delay_seconds,
                    "timeout_seconds": probe.timeout_seconds,
                    "period_seconds": probe.period_seconds,
                    "failure_timeout_seconds": probe.failure_timeout_seconds,
                },
                "replica_policy": {
                    "min_replicas": policy.min_replicas,
                    "max_replicas": policy.max_replicas,
                    "target_qps_per_replica": policy.target_qps_per_accelerator
                    or policy.target_qps_per_replica,
                    **policy.engine_targets,
                    "autoscaling": policy.autoscaling,
                    "upscale_delay_seconds": policy.upscale_delay_seconds,
                    "downscale_delay_seconds": policy.downscale_delay_seconds,
                    "num_overprovision": policy.num_overprovision,
                },
                "load_balancing_policy": self.service.load_balancing_policy,
                "tls": None if tls is None else {"keyfile": tls.keyfile, "certfile": tls.certfile},
                "stream_timeout_seconds": self.service.load_balancer.stream_timeout_seconds,
                # Every balancer setting, defaults filled in: an operator sees the hold and the
                # session settings they wrote were read, and what the rest will be.
                "load_balancer": self.service.load_balancer.model_dump(mode="json"),
            },
            "warnings": self.warnings,
        }


def value_flag(field: str) -> str:
    """The flag that gives a value to ``envs.NAME`` (``--env``) or ``secrets.NAME``."""
    return "--secret" if field.startswith("secrets.") else "--env"
