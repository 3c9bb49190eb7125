"""The package's imports point one way: no module imports itself back through others (any import,
at module level, in a function or for type checking), and model/'s rooms import downward only:
loading -> models -> layers -> kernels (model/config.py and model/__init__.py serve all four)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import kvmemo

PACKAGE = Path(kvmemo.__file__).parent
ROOMS = ("loading", "models", "layers", "kernels")  # each may import the ones after it


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str) -> set[str]:
    """Every absolute name an import statement anywhere in `source` names (module.name too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """module -> the package's modules it imports. Importing a package's own ancestors is not an
    edge: Python runs a parent's __init__ before any child, whoever imports whom."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for imported in imported_names(source):
            target = imported
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports from one room of kvmemo.model into a room before it."""

    def room(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["kvmemo", "model"] or len(parts) < 3 or parts[2] not in ROOMS:
            return None
        return ROOMS.index(parts[2])

    found = []
    for module, targets in graph.items():
        for target in targets:
            here, there = room(module), room(target)
            if here is not None and there is not None and there < here:
                found.append(f"{module} imports {target}")
    return sorted(found)


def package_sources() -> dict[str, str]:
    return {module_name(p, PACKAGE): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_the_package_has_no_import_cycle():
    sources = package_sources()
    assert len(sources) > 100, "the scan found too few modules to mean anything"
    assert cycles(import_graph(sources)) == []


def test_model_rooms_import_downward_only():
    graph = import_graph(package_sources())
    for name in ROOMS:
        assert f"kvmemo.model.{name}" in graph, f"model/{name}/ is missing its __init__.py"
    assert upward_imports(graph) == []


def test_the_scans_catch_a_cycle_and_an_upward_import():
    sources = {
        "kvmemo": "",
        "kvmemo.a": "from kvmemo.b import x\n",
        "kvmemo.b": "def f():\n    import kvmemo.c\n",
        "kvmemo.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvmemo import a\n",
        "kvmemo.d": "import kvmemo\nfrom kvmemo.a import y\n",  # a parent and a leaf: no cycle
        "kvmemo.model": "",
        "kvmemo.model.config": "",
        "kvmemo.model.kernels.k": "from kvmemo.model.layers.basic import RMSNorm\n",
        "kvmemo.model.layers.basic": "from kvmemo.model.kernels import k\n"
                                     "from kvmemo.model.config import C\n",
        "kvmemo.model.loading.loader": "from kvmemo.model.layers.basic import RMSNorm\n",
    }
    graph = import_graph(sources)
    assert cycles(graph) == [["kvmemo.a", "kvmemo.b", "kvmemo.c"],
                             ["kvmemo.model.kernels.k", "kvmemo.model.layers.basic"]]
    assert upward_imports(graph) == [
        "kvmemo.model.kernels.k imports kvmemo.model.layers.basic"]


def test_config_reads_only_torch_free_leaves():
    """config.py validates options against the values their owners define (attention backend
    names, hash algorithms, kv_store and speculative specs), but it sits below everything that
    reads a config: all it pulls in, transitively, imports the standard library only at module
    level (an optional package, xxhash, is imported where it is used)."""
    import sys

    def module_level_names(source: str) -> set[str]:
        body = ast.parse(source).body
        return imported_names(ast.unparse(ast.Module(
            [n for n in body if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[])))

    sources = package_sources()
    graph = import_graph(sources)
    closure, todo = set(), ["kvmemo.config"]
    while todo:
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo.extend(graph[module])
    third_party = {
        f"{module} imports {name}"
        for module in closure
        for name in module_level_names(sources[module])
        if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "kvmemo"
    }
    assert third_party == set()
    assert not any(m.startswith(("kvmemo.engine", "kvmemo.model", "kvmemo.server")) for m in closure)
