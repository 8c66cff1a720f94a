"""The proxy process never imports torch, numpy or prometheus_client: it runs on the
standard library, so it starts in tens of milliseconds for a respawn.

One check, in one fresh interpreter (``python -I``, the worktree first on its path),
over modules derived from the package rather than listed: every module of the parts
``proxy_proc`` may import, directly or through others (docs/design.md's parts block),
and every module ``remote_dspark`` and ``remote_dspark.proxy_proc`` reach through their
imports, lazy ones included (``test_layout.import_graph``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from test_layout import PACKAGE, ROOT, documented_parts, import_graph, module_files, part_of

HEAVY = ("torch", "numpy", "prometheus_client")
ROOTS = (PACKAGE, f"{PACKAGE}.proxy_proc")

CHILD = """
import importlib, json, sys
sys.path.insert(0, {root!r})
pulled = {{}}
for name in {modules!r}:
    before = set(sys.modules)
    importlib.import_module(name)
    heavy = [m for m in {heavy!r} if m in sys.modules and m not in before]
    if heavy:
        pulled[name] = heavy
print(json.dumps(pulled))
"""


def proxy_closure() -> list[str]:
    """The modules the proxy process may load: every module of the parts ``proxy_proc``
    may import (transitively), and the package's modules the roots reach through any
    import statement."""
    allowed, parts, todo = documented_parts(), set(), ["proxy_proc"]
    while todo:
        part = todo.pop()
        if part not in parts:
            parts.add(part)
            todo.extend(allowed[part])
    modules = {m for m in module_files() if part_of(m) in parts}
    graph, reached, todo = import_graph(), set(), list(ROOTS)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    return sorted(modules | reached)


def test_the_proxy_closure_imports_no_torch_numpy_or_prometheus():
    modules = proxy_closure()
    # The derivation itself: the roots, what the proxy loop uses, both transports.
    assert {
        *ROOTS,
        f"{PACKAGE}.native",
        f"{PACKAGE}.proxy.tcp_round",
        f"{PACKAGE}.proxy.spawn",
        f"{PACKAGE}.transport.ofl",
        f"{PACKAGE}.wire",
    } <= set(modules)
    code = CHILD.format(root=str(ROOT), modules=modules, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {}, "modules of the proxy's closure that import a heavy dependency"
