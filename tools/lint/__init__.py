"""The project's own lint checkers, beside ruff (`make lint` runs them).

- `python -m tools.lint.imports`: import circles and layer rules.
- `python -m tools.lint.duplicates`: six or more consecutive lines of product code repeated.

Each prints one line per finding and exits 1, or exits 0 when the tree is clean.
"""
