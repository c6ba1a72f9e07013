"""The import graph of the project's packages and the layer rules it must follow (issue 17).

``import_graph`` reads every module's imports with ``ast`` -- top-level and function-local alike, since a
function-local import still runs and can still close a cycle -- and keeps, per module, the project modules
it imports and the third-party top-level names it imports. ``check`` applies the rules:

| rule | reported as |
|---|---|
| every module has a layer (``layers``: its entry, else the longest ``prefix.*``) | ``("unclassified", module, "")`` |
| a module imports only modules of the layers ``may_import[its layer]`` | ``("layer", module, imported)`` |
| a module imports no third-party package of ``forbidden_external[its layer]`` | ``("external", module, name)`` |
| no import cycle: no strongly connected component of size > 1 without the allowlisted edges | ``("cycle", a, b)`` |

A cycle is reported as each of its edges: ``("cycle", a, b)`` for every import ``a -> b`` inside the component.

``allow`` maps an edge ``(module, imported)`` to the issue item that removes it: an allowlisted edge is not
reported, and one that no longer exists, or no longer breaks a rule (neither a layer/external violation nor
inside a cycle of the full graph), is reported as stale, so the list can only shrink.

What it does not see: ``importlib.import_module("...")`` with a string (``distrl/cmd/cli.py``'s command table,
``distrl/rollout/rewards.py``'s user reward module), and implicit imports of parent packages' ``__init__``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

Edge = tuple[str, str]
Violation = tuple[str, str, str]


@dataclass
class Graph:
    """``edges[m]``: project modules ``m`` imports; ``external[m]``: third-party top-level names it imports."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> file for every ``.py`` under ``root/<package>`` (``__init__`` names the package)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (resolves ``from . import x`` and ``from ..a import b``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` is or lies inside (``a.b.func`` -> ``a.b``); None if none."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def imported_names(path: Path, module: str) -> list[str]:
    """Every absolute name ``path`` imports, anywhere in the file: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a.b`` (a submodule, a function or a class: ``_resolve`` tells them apart)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            names.extend(source if alias.name == "*" else f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path, packages: list[str]) -> Graph:
    """The import graph of the modules under ``root/<package>`` for each of ``packages``."""
    files = module_files(root, packages)
    known = set(files)
    graph = Graph()
    for module, path in files.items():
        graph.edges[module], graph.external[module] = set(), set()
        for name in imported_names(path, module):
            target = _resolve(name, known)
            if target is None and name.split(".")[0] not in packages:
                graph.external[module].add(name.split(".")[0])
            elif target is not None and target != module:
                graph.edges[module].add(target)
    return graph


def layer_of(module: str, layers: dict[str, str]) -> str | None:
    """The layer ``layers`` gives ``module``: its own entry, else the longest ``prefix.*`` entry it lies in
    (``rollout.*`` covers ``rollout`` and every module under it); None when neither exists."""
    if module in layers:
        return layers[module]
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        pattern = ".".join(parts[:end]) + ".*"
        if pattern in layers:
            return layers[pattern]
    return None


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of size > 1 (iterative, so deep graphs do not recurse)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _edges_in_cycles(edges: dict[str, set[str]]) -> set[Edge]:
    """The edges whose two ends lie in one strongly connected component of size > 1."""
    cycle_edges = set()
    for component in strongly_connected(edges):
        cycle_edges.update((a, b) for a in component for b in edges.get(a, ()) if b in component)
    return cycle_edges


def check(graph: Graph, layers: dict[str, str], may_import: dict[str, set[str]],
          forbidden_external: dict[str, set[str]], allow: dict[Edge, str]) -> tuple[set[Violation], set[Edge]]:
    """(violations not allowlisted, stale allowlist entries) of ``graph`` under the rules (module docstring)."""
    broken: set[Violation] = set()
    for module in graph.edges:
        layer = layer_of(module, layers)
        if layer is None:
            broken.add(("unclassified", module, ""))
            continue
        for target in graph.edges[module]:
            if layer_of(target, layers) not in may_import[layer]:
                broken.add(("layer", module, target))
        for name in graph.external[module] & forbidden_external.get(layer, set()):
            broken.add(("external", module, name))
    in_cycles = _edges_in_cycles(graph.edges)
    kept = {m: {t for t in targets if (m, t) not in allow} for m, targets in graph.edges.items()}
    broken.update(("cycle", a, b) for a, b in _edges_in_cycles(kept))
    new = {v for v in broken if (v[1], v[2]) not in allow}
    still_broken = {(v[1], v[2]) for v in broken} | in_cycles
    stale = {edge for edge in allow if edge not in still_broken}
    return new, stale
