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
        runs = [_run_mode(endpoint, mode, work, config, say) for mode in MODES]
    _report(runs, model, config)
    vericache_ok = all(
        r.tokens == f.tokens for r, f in zip(runs[2].replies, runs[0].replies, strict=True)
    )
    return 0 if vericache_ok else 1


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


def _report(runs: list[ModeRun], model, config: DemoConfig) -> None:
    full = runs[0]
    full_rate = sum(len(r.tokens) for r in full.replies) / full.wall_s
    print()
    header = (
        f"{'mode':10s} {'tok/s':>7s} {'vs full':>8s} {'p50 s':>7s} {'p95 s':>7s} "
        f"{'acc/verif':>9s} {'pulled/tok':>11s} {'bound':>6s} {'policy':>10s} {'split':>5s}"
        "  identical to full"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        generated = sum(len(r.tokens) for r in run.replies)
        rate = generated / run.wall_s
        pulled = sum(r.stats.get("pulled_bytes", 0) for r in run.replies) / max(1, generated)
        verifications = sum(r.stats.get("verifications", 0) for r in run.replies)
        accepted = sum(r.stats.get("accepted", 0) for r in run.replies)
        acc = f"{accepted / verifications:.2f}" if verifications else "-"
        bound = _bound(run, full)
        print(
            f"{run.mode:10s} {rate:7.2f} {rate / full_rate:7.2f}x "
            f"{statistics.median(run.latencies):7.1f} {_pct(run.latencies, 0.95):7.1f} "
            f"{acc:>9s} {_human(pulled):>11s} {f'{bound:.2f}x' if bound else '-':>6s} "
            f"{_policy(run):>10s} {_split(run):>5s}  {_identical_to_full(run, full)}"
        )
    served = Counter(r.stats.get("worker", "?") for run in runs for r in run.replies)
    print("\nserved by (through the router, by prefix affinity): " + ", ".join(
        f"{worker} {count}" for worker, count in sorted(served.items())))  # fmt: skip
    print(
        "bound: full-KV step time over draft step time, times the drafts accepted "
        "(docs/DESIGN.md section 10); policy: the horizon policy's most common choice; split: "
        "the mode's requests per decoder (the router places each mode's batch anew)"
    )
    print()
    print(f"request 1 (vericache, tenant alice, shared document): {QUESTIONS[0]}")
    print(runs[2].replies[0].text.strip())
    print(
        "\nLarger: vericache demo --prefix-tokens 8000 --requests 16 --max-new-tokens 128 "
        "(about 6 minutes on 2 cores); make bench-remote for the full comparison."
    )
    sys.stdout.flush()


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


def _identical_to_full(run: ModeRun, full: ModeRun) -> str:
    """The table's last cell: "reference" for the full run itself (never compared with
    itself); else how many replies equal full's token for token ("2/3"), and where the
    others diverged."""
    if run is full:
        return "reference"
    pairs = list(zip(run.replies, full.replies, strict=True))
    where = [_diverges(r.tokens, f.tokens) for r, f in pairs if r.tokens != f.tokens]
    verdict = f"{len(pairs) - len(where)}/{len(pairs)}"
    if where:
        verdict += " (diverged at token " + ", ".join(str(w) for w in where) + ")"
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
