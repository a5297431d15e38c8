"""No class over MAX_LINES lines or MAX_METHODS methods in product code.

A class that grows past either bound holds more than one noun: split it (see
docs/CONTRIBUTING.md). Counted: the class statement's lines (decorators excluded,
docstrings included) and the functions defined directly in its body (properties, static
and class methods included; nested classes are classes of their own). Exempt, and only
these: generated code (proto/gen, outside the product packages) and the SDKs' public
client classes, whose methods are their API (EXEMPT), with the sans-IO core behind the two
store clients, which has one method per API call.

One line per finding: `class: path:line Name (N lines, M methods; at most 300 and 20)`.

Usage: python -m tools.lint.classes [ROOT]  (ROOT: the repository root, default: cwd).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tools.lint import report

PACKAGES = ("decoder", "prefix_store", "cluster", "rpc", "numerics")
"""The top-level packages checked (those that exist)."""
MAX_LINES = 300
MAX_METHODS = 20
EXEMPT = frozenset(
    {
        "prefix_store/client/sync.py:StoreClient",
        "prefix_store/client/aio.py:AsyncStoreClient",
        "prefix_store/client/core.py:ClientCore",
    }
)
"""`path:Class` of the SDKs' public client classes (and the store clients' shared core)."""


def class_sizes(source: str) -> list[tuple[str, int, int, int]]:
    """(name, line, lines, methods) of every class in `source`, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
            out.append((node.name, node.lineno, node.end_lineno - node.lineno + 1, methods))
    return out


def findings(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            for name, line, lines, methods in class_sizes(path.read_text()):
                if f"{relative}:{name}" in EXEMPT:
                    continue
                if lines > MAX_LINES or methods > MAX_METHODS:
                    found.append(
                        f"class: {relative}:{line} {name} ({lines} lines, {methods} methods; "
                        f"at most {MAX_LINES} and {MAX_METHODS})"
                    )
    return found


def main(argv: list[str] | None = None) -> int:
    return report.main(findings, argv)


if __name__ == "__main__":
    sys.exit(main())
