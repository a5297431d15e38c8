"""Import circles and layer rules among the product packages.

Every import counts, wherever it stands: module level, inside a function (lazy), and
`importlib.import_module("literal")`. Only imports under `if TYPE_CHECKING:` are exempt
(they never run). `from a.b import c` is an import of the module a.b.c when that is a
module, else of a.b; relative imports resolve against the importing module's package.

Findings, one line each:
- `circle: a -> b -> a`: a strongly connected component of more than one module, printed
  as one cycle through it (tarjan's components; each printed once).
- `layer: path:line: a imports b (rule)`: an import a layer rule forbids.

Usage: python -m tools.lint.imports [ROOT]  (ROOT: the repository root, default: cwd).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.lint import report

PACKAGES = ("decoder", "prefix_store", "cluster", "rpc", "numerics")
"""The top-level packages whose modules form the graph (those that exist)."""

LAYER_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (importer prefix, forbidden imported prefixes); "x*" is x and everything under it.
    (
        "prefix_store.client*",
        (
            "prefix_store.server*",
            "prefix_store.shard*",
            "prefix_store.data_plane",
            "prefix_store.tiers*",
            "prefix_store.attend",
            "prefix_store.lmcache*",
            "rpc*",
        ),
    ),
    (
        "decoder*",
        (
            "prefix_store.server*",
            "prefix_store.shard*",
            "prefix_store.data_plane",
            "prefix_store.tiers*",
        ),
    ),
    ("decoder.service.client*", ("decoder.service.server*",)),
    ("numerics*", ("decoder*", "prefix_store*", "cluster*", "rpc*")),
)
"""Which modules may not import which: the client SDK no store server module (nor rpc),
the decoder no store server module, the decoder's SDK no decoder server module, the
kernels nothing above them. Prefixes, so modules that move keep their rules."""


@dataclass(frozen=True, slots=True)
class Edge:
    """One import: `source` imports `target` at `path`:`line`."""

    source: str
    target: str
    path: str
    line: int


def matches(module: str, pattern: str) -> bool:
    """`x*` matches x and x.anything and x_anything (prefix); `x` matches x only."""
    if pattern.endswith("*"):
        return module.startswith(pattern[:-1])
    return module == pattern


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under the product packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def edges(root: Path) -> list[Edge]:
    """Every import from a product module to another product module."""
    modules = module_files(root)
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in _imports(tree, package):
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != name:
                found.append(Edge(name, resolved, str(path.relative_to(root)), line))
    return found


def _imports(tree: ast.AST, package: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in `tree`, outside `if TYPE_CHECKING:` blocks."""
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base
        elif _is_import_module_call(node):
            yield node.lineno, node.args[0].value


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, skipping the body (not the else) of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _walk_runtime(other)
        else:
            yield from _walk_runtime(child)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _is_import_module_call(node: ast.AST) -> bool:
    """`importlib.import_module("literal")` or `import_module("literal")`."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    return (
        name == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str)
    )


def _absolute(module: str | None, level: int, package: str) -> str:
    """The absolute name of `from <level dots><module> import ...` inside `package`."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, module] if module else base)


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The longest product module that `target` names or lies in; None outside them."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def circles(found: list[Edge]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected component of
    more than one module, sorted."""
    graph: dict[str, set[str]] = {}
    for edge in found:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    cycles = [_cycle_in(graph, set(c)) for c in _components(graph) if len(c) > 1]
    return sorted(cycles)


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    result.append(_pop_component(stack, on_stack, node))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return result


def _pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    component = []
    while True:
        node = stack.pop()
        on_stack.discard(node)
        component.append(node)
        if node == root:
            return sorted(component)


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's smallest module (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return [*_path_to(parents, node, start), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError("a strongly connected component without a cycle")


def _path_to(parents: dict[str, str], node: str, start: str) -> list[str]:
    path = [node]
    while path[-1] != start:
        path.append(parents[path[-1]])
    return path[::-1]


def layer_violations(found: list[Edge]) -> list[str]:
    """One line per import that a rule of LAYER_RULES forbids."""
    lines = []
    for edge in found:
        for importer, forbidden in LAYER_RULES:
            if not matches(edge.source, importer):
                continue
            for pattern in forbidden:
                if matches(edge.target, pattern):
                    lines.append(
                        f"layer: {edge.path}:{edge.line}: {edge.source} imports {edge.target} "
                        f"({importer} must not import {pattern})"
                    )
    return sorted(set(lines))


def findings(root: Path) -> list[str]:
    """Every finding under `root`, one line each."""
    found = edges(root)
    lines = [f"circle: {' -> '.join(cycle)}" for cycle in circles(found)]
    return lines + layer_violations(found)


def main(argv: list[str] | None = None) -> int:
    return report.main(findings, argv)


if __name__ == "__main__":
    sys.exit(main())
