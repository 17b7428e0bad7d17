"""SkyServe's ``service.autoscaling:`` section (its model-first specs, v2): the metrics to scale
on, each with a target per replica, and the bounds and delays SkyServe v2 also reads there.
:class:`corral.spec.service.ServiceSection` turns it into a ``replica_policy``."""

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from corral.spec.section import Section
from corral.spec.values import MAX_REPLICAS, MAX_SECONDS


class AutoscalingMetric(Section):
    """One of SkyServe's ``service.autoscaling.metrics``: what to scale on, and the target
    per replica (``queue_depth``: requests waiting in an engine's queue, as SkyServe
    v2 reads it; ``qps``: requests per second)."""

    type: Literal["queue_depth", "qps", "kv_cache_usage", "tokens_per_second"]
    target: float = Field(gt=0)

    @field_validator("type", mode="before")
    @classmethod
    def _skyserve_names(cls, value: Any) -> Any:
        # SkyServe's own names for two of them (sky/serve/serve_spec_v2.py).
        aliases = {"kv_cache_utilization": "kv_cache_usage", "requests_per_second": "qps"}
        return aliases.get(value, value) if isinstance(value, str) else value

    @field_validator("target")
    @classmethod
    def _a_fraction_for_the_kv_cache(cls, value: float, info: ValidationInfo) -> float:
        # Checked here, where the spec wrote it: past this point the target is
        # replica_policy.target_kv_cache_usage, a field (and a line) the spec does not have,
        # and its own bound there would name that field instead of this one.
        if info.data.get("type") == "kv_cache_usage" and value > 1:
            raise ValueError(
                f"must be at most 1 for kv_cache_usage (the share of one replica's KV cache "
                f"in use, 0..1), got {value:g}"
            )
        return value


# Each metric type's field in replica_policy.
METRIC_FIELDS = {
    "queue_depth": "target_queue_per_replica",
    "qps": "target_qps_per_replica",
    "kv_cache_usage": "target_kv_cache_usage",
    "tokens_per_second": "target_tokens_per_second_per_replica",
}


class AutoscalingSettings(Section):
    """SkyServe's ``service.autoscaling:`` (its model-first specs): the metrics to follow; the
    replica count is the most any of them asks for."""

    metrics: list[AutoscalingMetric] = Field(min_length=1, max_length=len(METRIC_FIELDS))
    # SkyServe v2 reads these here too (service.max_replicas wins), with its own delays'
    # defaults for this form: 60 s up, 300 s down (sky/serve/serve_spec_v2.py).
    max_replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    upscale_delay: float = Field(default=60.0, ge=0, le=MAX_SECONDS)
    downscale_delay: float = Field(default=300.0, ge=0, le=MAX_SECONDS)

    @field_validator("metrics")
    @classmethod
    def _each_type_once(cls, value: list[AutoscalingMetric]) -> list[AutoscalingMetric]:
        kinds = [metric.type for metric in value]
        twice = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} more than once: give each type once")
        return value
