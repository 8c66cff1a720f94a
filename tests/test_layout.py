"""The package's layout (issue 14): no module over MAX_LINES lines, no import cycle.

Both are read from the source, not from an imported package: the import graph is built
with ``ast`` from every ``.py`` under ``remote_dspark/``, with every import statement an
edge wherever it sits (a lazy import inside a function is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "remote_dspark"
MAX_LINES = 450


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, from every import statement in it.

    ``import a.b`` and ``from a.b import c`` are edges to ``a.b``, or to ``a.b.c`` when
    that is a module (``from . import x`` with x a submodule is an edge to x). Relative
    imports are resolved against the importing module's package. Imports from outside
    the package, and a module's implicit import of its parent packages, are not edges.
    """
    files = module_files(root, package)

    def known(name: str | None) -> str | None:
        """``name``, or its nearest enclosing module of the package (None if outside)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in files else known(base))
        edges.discard(None)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each as one cycle
    through its modules (``a -> b -> ... -> a``), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few dozen modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_one_cycle(graph, c) for c in found)


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to it, inside it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# --- module size ------------------------------------------------------------------------


def line_counts() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in module_files().values()}


def test_no_module_is_over_the_line_limit():
    over = {name: n for name, n in line_counts().items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines (split by concern): {over}"


MAX_C_LINES = 650


def test_no_c_file_is_over_its_line_limit():
    files = sorted((ROOT / "remote_dspark" / "native").glob("*.[ch]"))
    assert {p.name for p in files} >= {"hostflag.c", "tcp_round.c", "hostflag.h"}
    over = {p.name: n for p in files if (n := len(p.read_text().splitlines())) > MAX_C_LINES}
    assert not over, f"over {MAX_C_LINES} lines (split by concern): {over}"


# --- import cycles ----------------------------------------------------------------------


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    """The checker itself, on a small package: a cycle closed only by a function-level
    ``from . import x`` is found; ``from .pkg import name`` is an edge to the package."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import helper\n")
    (pkg / "sub" / "__init__.py").write_text("def helper():\n    from ..b import x\n")
    (pkg / "b.py").write_text("import os\nx = 1\n\ndef late():\n    from . import a\n")
    (pkg / "c.py").write_text("from p.sub import helper\nfrom . import b\n")
    graph = import_graph(tmp_path, "p")
    assert graph == {"p": set(), "p.a": {"p.sub"}, "p.sub": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.sub", "p.b"}}
    assert cycles(graph) == [["p.a", "p.sub", "p.b", "p.a"]]
    (pkg / "b.py").write_text("x = 1\n")
    assert cycles(import_graph(tmp_path, "p")) == []


# --- the documented layers --------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"


def documented_layers() -> list[tuple[str, list[str]]]:
    """The ```layers block of docs/design.md: (layer, dotted module names), bottom first."""
    text = DESIGN.read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    layers = []
    for line in block.strip().splitlines():
        name, _, modules = line.partition(":")
        layers.append((name.strip(), [m if m == PACKAGE else f"{PACKAGE}.{m}" for m in modules.split()]))
    return layers


def test_the_design_documents_every_module_once():
    listed = [m for _, modules in documented_layers() for m in modules]
    assert len(listed) == len(set(listed)), "listed twice: " + str(sorted({m for m in listed if listed.count(m) > 1}))
    actual = set(module_files())
    assert set(listed) == actual, (
        f"docs/design.md's layers lack {sorted(actual - set(listed))} and list "
        f"{sorted(set(listed) - actual)}, which do not exist"
    )


def test_no_import_goes_up_a_layer():
    layer_of = {m: i for i, (_, modules) in enumerate(documented_layers()) for m in modules}
    names = [name for name, _ in documented_layers()]
    up = sorted(
        f"{m} ({names[layer_of[m]]}) imports {d} ({names[layer_of[d]]})"
        for m, deps in import_graph().items()
        for d in deps
        if m in layer_of and d in layer_of and layer_of[d] > layer_of[m]
    )
    assert not up, "imports that go up a layer: " + "; ".join(up)
