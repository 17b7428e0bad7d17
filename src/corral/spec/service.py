"""``service:``: how replicas are probed, sized and load balanced, and its old spellings."""

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, Field, ValidationInfo, field_validator, model_validator

from corral.spec.autoscaling import METRIC_FIELDS, AutoscalingSettings
from corral.spec.section import Section
from corral.spec.values import (
    DEFAULT_DOWNSCALE_DELAY_SECONDS,
    DEFAULT_FAILURE_TIMEOUT_SECONDS,
    DEFAULT_HEADER_TIMEOUT_SECONDS,
    DEFAULT_INITIAL_DELAY_SECONDS,
    DEFAULT_LOAD_BALANCING_POLICY,
    DEFAULT_PERIOD_SECONDS,
    DEFAULT_READINESS_PATH,
    DEFAULT_STREAM_TIMEOUT_SECONDS,
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_UPSCALE_DELAY_SECONDS,
    MAX_REPLICAS,
    MAX_SECONDS,
    POLICY_ALIASES,
    HeaderName,
    HeaderValue,
    LoadBalancingPolicy,
    show,
)

# Request headers the balancer drops or replaces before a policy sees the rest (the set
# corral.balancer.headers keeps as REQUEST_DROP; a test holds the two equal): a session
# header among them would be missing, or the balancer's own value, on some requests.
BALANCER_OWNED_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host", "expect",
        "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "content-length",
    }
)  # fmt: skip


class ReadinessProbe(Section):
    """How corral decides that a replica serves. Also written ``readiness_probe: /path``."""

    path: str = DEFAULT_READINESS_PATH
    post_data: dict[str, Any] | None = None
    initial_delay_seconds: float = Field(DEFAULT_INITIAL_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    timeout_seconds: float = Field(DEFAULT_TIMEOUT_SECONDS, gt=0, le=MAX_SECONDS)
    # corral's names first; SkyServe's later names for the same two settings are also read.
    period_seconds: float = Field(
        DEFAULT_PERIOD_SECONDS,
        gt=0,
        le=MAX_SECONDS,
        validation_alias=AliasChoices("period_seconds", "endpoint_probe_interval_seconds"),
    )
    failure_timeout_seconds: float = Field(
        DEFAULT_FAILURE_TIMEOUT_SECONDS,
        ge=0,
        le=MAX_SECONDS,
        validation_alias=AliasChoices(
            "failure_timeout_seconds", "consecutive_failure_threshold_timeout"
        ),
    )
    headers: dict[HeaderName, HeaderValue] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must start with '/', like '/health'; got {show(value)}")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"must not contain spaces or control characters; got {show(value)}")
        return value

    @field_validator("post_data", mode="before")
    @classmethod
    def _json_body(cls, value: Any) -> Any:
        # SkyServe takes an object or a JSON string. Both become a plain JSON object here, so the
        # prober can send it and `corral validate` can print it without surprises.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"is not valid JSON ({exc.msg} at character {exc.pos}); "
                    'give a mapping or a JSON object string like \'{"prompt": "hi"}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object (a mapping), got {show(value)}")
        try:
            return json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot be sent as JSON: {exc}") from None


class ReplicaPolicy(Section):
    """How many replicas: fixed (``min == max``) or request-rate autoscaled between them.

    Both ``replicas: N`` and ``replica_policy:`` end up here, so consumers read one shape.
    """

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "base_ondemand_fallback_replicas",
        "dynamic_ondemand_fallback",
        "spot_placer",
        "spot_policy",
        "spot_zones",
        "on_demand_zones",
    )

    min_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    # Declared before max_replicas: max_replicas' check needs them (TARGETS). The queue is
    # corral's name for SkyServe's `autoscaling.metrics: [{type: queue_depth, target: N}]`:
    # the requests waiting in an LLM engine's queue per replica (not those it runs); the KV-cache
    # use (0..1) and generated tokens per second are the engines' other signals (docs/llm.md).
    target_qps_per_replica: float | None = Field(default=None, gt=0)
    # SkyServe's `target_qps_per_replica: {H100: 10, A100: 5}` (with the policy
    # instance_aware_least_load), moved here by _per_accelerator so the field above stays
    # a number: requests per second one replica of each accelerator serves.
    target_qps_per_accelerator: dict[str, Annotated[float, Field(gt=0)]] | None = None
    target_queue_per_replica: float | None = Field(default=None, gt=0)
    target_kv_cache_usage: float | None = Field(default=None, gt=0, le=1)
    target_tokens_per_second_per_replica: float | None = Field(default=None, gt=0)
    max_replicas: int = Field(default=None, ge=0, le=MAX_REPLICAS, validate_default=True)
    upscale_delay_seconds: float = Field(DEFAULT_UPSCALE_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    downscale_delay_seconds: float = Field(DEFAULT_DOWNSCALE_DELAY_SECONDS, ge=0, le=MAX_SECONDS)
    num_overprovision: int = Field(0, ge=0, le=MAX_REPLICAS)

    base_ondemand_fallback_replicas: Any = None
    dynamic_ondemand_fallback: Any = None
    spot_placer: Any = None
    spot_policy: Any = None
    spot_zones: Any = None
    on_demand_zones: Any = None

    @model_validator(mode="before")
    @classmethod
    def _per_accelerator(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("target_qps_per_replica"), dict):
            data = dict(data)
            if "target_qps_per_accelerator" in data:
                raise ValueError(
                    "target_qps_per_replica as a mapping and target_qps_per_accelerator name "
                    "the same setting: give only one"
                )
            data["target_qps_per_accelerator"] = data.pop("target_qps_per_replica")
        return data

    @field_validator("target_qps_per_accelerator")
    @classmethod
    def _some_accelerator(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not value:
            raise ValueError(
                "is an empty mapping: name each accelerator with the requests per second one "
                "replica on it serves, like {H100: 10, A100: 5}"
            )
        return value

    @field_validator("max_replicas", mode="before")
    @classmethod
    def _max_defaults_to_min(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            return value
        if _target_of(info.data) is not None:
            raise ValueError(
                f"is required when {_target_of(info.data)} is set: it caps how far autoscaling "
                "may go"
            )
        # Without autoscaling the policy is fixed at min_replicas. If min_replicas itself was
        # invalid its own error is reported; 0 only keeps this field quiet.
        return info.data.get("min_replicas", 0)

    @field_validator("max_replicas")
    @classmethod
    def _max_fits_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")
        if low is None:
            return value
        if value < low:
            raise ValueError(f"must be at least min_replicas ({low}), got {value}")
        targets_read = all(name in info.data for name in TARGETS)
        if targets_read and _target_of(info.data) is None and value != low:
            raise ValueError(
                f"is {value} but min_replicas is {low} and target_qps_per_replica is not "
                "set: set target_qps_per_replica (or another autoscaling target) to "
                "autoscale between them, or make max_replicas equal to min_replicas (or "
                "leave it out) for a fixed size"
            )
        return value

    @property
    def autoscaling(self) -> bool:
        """True when the replica count follows the load (request rate or the engines' own
        signals) rather than staying fixed."""
        return _target_of(self.__dict__) is not None and self.max_replicas > self.min_replicas

    @property
    def engine_targets(self) -> dict[str, float]:
        """The targets on what the engines report, by field name (those set)."""
        names = (
            "target_queue_per_replica",
            "target_kv_cache_usage",
            "target_tokens_per_second_per_replica",
        )
        return {name: value for name in names if (value := getattr(self, name)) is not None}


# Every autoscaling target: any one set makes the replica count follow the load.
TARGETS = (
    "target_qps_per_replica",
    "target_qps_per_accelerator",
    "target_queue_per_replica",
    "target_kv_cache_usage",
    "target_tokens_per_second_per_replica",
)


def _target_of(data: Mapping[str, Any]) -> str | None:
    """The autoscaling target field set, if any (for messages)."""
    for name in TARGETS:
        if data.get(name) is not None:
            return "target_qps_per_replica" if name == "target_qps_per_accelerator" else name
    return None


class TlsSettings(Section):
    """Key and certificate with which the load balancer serves HTTPS."""

    keyfile: str
    certfile: str

    @field_validator("keyfile", "certfile")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a file path, got an empty text")
        return value


class LegacyHttps(Section):
    """SkyServe's old ``https: {key, cert}`` spelling of ``tls``; read so old specs still run."""

    key: str
    cert: str


class LoadBalancerSettings(Section):
    """SkyServe's ``load_balancer:`` knobs (its stream timeout), plus corral's own.

    ``stream_timeout_seconds`` is SkyServe's: the longest a replica may stay silent, before its
    response headers (unless ``first_byte_timeout_seconds`` says otherwise) and between chunks.
    The rest are corral extensions: connecting to a replica, the largest request body and
    header line accepted, how long a client may take to send a request's headers, and how long a
    leaving replica may finish its in-flight requests.
    """

    stream_timeout_seconds: float = Field(DEFAULT_STREAM_TIMEOUT_SECONDS, gt=0, le=MAX_SECONDS)
    connect_timeout_seconds: float = Field(5.0, gt=0, le=MAX_SECONDS)
    first_byte_timeout_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    max_body_bytes: int | None = Field(None, gt=0)
    max_header_bytes: int = Field(8190, ge=1024, le=1 << 20)
    # A client has this long to send a request's line and headers (and a keep-alive connection
    # may idle this long): slowloris clients are cut off instead of holding sockets for hours.
    header_timeout_seconds: float = Field(DEFAULT_HEADER_TIMEOUT_SECONDS, gt=0, le=3600)
    drain_timeout_seconds: float = Field(30.0, ge=0, le=MAX_SECONDS)
    # Client connections each balancer worker keeps open for this service; one more gets a
    # 503. None: a quarter of the worker's open-file limit, so no service can use up the
    # descriptors every other service (and the worker's own upstream connections) need.
    max_connections: int | None = Field(None, ge=1, le=1 << 22)
    # LLM serving (docs/llm.md). The JSON field that holds the prompt for an API the
    # prefix_affinity policy does not know (dotted: "input.text").
    prompt_field: str | None = Field(None, min_length=1, max_length=200)
    # A replica is passed over while its load is this many times the mean (prefix_affinity,
    # session affinity): how far a hot prompt family may pile onto its replica.
    balance_factor: float = Field(1.25, ge=1.0, le=10.0)
    # Requests in flight to one replica before the balancer holds the next ones itself, FIFO,
    # until one has room (instead of queueing them in the engines); None: no limit.
    max_in_flight_per_replica: int | None = Field(None, ge=1, le=1 << 16)
    # How long a held request may wait for room before a 503 with Retry-After.
    hold_timeout_seconds: float = Field(30.0, gt=0, le=MAX_SECONDS)
    # Under a policy that prefers a replica (prefix_affinity, session affinity): how long a
    # held request waits for that one (its cache is there) before taking any with room. 0:
    # any replica, first in first out.
    hold_patience_seconds: float = Field(0.5, ge=0, le=MAX_SECONDS)
    # Session affinity: requests carrying the same value of this header (or cookie) go to
    # the same replica, from every balancer worker.
    session_header: str | None = Field(None, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    session_cookie: str | None = Field(None, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")

    @field_validator("session_header")
    @classmethod
    def _a_header_the_client_owns(cls, name: str | None) -> str | None:
        if name is not None and name.lower() in BALANCER_OWNED_HEADERS:
            raise ValueError(
                f"{name!r} is a header the balancer drops or sets itself, so it cannot tell "
                "sessions apart; name one the client sends (X-Session-ID, say)"
            )
        return name

    # Where each replica's engine publishes Prometheus metrics (vLLM, SGLang: /metrics): read
    # every second for its queue and KV-cache use. None: /metrics under prefix_affinity, else
    # not read.
    engine_metrics_path: str | None = Field(None, pattern=r"^/[^\s]*$", max_length=500)


# Long enough for a model download in `setup`; a hung setup fails the launch after it.
DEFAULT_SETUP_TIMEOUT = 1800.0


class ServiceSection(Section):
    """The ``service:`` section: probing, sizing and load balancing of the replicas."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = (
        "controller_resources",
        "route53_hosted_zone",
        "external_load_balancers",
    )
    _LEGACY: ClassVar[tuple[str, ...]] = ("port", "https")

    readiness_probe: ReadinessProbe = Field(default_factory=ReadinessProbe)
    replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    # SkyServe's shape with `autoscaling:` (its model-first specs): `replicas` is the least,
    # `max_replicas` the most.
    max_replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    autoscaling: AutoscalingSettings | None = None
    # Always set after validation (from replica_policy:, replicas: or the default of 1).
    replica_policy: ReplicaPolicy = Field(default=None, validate_default=True)
    load_balancing_policy: LoadBalancingPolicy = DEFAULT_LOAD_BALANCING_POLICY
    port: int | None = Field(default=None, ge=1, le=65535)
    ports: int | None = Field(default=None, ge=1, le=65535, validate_default=True)
    https: LegacyHttps | None = None
    tls: TlsSettings | None = Field(default=None, validate_default=True)
    load_balancer: LoadBalancerSettings = Field(default_factory=LoadBalancerSettings)
    # corral's own: how long a replica's `setup` may run before its launch fails. A setup that
    # hangs would otherwise hold a launch slot forever (and, 16 of them, every service's).
    setup_timeout_seconds: float = Field(default=DEFAULT_SETUP_TIMEOUT, gt=0, le=7 * 24 * 3600)

    controller_resources: Any = None
    route53_hosted_zone: Any = None
    external_load_balancers: Any = None

    @field_validator("readiness_probe", mode="before")
    @classmethod
    def _path_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        if isinstance(value, dict | ReadinessProbe):
            return value
        raise ValueError(
            f"expected a path like /health, or a mapping with path:, got {show(value)}"
        )

    @field_validator("max_replicas")
    @classmethod
    def _max_fits_replicas(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None or "replicas" not in info.data:
            return value  # not given, or replicas is wrong and says so itself
        least = info.data["replicas"]
        if value < (1 if least is None else least):
            said = f"replicas ({least})" if least is not None else "replicas (1, its default)"
            raise ValueError(f"must be at least {said}, got {value}")
        return value

    @field_validator("autoscaling")
    @classmethod
    def _its_max_fits_replicas(
        cls, value: AutoscalingSettings | None, info: ValidationInfo
    ) -> AutoscalingSettings | None:
        # SkyServe v2's autoscaling.max_replicas, where service.max_replicas does not win:
        # said under the field the spec has (replica_policy is not in it).
        if value is None or value.max_replicas is None or info.data.get("max_replicas") is not None:
            return value
        if "replicas" not in info.data or "max_replicas" not in info.data:
            return value  # one of them is wrong and says so itself
        least = 1 if info.data["replicas"] is None else info.data["replicas"]
        if value.max_replicas < least:
            raise ValueError(
                f"max_replicas must be at least replicas ({least}), got {value.max_replicas}"
            )
        return value

    @field_validator("replica_policy", mode="before")
    @classmethod
    def _one_sizing_form(cls, value: Any, info: ValidationInfo) -> Any:
        replicas = info.data.get("replicas")
        scaling: AutoscalingSettings | None = info.data.get("autoscaling")
        most = info.data.get("max_replicas")
        if value is None and not {"max_replicas", "autoscaling"} <= info.data.keys():
            # One of them is wrong and its own error says how: a second error here would
            # blame a field the spec does not have.
            count = 1 if replicas is None else replicas
            return {"min_replicas": count, "max_replicas": count}
        if scaling is not None and value is None:
            targets = {METRIC_FIELDS[metric.type]: metric.target for metric in scaling.metrics}
            least = 1 if replicas is None else replicas
            if most is None:
                most = scaling.max_replicas  # at least replicas: _its_max_fits_replicas
            most = least if most is None else most  # no room to scale: a warning says so
            delays = {
                "upscale_delay_seconds": scaling.upscale_delay,
                "downscale_delay_seconds": scaling.downscale_delay,
            }
            return {"min_replicas": least, "max_replicas": most, **targets, **delays}
        if most is not None or scaling is not None:
            raise ValueError(
                "max_replicas and autoscaling at the service level go with replicas (the "
                "least) and not with replica_policy: use one form"
                if value is not None
                else "max_replicas at the service level needs autoscaling.metrics (what to "
                "scale on); or use replica_policy (min_replicas, max_replicas, "
                "target_qps_per_replica)"
            )
        if value is None:
            count = 1 if replicas is None else replicas
            return {"min_replicas": count, "max_replicas": count}
        if replicas is not None:
            raise ValueError(
                "cannot be combined with replicas: use replicas for a fixed size, or "
                "replica_policy (min_replicas, max_replicas, target_qps_per_replica), not both"
            )
        return value

    @field_validator("load_balancing_policy", mode="before")
    @classmethod
    def _policy_case(cls, value: Any) -> Any:
        # SkyServe matches policy names case-insensitively; other LLM routers' names for
        # prefix_affinity are taken too.
        if not isinstance(value, str):
            return value
        name = value.strip().lower()
        return POLICY_ALIASES.get(name, name)

    @field_validator("ports", mode="before")
    @classmethod
    def _legacy_port(cls, value: Any, info: ValidationInfo) -> Any:
        old = info.data.get("port")
        if value is None:
            return old
        if old is not None:
            raise ValueError("port is the old name of ports: give only ports")
        return value

    @field_validator("tls", mode="before")
    @classmethod
    def _legacy_https(cls, value: Any, info: ValidationInfo) -> Any:
        old = info.data.get("https")
        if value is None:
            if old is None:
                return None
            return TlsSettings(keyfile=old.key, certfile=old.cert)
        if old is not None:
            raise ValueError("https is the old form of tls: give only tls (keyfile, certfile)")
        return value

    def _notes(self, meaningless: str) -> list[str]:
        paths = self._placement_set("service.")
        paths += self.replica_policy._placement_set("service.replica_policy.")
        notes = [f"{path}: {meaningless}" for path in paths]
        if (
            self.autoscaling is not None
            and self.max_replicas is None
            and self.autoscaling.max_replicas is None
        ):
            least = self.replica_policy.min_replicas
            notes.append(
                "service.autoscaling: has no effect without service.max_replicas: the service "
                f"stays at replicas ({least}) and no metric scales it (as in SkyServe); set "
                "max_replicas to the most replicas the metrics may ask for"
            )
        policy = self.replica_policy
        if (
            policy.autoscaling
            and policy.target_queue_per_replica is not None
            and policy.target_kv_cache_usage is None
            and policy.target_tokens_per_second_per_replica is None
            and policy.target_qps_per_replica is None
        ):
            where = (
                "service.autoscaling"
                if self.autoscaling is not None
                else "service.replica_policy.target_queue_per_replica"
            )
            notes.append(
                f"{where}: queue_depth is the only autoscaling target: a steady load the "
                "replicas keep up with empties the queue, scales down after the downscale "
                "delay and back up when the queue forms again; add a kv_cache_usage target to "
                "keep the replicas it needs (docs/llm.md)"
            )
        if self.port is not None:
            notes.append("service.port: SkyServe's old name of service.ports; read as ports")
        if self.https is not None:
            notes.append(
                "service.https: SkyServe's old form of service.tls; read as tls "
                "(keyfile = key, certfile = cert)"
            )
        return notes
