"""corral's modules and functions stay small enough to read in one sitting, or say why not.

Why: a 1,000-line module or a 150-line function is where a change breaks something three
screens away. The project's rule (docs and issue 13) is no module over ~500 lines and no function
over ~60 lines; this test makes the rule checkable instead of a matter of taste.

Conventions this test enforces, over every module under ``src/corral`` (parsed with ``ast``):

* A module over ``MAX_MODULE_LINES`` lines must state why in its module docstring, on a line of
  its own that starts with ``Size:`` followed by the reason, e.g.
  ``Size: the per-request path is kept in one module, as a call across modules costs ...``.
  An empty reason does not count.
* A function or method (nested ones included) may span at most ``MAX_FUNCTION_LINES`` lines,
  counted from its ``def`` line to its last line (``end_lineno - lineno + 1``; decorators are not
  counted). The exceptions are listed in ``ALLOWED`` with a one-line reason each.

Functions are named ``<path under src/corral>:<qualified name>``, where a method is
``Class.method`` and a nested function ``outer.inner``. An entry of ``ALLOWED`` that no longer
matches a violation fails the test too, so the list cannot rot.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "corral"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# Functions kept long on purpose. Each needs a reason that would convince a reviewer.
ALLOWED: dict[str, str] = {
    "balancer/fast.py:try_request": (
        "the fast path's per-request parse, kept flat: a split adds a call to every request"
        " (measured by bench/balancer.py)"
    ),
    "balancer/fast.py:_send": (
        "the fast path's per-request send, kept flat: a split adds a call to every request"
        " (measured by bench/balancer.py)"
    ),
    "balancer/fast.py:try_response": (
        "the fast path's per-response relay and commit, kept flat: a split adds a call to every"
        " request (measured by bench/balancer.py)"
    ),
}


@dataclass(frozen=True)
class Violation:
    key: str  # "path" for a module, "path:qualname" for a function
    where: str  # "path:line"
    length: int
    limit: int

    def __str__(self) -> str:
        what = "module" if ":" not in self.key else self.key.partition(":")[2]
        return f"{self.where}: {what} is {self.length} lines (limit {self.limit})"


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _states_size_reason(tree: ast.Module) -> bool:
    doc = ast.get_docstring(tree) or ""
    for line in doc.splitlines():
        head, sep, reason = line.strip().partition("Size:")
        if sep and not head and reason.strip():
            return True
    return False


def violations() -> list[Violation]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and not _states_size_reason(tree):
            found.append(Violation(rel, f"{rel}:1", lines, MAX_MODULE_LINES))
        for name, node in _functions(tree):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                where = f"{rel}:{node.lineno}"
                found.append(Violation(f"{rel}:{name}", where, length, MAX_FUNCTION_LINES))
    return found


def test_modules_and_functions_are_small_or_say_why() -> None:
    bad = [v for v in violations() if v.key not in ALLOWED]
    assert not bad, (
        f"{len(bad)} module(s)/function(s) over the size limits; split them, or for a module add a"
        " 'Size: <reason>' line to its docstring (see this test's docstring):\n"
        + "\n".join(f"  {v}" for v in bad)
    )


def test_allowlists_name_only_current_violations() -> None:
    current = {v.key for v in violations()}
    stale = sorted(set(ALLOWED) - current)
    assert not stale, (
        "these entries of ALLOWED in tests/test_code_shape.py are no longer"
        " violations (split or renamed); remove them:\n" + "\n".join(f"  {k}" for k in stale)
    )


def test_every_allowed_function_has_a_reason() -> None:
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_checker_sees_long_functions_and_unexplained_modules(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f'"""Doc."""\nclass C:\n    def f(self):\n{body}')
    ((name, node),) = _functions(tree)
    assert name == "C.f"
    assert node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    assert not _states_size_reason(tree)
    assert _states_size_reason(ast.parse('"""Doc.\n\nSize: kept whole for speed.\n"""'))
    assert not _states_size_reason(ast.parse('"""Doc.\n\nSize:\n"""'))


def test_no_patch_leftovers_in_the_package() -> None:
    """A `patch` run leaves `*.orig` / `*.rej` copies beside the files it changed: stale
    second copies of modules that no check above reads (they are not `*.py`)."""
    leftovers = [
        str(path.relative_to(PACKAGE))
        for pattern in ("*.orig", "*.rej")
        for path in PACKAGE.rglob(pattern)
    ]
    assert leftovers == []
