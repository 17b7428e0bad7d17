"""YAML text -> data and node tree, within bounds that keep a hostile file cheap."""

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

from corral.spec.errors import SpecError, SpecIssue
from corral.spec.locate import loc_text, locate

# A spec is a page of YAML (the biggest SkyServe example: 2 KB, 55 values); these bounds keep a
# hostile or broken file (a "billion laughs" of aliases, a log pasted by mistake, 100000 copies of
# one key) from costing more than a moment. They matter because the daemon validates every spec
# posted to its API on its one event loop: PyYAML's pure-Python parser needs ~1 s per MB on a
# loaded machine and ~30 us per value, so text size and value count are capped while parsing,
# before the work is done, not after. The bounds are far above any real spec.
MAX_SPEC_BYTES = 256 * 1024
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 64


def _check_size(node: Node, depth: int, count: int, source: str) -> None:
    """Refuse a document whose aliases expand past MAX_YAML_DEPTH levels or MAX_YAML_NODES
    values: the loader counts an alias once, its expansion is only seen while walking."""
    if depth > MAX_YAML_DEPTH:
        message = (
            f"the spec nests deeper than {MAX_YAML_DEPTH} levels (an alias that "
            "contains itself?); a service spec is much flatter"
        )
    elif count > MAX_YAML_NODES:
        message = (
            f"the spec expands to more than {MAX_YAML_NODES} YAML values "
            "(aliases repeated too often?); a service spec is much smaller"
        )
    else:
        return
    raise SpecError([SpecIssue("", message, node.start_mark.line + 1)], source)


# YAML's "\0" (or "\x00") escape makes a NUL, which no command, argument, path or environment
# value can hold: accepted, it failed every launch with "ValueError: embedded null byte".
NUL_MESSAGE = "holds a NUL character (\\0), which no command, path or value can carry"
# YAML's "\uD800" escape makes a lone surrogate: no UTF-8 text holds one, so it passed
# `validate` and `up` and then failed every launch with a UnicodeEncodeError (in `run`,
# `setup`, `envs`, `secrets`).
SURROGATE_MESSAGE = (
    "holds a lone surrogate (a \\uD800-\\uDFFF escape), which is not text: no command, "
    "path or value can carry it"
)


def _uncarriable(text: str) -> str | None:
    """Why ``text`` can be no command, argument, path or environment value, or None."""
    if "\0" in text:
        return NUL_MESSAGE
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return SURROGATE_MESSAGE
    return None


def _walk_nodes(root: Node, source: str) -> list[SpecIssue]:
    """Flag duplicate keys (YAML silently keeps the last), NUL characters and lone surrogates,
    and refuse absurdly large documents."""
    issues: list[SpecIssue] = []
    stack: list[tuple[Node, tuple[int | str, ...]]] = [(root, ())]
    checked: set[int] = set()
    count = 0
    while stack:
        node, path = stack.pop()
        count += 1
        _check_size(node, len(path), count, source)
        if isinstance(node, MappingNode):
            first_seen: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, ScalarNode):
                    stack.append((key_node, path))
                    stack.append((value_node, path))
                    continue
                if key_node.tag == "tag:yaml.org,2002:merge":
                    stack.append((value_node, path))
                    continue
                line = key_node.start_mark.line + 1
                if bad := _uncarriable(key_node.value):
                    issues.append(SpecIssue(loc_text(path), bad, line))
                ident = (key_node.tag, key_node.value)
                if id(node) not in checked and ident in first_seen:
                    # The path is known here: searching the tree for it again per duplicate
                    # made a file of 100000 repeated keys take minutes (found by fuzzing).
                    issues.append(
                        SpecIssue(
                            loc_text((*path, key_node.value)),
                            f"'{key_node.value}' is given twice (first at line "
                            f"{first_seen[ident]}); YAML would silently keep only the last one",
                            line,
                        )
                    )
                first_seen.setdefault(ident, line)
                stack.append((value_node, (*path, key_node.value)))
            checked.add(id(node))
        elif isinstance(node, SequenceNode):
            stack.extend((item, (*path, index)) for index, item in enumerate(node.value))
        elif isinstance(node, ScalarNode) and (bad := _uncarriable(node.value)):
            issues.append(SpecIssue(loc_text(path), bad, node.start_mark.line + 1))
    return issues


def _unreadable_scalar(root: Node) -> tuple[str, int | None]:
    """Where the first scalar PyYAML cannot turn into a value is; only used on the error path."""
    stack: list[tuple[Node, tuple[int | str, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(node)
            except Exception:
                return locate(root, path)[0], node.start_mark.line + 1
        elif isinstance(node, MappingNode):
            for key_node, value_node in reversed(node.value):
                key = key_node.value if isinstance(key_node, ScalarNode) else "?"
                stack.append((value_node, (*path, key)))
                stack.append((key_node, path))
        elif isinstance(node, SequenceNode):
            stack.extend((item, (*path, i)) for i, item in reversed(list(enumerate(node.value))))
    return "", None


def _check_flow_depth(text: str, source: str) -> None:
    """Refuse bracket nesting that only an attack has: PyYAML's scanner is quadratic in it.

    Brackets in quoted text or block scalars are counted too; only a run of 200 unclosed ones
    trips this, which no real spec has.
    """
    if text.count("[") + text.count("{") <= 200:
        return
    depth = 0
    for index, char in enumerate(text):
        if char in "[{":
            depth += 1
            if depth > 200:
                line = text.count("\n", 0, index) + 1
                message = "not valid YAML: brackets nested more than 200 deep"
                raise SpecError([SpecIssue("", message, line)], source)
        elif char in "]}" and depth:
            depth -= 1


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document past MAX_YAML_NODES values or MAX_YAML_DEPTH
    levels while it is being built.

    Counting after composing (as :func:`_walk_nodes` does for what aliases expand to) comes too
    late for size: 250 KB of ``[a,a,a,...]`` is 100000 nodes and many seconds of parsing first.
    Stopping the composer stops the parser and scanner with it, since they run on demand.
    Aliases cost one count here (they are references); their expansion is counted later.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._nodes += 1
        self._depth += 1
        try:
            if self._nodes > MAX_YAML_NODES or self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]
                if self._depth > MAX_YAML_DEPTH:
                    message = (
                        f"the spec nests deeper than {MAX_YAML_DEPTH} levels; "
                        "a service spec is much flatter"
                    )
                else:
                    message = (
                        f"the spec has more than {MAX_YAML_NODES} YAML values; "
                        "a service spec is much smaller"
                    )
                raise _Refused(message, line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Refused(Exception):
    """A limit of :class:`_BoundedLoader` was hit; carries the message and the line."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def read_yaml(text: str, source: str) -> tuple[Any, Node, list[SpecIssue]]:
    """YAML text -> (data, node tree for line numbers, duplicate-key issues)."""

    def fail(message: str, line: int | None = None) -> SpecError:
        return SpecError([SpecIssue("", message, line)], source)

    if len(text) > MAX_SPEC_BYTES:
        raise fail(
            f"the spec is {len(text)} characters long, more than the {MAX_SPEC_BYTES} allowed; "
            "a service spec is a short YAML file",
            text.count("\n", 0, MAX_SPEC_BYTES) + 1,
        )
    _check_flow_depth(text, source)
    loader: _BoundedLoader | None = None
    root: Node | None = None
    try:
        loader = _BoundedLoader(text)
        root = loader.get_single_node()
        if root is None:
            raise fail("the spec is empty; it needs at least a `run` command", 1)
        issues = _walk_nodes(root, source)
        data = loader.construct_document(root)
    except SpecError:
        raise
    except _Refused as exc:
        raise fail(exc.message, exc.line) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        line = None if mark is None else mark.line + 1
        hint = TAB_HINT if "'\\t'" in what else _command_hint(text, line)
        issue = SpecIssue("", f"not valid YAML: {what}", line, hint)
        raise SpecError([issue], source) from None
    except ReaderError as exc:
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        raise fail(f"not valid YAML: character {exc.character!r} is not allowed", line) from None
    except yaml.YAMLError as exc:
        raise fail(f"not valid YAML: {exc}") from None
    except RecursionError:
        raise fail("not valid YAML: nested too deeply") from None
    except Exception as exc:
        # PyYAML's constructors let plain exceptions through for values that do not fit their
        # tag: ValueError for a date like 2024-13-01, and (found by fuzzing) AttributeError for
        # `!!timestamp null`, IndexError for an empty `!!int`.
        loc, bad_line = ("", None) if root is None else _unreadable_scalar(root)
        if bad_line is None and root is not None:
            bad_line = root.start_mark.line + 1
        detail = (
            str(exc) if isinstance(exc, ValueError | OverflowError) else "it does not fit its tag"
        )
        message = f"a value cannot be read: {detail}; quote it if it is text"
        raise SpecError([SpecIssue(loc, message, bad_line)], source) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, root, issues


# PyYAML says "found character '\t' that cannot start any token": what, not what to do.
TAB_HINT = "indent and separate with spaces: YAML does not accept a tab there"


def command_block_hint(key: str) -> str:
    """`run: echo "a: b"`: YAML reads the `: ` inside a command as a mapping (or refuses the
    line). The command is meant as text, and a block says so whatever it holds."""
    return (
        f"write the command as a block: `{key}: |` and the command on the next line, indented "
        "(YAML reads `a: b` in a command as a mapping)"
    )


def _command_hint(text: str, line: int | None) -> str | None:
    """A top-level `run:`/`setup:` line YAML refused: most often a `: ` inside the command."""
    lines = text.splitlines()
    if line is None or not 0 < line <= len(lines):
        return None
    key = lines[line - 1].split(":", 1)[0]
    return command_block_hint(key) if key in ("run", "setup") else None
