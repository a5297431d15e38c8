"""What every checker's command line does: find under ROOT (default: the working
directory), print one line per finding, exit 1 if there was any."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def main(findings: Callable[[Path], list[str]], argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    lines = findings(Path(args[0]) if args else Path.cwd())
    for line in lines:
        print(line)
    return 1 if lines else 0
