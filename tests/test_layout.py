"""The package's layout: the parts of docs/design.md and what each may import, no import
cycle, no private name imported across modules, no module over MAX_LINES lines and no
function over MAX_FUNCTION_LINES (argparse builders excepted).

All of it is read from the source, not from an imported package: the import graph is
built with ``ast`` from every ``.py`` under ``remote_dspark/``, with every import
statement an edge wherever it sits (a lazy import inside a function is still a
dependency), and so is every ``import_module("remote_dspark...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
            if dynamic := _import_module_literal(node):
                edges.add(known(dynamic) if dynamic.split(".")[0] == package else None)
            elif isinstance(node, ast.Import):
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


def _import_module_literal(node: ast.AST) -> str | None:
    """The name in ``import_module("a.b")`` or ``importlib.import_module("a.b")`` (a
    string literal), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    value = node.args[0].value
    return value if name == "import_module" and isinstance(value, str) else None


def private_imports(root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    """``from <module of the package> import _name`` anywhere in the package: a private
    name used outside the module that owns it."""
    found = []
    for module, path in module_files(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == package):
                found += [f"{module} imports {alias.name}" for alias in node.names if alias.name.startswith("_")]
    return sorted(found)


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


# --- the parts and what each may import ----------------------------------------------

DESIGN = ROOT / "docs" / "design.md"


def documented_parts(text: str | None = None, block: str = "parts") -> dict[str, set[str]]:
    """A ```parts block of docs/design.md (``block``: ``parts`` for the package,
    ``engine-parts`` for the engine's folders): part -> the parts it may import."""
    text = DESIGN.read_text() if text is None else text
    body = text.split(f"```{block}\n", 1)[1].split("```", 1)[0]
    parts = {}
    for line in body.strip().splitlines():
        name, _, allowed = line.partition(":")
        parts[name.strip()] = set(allowed.split())
    return parts


def part_of(module: str, depth: int = 1) -> str:
    """A module's part: its folder (or module) ``depth`` levels under the package; a
    package at that level or above is its own part (``__init__`` below the top)."""
    names = module.split(".")
    if len(names) > depth:
        return names[depth]
    return names[0] if depth == 1 else "__init__"


# A level of parts: the block naming them, the package they part, and its depth.
LEVELS = {"parts": (PACKAGE, 1), "engine-parts": (f"{PACKAGE}.engine", 2)}


def level_graph(graph: dict[str, set[str]], block: str) -> dict[str, set[str]]:
    """The import graph among the modules ``block`` parts (all of the package, or the
    engine's modules), other modules left out."""
    package, _ = LEVELS[block]
    inside = [m for m in graph if m == package or m.startswith(package + ".")]
    return {m: {d for d in graph[m] if d == package or d.startswith(package + ".")} for m in inside}


def part_graph(graph: dict[str, set[str]], depth: int = 1) -> dict[str, set[str]]:
    """part -> the other parts its modules import."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(part_of(module, depth), set()).update(part_of(d, depth) for d in deps)
    return {part: deps - {part} for part, deps in out.items()}


def forbidden_imports(graph: dict[str, set[str]], parts: dict[str, set[str]], depth: int = 1) -> list[str]:
    """Every import between parts that the block does not allow."""
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if part_of(m, depth) != part_of(d, depth) and part_of(d, depth) not in parts.get(part_of(m, depth), set())
    )


LEVEL_IDS = pytest.mark.parametrize("block", list(LEVELS))


@LEVEL_IDS
def test_the_design_lists_every_part_once(block):
    body = DESIGN.read_text().split(f"```{block}\n", 1)[1].split("```", 1)[0]
    names = [line.partition(":")[0].strip() for line in body.strip().splitlines()]
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    package, depth = LEVELS[block]
    actual = {part_of(m, depth) for m in level_graph(import_graph(), block)} - ({PACKAGE} if depth == 1 else set())
    assert set(names) == actual, (
        f"docs/design.md's {block} lack {sorted(actual - set(names))} and list {sorted(set(names) - actual)}, "
        "which do not exist"
    )
    unknown = {
        p: sorted(allowed - set(names)) for p, allowed in documented_parts(block=block).items() if allowed - set(names)
    }
    assert not unknown, f"parts allowed to import parts that do not exist: {unknown}"


@LEVEL_IDS
def test_no_part_imports_a_part_it_may_not(block):
    depth = LEVELS[block][1]
    bad = forbidden_imports(level_graph(import_graph(), block), documented_parts(block=block), depth)
    assert not bad, "imports the parts block does not allow: " + "; ".join(bad)


@LEVEL_IDS
def test_the_parts_are_layers(block):
    """The allowed imports have no cycle, so the parts stack in layers."""
    found = cycles(documented_parts(block=block))
    assert not found, "parts that may import each other: " + "; ".join(" -> ".join(c) for c in found)


@LEVEL_IDS
def test_the_allowed_imports_are_the_ones_used(block):
    """Each part's list is what it imports, no more: a stale allowance would let an
    import in unnoticed."""
    depth = LEVELS[block][1]
    used = part_graph(level_graph(import_graph(), block), depth)
    loose = {p: sorted(allowed - used.get(p, set())) for p, allowed in documented_parts(block=block).items()}
    loose = {p: extra for p, extra in loose.items() if extra and p != "integrations"}
    assert not loose, f"allowed but not imported: {loose}"


def test_no_private_name_is_imported_from_another_module():
    found = private_imports()
    assert not found, "private names used outside their module: " + "; ".join(found)


def test_the_checks_see_dynamic_imports_forbidden_parts_and_private_names(tmp_path):
    """The checkers themselves, on a small package: an ``import_module`` literal is an
    edge, an import the block does not allow is named, a private import is found."""
    pkg = tmp_path / "q"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("import importlib\n\ndef f():\n    return importlib.import_module('q.high')\n")
    (pkg / "high.py").write_text("from .low.a import _hidden\n")
    graph = import_graph(tmp_path, "q")
    assert graph["q.low.a"] == {"q.high"} and graph["q.high"] == {"q.low.a"}
    parts = documented_parts("```parts\nlow:\nhigh: low\n```\n")
    assert forbidden_imports(graph, parts) == ["q.low.a imports q.high"]
    assert private_imports(tmp_path, "q") == ["q.high imports _hidden"]
    assert cycles(parts) == [] and cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    # One level down: q.low's modules by their folder under it, q.low itself its __init__.
    (pkg / "low" / "b.py").write_text("from .a import f\n")
    low = {m: {d for d in deps if d.startswith("q.low")} for m, deps in import_graph(tmp_path, "q").items()}
    low = {m: deps for m, deps in low.items() if m.startswith("q.low")}
    assert part_of("q.low", 2) == "__init__" and part_of("q.low.a", 2) == "a"
    assert forbidden_imports(low, {"a": set(), "b": set()}, depth=2) == ["q.low.b imports q.low.a"]
    assert forbidden_imports(low, {"a": set(), "b": {"a"}}, depth=2) == []


# --- function size ----------------------------------------------------------------------

MAX_FUNCTION_LINES = 80
# argparse builders: one add_argument after another, long by nature and flat
PARSER_BUILDERS = ("add_parser", "add_parsers", "build_parser")


def long_functions(root: Path = ROOT, package: str = PACKAGE) -> dict[str, int]:
    out = {}
    for module, path in module_files(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in PARSER_BUILDERS:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{module}.{node.name}"] = n
    return out


def test_no_function_is_over_the_line_limit():
    over = long_functions()
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split by concern): {over}"


# --- what each package says it holds ----------------------------------------------------


def package_listing(init: Path) -> tuple[set[str], set[str]]:
    """``(held, named)`` for a package: the modules and subpackages it holds, and those
    its ``__init__`` docstring names (``:mod:`.x``` or a word of it; the rows of a
    table, ``x`` or ``x/`` then two spaces at the start of a line, must each be held)."""
    import re

    folder = init.parent
    held = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    held |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    body = ast.parse(init.read_text()).body
    first = body[0].value if body and isinstance(body[0], ast.Expr) else None
    doc = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    rows = set(re.findall(r"^ {0,4}(\w+)/? {2,}\S", doc, re.M)) | set(re.findall(r":mod:`\.(\w+)", doc))
    words = set(re.findall(r"\w+", doc))
    return held, {h for h in held if h in words} | rows


def test_every_package_names_what_it_holds():
    """A newcomer opens a folder's ``__init__`` and finds each of its modules named, and
    no row for one that is not there."""
    wrong = {}
    for init in sorted((ROOT / PACKAGE).rglob("__init__.py")):
        held, named = package_listing(init)
        if held != named:
            wrong[str(init.parent.relative_to(ROOT))] = {
                "not named": sorted(held - named),
                "not held": sorted(named - held),
            }
    assert not wrong, f"packages whose docstring does not list what they hold: {wrong}"


def test_the_listing_check_sees_a_missing_and_a_stale_row(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("")
    (pkg / "__init__.py").write_text('"""The parts.\n\n    a     one\n    gone  a row for nothing\n"""\n')
    held, named = package_listing(pkg / "__init__.py")
    assert held == {"a", "sub"} and named == {"a", "gone"}
    (pkg / "__init__.py").write_text('"""The parts: :mod:`.a` and the sub/ folder.\n\n    sub/  two\n"""\n')
    assert package_listing(pkg / "__init__.py") == ({"a", "sub"}, {"a", "sub"})


# --- class names ------------------------------------------------------------------------


def duplicate_classes(root: Path = ROOT, package: str = PACKAGE) -> dict[str, list[str]]:
    """class name -> the modules that define it, for every name defined more than once
    anywhere in the package (nested classes included): each name says one thing."""
    where: dict[str, list[str]] = {}
    for module, path in module_files(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    return {name: modules for name, modules in sorted(where.items()) if len(modules) > 1}


def test_no_class_name_is_defined_twice():
    found = duplicate_classes()
    assert not found, f"class names defined more than once (name each for what it is): {found}"


def test_the_class_check_sees_nested_and_same_module_twins(tmp_path):
    """The checker itself, on a small package: a name in two modules, and a nested class
    sharing a top-level name in one module, are found; distinct names are not."""
    pkg = tmp_path / "r"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("class Top:\n    pass\n")
    (pkg / "a.py").write_text("class Row:\n    pass\n\nclass Only:\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    class Row:\n        pass\n")
    (pkg / "c.py").write_text("class Twice:\n    class Twice:\n        pass\n")
    assert duplicate_classes(tmp_path, "r") == {"Row": ["r.a", "r.sub.b"], "Twice": ["r.c", "r.c"]}
    (pkg / "sub" / "b.py").write_text("class BRow:\n    pass\n")
    (pkg / "c.py").write_text("")
    assert duplicate_classes(tmp_path, "r") == {}
