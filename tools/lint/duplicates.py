"""Six or more consecutive lines of product code that appear in two places.

Product code: every .py under the product packages (PACKAGES; generated code lives in
proto/gen, outside them). Lines are compared after normalizing:
- each line is stripped of its indentation and of comments;
- blank lines, docstrings (and every other bare string statement: attribute docstrings),
  import statements, and lines of only brackets and commas are dropped;
- argparse calls (`add_argument(`, `add_parser(`, `add_argument_group(`,
  `add_mutually_exclusive_group(`) are dropped with their continuation lines: parsers
  repeat those shapes by nature;
- string literals are kept as written (not collapsed): two blocks differing only in a
  message are not reported, so that what is reported is code to share, not a shape.

Six consecutive kept lines equal in two places (two files, or one file twice without
overlap) are a finding; overlapping windows merge into one finding per run:
`duplicate: a.py:10-17 and b.py:40-47 (6 lines)`.

Usage: python -m tools.lint.duplicates [ROOT]  (ROOT: the repository root, default: cwd).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tools.lint import report

PACKAGES = ("decoder", "prefix_store", "cluster", "rpc", "numerics")
"""The top-level packages whose code is compared (those that exist)."""
WINDOW = 6
"""How many consecutive kept lines make a duplicate."""
ARGPARSE_CALLS = frozenset(
    {"add_argument", "add_parser", "add_argument_group", "add_mutually_exclusive_group"}
)
"""Calls whose lines (continuations included) are not compared."""
_PUNCTUATION_ONLY = re.compile(r"^[\s()\[\]{},:;]*$")


@dataclass(frozen=True, slots=True)
class Line:
    """A kept line: where it is and its normalized text."""

    number: int
    text: str


def kept_lines(source: str) -> list[Line]:
    """The normalized lines of `source` that take part in the comparison, in order."""
    dropped = _dropped_lines(ast.parse(source))
    lines = _without_comments(source)
    kept = []
    for number, text in enumerate(lines, start=1):
        text = text.strip()
        if number in dropped or _PUNCTUATION_ONLY.match(text):
            continue
        kept.append(Line(number, text))
    return kept


def _dropped_lines(tree: ast.AST) -> set[int]:
    """Line numbers of docstrings, bare strings, imports and argparse calls."""
    dropped: set[int] = set()
    for node in ast.walk(tree):
        if _is_dropped(node):
            dropped.update(range(node.lineno, node.end_lineno + 1))
    return dropped


def _is_dropped(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return _call_name(node) in ARGPARSE_CALLS
    return _is_bare_string(node) or isinstance(node, ast.Import | ast.ImportFrom)


def _is_bare_string(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _without_comments(source: str) -> list[str]:
    """The source's lines with every comment cut off."""
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    return lines


def product_files(root: Path) -> list[Path]:
    """Every .py under the product packages, sorted."""
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


def findings(root: Path) -> list[str]:
    """One line per run of WINDOW or more equal kept lines found in two places."""
    files = {str(p.relative_to(root)): kept_lines(p.read_text()) for p in product_files(root)}
    places: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        for start in range(len(lines) - WINDOW + 1):
            window = tuple(line.text for line in lines[start : start + WINDOW])
            places[window].append((name, start))
    pairs = _pairs(places)
    return [_describe(files, run) for run in _runs(pairs)]


def _pairs(places: dict) -> set[tuple[str, int, str, int]]:
    """(file, window, file, window) for each window equal to an earlier one's."""
    pairs = set()
    for where in places.values():
        first = where[0]
        for other in where[1:]:
            same_file = other[0] == first[0]
            if not (same_file and other[1] - first[1] < WINDOW):
                pairs.add((*first, *other))
    return pairs


def _runs(pairs: set[tuple[str, int, str, int]]) -> list[tuple[str, int, str, int, int]]:
    """Pairs of overlapping windows merged: (file, start, file, start, windows in the run)."""
    runs = []
    for a, i, b, j in sorted(pairs):
        if (a, i - 1, b, j - 1) in pairs:
            continue
        length = 1
        while (a, i + length, b, j + length) in pairs:
            length += 1
        runs.append((a, i, b, j, length))
    return runs


def _describe(files: dict[str, list[Line]], run: tuple[str, int, str, int, int]) -> str:
    a, i, b, j, windows = run
    count = windows + WINDOW - 1
    first = files[a][i].number, files[a][i + count - 1].number
    second = files[b][j].number, files[b][j + count - 1].number
    return f"duplicate: {a}:{first[0]}-{first[1]} and {b}:{second[0]}-{second[1]} ({count} lines)"


def main(argv: list[str] | None = None) -> int:
    return report.main(findings, argv)


if __name__ == "__main__":
    sys.exit(main())
