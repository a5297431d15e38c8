"""The median and spread of a benchmark's repeated runs, as its tables and JSON report them.

Every bench repeats each measurement (`--repeats`, `DEFAULT_REPEATS` unless a bench needs
more) and reports a figure as the median of its runs with their spread, the range from the
lowest run to the highest: "12.30 [11.90-12.80]" in a table, and
`{"median": 12.3, "min": 11.9, "max": 12.8, "runs": 3}` in JSON. A ratio of two figures is
the ratio of their medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_REPEATS = 3
"""The fewest runs a bench makes by default: one run has no spread, two no middle."""


@dataclass(frozen=True)
class Spread:
    """One figure over repeated runs."""

    median: float
    low: float
    """The lowest run."""
    high: float
    """The highest run."""
    runs: int
    """How many runs it summarises (>= 1)."""

    def scaled(self, factor: float) -> Spread:
        """The same runs in other units (seconds to ms: 1e3; a rate from a time: never,
        since a time's low is a rate's high: summarise the rates instead)."""
        return Spread(self.median * factor, self.low * factor, self.high * factor, self.runs)

    def text(self, spec: str = ".2f") -> str:
        """As "median [low-high]", each number formatted with `spec`."""
        return f"{self.median:{spec}} [{self.range_text(spec)}]"

    def range_text(self, spec: str = ".2f") -> str:
        """As "low-high", each number formatted with `spec`."""
        return f"{self.low:{spec}}-{self.high:{spec}}"

    def to_json(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.low, "max": self.high, "runs": self.runs}

    @classmethod
    def from_json(cls, data: dict) -> Spread:
        """The inverse of `to_json`."""
        return cls(data["median"], data["min"], data["max"], data["runs"])


def spread(samples: Iterable[float]) -> Spread:
    """The median and range of `samples` (one per run). ValueError when there are none."""
    values = sorted(float(s) for s in samples)
    if not values:
        raise ValueError("no runs to summarise: --repeats must be at least 1")
    return Spread(statistics.median(values), values[0], values[-1], len(values))


def spreads(runs: Sequence[dict], keys: Iterable[str]) -> dict[str, Spread]:
    """Per key, the spread of that key's value over `runs` (dicts, one per run)."""
    return {key: spread(run[key] for run in runs) for key in keys}


def spreads_json(figures: dict[str, Spread]) -> dict[str, dict[str, float | int]]:
    """`spreads`' result as JSON (each `Spread.to_json`): what a result row keeps under
    "spread"."""
    return {key: figure.to_json() for key, figure in figures.items()}


def row_spread(row: dict, key: str) -> Spread:
    """A result row's figure `key`, from the row's "spread" (`spreads_json`)."""
    return Spread.from_json(row["spread"][key])


def row_text(row: dict, key: str, spec: str = ".2f", factor: float = 1.0) -> str:
    """A result row's figure `key` as "median [low-high]" (`Spread.text`), scaled by
    `factor`."""
    return row_spread(row, key).scaled(factor).text(spec)
