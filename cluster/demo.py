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
QUESTIONS = [
    "Summarise what this module does.",
    "Which function wraps a paragraph?",
    "What does dedent return for mixed indentation?",
    "Write a docstring for fill().",
    "List the public names this module exports.",
    "How would you shorten a long line with this module?",
    "What are TextWrapper's main options?",
    "Explain the role of the regular expressions here.",
]


@dataclass
class DemoConfig:
    prefix_tokens: int = 3000
    requests: int = 6
    max_new_tokens: int = 48
    compressor: str = "snapkv:budget=0.125"


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
    doc_ids = model.encode(document_text())[: config.prefix_tokens]
    private_ids = model.encode(inspect.getsource(inspect))[: max(256, config.prefix_tokens // 4)]
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
    )
    say(
        f"vericache demo: {model.name}; shared document {len(doc_ids)} tokens, "
        f"{config.requests} concurrent requests x {config.max_new_tokens} new tokens, "
        f"compressor {config.compressor}"
    )
    t0 = time.perf_counter()
    say("starting the local cluster (Ray, Redis, 2 store shards, 2 decoders, 1 router) ...")
    with Deployment(serve) as deployment:
        say(f"  up in {time.perf_counter() - t0:.0f}s: router at {deployment.routers[0]}")
        md = Metadata(deployment.redis_url)
        tokens = {name: md.add_tenant(name, 0) for name in ("alice", "bob", "carol")}
        md.add_shared("docs", list(tokens))
        say("tenants alice, bob, carol; shared namespace 'docs' (all three)")
        endpoint = deployment.routers[0]  # the one front door
        _publish(endpoint, tokens["alice"], doc_ids, "docs", config.compressor, say)
        _publish(endpoint, tokens["alice"], private_ids, "", config.compressor, say)
        work = _workload(model, doc_ids, private_ids, tokens, config.requests)
        runs = [_run_mode(endpoint, mode, work, config, say) for mode in MODES]
    _report(runs, work, config)
    vericache_ok = all(
        r.tokens == f.tokens for r, f in zip(runs[2].replies, runs[0].replies, strict=True)
    )
    return 0 if vericache_ok else 1


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


def _workload(model, doc_ids, private_ids, tokens, n) -> list[tuple[str, str, list[int]]]:
    """(tenant token, namespace, prompt) per request: questions over the shared document
    from all three tenants, and one of alice's over her private prefix."""
    names = list(tokens)
    work = []
    for i in range(n):
        question = model.encode(f"\n\n# Question: {QUESTIONS[i % len(QUESTIONS)]}\n# Answer:")
        if i == n - 1 and n > 1:
            work.append((tokens["alice"], "", private_ids + question[1:]))
        else:
            work.append((tokens[names[i % 3]], "docs", doc_ids + question[1:]))
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


def _report(runs: list[ModeRun], work, config: DemoConfig) -> None:
    full = runs[0]
    full_rate = sum(len(r.tokens) for r in full.replies) / full.wall_s
    print()
    header = (
        f"{'mode':10s} {'tok/s':>7s} {'vs full':>8s} {'p50 s':>7s} {'p95 s':>7s} "
        f"{'acc/verif':>9s} {'pulled/tok':>11s}  identical to full"
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
        print(
            f"{run.mode:10s} {rate:7.2f} {rate / full_rate:7.2f}x "
            f"{statistics.median(run.latencies):7.1f} {_pct(run.latencies, 0.95):7.1f} "
            f"{acc:>9s} {_human(pulled):>11s}  {_identical_to_full(run, full)}"
        )
    served = Counter(r.stats.get("worker", "?") for run in runs for r in run.replies)
    print("\nserved by (through the router, by prefix affinity): " + ", ".join(
        f"{worker} {count}" for worker, count in sorted(served.items())))  # fmt: skip
    print()
    print(f"request 1 (vericache, tenant alice, shared document):\n{runs[2].replies[0].text}")
    print(
        "\nLarger: vericache demo --prefix-tokens 8000 --requests 16 --max-new-tokens 128 "
        "(about 6 minutes on 2 cores); make bench-remote for the full comparison."
    )
    sys.stdout.flush()


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
