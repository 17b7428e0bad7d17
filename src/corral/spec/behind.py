"""The spec behind its errors: what is left to check once the fields pydantic refused are
taken out.

Why: `corral validate` promises every problem of a file at once, but the checks after parsing
(workdir, `run` on a fixed port, the machine's resources, a model this machine cannot run) and
the warnings (fields kept without effect) need a parsed spec. A spec with one bad field had
none, so a user fixed `max_replicas`, ran `validate` again, and only then learnt that the
workdir is missing, the port is fixed and `use_spot` means nothing here. So each refused field
is left out of the data (its section when a field it needs is missing) and the rest is
parsed again: what that finds is real, since nothing was made up in its place.
"""

import copy
from typing import Any

from pydantic import ValidationError

from corral.spec.model import ServiceSpec
from corral.spec.service import TARGETS

# Each round leaves out what the last one refused; a check the first round never reached
# (one that needs a sibling to be valid) may refuse something else in the next.
_MAX_ROUNDS = 8
# Left out of a mapping's list: removed from the list once every path of a round is taken.
_GONE = object()

Path = tuple[Any, ...]  # the data's own keys (a null key is None) and list indexes


def spec_behind(data: Any, errors: list[Any]) -> ServiceSpec | None:
    """``data`` parsed without what ``errors`` (pydantic's, for ``data``) refuse, or None when
    that leaves nothing to check (a refused `run`, a problem of the whole spec)."""
    if any(tuple(error["loc"])[:1] == ("infra",) for error in errors):
        # Left out, infra would be local, and the local rules (one machine's ports and GPUs)
        # would judge a spec meant for another backend: problems that are not its own.
        return None
    data = copy.deepcopy(data)
    for _ in range(_MAX_ROUNDS):
        paths: set[Path] = set()
        for error in errors:
            found = _refused_paths(data, _data_loc(tuple(error["loc"])))
            if not found:
                return None
            paths.update(found)
        if not _leave_out(data, paths):
            return None  # no progress: the same errors would come back
        try:
            return ServiceSpec.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
    return None


def _data_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """pydantic's path as the data's: the per-accelerator QPS map is written as
    target_qps_per_replica, and "[key]" (a refused key) points at the key's own entry."""
    renamed = ("target_qps_per_replica" if p == "target_qps_per_accelerator" else p for p in loc)
    return tuple(p for p in renamed if p != "[key]")


def _refused_paths(data: Any, loc: tuple[int | str, ...]) -> list[Path]:
    """The entries of ``data`` to leave out for an error at ``loc``: the field itself; a
    missing field's section (nothing is guessed for it), except a missing max_replicas, whose
    autoscaling targets go instead (the policy stays at min_replicas, as without them); a
    shorthand (``readiness_probe: /x y``) whole. Empty: the whole spec, nothing to leave out."""
    node: Any = data
    path: Path = ()
    for index, part in enumerate(loc):
        if isinstance(node, dict):
            key = _key_of(node, part)
            if key is _GONE:
                if index == len(loc) - 1 and part == "max_replicas":
                    targets: list[Path] = [(*path, name) for name in TARGETS if name in node]
                    if targets:
                        return targets
                return [path] if path else []
            path, node = (*path, key), node[key]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = (*path, part), node[part]
        else:
            break  # a value where the error looks inside it: a shorthand, left out whole
    return [path] if path else []


def _key_of(node: dict[Any, Any], part: int | str) -> Any:
    """The key of ``node`` that pydantic's ``part`` names (it shows ``~:`` as "None", a date
    by its repr()), or _GONE."""
    if part in node:
        return part
    return next((key for key in node if str(part) in (str(key), repr(key))), _GONE)


def _leave_out(data: Any, paths: set[Path]) -> bool:
    """Remove every entry ``paths`` name from ``data``; whether any was there to remove."""
    lists: list[list[Any]] = []
    removed = False
    for path in sorted(paths, key=len):  # a section first: its fields go with it
        node = data
        for part in path[:-1]:
            node = node.get(part, _GONE) if isinstance(node, dict) else _item(node, part)
        last = path[-1]
        if isinstance(node, dict) and last in node:
            del node[last]
            removed = True
        elif isinstance(node, list) and _item(node, last) is not _GONE:
            node[last] = _GONE
            lists.append(node)
            removed = True
    for items in lists:
        items[:] = [item for item in items if item is not _GONE]
    return removed


def _item(node: Any, part: Any) -> Any:
    """``node[part]`` of a list, or _GONE."""
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return _GONE
