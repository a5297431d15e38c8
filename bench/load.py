"""Load: a real deployment held under many concurrent clients of several tenants (issue 15).

A deployment like `vericache serve` starts one (Ray actors: `--shards` shards with
replication 2, `--decoders` decoders, a Redis metadata plane). `--clients` threads, spread
over `--tenants` tenants, then run operations back to back for `--seconds`:

- publish: store a prefix of random KV through the store SDK (a small layout, so that the
  store's own paths are what is loaded): half the time one of the tenant's last few again
  (found stored: no new bytes), half the time a new one, which joins them (so new bytes
  keep arriving, and the tiers spill and evict as in production);
- lookup: look one of the tenant's prefixes up (a hit must cover what was published);
- fetch: read one back and compare it bitwise with what was published (bytes verified);
- generate: one of the tenant's prompts through a decoder in `full`, `vericache` or
  `lossy` mode (documents published through the decoder at start, plus uncached prompts
  the decoder prefills itself).

After the run, a sample of the lossless generations (`--sample`) is decoded again in this
process with full KV and compared token for token: any difference counts as wrong tokens.
It prints, and writes as JSON: per operation p50/p95/p99 latency, count and throughput,
errors by status code; bytes verified; wrong tokens and lost bytes (both must be 0); the
RSS of every shard and decoder process at start and end (and its peak while sampled).

`bench/chaos.py` runs the same load while it injects faults.

Usage: python bench/load.py [--clients 64] [--tenants 4] [--seconds 600] [--decoders 1]
       [--sample 16] [--out bench/results/load.json]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import platform
import random
import secrets
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.progress import progress  # noqa: E402
from decoder.service.client import DecoderClient  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import ClientConfig, MiB  # noqa: E402
from prefix_store.errors import StoreError  # noqa: E402
from prefix_store.layout import KVLayout  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402
from rpc.status import STORE  # noqa: E402

LAYOUT = KVLayout("load-test@1", "float32", num_layers=4, num_kv_heads=2, head_dim=16)
"""Store operations use a small layout: the store's paths, not the bytes, are loaded."""
OPERATIONS = ("publish", "lookup", "fetch", "generate")
MODES = ("full", "vericache", "lossy")
LOSSLESS = ("full", "vericache")


@dataclass
class LoadConfig:
    clients: int = 64
    tenants: int = 4
    seconds: float = 600.0
    shards: int = 2
    decoders: int = 1
    sample: int = 16
    """Lossless generations checked against in-process full-KV decoding."""
    new_tokens: int = 8
    prefixes: int = 3
    """Store prefixes per tenant that the clients read and publish again (the latest)."""
    fresh: float = 0.5
    """Share of publishes that store a new prefix."""
    prefix_chunks: int = 3
    weights: dict[str, int] = field(
        default_factory=lambda: {"publish": 1, "lookup": 3, "fetch": 3, "generate": 1}
    )
    timeout_s: float = 300.0
    """Per operation (a generate waits its turn behind every client's)."""
    seed: int = 0


@dataclass
class Outcome:
    op: str
    seconds: float
    status: str
    """"OK", a gRPC status code name, or "exception:TypeName" (a bug)."""
    verified_bytes: int = 0
    lost_bytes: int = 0
    started: float = 0.0


@dataclass
class Generation:
    prompt: list[int]
    mode: str
    tokens: list[int]


class Recorder:
    """Every client's outcomes and lossless generations (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.generations: list[Generation] = []

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def generated(self, generation: Generation) -> None:
        with self._lock:
            self.generations.append(generation)

    def since(self, start: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.started >= start]


def status_of(error: BaseException) -> str:
    if isinstance(error, StoreError):
        return STORE.code_of(error).name
    return f"exception:{type(error).__name__}"


# ---- the workload ------------------------------------------------------------------------


def documents(model, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct real source texts of `tokens` tokens."""
    text = inspect.getsource(textwrap) + inspect.getsource(inspect)
    step = max(1, len(text) // (count + 1))
    return [model.encode(f"# part {i}\n" + text[i * step :])[:tokens] for i in range(count)]


@dataclass
class Tenant:
    name: str
    token: str
    store: StoreClient
    latest: deque[int]
    """Seeds (`prefix_of`) of the latest few prefixes published: what clients use."""
    prompts: list[list[int]]
    published: list[int] = field(default_factory=list)
    """Seeds of every prefix published (for sweeps that read everything back)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, rng: random.Random) -> int:
        with self.lock:
            return rng.choice(self.latest)

    def add(self, seed: int) -> None:
        with self.lock:
            self.latest.append(seed)
            self.published.append(seed)

    def everything(self) -> list[int]:
        with self.lock:
            return list(self.published)


def prefix_of(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    """A prefix made from its seed: token ids (distinct prefixes with overwhelming
    probability) and random KV for them; the same every time, so only seeds are kept."""
    rng = random.Random(seed)
    tokens = chunks * LAYOUT.chunk_tokens
    ids = [rng.randrange(50_000) for _ in range(tokens)]
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return ids, torch.randn(shape, generator=g)


class Workload:
    """What the clients of each tenant do, and the checks they make on the way."""

    def __init__(self, config: LoadConfig, deployment: Deployment, model) -> None:
        self.config = config
        self.deployment = deployment
        self.model = model
        self.metadata = Metadata(deployment.redis_url)
        self.recorder = Recorder()
        self.tenants = [self._tenant(i) for i in range(config.tenants)]

    def decoders(self) -> list[str]:
        return [self.deployment.decoders[i] for i in sorted(self.deployment.decoders)]

    def endpoints(self) -> list[str]:
        return [self.deployment.endpoints[i] for i in sorted(self.deployment.endpoints)]

    def _tenant(self, index: int) -> Tenant:
        name = f"load-{index}-{secrets.token_hex(3)}"
        token = self.metadata.add_tenant(name)
        store = StoreClient(self.endpoints(), token, self.client_config())
        docs = documents(self.model, 2, 300)
        question = self.model.encode("\n# What does this do?\n")[1:]
        with DecoderClient(self.decoders()[0], token, timeout_s=self.config.timeout_s) as d:
            for doc in docs:
                d.publish(token_ids=doc, compressors=["snapkv:budget=0.125"])
        prompts = [doc + question for doc in docs] + [docs[0][: 64 + index]]  # last: uncached
        tenant = Tenant(name, token, store, deque(maxlen=self.config.prefixes), prompts)
        rng = random.Random(f"{self.config.seed}/{name}")
        for _ in range(self.config.prefixes):
            seed = rng.getrandbits(62)
            store.publish_prefix(*prefix_of(seed, self.config.prefix_chunks), LAYOUT)
            tenant.add(seed)
        return tenant

    def client_config(self) -> ClientConfig:
        return ClientConfig(timeout_s=30, stream_timeout_s=60, retries=3)

    def stopped(self) -> bool:
        """Whether clients should stop before their deadline."""
        return False

    def close(self) -> None:
        for tenant in self.tenants:
            tenant.store.close()

    # ---- one client ------------------------------------------------------------------

    def client(self, index: int, deadline: float) -> None:
        tenant = self.tenants[index % len(self.tenants)]
        rng = random.Random(self.config.seed * 7 + index)
        ops, weights = zip(*self.config.weights.items(), strict=True)
        decoders = self.decoders()
        decoder = DecoderClient(
            decoders[index % len(decoders)], tenant.token, timeout_s=self.config.timeout_s
        )
        try:
            while time.monotonic() < deadline and not self.stopped():
                op = rng.choices(ops, weights)[0]
                self.run(op, lambda op=op: getattr(self, op)(tenant, rng, decoder))
        finally:
            decoder.close()

    def run(
        self, op: str, fn: Callable[[], tuple[int, int]], recorder: Recorder | None = None
    ) -> None:
        """Run one operation, its outcome recorded in `recorder` (default: the run's)."""
        started = time.monotonic()
        try:
            verified, lost = fn()
            outcome = Outcome(op, 0.0, "OK", verified, lost, started)
        except Exception as error:  # noqa: BLE001 - every failure is a figure
            outcome = Outcome(op, 0.0, status_of(error), started=started)
        outcome.seconds = time.monotonic() - started
        (recorder or self.recorder).add(outcome)

    def publish(self, tenant: Tenant, rng: random.Random, _) -> tuple[int, int]:
        fresh = rng.random() < self.config.fresh
        seed = rng.getrandbits(62) if fresh else tenant.pick(rng)
        tenant.store.publish_prefix(*prefix_of(seed, self.config.prefix_chunks), LAYOUT)
        if fresh:
            tenant.add(seed)
        return 0, 0

    def lookup(self, tenant: Tenant, rng: random.Random, _) -> tuple[int, int]:
        ids, _ = prefix_of(tenant.pick(rng), self.config.prefix_chunks)
        tenant.store.lookup(ids + [1], LAYOUT)
        return 0, 0

    def fetch(self, tenant: Tenant, rng: random.Random, _) -> tuple[int, int]:
        return self.verify(tenant, tenant.pick(rng))

    def verify(self, tenant: Tenant, seed: int) -> tuple[int, int]:
        """Read a prefix back: (bytes equal to what was published, bytes not). A prefix
        found only in part (evicted, or a publish under way) is read as far as found."""
        ids, kv = prefix_of(seed, self.config.prefix_chunks)
        prefix = tenant.store.lookup(ids, LAYOUT)
        if prefix.tokens == 0:
            return 0, 0
        shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
        k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        tenant.store.fetch_layers(prefix, k, v)
        n = prefix.tokens
        same = torch.equal(k, kv[:, 0, :, :n]) and torch.equal(v, kv[:, 1, :, :n])
        nbytes = 2 * k.numel() * k.element_size()
        return (nbytes, 0) if same else (0, nbytes)

    def generate(self, tenant: Tenant, rng: random.Random, decoder) -> tuple[int, int]:
        prompt = rng.choice(tenant.prompts)
        mode = rng.choice(MODES)
        reply = decoder.generate(token_ids=prompt, max_new_tokens=self.config.new_tokens, mode=mode)
        if mode in LOSSLESS:
            self.recorder.generated(Generation(prompt, mode, list(reply.tokens)))
        return 0, 0


# ---- running it ------------------------------------------------------------------------


class Processes:
    """RSS of every shard and decoder process, sampled in the background: the peak, and the
    first sample after `warm_s` (once every kind of request has run: the baseline that
    "flat" is judged against)."""

    def __init__(self, deployment: Deployment, every_s: float = 5.0, warm_s: float = 0) -> None:
        self.deployment = deployment
        self.every_s = every_s
        self.warm_s = warm_s
        self.peak: dict[str, int] = defaultdict(int)
        self.warm: dict[str, int] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def actors(self) -> dict[str, object]:
        """The actors whose processes are sampled, by name."""
        d = self.deployment
        actors = {f"shard-{i}": a for i, a in d.actors.items()}
        return actors | {f"decoder-{i}": a for i, a in d.decoder_actors.items()}

    def pids(self) -> dict[str, int]:
        pids = {}
        for name, actor in self.actors().items():
            with contextlib.suppress(Exception):  # a process being killed by chaos
                pids[name] = ray.get(actor.pid.remote(), timeout=10)
        return pids

    def rss(self) -> dict[str, int]:
        out = {}
        for name, pid in self.pids().items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) * 1024
        return out

    def start(self) -> Processes:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            warm = time.monotonic() - self._started >= self.warm_s
            for name, rss in self.rss().items():
                self.peak[name] = max(self.peak[name], rss)
                if warm:
                    self.warm.setdefault(name, rss)


def drive(workload: Workload, seconds: float) -> None:
    """`config.clients` threads for `seconds`."""
    deadline = time.monotonic() + seconds
    threads = [
        threading.Thread(target=workload.client, args=(i, deadline), daemon=True)
        for i in range(workload.config.clients)
    ]
    for t in threads:
        t.start()
    watch(workload, deadline, seconds, threads)
    for t in threads:
        t.join(timeout=seconds + workload.config.timeout_s + 60)


def watch(workload: Workload, deadline: float, seconds: float, threads) -> None:
    """A progress bar over the run's seconds, with operations done so far, until `deadline`
    (or until every client thread ended)."""
    total = round(seconds)
    with progress(desc="load", total=total, unit="s") as bar:
        shown = 0
        while (left := deadline - time.monotonic()) > 0 and any(t.is_alive() for t in threads):
            time.sleep(min(1.0, left))
            elapsed = total - max(0, round(deadline - time.monotonic()))
            bar.update(elapsed - shown)
            shown = elapsed
            bar.set_postfix_str(f"{len(workload.recorder.outcomes)} operations")


def check_generations(
    workload: Workload,
    runner,
    sample: int,
    generations: list[Generation] | None = None,
    references: dict[tuple[int, ...], list[int]] | None = None,
) -> dict:
    """Decode a sample of the lossless generations (default: the run's) again with full KV,
    here; `references` (prompt -> full-KV tokens) carries them from one call to the next."""
    from decoder.generate import generate_full

    seen: dict[tuple, list[Generation]] = defaultdict(list)
    for g in workload.recorder.generations if generations is None else generations:
        seen[(tuple(g.prompt), g.mode)].append(g)
    picked = [gs[0] for gs in seen.values()][:sample]
    picked += [g for gs in seen.values() for g in gs[1:]][: max(0, sample - len(picked))]
    wrong = 0
    eos = workload.model.eos_token_ids
    references = {} if references is None else references
    for g in progress(picked, desc="checking generations", unit="gen"):
        key = tuple(g.prompt)
        if key not in references:
            full = generate_full(
                runner, [g.prompt], max_new_tokens=workload.config.new_tokens, eos_token_ids=eos
            )
            references[key] = full[0].tokens
        ref = references[key]
        wrong += sum(a != b for a, b in zip(g.tokens, ref, strict=False))
        wrong += abs(len(g.tokens) - len(ref))
    return {"checked": len(picked), "wrong_tokens": wrong, "generations": len(seen)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(
    outcomes: list[Outcome], seconds: float, operations: tuple[str, ...] = OPERATIONS
) -> dict:
    by_op: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_op[o.op].append(o)
    table = {}
    for op in operations:
        done = by_op.get(op, [])
        ok = [o.seconds for o in done if o.status == "OK"]
        table[op] = {
            "count": len(done),
            "ok": len(ok),
            "per_s": len(ok) / seconds if seconds else 0.0,
            "p50_s": percentile(ok, 0.50),
            "p95_s": percentile(ok, 0.95),
            "p99_s": percentile(ok, 0.99),
            "errors": dict(Counter(o.status for o in done if o.status != "OK")),
        }
    return {
        "operations": table,
        "verified_bytes": sum(o.verified_bytes for o in outcomes),
        "lost_bytes": sum(o.lost_bytes for o in outcomes),
        "errors": dict(Counter(o.status for o in outcomes if o.status != "OK")),
    }


def print_table(summary: dict) -> None:
    print(
        f"{'operation':<10} {'count':>7} {'ok/s':>7} {'p50 s':>8} {'p95 s':>8} {'p99 s':>8}  errors"
    )
    for op, row in summary["operations"].items():
        errors = ", ".join(f"{k} {v}" for k, v in sorted(row["errors"].items())) or "-"
        print(
            f"{op:<10} {row['count']:>7} {row['per_s']:>7.2f} {row['p50_s']:>8.3f} "
            f"{row['p95_s']:>8.3f} {row['p99_s']:>8.3f}  {errors}"
        )


@contextlib.contextmanager
def deployment_for(config: LoadConfig, redis_url: str | None = None, **serve) -> Iterator:
    """A deployment on this machine (its state in a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="vericache-load-") as home:
        settings = dict(
            shards=config.shards,
            decoders=config.decoders,
            memory_bytes=256 * MiB,
            disk_bytes=512 * MiB,
            state_dir=Path(home) / "state",
            redis_url=redis_url,
        )
        settings.update(serve)
        with Deployment(ServeConfig(**settings)) as deployment:
            yield deployment


def run(config: LoadConfig, deployment: Deployment, model, runner) -> dict:
    """The load against a running deployment; the figures."""
    workload = Workload(config, deployment, model)
    processes = Processes(deployment, warm_s=min(60.0, config.seconds / 5))
    rss_start = processes.rss()
    processes.start()
    t0 = time.monotonic()
    try:
        drive(workload, config.seconds)
    finally:
        processes.stop()
        workload.close()
    seconds = time.monotonic() - t0
    rss_end = processes.rss()
    summary = summarise(workload.recorder.outcomes, seconds)
    summary["tokens"] = check_generations(workload, runner, config.sample)
    summary["rss"] = {
        name: {
            "start": rss_start.get(name),
            "warm": processes.warm.get(name),
            "end": rss_end.get(name),
            "peak": peak,
        }
        for name, peak in processes.peak.items()
    }
    summary["seconds"] = seconds
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = LoadConfig()
    ap.add_argument("--clients", type=int, default=defaults.clients)
    ap.add_argument("--tenants", type=int, default=defaults.tenants)
    ap.add_argument("--seconds", type=float, default=defaults.seconds)
    ap.add_argument("--decoders", type=int, default=defaults.decoders)
    ap.add_argument("--sample", type=int, default=defaults.sample)
    ap.add_argument("--out", type=Path, default=Path("bench/results/load.json"))
    args = ap.parse_args()
    config = LoadConfig(
        clients=args.clients,
        tenants=args.tenants,
        seconds=args.seconds,
        decoders=args.decoders,
        sample=args.sample,
    )
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    with deployment_for(config) as deployment:
        summary = run(config, deployment, model, runner)
    print_table(summary)
    tokens = summary["tokens"]
    print(
        f"\nbytes verified {summary['verified_bytes']}, lost {summary['lost_bytes']}; "
        f"generations checked {tokens['checked']}, wrong tokens {tokens['wrong_tokens']}"
    )
    for name, rss in sorted(summary["rss"].items()):
        mib = {k: f"{v / 2**20:.0f} MiB" if v else "-" for k, v in rss.items()}
        print(
            f"{name:<10} RSS start {mib['start']}, warm {mib['warm']}, end {mib['end']}, "
            f"peak {mib['peak']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": asdict(config), "machine": platform.platform(), **summary}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    healthy = summary["lost_bytes"] == 0 and tokens["wrong_tokens"] == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
