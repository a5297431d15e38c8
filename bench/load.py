"""Load: a real deployment held under many concurrent clients of several tenants (issue 15).

A deployment like `vericache serve` starts one (Ray actors: `--shards` shards with
replication 2, `--decoders` decoders, a Redis metadata plane). `--clients` threads, spread
over `--tenants` tenants, then run operations back to back for `--seconds`:

- publish: store a prefix of random KV through the store SDK (a small layout, so that the
  store's own paths are what is loaded): half the time one of the tenant's last few again
  (found stored: no new bytes), half the time a new one, which joins them (so new bytes
  keep arriving, and the tiers spill and evict as in production);
- lookup: look one of the tenant's prefixes up (it must cover what was published);
- fetch: read one back and compare it bitwise with what was published (bytes verified);
- generate: one of the tenant's prompts through a decoder in `full`, `vericache` or
  `lossy` mode (documents published through the decoder at start, plus uncached prompts
  the decoder prefills itself).

After the run, every lossless generation is checked against full KV decoded in this
process (one reference per prompt), token for token; and every prefix ever committed (its
publish returned) is read back once. Loss is counted honestly (`Losses`): a read that
finds less than was committed is a miss (status MISS, not an error); a miss is a loss
unless the shards' own counters explain it (blobs evicted out of a shard, lost spills,
corrupt copies dropped, files rejected at start-up: `explanations`). It prints, and writes
as JSON: per operation p50/p95/p99 latency, count and throughput, errors by status code;
bytes verified; misses, explained and not; wrong tokens; the RSS of every shard and
decoder process at start and end (and its peak while sampled). It exits 1 unless
`verdict` finds nothing wrong: no byte read back wrong, no wrong token, no unexplained
miss, no error status, something verified and checked, every operation succeeding.

`bench/chaos.py` runs the same load while it injects faults.

Usage: python bench/load.py [--clients 64] [--tenants 4] [--seconds 600] [--decoders 1]
       [--out bench/results/load.json]
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
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.config import Placement  # noqa: E402
from decoder.progress import progress  # noqa: E402
from decoder.service.client import DecoderClient  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import ClientConfig, MiB  # noqa: E402
from prefix_store.errors import NotFound, StoreError  # noqa: E402
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
    decoder_threads: int | None = None
    """torch threads per decoder (None: the node's cores, as `vericache serve`)."""
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
    placement: Placement = "auto"
    """Where the decoders verify (`serve --placement`). `near` also turns resident prefixes
    off, so that every lossless generation attends its prefix on the shards (Attend
    streams) instead of reading a copy it would hold: faults then meet near-data
    verification."""

    def serving(self) -> dict:
        """The deployment settings that follow from the load's (`ServeConfig` fields)."""
        return {"placement": self.placement, "resident_prefixes": self.placement != "near"}


MISS = "MISS"
"""The status of a read that found less than was committed: not an error, a miss (a loss
unless explained: `Losses`)."""
ANSWERED = ("OK", MISS)
EXPLAINING = ("dropped", "lost_spills", "corrupt", "disk_rejected")
"""Shard counters each of whose events can take one copy of a committed blob away."""


@dataclass(frozen=True)
class Done:
    """What one successful operation found."""

    verified_bytes: int = 0
    """Bytes read back equal to what was published."""
    lost_bytes: int = 0
    """Bytes read back different from what was published (CRC-clean, yet wrong)."""
    missed: bool = False
    """It found less of a committed prefix than was published (`MISS`)."""
    missing_replicas: int = 0
    """Chunk copies a publish could not place (its shard down)."""


@dataclass
class Outcome:
    op: str
    seconds: float
    status: str
    """"OK", MISS, a gRPC status code name, or "exception:TypeName" (a bug)."""
    verified_bytes: int = 0
    lost_bytes: int = 0
    started: float = 0.0
    missing_replicas: int = 0
    detail: str = ""
    """A failure's message (an exception's with where it was raised), for the report."""


@dataclass
class Generation:
    prompt: list[int]
    mode: str
    tokens: list[int]
    started: float = 0.0
    near_passes: int = 0
    """Its verification passes that attended the prefix on the shards."""
    near_retries: int = 0
    """Its passes undone while attending near the data and redone pulling."""


class Recorder:
    """Every client's outcomes and lossless generations, and the operations in flight
    (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.generations: list[Generation] = []
        self._in_flight: Counter[str] = Counter()

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def generated(self, generation: Generation) -> None:
        with self._lock:
            self.generations.append(generation)

    def since(self, start: float, end: float = float("inf")) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if start <= o.started < end]

    @contextlib.contextmanager
    def flying(self, op: str) -> Iterator[None]:
        """Count `op` in flight while the block runs."""
        with self._lock:
            self._in_flight[op] += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[op] -= 1

    def in_flight(self, op: str) -> int:
        with self._lock:
            return self._in_flight[op]


class Losses:
    """Misses of committed prefixes, and what may explain them (thread-safe).

    A prefix is committed once its publish returned. A read that finds less of it is a
    miss. Each event that took a committed blob's copy away (`explain`: a shard's
    `EXPLAINING` counters, a shard killed with blobs in memory, a fetch corrupted in
    transit on every copy) explains at most one distinct missed prefix; the rest are
    unexplained: lost. The bound is loose (a chunk has two copies), never the other way: a
    run in which nothing took a copy away may miss nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.missed: dict[tuple[str, int], float] = {}
        """(tenant, seed) -> when it was first found missing."""
        self.explained_by: Counter[str] = Counter()

    def miss(self, tenant: str, seed: int) -> None:
        with self._lock:
            self.missed.setdefault((tenant, seed), time.monotonic())

    def explain(self, cause: str, count: int) -> None:
        if count > 0:
            with self._lock:
                self.explained_by[cause] += count

    def figures(self) -> dict:
        with self._lock:
            missed, explanations = len(self.missed), sum(self.explained_by.values())
            return {
                "missed_prefixes": missed,
                "explanations": dict(self.explained_by),
                "unexplained": max(0, missed - explanations),
            }


class ShardCounters:
    """The growth of every shard's `EXPLAINING` counters over a run, across restarts: each
    actor (a restarted shard is a new one) is read at `observe`; what it counted since its
    last reading (since it started, for a new one) feeds `losses`."""

    def __init__(self, deployment: Deployment, losses: Losses) -> None:
        self.deployment = deployment
        self.losses = losses
        self._last: dict[str, dict] = {}
        self._lock = threading.Lock()

    def observe(self) -> dict[int, dict]:
        """Read every live shard now; its stats by index."""
        now = {}
        for index, actor in list(self.deployment.actors.items()):
            with contextlib.suppress(Exception):  # a shard being killed by chaos
                now[index] = (actor, ray.get(actor.stats.remote(), timeout=30))
        with self._lock:
            for actor, stats in now.values():
                key = actor._actor_id.hex()
                before = self._last.get(key, {})
                for name in EXPLAINING:
                    self.losses.explain(name, stats.get(name, 0) - before.get(name, 0))
                self._last[key] = stats
        return {index: stats for index, (_, stats) in now.items()}


def detail_of(error: BaseException) -> str:
    """What the report shows of a failure: its message, and for an exception that is no
    store error (a bug) the last frames it was raised through."""
    text = f"{type(error).__name__}: {error}"[:300]
    if isinstance(error, StoreError):
        return text
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    return text + " at " + " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames)


def error_samples(outcomes: list[Outcome], per_status: int = 3) -> dict[str, list[str]]:
    """A few failures of each status (operation: detail), for the report."""
    samples: dict[str, list[str]] = defaultdict(list)
    for o in outcomes:
        if o.status not in ANSWERED and len(samples[o.status]) < per_status:
            samples[o.status].append(f"{o.op}: {o.detail}")
    return dict(samples)


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


class Reads:
    """A tenant's store operations on its prefixes, checked against what it committed:
    bitwise, and for coverage (a miss goes to `losses`)."""

    def __init__(self, chunks: int, losses: Losses) -> None:
        self.chunks = chunks
        self.losses = losses

    def publish(self, tenant: Tenant, seed: int, fresh: bool) -> Done:
        """Publish the prefix of `seed` (new to the tenant when `fresh`, else one of its
        committed ones again); once the publish returned it is committed."""
        result = tenant.store.publish_prefix(*prefix_of(seed, self.chunks), LAYOUT)
        if fresh:
            tenant.add(seed)
        return Done(missing_replicas=result.missing_replicas)

    def lookup(self, tenant: Tenant, seed: int) -> Done:
        """A lookup of a committed prefix, one token longer: it must cover the prefix."""
        ids, _ = prefix_of(seed, self.chunks)
        found = tenant.store.lookup(ids + [1], LAYOUT).tokens
        return self.found(tenant, seed, found >= len(ids))

    def verify(self, tenant: Tenant, seed: int) -> Done:
        """Read a committed prefix back whole and compare it bitwise with what was
        published. Found in part, or gone by the time of the fetch (NOT_FOUND): a miss."""
        ids, kv = prefix_of(seed, self.chunks)
        prefix = tenant.store.lookup(ids, LAYOUT)
        if prefix.tokens < len(ids):
            return self.found(tenant, seed, False)
        shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
        k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        try:
            tenant.store.fetch_layers(prefix, k, v)
        except NotFound:
            return self.found(tenant, seed, False)
        same = torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
        nbytes = 2 * k.numel() * k.element_size()
        return Done(verified_bytes=nbytes) if same else Done(lost_bytes=nbytes)

    def found(self, tenant: Tenant, seed: int, whole: bool) -> Done:
        """A read of a committed prefix that found it `whole`, or missed it."""
        if whole:
            return Done()
        self.losses.miss(tenant.name, seed)
        return Done(missed=True)


class Workload:
    """What the clients of each tenant do, and the checks they make on the way."""

    def __init__(self, config: LoadConfig, deployment: Deployment, model) -> None:
        self.config = config
        self.deployment = deployment
        self.model = model
        self.metadata = Metadata(deployment.redis_url)
        self.recorder = Recorder()
        self.losses = Losses()
        self.reads = Reads(config.prefix_chunks, self.losses)
        self.counters = ShardCounters(deployment, self.losses)
        self.counters.observe()  # the baseline: what the shards counted before the run
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
            self.reads.publish(tenant, rng.getrandbits(62), fresh=True)
        return tenant

    def client_config(self) -> ClientConfig:
        return ClientConfig(timeout_s=30, stream_timeout_s=60, retries=3)

    def events(self) -> Counter[str]:
        """What the tenants' store clients met so far (failovers, unreachable shards)."""
        total: Counter[str] = Counter()
        for tenant in self.tenants:
            total.update(tenant.store.events())
        return total

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

    def run(self, op: str, fn: Callable[[], Done], recorder: Recorder | None = None) -> None:
        """Run one operation, its outcome recorded in `recorder` (default: the run's)."""
        recorder = recorder or self.recorder
        started = time.monotonic()
        try:
            with recorder.flying(op):
                done = fn()
            status = MISS if done.missed else "OK"
            outcome = Outcome(op, 0.0, status, done.verified_bytes, done.lost_bytes, started,
                              done.missing_replicas)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every failure is a figure
            outcome = Outcome(op, 0.0, status_of(error), started=started, detail=detail_of(error))
        outcome.seconds = time.monotonic() - started
        recorder.add(outcome)

    def publish(self, tenant: Tenant, rng: random.Random, _) -> Done:
        fresh = rng.random() < self.config.fresh
        seed = rng.getrandbits(62) if fresh else tenant.pick(rng)
        return self.reads.publish(tenant, seed, fresh)

    def lookup(self, tenant: Tenant, rng: random.Random, _) -> Done:
        return self.reads.lookup(tenant, tenant.pick(rng))

    def fetch(self, tenant: Tenant, rng: random.Random, _) -> Done:
        return self.reads.verify(tenant, tenant.pick(rng))

    def generate(self, tenant: Tenant, rng: random.Random, decoder) -> Done:
        return self._generate(rng.choice(tenant.prompts), rng.choice(MODES), decoder)

    def generate_each(self, mode: str = "vericache") -> None:
        """One generation in `mode` per tenant over its first stored document, run now and
        recorded (and checked at the end) as the clients' are: the decoders' own traffic on
        demand, as `sweep` is the store's."""
        address = self.decoders()[0]
        for tenant in self.tenants:
            with DecoderClient(address, tenant.token, timeout_s=self.config.timeout_s) as d:
                self.run("generate", lambda t=tenant, d=d: self._generate(t.prompts[0], mode, d))

    def _generate(self, prompt: list[int], mode: str, decoder) -> Done:
        started = time.monotonic()
        reply = decoder.generate(token_ids=prompt, max_new_tokens=self.config.new_tokens, mode=mode)
        if mode in LOSSLESS:
            stats = reply.stats
            near, retries = int(stats.get("near_passes", 0)), int(stats.get("near_retries", 0))
            self.recorder.generated(
                Generation(prompt, mode, list(reply.tokens), started, near, retries)
            )
        return Done()

    def sweep(self, recorder: Recorder | None = None) -> None:
        """Read every prefix committed so far back once, each checked bitwise (outcomes
        into `recorder`, default the run's)."""
        for tenant in self.tenants:
            for seed in tenant.everything():
                self.run("fetch", lambda t=tenant, s=seed: self.reads.verify(t, s), recorder)


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
    generations: list[Generation] | None = None,
    references: dict[tuple[int, ...], list[int]] | None = None,
) -> dict:
    """Check every lossless generation (default: the run's) against full KV decoded again
    here, token for token: one reference per distinct prompt, `references` (prompt ->
    full-KV tokens) carrying them from one call to the next. `wrong_at`: when each
    generation with a wrong token started (for fault windows)."""
    from decoder.generate import generate_full

    picked = workload.recorder.generations if generations is None else generations
    picked = [g for g in picked if g.mode in LOSSLESS]
    references = {} if references is None else references
    eos = workload.model.eos_token_ids
    missing = sorted({tuple(g.prompt) for g in picked} - set(references))
    for batch in progress(_batches(missing, REFERENCE_BATCH), desc="full-KV references",
                          unit="batch"):  # fmt: skip
        full = generate_full(
            runner,
            [list(p) for p in batch],
            max_new_tokens=workload.config.new_tokens,
            eos_token_ids=eos,
        )
        references.update(zip(batch, (r.tokens for r in full), strict=True))
    wrong, wrong_at = 0, []
    for g in picked:
        ref = references[tuple(g.prompt)]
        here = sum(a != b for a, b in zip(g.tokens, ref, strict=False))
        here += abs(len(g.tokens) - len(ref))
        if here:
            wrong += here
            wrong_at.append(g.started)
    return {
        "checked": len(picked),
        "wrong_tokens": wrong,
        "wrong_at": wrong_at,
        "prompts": len({tuple(g.prompt) for g in picked}),
    }


REFERENCE_BATCH = 8
"""Prompts decoded together for full-KV references (exact mode: a prompt's tokens do not
depend on its batch)."""


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


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
        ok = [o.seconds for o in done if o.status in ANSWERED]
        table[op] = {
            "count": len(done),
            "ok": len(ok),
            "misses": sum(o.status == MISS for o in done),
            "per_s": len(ok) / seconds if seconds else 0.0,
            "p50_s": percentile(ok, 0.50),
            "p95_s": percentile(ok, 0.95),
            "p99_s": percentile(ok, 0.99),
            "errors": errors_of(done),
        }
    return {
        "operations": table,
        "verified_bytes": sum(o.verified_bytes for o in outcomes),
        "lost_bytes": sum(o.lost_bytes for o in outcomes),
        "misses": sum(o.status == MISS for o in outcomes),
        "errors": errors_of(outcomes),
    }


def errors_of(outcomes: list[Outcome]) -> dict[str, int]:
    """Failed operations by status (a miss answered: not an error)."""
    return dict(Counter(o.status for o in outcomes if o.status not in ANSWERED))


def integrity(summary: dict) -> list[str]:
    """What every run must show (empty: it does): no byte read back wrong, no wrong token,
    no unexplained miss, no operation failing with an exception (a bug), and something was
    verified and checked at all."""
    problems = []
    if summary["lost_bytes"]:
        problems.append(f"{summary['lost_bytes']} bytes read back wrong")
    if not summary["verified_bytes"]:
        problems.append("no byte was read back and verified")
    tokens = summary["tokens"]
    if tokens["wrong_tokens"]:
        problems.append(f"{tokens['wrong_tokens']} wrong tokens")
    if not tokens["checked"]:
        problems.append("no lossless generation was checked against full KV")
    losses = summary["losses"]
    if losses["unexplained"]:
        problems.append(
            f"{losses['unexplained']} of {losses['missed_prefixes']} committed prefixes missed "
            f"with nothing to explain it (explanations: {losses['explanations'] or 'none'})"
        )
    bugs = {k: v for k, v in summary["errors"].items() if k.startswith("exception:")}
    if bugs:
        problems.append(f"operations failed with an exception (a bug): {bugs}")
    return problems


def verdict(summary: dict, expected_errors: Collection[str] = ()) -> list[str]:
    """What went wrong in a load run (empty: nothing): `integrity`, every operation
    succeeding at least once, and no failure with a status outside `expected_errors`."""
    problems = integrity(summary)
    for op, row in summary["operations"].items():
        if not row["ok"]:
            problems.append(f"{op}: none of {row['count']} succeeded")
    unexpected = {
        k: v
        for k, v in summary["errors"].items()
        if k not in expected_errors and not k.startswith("exception:")
    }
    if unexpected:
        problems.append(f"operations failed: {unexpected}")
    return problems


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


def print_checks(summary: dict) -> None:
    """The checks' figures: bytes, misses and what explains them, tokens."""
    tokens, losses = summary["tokens"], summary["losses"]
    print(
        f"\nbytes verified {summary['verified_bytes']}, read back wrong {summary['lost_bytes']}; "
        f"misses {summary['misses']} ({losses['missed_prefixes']} prefixes; explanations "
        f"{losses['explanations'] or 'none'}; unexplained {losses['unexplained']}); "
        f"lossless generations checked {tokens['checked']} over {tokens['prompts']} prompts, "
        f"wrong tokens {tokens['wrong_tokens']}"
    )


@contextlib.contextmanager
def deployment_for(config: LoadConfig, redis_url: str | None = None, **serve) -> Iterator:
    """A deployment on this machine (its state in a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="vericache-load-") as home:
        settings = dict(
            shards=config.shards,
            decoders=config.decoders,
            decoder_threads=config.decoder_threads,
            memory_bytes=256 * MiB,
            disk_bytes=512 * MiB,
            state_dir=Path(home) / "state",
            redis_url=redis_url,
            **config.serving(),
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
    sweep = Recorder()
    try:
        drive(workload, config.seconds)
        seconds = time.monotonic() - t0
        workload.sweep(sweep)  # every committed prefix, read back once
    finally:
        processes.stop()
        workload.close()
    rss_end = processes.rss()
    workload.counters.observe()
    summary = summarise(workload.recorder.outcomes, seconds)  # the timed operations
    swept = summarise(sweep.outcomes, seconds, ("fetch",))
    summary["sweep"] = {k: swept[k] for k in ("verified_bytes", "lost_bytes", "misses", "errors")}
    summary["sweep"]["prefixes"] = len(sweep.outcomes)
    totals = summarise(workload.recorder.outcomes + sweep.outcomes, seconds)  # every check
    summary |= {k: totals[k] for k in ("verified_bytes", "lost_bytes", "errors")}
    summary["losses"] = workload.losses.figures()
    summary["tokens"] = check_generations(workload, runner)
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
    ap.add_argument("--out", type=Path, default=Path("bench/results/load.json"))
    args = ap.parse_args()
    config = LoadConfig(
        clients=args.clients,
        tenants=args.tenants,
        seconds=args.seconds,
        decoders=args.decoders,
    )
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    with deployment_for(config) as deployment:
        summary = run(config, deployment, model, runner)
    print_table(summary)
    print_checks(summary)
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
    problems = verdict(summary)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
