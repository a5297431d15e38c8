"""PNG figures beside a benchmark's JSON, drawn from the same result rows.

One function per figure; each takes the rows (the dicts the bench wrote to JSON) and the
PNG path, and returns that path, or None when the rows hold no data for it (it says so on
stderr). `png_path(json, "budget")` names a figure after its JSON: results/remote.json ->
results/remote-budget.png. `write_figures` draws several and never raises: the JSON is
already written, and a figure that fails is reported, not fatal.

matplotlib runs with the non-interactive Agg backend (no display needed).

Redraw from a results file: python bench/plots.py bench/results/cluster.json [--out-dir DIR]
(every figure whose data its rows hold).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

Rows = Sequence[dict]
Figure = Callable[[Rows, Path], "Path | None"]
DPI = 100
MODE_ORDER = (
    "full",
    "full+ngram",
    "lossy",
    "vericache",
    "vericache@pull",
    "vericache@near",
    "vericache+ngram",
)
"""The benches' modes, each drawn in the same colour in every figure."""


def png_path(json_path: Path, suffix: str) -> Path:
    """`results/remote.json`, "budget" -> `results/remote-budget.png`."""
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}-{suffix}.png")


def write_figures(json_path: Path, figures: Sequence[tuple[str, Figure, Rows]]) -> list[Path]:
    """Draw each (suffix, figure, rows) beside `json_path`; print and return the PNGs
    written. A figure that raises is reported on stderr and skipped."""
    written = []
    for suffix, figure, rows in figures:
        out = png_path(json_path, suffix)
        try:
            path = figure(rows, out)
        except Exception as error:  # the JSON is written already: report and go on
            print(f"plot {out.name} failed: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        if path is not None:
            print(f"wrote {path}")
            written.append(path)
    return written


def merged_histogram(histograms) -> dict[str, int]:
    """Verifications by drafts accepted (the engine's `accepted_histogram`, keys are the
    counts as strings), summed over requests or repeats."""
    total: dict[str, int] = {}
    for histogram in histograms:
        for accepted, count in histogram.items():
            total[accepted] = total.get(accepted, 0) + count
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def tokens_per_s_vs_horizon(rows: Rows, out: Path) -> Path | None:
    """bench_local: tok/s against the verification horizon, one line per (context, batch)
    over the fixed horizons, a star for `auto` at the mean drafts per verification it
    chose, and full-KV decoding as a dotted line."""
    cases: dict[tuple, dict] = defaultdict(lambda: {"fixed": [], "auto": [], "full": None})
    for row in rows:
        case = (row.get("context"), row.get("batch"), row.get("compressor"))
        rate, horizon = _rate(row), row.get("horizon")
        if rate is None:
            continue
        if row.get("mode") == "vericache" and isinstance(horizon, int | float):
            cases[case]["fixed"].append((horizon, rate))
        elif row.get("mode") == "vericache" and horizon == "auto" and row.get("verifications"):
            cases[case]["auto"].append((row["drafted"] / row["verifications"], rate))
    full = {(r.get("context"), r.get("batch")): _rate(r) for r in rows if r.get("mode") == "full"}
    plotted = {c: v for c, v in cases.items() if v["fixed"] or v["auto"]}
    if not plotted:
        return _skip(out, "no vericache rows with a horizon")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((context, batch, spec), series) in enumerate(sorted(plotted.items(), key=str)):
        color = f"C{i % 10}"
        label = f"ctx {context}, batch {batch}, {spec}"
        if series["fixed"]:
            xs, ys = zip(*sorted(series["fixed"]), strict=True)
            ax.plot(xs, ys, "o-", color=color, label=label)
            label = None
        for x, y in series["auto"]:
            ax.plot([x], [y], "*", color=color, markersize=13, label=label)
            label = None
        if full.get((context, batch)):
            ax.axhline(full[(context, batch)], color=color, linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)  # horizons double: 2, 4, 8, ...
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("drafted tokens per verification (horizon; * = auto, its mean)")
    ax.set_ylabel("tokens/s")
    ax.set_title("VeriCache tokens/s vs horizon (dotted: full-KV decoding)")
    return _save(fig, out)


def accepted_histogram(rows: Rows, out: Path) -> Path | None:
    """Any bench: verifications by the number of drafts they accepted, one bar group per
    speculative row (its `accepted_histogram`), as shares of that row's verifications."""
    series = [(_label(r), r["accepted_histogram"]) for r in rows if r.get("accepted_histogram")]
    if not series:
        return _skip(out, "no row records accepted_histogram")
    shown = series[:8]  # beyond that the bars are unreadable
    title = "Accepted drafts per verification"
    if len(series) > len(shown):
        title += f" (first {len(shown)} of {len(series)} rows)"
    series = shown
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, histogram) in enumerate(series):
        counts = {int(k): v for k, v in histogram.items()}
        total = sum(counts.values()) or 1
        xs = sorted(counts)
        ax.bar(
            [x + (i - (len(series) - 1) / 2) * width for x in xs],
            [counts[x] / total for x in xs],
            width=width,
            label=label,
            color=f"C{i % 10}",
        )
    ax.set_xlabel("drafts accepted by a verification")
    ax.set_ylabel("share of verifications")
    ax.set_title(title)
    return _save(fig, out)


def budget_sweep(rows: Rows, out: Path) -> Path | None:
    """bench_remote: aggregate tok/s against the decoder's KV budget, one line per mode."""
    by_mode: dict[str, list] = defaultdict(list)
    for row in rows:
        if row.get("budget") and _rate(row) is not None:
            by_mode[row.get("mode", "?")].append((row["budget"], _rate(row)))
    if not by_mode:
        return _skip(out, "no rows under a KV budget")
    largest = max(b for points in by_mode.values() for b, _ in points)
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, points in by_mode.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot([x / scale for x in xs], ys, "o-", label=mode, color=_color(mode))
    ax.set_xlabel(f"decoder KV budget ({unit})")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Tokens/s under a KV budget (distinct prefixes)")
    return _save(fig, out)


def bytes_per_token(rows: Rows, out: Path) -> Path | None:
    """bench_remote, bench_cluster: bytes on the wire per generated token (pulled KV plus
    near-data queries and partials; pulled KV alone in older results), grouped by workload
    and budget or link, one bar per mode, log scale."""
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows:
        value = row.get("wire_per_token", row.get("pulled_per_token"))
        if value is None:
            continue
        where = row.get("link") or row.get("budget_label") or ""
        group = " / ".join(str(p) for p in (row.get("workload"), where) if p)
        groups[group or "all"][row.get("mode", "?")] = value
    if not groups:
        return _skip(out, "no row records bytes pulled per token")
    modes = sorted(dict.fromkeys(m for g in groups.values() for m in g), key=_order)
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups)), 4.5))
    for i, mode in enumerate(modes):
        xs = [g for g, (_, values) in enumerate(groups.items()) if mode in values]
        ys = [max(values[mode], 1.0) for values in groups.values() if mode in values]
        offset = (i - (len(modes) - 1) / 2) * width
        ax.bar([x + offset for x in xs], ys, width=width, label=mode, color=_color(mode))
    ax.set_xticks(range(len(groups)), list(groups), rotation=15, ha="right")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes(v)))
    ax.set_ylabel("bytes per generated token")
    ax.set_title("Bytes on the wire per generated token")
    return _save(fig, out)


def link_sweep(rows: Rows, out: Path) -> Path | None:
    """bench_cluster: tok/s as a ratio to the full-KV baseline on the same link, against
    the link's speed, one line per mode, one panel per workload."""
    by_workload: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    speeds: dict[str, float] = {}
    for row in rows:
        if row.get("link") is None or row.get("ratio") is None:
            continue
        speed = row.get("link_bytes_per_s")
        speeds[row["link"]] = math.inf if speed is None else speed
        by_workload[row.get("workload", "")][row.get("mode", "?")].append(
            (row["link"], row["ratio"])
        )
    if not by_workload:
        return _skip(out, "no rows with a link and a ratio to full")
    links = sorted(speeds, key=lambda link: speeds[link])  # slowest first
    panels = sorted(by_workload)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], panels, strict=True):
        for mode, points in sorted(by_workload[workload].items(), key=lambda kv: _order(kv[0])):
            points = sorted(points, key=lambda p: links.index(p[0]))
            xs = [links.index(link) for link, _ in points]
            ax.plot(xs, [ratio for _, ratio in points], "o-", label=mode, color=_color(mode))
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(links)), links)
        ax.set_xlabel("decoder's link to the store")
        ax.set_ylabel("tokens/s vs full-KV baseline")
        ax.set_title(f"{workload or 'all'}: speed vs link")
    return _save(fig, out)


def _order(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def _color(mode: str) -> str:
    """A mode's colour: its place in MODE_ORDER, the rest in the last palette slots."""
    if mode in MODE_ORDER:
        return f"C{MODE_ORDER.index(mode)}"
    return f"C{len(MODE_ORDER) + sum(map(ord, mode)) % (10 - len(MODE_ORDER))}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _rate(row: dict) -> float | None:
    """Tokens/s of a row: bench_local's `tok_s` or bench_remote's `tokens_per_s`."""
    value = row.get("tok_s", row.get("tokens_per_s"))
    return float(value) if isinstance(value, int | float) else None


def _label(row: dict) -> str:
    parts = [row.get("mode"), row.get("compressor"), row.get("workload")]
    parts.append(row.get("link") or row.get("budget_label"))
    if row.get("context") is not None:
        parts += [f"ctx {row['context']}", f"batch {row.get('batch')}"]
    if row.get("horizon") not in (None, "-"):
        parts.append(f"h={row['horizon']}")
    return ", ".join(str(p) for p in parts if p not in (None, "", "-"))


def _skip(out: Path, why: str) -> None:
    print(f"no {out.name}: {why}", file=sys.stderr)
    return None


def _save(fig, out: Path) -> Path:
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


FIGURES: dict[str, Figure] = {
    "horizon": tokens_per_s_vs_horizon,
    "accepted": accepted_histogram,
    "budget": budget_sweep,
    "bytes": bytes_per_token,
    "links": link_sweep,
}
"""Every figure by its file suffix."""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Draw a benchmark's figures from its JSON.")
    ap.add_argument("results", type=Path, help="a bench's JSON (with a 'rows' list)")
    ap.add_argument("--out-dir", type=Path, help="where the PNGs go (default: beside it)")
    args = ap.parse_args(argv)
    rows = json.loads(args.results.read_text()).get("rows", [])
    base = (args.out_dir or args.results.parent) / args.results.name
    written = write_figures(base, [(suffix, f, rows) for suffix, f in FIGURES.items()])
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
