"""`vericache demo`: the service on this machine, three tenants, one shared document.

Starts the embedded deployment (local Ray, Redis, two shards, two decoder workers behind
one router, which every request goes through), creates
three tenants and a shared namespace, publishes a long source file into it plus one
tenant's private prefix, then runs one batch of concurrent requests in three modes:
full-KV remote prefix caching, lossy compressed decoding, and VeriCache. It prints a table
(aggregate tokens/s, latency, acceptance, bytes pulled per token) and checks every request
against the full-KV output, token for token.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from decoder.progress import note, progress

MODES = ("full", "lossy", "vericache")
SYSTEM = "You are a helpful assistant. Answer questions about this Python source file.\n\n"
"""The system turn's instruction; the document follows it, and the whole turn is the
prefix that is published and shared."""
QUESTIONS = [
    "What does the dedent function do?",
    "Summarise what this module does in two sentences.",
    "Which function wraps a paragraph into lines?",
    "What are the main options of TextWrapper?",
    "How would you shorten a long line with this module?",
    "What does the fill function return?",
    "What is the indent function for?",
    "Explain the role of the regular expressions here.",
]
PRIVATE_QUESTION = "What is this module for?"


@dataclass
class DemoConfig:
    prefix_tokens: int = 3000
    requests: int = 6
    max_new_tokens: int = 48
    compressor: str = "snapkv:budget=0.125"
    kv_budget: int | None = None
    """KV bytes per decoder (None: unlimited). The full-KV baseline needs room for the
    shared document's full KV."""
    repeats: int = 1
    """Runs of each mode, interleaved (full, lossy, vericache, full, ...) so that drift on a
    shared machine touches every mode alike. Above 1 the table gives each mode's median
    tokens/s with the range of its runs, and the other columns from its median run."""
    out: Path | None = None
    """Where to write the table as JSON as well (bench/bench_summary.py reads it)."""


@dataclass
class ModeRun:
    mode: str
    wall_s: float
    replies: list = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def document_text() -> str:
    """The shared document: the source of Python's textwrap and difflib modules."""
    import difflib
    import textwrap

    return inspect.getsource(textwrap) + "\n\n" + inspect.getsource(difflib)


def run_demo(config: DemoConfig) -> int:
    from cluster.serve import Deployment, ServeConfig
    from decoder.loader import load_model
    from prefix_store.config import GiB
    from prefix_store.metadata import Metadata

    say = _progress
    model = load_model()
    doc_prefix, doc_prompts = _chat(model, document_text(), config.prefix_tokens, QUESTIONS)
    private_prefix, private_prompts = _chat(
        model, inspect.getsource(inspect), max(256, config.prefix_tokens // 4), [PRIVATE_QUESTION]
    )
    full_kv = len(doc_prefix) * model.config.kv_bytes_per_token
    home = Path(tempfile.mkdtemp(prefix="vericache-demo-"))
    os.environ["VERICACHE_HOME"] = str(home)  # never touch a running service's state file
    serve = ServeConfig(
        shards=2,
        decoders=2,
        decoder_threads=max(1, (os.cpu_count() or 2) // 2),  # the two share this machine
        memory_bytes=2 * GiB,
        disk_bytes=0,
        state_dir=home / "state",
        compressor=config.compressor,
        kv_budget=config.kv_budget,
    )
    say(
        f"vericache demo: {model.name}; shared document {len(doc_prefix)} tokens, "
        f"{config.requests} concurrent requests x {config.max_new_tokens} new tokens, "
        f"compressor {config.compressor}"
    )
    say(_regime(config.kv_budget, full_kv))
    t0 = time.perf_counter()
    say("starting the local cluster (Ray, Redis, 2 store shards, 2 decoders, 1 router) ...")
    with Deployment(serve) as deployment:
        say(f"  up in {time.perf_counter() - t0:.0f}s: router at {deployment.routers[0]}")
        md = Metadata(deployment.redis_url)
        tokens = {name: md.add_tenant(name, 0) for name in ("alice", "bob", "carol")}
        md.add_shared("docs", list(tokens))
        say("tenants alice, bob, carol; shared namespace 'docs' (all three)")
        endpoint = deployment.routers[0]  # the one front door
        _publish(endpoint, tokens["alice"], doc_prefix, "docs", config.compressor, say)
        _publish(endpoint, tokens["alice"], private_prefix, "", config.compressor, say)
        work = _workload(doc_prompts, private_prompts[0], tokens, config.requests)
        runs = {mode: [] for mode in MODES}
        for _ in range(config.repeats):
            for mode in MODES:
                runs[mode].append(_run_mode(endpoint, mode, work, config, say))
    rows = _rows(runs)
    _report(rows, runs, config)
    if config.out is not None:
        _write(config, rows)
    return 0 if rows[-1]["identical"] == f"{len(work)}/{len(work)}" else 1


def _regime(budget: int | None, full_kv: int) -> str:
    """The one line that says which regime the demo runs in."""
    if budget is None:
        where = "unlimited decoder KV budget: the document's full KV stays resident"
    else:
        where = (
            f"decoder KV budget {_human(budget)}, {budget / full_kv:.1f}x the document's full KV"
        )
    return (
        f"regime: {where} ({_human(full_kv)}), where full-KV decoding is at its strongest; "
        "on this machine VeriCache wins at batch 1 and over slow links (docs/benchmarks.md)"
    )


def _chat(model, document: str, tokens: int, questions: list[str]):
    """(prefix, prompts): the system turn holding the first `tokens` tokens of `document`
    (the prefix that is published), and one chat prompt per question asking it about the
    document, each starting with that prefix."""
    text = model.decode(model.encode(document)[:tokens])
    system = {"role": "system", "content": SYSTEM + text}
    prefix = model.encode_chat([system], reply=False)
    prompts = [model.encode_chat([system, {"role": "user", "content": q}]) for q in questions]
    for prompt in prompts:
        if prompt[: len(prefix)] != prefix:
            raise RuntimeError(f"{model.name}'s chat template does not extend its system turn")
    return prefix, prompts


_PRINT = threading.Lock()


def _progress(line: str) -> None:
    with _PRINT:  # request threads report concurrently
        note(line)


def _publish(endpoint, token, ids, namespace, compressor, say) -> None:
    from decoder.service.client import DecoderClient

    where = f"shared namespace '{namespace}'" if namespace else "alice's private namespace"
    say(f"publishing {len(ids)} tokens into {where} (exact prefill, KV chunks + artifact) ...")
    with DecoderClient(endpoint, token) as client:
        reply = client.publish(token_ids=ids, namespace=namespace, compressors=[compressor])
    say(
        f"  stored {reply.stored_bytes / 2**20:.0f} MiB (replicas included), prefill "
        f"{reply.prefill_s:.1f}s"
    )


def _workload(doc_prompts, private_prompt, tokens, n) -> list[tuple[str, str, list[int]]]:
    """(tenant token, namespace, prompt) per request: questions over the shared document
    from all three tenants, and one of alice's over her private prefix."""
    names = list(tokens)
    work = []
    for i in range(n):
        if i == n - 1 and n > 1:
            work.append((tokens["alice"], "", private_prompt))
        else:
            work.append((tokens[names[i % 3]], "docs", doc_prompts[i % len(doc_prompts)]))
    return work


def _run_mode(endpoint, mode, work, config: DemoConfig, say) -> ModeRun:
    from decoder.service.client import DecoderClient

    say(f"{mode}: {len(work)} concurrent requests ...")
    run = ModeRun(mode, 0.0, [None] * len(work), [0.0] * len(work))
    errors: list[BaseException] = []
    bar = progress(desc=mode, total=len(work), unit="req")

    def one(i: int) -> None:
        token, namespace, prompt = work[i]
        t = time.perf_counter()
        try:
            with DecoderClient(endpoint, token) as client:
                run.replies[i] = client.generate(
                    token_ids=prompt,
                    max_new_tokens=config.max_new_tokens,
                    mode=mode,
                    compressor=config.compressor,
                    namespace=namespace,
                )
        except BaseException as error:  # reported below
            errors.append(error)
            return
        run.latencies[i] = time.perf_counter() - t
        say(f"  request {i + 1}/{len(work)} done in {run.latencies[i]:.1f}s")
        bar.update(1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - t0
    bar.close()
    if errors:
        raise errors[0]
    return run


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rows(runs: dict[str, list[ModeRun]]) -> list[dict]:
    """One row per mode: its median tokens/s over its runs with their range, the ratio to
    full KV's median, and the other figures from its median run (by tokens/s). A lossless
    mode's requests count as identical only where every run equals every full run."""
    full = runs["full"]
    full_rate = statistics.median(_rate(run) for run in full)
    middle = sorted(full, key=_rate)[(len(full) - 1) // 2]
    rows = []
    for mode, mode_runs in runs.items():
        rates = sorted(_rate(run) for run in mode_runs)
        run = sorted(mode_runs, key=_rate)[(len(mode_runs) - 1) // 2]
        verifications = _total(run, "verifications")
        rows.append(
            {
                "mode": mode,
                "tok_s": statistics.median(rates),
                "vs_full": statistics.median(rates) / full_rate,
                # bench/stats.py's shape: what bench_summary reads
                "spread": {
                    "tok_s": {
                        "median": statistics.median(rates),
                        "min": rates[0],
                        "max": rates[-1],
                        "runs": len(rates),
                    }
                },
                "runs": len(mode_runs),
                "p50_s": statistics.median(run.latencies),
                "p95_s": _pct(run.latencies, 0.95),
                "accepted_per_verification": (
                    _total(run, "accepted") / verifications if verifications else None
                ),
                "pulled_per_token": _total(run, "pulled_bytes") / max(1, _generated(run)),
                "bound": _bound(run, middle),
                "policy": _policy(run),
                "modelled_gain": _median_stat(run, "modelled_gain"),
                "split": _split(run),
                "identical": None if mode == "full" else _identical_to_full(mode_runs, full),
            }
        )
    return rows


def _rate(run: ModeRun) -> float:
    return _generated(run) / run.wall_s


def _generated(run: ModeRun) -> int:
    return sum(len(r.tokens) for r in run.replies)


def _median_stat(run: ModeRun, key: str) -> float | None:
    """The median over the run's requests of a figure some of them report (else None)."""
    values = [r.stats[key] for r in run.replies if r.stats.get(key) is not None]
    return statistics.median(values) if values else None


def _total(run: ModeRun, key: str) -> float:
    return sum(r.stats.get(key, 0) for r in run.replies)


def _report(rows: list[dict], runs: dict[str, list[ModeRun]], config: DemoConfig) -> None:
    repeated = config.repeats > 1
    print()
    if repeated:
        print(f"medians of {config.repeats} runs per mode, interleaved; min-max: tok/s over them")
    header = (
        f"{'mode':10s} {'tok/s':>7s} {'min-max':>13s} {'vs full':>8s} {'p50 s':>7s} "
        if repeated
        else f"{'mode':10s} {'tok/s':>7s} {'vs full':>8s} {'p50 s':>7s} "
    ) + (
        f"{'p95 s':>7s} {'acc/verif':>9s} {'pulled/tok':>11s} {'bound':>6s} {'policy':>10s} "
        f"{'split':>5s}  identical to full"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        acc = row["accepted_per_verification"]
        bound = row["bound"]
        tok_s = row["spread"]["tok_s"]
        spread_text = f"{tok_s['min']:.2f}-{tok_s['max']:.2f}".rjust(13) + " " if repeated else ""
        print(
            f"{row['mode']:10s} {row['tok_s']:7.2f} {spread_text}{row['vs_full']:7.2f}x "
            f"{row['p50_s']:7.1f} {row['p95_s']:7.1f} "
            f"{'-' if acc is None else f'{acc:.2f}':>9s} {_human(row['pulled_per_token']):>11s} "
            f"{f'{bound:.2f}x' if bound else '-':>6s} "
            f"{row['policy']:>10s} {row['split']:>5s}  {row['identical'] or 'reference'}"
        )
    served = Counter(
        r.stats.get("worker", "?") for mode_runs in runs.values() for r in mode_runs[0].replies
    )
    print("\nserved by (through the router, by prefix affinity): " + ", ".join(
        f"{worker} {count}" for worker, count in sorted(served.items())))  # fmt: skip
    print(
        "bound: full-KV step time over draft step time, times the drafts accepted "
        "(docs/DESIGN.md section 10); policy: the horizon policy's most common choice; split: "
        "the mode's requests per decoder (the router places each mode's batch anew)"
    )
    print()
    print(f"request 1 (vericache, tenant alice, shared document): {QUESTIONS[0]}")
    print(runs["vericache"][0].replies[0].text.strip())
    print(
        "\nLarger: vericache demo --prefix-tokens 8000 --requests 16 --max-new-tokens 128 "
        "(about 6 minutes on 2 cores); make bench-remote for the full comparison."
    )
    sys.stdout.flush()


def _write(config: DemoConfig, rows: list[dict]) -> None:
    settings = {k: v for k, v in vars(config).items() if k != "out"}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps({"config": settings, "rows": rows}, indent=1))
    print(f"wrote {config.out}")


def _bound(run: ModeRun, full: ModeRun) -> float | None:
    """The DESIGN.md section 10 bound of a vericache run against the full run: the full-KV
    step time over the time of one draft (a draft forward gives one or more), times the
    share of drafts accepted; None for other modes or without drafts."""
    stats = [r.stats for r in run.replies]
    drafted = sum(s.get("drafted", 0) for s in stats)
    forwards = sum(s.get("draft_steps", 0) for s in stats)
    draft_step = [s["draft_step_s"] for s in stats if s.get("draft_step_s")]
    full_step = [r.stats["full_step_s"] for r in full.replies if r.stats.get("full_step_s")]
    if run.mode != "vericache" or not drafted or not draft_step or not full_step:
        return None
    per_draft = statistics.median(draft_step) / max(1.0, drafted / max(1, forwards))
    accepted = sum(s.get("accepted", 0) for s in stats)
    return statistics.median(full_step) / per_draft * accepted / drafted


def _split(run: ModeRun) -> str:
    """How the router spread the run's requests over the decoders, busiest first ("4+2"):
    modes placed differently are not compared on equal terms."""
    served = Counter(r.stats.get("worker", "?") for r in run.replies)
    return "+".join(str(n) for n in sorted(served.values(), reverse=True))


def _policy(run: ModeRun) -> str:
    """The horizon policy's most common choice over the run's rounds, with its share
    ("draft 92%"); "-" where no policy chose (full and lossy)."""
    rounds = Counter()
    for reply in run.replies:
        rounds.update(reply.stats.get("policy") or {})
    if not rounds:
        return "-"
    reason, n = rounds.most_common(1)[0]
    return f"{reason} {100 * n / sum(rounds.values()):.0f}%"


def _identical_to_full(runs: list[ModeRun], full: list[ModeRun]) -> str:
    """The table's last cell for a mode other than full: how many requests equal full's
    token for token in every run of both ("2/3"), and where the others diverged (first
    run pair that differs)."""
    n = len(full[0].replies)
    where = {}
    for run in runs:
        for reference in full:
            for i, (r, f) in enumerate(zip(run.replies, reference.replies, strict=True)):
                if r.tokens != f.tokens and i not in where:
                    where[i] = _diverges(r.tokens, f.tokens)
    verdict = f"{n - len(where)}/{n}"
    if where:
        verdict += " (diverged at token " + ", ".join(str(where[i]) for i in sorted(where)) + ")"
    return verdict


def _diverges(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
