"""The service spec: SkyServe-shaped YAML, checked into pydantic models.

A spec is the one thing a user writes by hand, so this module spends its effort on error
messages: every problem names the dotted field path, the file and the line of that field, says
what was expected and what was found, and all problems of a file are reported together (a
compiler, not a game of whack-a-mole). Nothing but :class:`SpecError` leaves
:func:`parse_spec` / :func:`load_spec`, whatever the input, because the CLI and the daemon show
that error to the user as is.

SkyServe specs are accepted unchanged where corral can honour them. Fields that only say *where*
to run (clouds, regions, spot placement, SkyServe's own controller placement) are kept on the
model, for backends that may use them one day, and listed in ``ServiceSpec.warnings``. Fields that
would change how the service behaves and that corral cannot honour (an LB auth key, SkyServe's
model-only specs, ...) are errors: silently ignoring them would run something the user did not
ask for.

Choices that differ from SkyServe, and why:

* ``readiness_probe`` may be left out: it defaults to ``GET /``. SkyServe does the same in its
  parser (``config.get('readiness_probe', '/')``); a service with no probe at all could never
  become READY, so a default is kinder than an error.
* A spec a person submits (``corral validate``, ``up``, ``update``) needs its ``service:``
  section, as in SkyServe: a YAML without one is a SkyPilot task (``require_service``). A spec
  stored by an older corral without one still reads as one replica with the default probe.
* ``replicas: N`` is normalised to ``replica_policy`` with ``min == max == N`` so consumers read
  one shape; SkyServe keeps ``max_replicas = None`` instead.
* A YAML null (``key:`` with nothing after it) means "not given", as in SkyServe, except in
  ``envs`` where it means "no value": the variable is set to "" and a warning says so.
* Durations are capped at 7 days and replica counts at 10000: bigger values are almost surely a
  unit slip (milliseconds) and would overflow timers further down.
* Unknown fields are errors (SkyServe's schema says the same), with a "did you mean" or "belongs
  under" hint. Old SkyServe placement fields seen in its examples (``spot_policy``,
  ``spot_zones``, ``on_demand_zones``, ``controller_resources``, ``route53_hosted_zone``,
  ``external_load_balancers``) are kept with a warning like the current ones; near-misspellings
  of current fields (``base_on_demand_fallback_replicas``) stay errors, because the writer meant
  the current field and a backend with spot capacity would silently ignore the typo.
* Two old SkyServe spellings that change behaviour are still read, with a warning:
  ``service.port`` (now ``ports``) and ``service.https: {key, cert}`` (now ``tls``). SkyServe's
  later probe names ``endpoint_probe_interval_seconds`` and
  ``consecutive_failure_threshold_timeout`` are read as corral's ``period_seconds`` and
  ``failure_timeout_seconds``.
* Env and header values keep the text as written: ``PYTHON: 3.10`` is "3.10", not "3.1".
* Duplicate keys are errors (YAML itself would keep the last one without a word).

Lines: an issue carries the line of its field's key; a field that is absent gets the line of the
nearest section present, and one absent at the top level gets none.

The package, bottom up: ``values`` (defaults, bounds, small checks), ``section`` (the models'
base), ``resources``, ``service`` and ``model`` (the pydantic models), ``errors``, ``locate``
and ``reader`` (YAML text to data, lines of fields), ``messages`` (pydantic's errors in plain
words), ``loader`` (:func:`parse_spec`, :func:`load_spec`) and ``checks`` (paths, values given
at launch, names). Every public name is imported here, so callers write ``from corral.spec
import X`` and never depend on that layout.
"""

from corral.spec.checks import (
    REDACTED,
    generated_name,
    missing_values,
    path_issues,
    redact_secrets,
    tls_paths,
    validate_name,
)
from corral.spec.errors import SpecError, SpecIssue
from corral.spec.loader import load_spec, parse_spec
from corral.spec.locate import key_text
from corral.spec.messages import MAX_ISSUES, sorted_issues
from corral.spec.model import ServiceSpec, value_flag
from corral.spec.reader import MAX_SPEC_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES
from corral.spec.resources import Resources
from corral.spec.service import (
    DEFAULT_SETUP_TIMEOUT,
    LoadBalancerSettings,
    ReadinessProbe,
    ReplicaPolicy,
    ServiceSection,
    TlsSettings,
)
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
    NAME_RULE,
    InfraName,
    LoadBalancingPolicy,
    qps_of_accelerator,
)

__all__ = [
    "DEFAULT_DOWNSCALE_DELAY_SECONDS",
    "DEFAULT_FAILURE_TIMEOUT_SECONDS",
    "DEFAULT_HEADER_TIMEOUT_SECONDS",
    "DEFAULT_INITIAL_DELAY_SECONDS",
    "DEFAULT_LOAD_BALANCING_POLICY",
    "DEFAULT_PERIOD_SECONDS",
    "DEFAULT_READINESS_PATH",
    "DEFAULT_SETUP_TIMEOUT",
    "DEFAULT_STREAM_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "DEFAULT_UPSCALE_DELAY_SECONDS",
    "MAX_ISSUES",
    "MAX_REPLICAS",
    "MAX_SECONDS",
    "MAX_SPEC_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "NAME_RULE",
    "REDACTED",
    "InfraName",
    "LoadBalancerSettings",
    "LoadBalancingPolicy",
    "ReadinessProbe",
    "ReplicaPolicy",
    "Resources",
    "ServiceSection",
    "ServiceSpec",
    "SpecError",
    "SpecIssue",
    "TlsSettings",
    "generated_name",
    "key_text",
    "load_spec",
    "missing_values",
    "parse_spec",
    "path_issues",
    "qps_of_accelerator",
    "redact_secrets",
    "sorted_issues",
    "tls_paths",
    "validate_name",
    "value_flag",
]
