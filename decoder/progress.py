"""Progress bars for long work (model conversion, publish, the demo, benchmarks).

One place for the policy: bars go to stderr, and only when stderr is a terminal, so logs,
pipes and tests stay clean. `VERICACHE_PROGRESS=1` forces them on (a terminal multiplexer
that hides its TTY), `VERICACHE_PROGRESS=0` off. It lives in `decoder/` because the model
loader needs it and `decoder/` may not import `cluster/`; `cluster/` and `bench/` import it
from here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import tqdm

FORCE_ENV = "VERICACHE_PROGRESS"


def enabled() -> bool | None:
    """tqdm's `disable`: None (on when stderr is a TTY) unless $VERICACHE_PROGRESS forces it."""
    forced = os.environ.get(FORCE_ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return False
    if forced in ("0", "false", "no", "off"):
        return True
    return None


def progress(
    iterable: Iterable | None = None,
    desc: str = "",
    total: float | None = None,
    unit: str = "it",
    unit_scale: bool = False,
) -> tqdm:
    """A tqdm bar on stderr over `iterable` (or updated by hand when it is None)."""
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        unit_scale=unit_scale,
        file=sys.stderr,
        disable=enabled(),
        dynamic_ncols=True,
    )


def note(line: str) -> None:
    """Print `line` to stdout without tearing a bar that is drawn on stderr."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
