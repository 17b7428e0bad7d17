"""Where a field sits in the YAML text: its dotted path and line, for every issue shown.

pydantic reports a problem as a path of keys into the data, which no longer knows where it came
from; the node tree PyYAML composed on the way still does. So the reader keeps that tree next to
the data, and these functions walk it along an issue's path to the line a user can jump to.
"""

from collections.abc import Sequence
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


def locate(root: Node | None, loc: Sequence[int | str]) -> tuple[str, int | None]:
    """Dotted path and YAML line of ``loc``; the nearest present parent's line when absent."""
    parts: list[str] = []
    node = root
    line: int | None = None
    for part in loc:
        if part == "[key]":  # pydantic's marker for "the key itself": same line
            continue
        child: Node | None = None
        if isinstance(node, MappingNode):
            found = False
            shown = key_text(part)
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.value == str(part):
                    child, found = value_node, True
                    line = key_node.start_mark.line + 1
            if not found:
                # A key YAML typed (``true:``, ``1:``, ``~:``) reaches pydantic as a value, and
                # its error paths as that value's str() ("None" for ``~``), neither what the
                # file says: match it by value, and show it as written.
                for key_node, value_node in node.value:
                    if isinstance(key_node, ScalarNode) and _typed_key_is(key_node, part):
                        child = value_node
                        line = key_node.start_mark.line + 1
                        shown = key_text(key_node.value or "~")
            parts.append(f".{shown}" if parts else shown)
        elif (
            isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
            parts.append(f"[{part}]")
        elif isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(f".{key_text(part)}" if parts else key_text(part))
        node = child
    return "".join(parts), line


def _typed_key_is(key_node: ScalarNode, part: int | str) -> bool:
    """Whether a key YAML did not read as text is ``part``, or what pydantic calls it."""
    value = _scalar_value(key_node)
    if isinstance(value, str) or value is _UNREADABLE:
        return False  # a text key is matched by its text
    # pydantic names most keys by str() (``~`` as "None"), a date by its repr().
    return bool(value == part) or str(part) in (str(value), repr(value))


def _scalar_value(node: ScalarNode) -> Any:
    """The value PyYAML builds from one scalar, or a marker when it cannot build one."""
    try:
        return yaml.SafeLoader("").construct_object(node)
    except Exception:
        return _UNREADABLE


_UNREADABLE = object()


def loc_text(path: Sequence[int | str]) -> str:
    """``path`` (mapping keys and sequence indexes) as the dotted text issues use."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(f".{key_text(part)}" if parts else key_text(part))
    return "".join(parts)


def key_text(key: object) -> str:
    """A key as a path shows it: cut short, so a 100 KB key does not make a 100 KB path."""
    text = str(key)
    return text if len(text) <= 60 else text[:57] + "..."


def child_node(node: Node | None, key: str) -> Node | None:
    found: Node | None = None
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.value == key:
                found = value_node
    return found


def keep_text_as_written(node: Node | None, values: Any) -> None:
    """Use the text the user wrote for numbers and booleans in ``values`` (a dict).

    For env vars and headers YAML's typing only loses information: ``PYTHON: 3.10`` would
    become "3.1" and ``DEBUG: yes`` "True".
    """
    if not isinstance(node, MappingNode) or not isinstance(values, dict):
        return
    for key_node, value_node in node.value:
        if not (isinstance(key_node, ScalarNode) and isinstance(value_node, ScalarNode)):
            continue
        current = values.get(key_node.value)
        if isinstance(current, bool | int | float):
            values[key_node.value] = value_node.value
