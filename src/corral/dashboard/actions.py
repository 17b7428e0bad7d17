"""What a person may do from the dashboard, each through the daemon operation the CLI's verb
reaches through the API: ``down`` is ``corral down``, a rollback is ``corral update
--to-version N``, and scaling a fixed-size service is ``corral update`` with the current spec
where only ``service.replicas`` changed. Since only the ``service:`` section changes, the
daemon keeps the running replicas (relabelled to the new version) and its controller launches
or retires the difference; the event log records a new version, like any update.

The stored spec of that new version is the current one read and written back as YAML with
the new count: the values are the same, comments and anchors of the original file are not kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from corral.api_errors import RequestError
from corral.daemon import UpdateRequest
from corral.errors import Conflict

if TYPE_CHECKING:
    from corral.daemon import Daemon


def count_field(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(400, f"field {key!r} must be a whole number from {low} to {high}")
    return value


def down(daemon: Daemon, name: str) -> dict[str, Any]:
    return daemon.down(name, purge=False)


async def rollback(daemon: Daemon, name: str, version: int) -> dict[str, Any]:
    return await daemon.update(name, UpdateRequest(from_version=version))


def scaled_spec(spec_yaml: str, replicas: int) -> str:
    """``spec_yaml`` with a fixed size of ``replicas`` (``replica_policy`` replaced)."""
    data = yaml.safe_load(spec_yaml)
    if not isinstance(data, dict):
        raise Conflict("the stored spec is not a YAML mapping; use `corral update`")
    service = data.get("service")
    if service is None:
        service = data["service"] = {}
    if not isinstance(service, dict):
        raise Conflict("the stored spec's `service` is not a mapping; use `corral update`")
    service.pop("replica_policy", None)
    service["replicas"] = replicas
    return str(yaml.safe_dump(data, sort_keys=False))


async def scale(daemon: Daemon, name: str, replicas: int) -> dict[str, Any]:
    """Give a fixed-size service ``replicas`` replicas (an autoscaled one is refused: its
    size is the autoscaler's, between bounds that only a spec update should move)."""
    spec, row = daemon.current_version(name)
    policy = spec.service.replica_policy
    if policy.autoscaling:
        raise Conflict(
            f"service {name!r} autoscales between {policy.min_replicas} and "
            f"{policy.max_replicas} replicas: change its replica_policy with `corral update`",
        )
    text = scaled_spec(row.spec_yaml, replicas)
    # Over the running version's files and values: its source directory may hold other code
    # by now (or be gone), and the stored spec's secrets are '<redacted>'.
    request = UpdateRequest(
        spec_text=text, source=row.source, base_dir=row.base_dir, files_of=row.version
    )
    return await daemon.update(name, request)
