"""corral's modules import one way: no import circle, and the top layers in their order.

Why: a circle between modules (the daemon importing the API that imports the daemon) makes
each half impossible to change, test or read alone, and the order of layers is what
docs/architecture.md promises a newcomer. Every import counts, also one inside a function;
only ``if TYPE_CHECKING:`` blocks (annotations, never run) and a module's own parent packages
(Python initialises those first whatever is written) are left out. Inside the balancer even
those blocks count: a lower module names what it needs of a higher one by a Protocol
(corral.balancer.roles), never by the higher one's class.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(
    name: str, path: Path, modules: dict[str, Path], type_checking: bool = False
) -> set[str]:
    """What ``name`` imports; with ``type_checking``, also inside ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    seen: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if not type_checking and (
                getattr(test, "id", None) == "TYPE_CHECKING"
                or getattr(test, "attr", None) == "TYPE_CHECKING"
            ):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            seen.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                seen.add(sub if sub in modules else module)

    Visitor().visit(ast.parse(path.read_text()))
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in seen if m in modules and m != name and m not in ancestors}


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, type_checking) for name, path in modules.items()}


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    todo, reached = [start], set()
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    return reached


def test_no_import_circle() -> None:
    graph = _graph()
    assert "corral.daemon" in graph and "corral.balancer.fast" in graph
    circles = sorted(name for name in graph if name in _reaches(graph, name))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_balancer_has_no_circle_even_in_annotations() -> None:
    """The balancer's modules form no circle with ``if TYPE_CHECKING:`` imports counted: no
    module names, even in an annotation, a class of a module that imports it (``LoadBalancer``
    in ``client``, ``ClientConnection`` in ``exchange`` ...; it names a Protocol of
    corral.balancer.roles instead), so each reads from the bottom up and one request can be
    followed from accept to answer."""
    graph = _graph(type_checking=True)
    balancer = {
        name: {m for m in imported if m.startswith("corral.balancer.")}
        for name, imported in graph.items()
        if name.startswith("corral.balancer.")
    }
    circles = sorted(name for name in balancer if name in _reaches(balancer, name))
    assert not circles, f"balancer modules on an import circle, annotations counted: {circles}"
    # annotations were counted: exchange imports roles only under TYPE_CHECKING
    assert "corral.balancer.roles" in balancer["corral.balancer.exchange"]


def test_the_top_layers_point_down() -> None:
    graph = _graph()
    below_api = _reaches(graph, "corral.daemon") | {"corral.daemon"}
    assert "corral.api" not in below_api and "corral.bootstrap" not in below_api
    assert "corral.bootstrap" not in _reaches(graph, "corral.api")
    assert {"corral.api", "corral.daemon"} <= _reaches(graph, "corral.bootstrap")
    # lower layers never reach the controller or anything above it
    for low in ("corral.spec", "corral.state", "corral.replicas", "corral.balancer.proxy"):
        assert "corral.controller" not in _reaches(graph, low), low
    # a controller drives a backend through the Infra protocol, never by its class
    assert not {"corral.infra.local", "corral.infra.ray"} & _reaches(graph, "corral.controller")
    # the spec says what a service is; a backend's rules for it live with the backend
    assert not {m for m in _reaches(graph, "corral.spec") if m.startswith("corral.infra")}


def test_the_floor_imports_nothing_above_it() -> None:
    """Process facts, ports and the spec are what every layer stands on: they import nothing of
    corral but their own parts, so a job, a backend or the CLI can use them without a cycle."""
    graph = _graph()
    floor = {"corral.procfs": set(), "corral.ports": set(), "corral.spec": {"corral.spec"}}
    for low, own in floor.items():
        outside = {m for m in _reaches(graph, low) if not any(m.startswith(p) for p in own)}
        assert not outside, f"{low} reaches {sorted(outside)}"
    # a job and its command stand on capture and procfs only
    for mod in ("corral.job", "corral.jobcommand", "corral.jobs"):
        assert _reaches(graph, mod) <= {
            "corral.capture",
            "corral.procfs",
            "corral.job",
            "corral.jobcommand",
        }, mod


DOMAIN = ("corral.errors", "corral.admission", "corral.daemon", "corral.controller")


def _is_http(module: str) -> bool:
    """The HTTP layer: the app, its routes, the one table from domain errors to statuses,
    the body reader and the dashboard."""
    return module in ("corral.api", "corral.httpbody") or module.startswith(
        ("corral.api_", "corral.dashboard")
    )


def test_the_api_imports_the_domain_errors_never_the_reverse() -> None:
    graph = _graph()
    assert graph["corral.errors"] == set(), "domain errors import nothing of corral's"
    assert "corral.errors" in graph["corral.api_errors"]
    assert "corral.api_errors" in _reaches(graph, "corral.api")
    for module in DOMAIN:
        http = sorted(m for m in _reaches(graph, module) if _is_http(m))
        assert not http, f"{module} reaches the HTTP layer: {http}"


ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


def _table_rows() -> list[tuple[set[str], str]]:
    """docs/architecture.md's module table: per row, the modules it names (a ``pkg/`` row names
    the package and every module in it) and its "imports from corral" cell."""
    import re

    modules = _modules()
    rows = []
    for line in ARCHITECTURE.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        named: set[str] = set()
        for item in re.findall(r"`([^`]+)`", cells[0]):
            name = "corral." + item.strip("/").replace("/", ".")
            assert name in modules, f"the module table names {item!r}: no such module"
            if item.endswith("/"):
                named |= {m for m in modules if m == name or m.startswith(name + ".")}
            else:
                named.add(name)
        rows.append((named, cells[-1]))
    return rows


def test_the_module_table_names_every_module_once() -> None:
    """Every module has its row (a reader looks for it there), and only one; a package's
    ``__init__`` needs none unless the package has a row of its own (``balancer/``)."""
    seen: dict[str, int] = {}
    for named, _ in _table_rows():
        for name in named:
            seen[name] = seen.get(name, 0) + 1
    modules = {
        name
        for name, path in _modules().items()
        if path.name != "__init__.py" and name != "corral.__main__"
    }
    missing = sorted(modules - set(seen))
    twice = sorted(m for m, n in seen.items() if n > 1)
    assert not missing, f"modules docs/architecture.md's table does not name: {missing}"
    assert not twice, f"modules named by two rows of docs/architecture.md's table: {twice}"


def test_the_module_table_says_what_each_row_imports() -> None:
    """Where a row's "imports from corral" cell is a plain list ("nothing", or module names;
    ``infra.local_*`` for a family; a package for any of its modules; words in parentheses
    are comments), it is exactly what the row's modules import of the rest of corral, as this
    file counts imports. A cell in words ("controller and all it uses") is not checked."""
    import re

    graph = _graph()
    wrong = []
    for named, cell in _table_rows():
        plain = re.sub(r"\([^)]*\)", "", cell).strip()
        if plain == "nothing":
            listed: list[str] = []
        elif re.fullmatch(r"[\w.*]+(\s*,\s*[\w.*]+)*", plain):
            listed = [x.strip() for x in plain.split(",")]
        else:
            continue
        imported = {m for name in named for m in graph[name]} - named

        def covers(entry: str, module: str) -> bool:
            full = "corral." + entry
            if full.endswith("*"):
                return module.startswith(full[:-1])
            return module == full or module.startswith(full + ".")

        uncovered = sorted(m for m in imported if not any(covers(e, m) for e in listed))
        unused = sorted(e for e in listed if not any(covers(e, m) for m in imported))
        if uncovered or unused:
            rows = ", ".join(sorted(n.removeprefix("corral.") for n in named))
            wrong.append(f"{rows}: not listed {uncovered}, listed but not imported {unused}")
    assert not wrong, "docs/architecture.md's module table is out of date:\n" + "\n".join(wrong)
