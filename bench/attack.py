"""Attack: the noisy-neighbour figures (issue 26, "Hostile neighbours").

A deployment like `vericache serve` starts one (`bench/load.py`'s: Ray actors, Redis, 2
shards, a decoder, a router, and here an LMCache gateway). A victim tenant (weight 1) runs a
steady mixed load at `--rate` operations per second: lookups, bitwise-checked fetches, 64-byte
puts, publishes, and vericache generates through the router whose tokens are checked, token
for token, against full-KV decoding in this process. Phases of `--seconds` each, in turn:

- baseline: the victim alone;
- benign: a second tenant does the same honest work beside it, at the attacks' rate
  (`--attack-rate`): what two cores cannot avoid, the yardstick of every attack;
- one phase per finding, the attack running from other tenants or unauthenticated peers:
  - 2: 12 Put streams held open, each one 64-byte segment carrying a 60 MB unknown field;
  - 3: two Puts declaring 7.5 GiB and 0.5 GiB per shard, kept alive by empty segment
    batches (the victim's own 64-byte puts are its "put" operations);
  - 4: 16 idle Put streams per shard from each of two tenants (the victim is the third);
  - 5: one tenant refreshing cheap OpenFetch tickets (never redeemed) faster than they
    expire, and unauthenticated peers holding data-plane connections;
  - 6: unknown tokens on every component, 60 MB unary messages without a token, and
    amplification with a valid one (a million token ids, chunk_tokens=1, a huge prompt);
  - 8: the LMCache gateway: connections from another local user (root: uid 65534) and
    PUTs declaring 256 MiB that never send their payload;
  - 10: slow clients holding metrics endpoints, Health.Watch with made-up service names.

Per phase it prints, and writes as JSON: the victim's operations, failures by status, p50
and p99 (overall and per kind), the p99 against the benign phase's, its throughput against
its share, shard and decoder peak RSS against the bound the deployment states, whether every
component answered its health check (and shards Describe) at the phase's end, wrong tokens,
and what the attack did. Targets, per attack: 0 failed operations; p99 <= 2x the benign
phase's; throughput >= 0.9x its share (the victim asks for less than its weighted share of
the deployment, so its share is what it asks for, as far as the baseline served it); RSS
under the bound (shard: RSS at start + receive budget + memory tier + 256 MiB; decoder: RSS
at start + KV budget + 256 MiB); healthy; 0 wrong tokens. The exit code is 0 only when every
target holds, every attack did something, and the victim did checked work (generations
checked and bytes verified).

Usage: python bench/attack.py [--quick] [--seconds 50] [--rate 3] [--attack-rate 20]
       [--attacks 2 3 4 5 6 8 10] [--out bench/results/attack.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vericache.v1 import decoder_pb2 as dpb  # noqa: E402
from vericache.v1 import prefix_store_pb2 as pb  # noqa: E402

from bench.load import (  # noqa: E402
    LAYOUT,
    MISS,
    Done,
    Generation,
    LoadConfig,
    Processes,
    Recorder,
    Tenant,
    Workload,
    check_generations,
    deployment_for,
    percentile,
    prefix_of,
    summarise,
)
from decoder.service.client import DecoderClient  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import GiB, MiB  # noqa: E402
from prefix_store.layout import KVLayout  # noqa: E402
from prefix_store.lmcache.protocol import Command, ReturnCode, client_header  # noqa: E402
from prefix_store.metrics import scrape  # noqa: E402
from prefix_store.protocol import wire  # noqa: E402

SMALL = KVLayout("attack-small@1", "float16", num_layers=1, num_kv_heads=1, head_dim=1,
                 chunk_tokens=16)  # fmt: skip
"""A chunk of 64 bytes: the victim's small puts, and the attack-2 streams' one segment."""
BIG = KVLayout("attack-big@1", "float32", num_layers=64, num_kv_heads=32, head_dim=128)
"""2 MiB per token: what attack 3 declares its puts in."""
OPERATIONS = ("lookup", "fetch", "put", "publish", "generate")
STORE = "/vericache.v1.PrefixStore/"
DECODER = "/vericache.v1.Decoder/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
EMPTY_BATCH = b"\x12\x00"
"""A PutRequest carrying an empty SegmentBatch."""
SERVING, UNKNOWN = b"\x08\x01", b"\x08\x03"
"""A serialised HealthCheckResponse: SERVING, SERVICE_UNKNOWN."""
RSS_SLACK = 256 * MiB
ANOTHER_HOST = "127.0.0.2"
"""Where unauthenticated peers connect from when the deployment is on loopback: another
address, as a peer on another host would be (limits per peer address are per host)."""
FOREIGN_UID = 65534
"""`nobody`: the other local user attack 8 connects to the gateway as (root only)."""


@dataclass(frozen=True)
class AttackConfig:
    """The benchmark: the deployment, the victim's load, the attacks and how long each runs."""

    seconds: float = 50.0
    """Length of each phase (9 phases: about 12 minutes with start-up on 2 cores)."""
    rate: float = 3.0
    """The victim's operations per second (open loop)."""
    attack_rate: float = 20.0
    """Requests (or connections) per second of each attack loop, and the benign
    neighbour's operations per second."""
    attacks: tuple[str, ...] = ("2", "3", "4", "5", "6", "8", "10")
    """Findings whose attacks run, in this order."""
    weights: dict[str, int] = field(
        default_factory=lambda: {"lookup": 3, "fetch": 3, "put": 2, "publish": 1, "generate": 1}
    )
    """The victim's (and the benign neighbour's) mix of operations."""
    workers: int = 8
    """Operations of one tenant in flight at most (a tick finding all busy is skipped)."""
    new_tokens: int = 8
    shards: int = 2
    decoders: int = 1
    decoder_threads: int | None = None
    """torch threads per decoder (None: the node's cores)."""
    memory_bytes: int = 256 * MiB
    """Memory tier per shard."""
    kv_budget: int = 512 * MiB
    """KV budget per decoder (the decoder's RSS bound is stated with it)."""
    seed: int = 0

    def load(self) -> LoadConfig:
        """The victim (tenant 0) and the benign neighbour (tenant 1), as `bench/load.py`
        sets tenants up (prompts published through the decoder, prefixes stored)."""
        return LoadConfig(tenants=2, shards=self.shards, decoders=self.decoders,
                          decoder_threads=self.decoder_threads, new_tokens=self.new_tokens,
                          prefixes=3, seed=self.seed)  # fmt: skip


def quick(config: AttackConfig) -> AttackConfig:
    """A smoke test: about 3 minutes."""
    return replace(config, seconds=12.0)


# ---- the tenants' load ---------------------------------------------------------------------


class Bench:
    """The deployment and what every phase uses: the victim, the benign neighbour, the
    attackers' tenants, the full-KV references."""

    def __init__(self, config: AttackConfig, deployment, model, runner) -> None:
        self.config = config
        self.deployment = deployment
        self.runner = runner
        self.workload = Workload(config.load(), deployment, model)
        self.victim, self.neighbour = self.workload.tenants
        self.references: dict[tuple[int, ...], list[int]] = {}

    def shards(self) -> list[str]:
        return self.workload.endpoints()

    def decoders(self) -> list[str]:
        """Decoders, then routers: every Decoder-service endpoint."""
        routers = [self.deployment.routers[i] for i in sorted(self.deployment.routers)]
        return self.workload.decoders() + routers

    def front(self) -> str:
        """Where tenants send generates: the router (a decoder when there is none)."""
        return self.decoders()[-1]

    def attacker(self, role: str) -> str:
        """A fresh tenant for an attack (a large quota: quota is not what should stop it)."""
        name = f"attack-{role}-{secrets.token_hex(3)}"
        return self.workload.metadata.add_tenant(name, quota=64 * GiB)

    def close(self) -> None:
        self.workload.close()


class Driver:
    """One tenant's mixed operations at a fixed rate, open loop: at most `workers` in
    flight, a tick that finds every one busy is skipped (and counted)."""

    def __init__(self, bench: Bench, tenant: Tenant, rate: float, recorder: Recorder) -> None:
        self.bench, self.tenant, self.rate, self.recorder = bench, tenant, rate, recorder
        config = bench.config
        self.rng = random.Random(f"{config.seed}/{tenant.name}/{time.monotonic()}")
        self.ops, self.weights = zip(*config.weights.items(), strict=True)
        self.free = threading.Semaphore(config.workers)
        self.skipped = self.issued = 0
        self.decoder = DecoderClient(bench.front(), tenant.token, timeout_s=300)
        work = bench.workload
        self.fns = {"lookup": work.lookup, "fetch": work.fetch, "publish": work.publish,
                    "put": self.put, "generate": self.generate}  # fmt: skip

    def run(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Issue operations for `seconds` (or until `stop`), then wait for those in flight."""
        start = time.monotonic()
        with ThreadPoolExecutor(self.bench.config.workers) as pool:
            for due in ticks(start, self.rate, start + seconds):
                if stop is not None and stop.is_set():
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                if not self.free.acquire(blocking=False):
                    self.skipped += 1
                    continue
                self.issued += 1
                pool.submit(self.one, self.rng.choices(self.ops, self.weights)[0])
        self.decoder.close()

    def one(self, op: str) -> None:
        try:
            fn = self.fns[op]
            self.bench.workload.run(op, lambda: fn(self.tenant, self.rng, self.decoder),
                                    self.recorder)  # fmt: skip
        finally:
            self.free.release()

    def put(self, tenant: Tenant, rng: random.Random, _) -> Done:
        """A 64-byte put (one chunk of SMALL), new every time."""
        ids = [rng.randrange(50_000) for _ in range(SMALL.chunk_tokens)]
        kv = torch.randn((1, 2, 1, SMALL.chunk_tokens, 1)).to(torch.float16)
        tenant.store.publish_prefix(ids, kv, SMALL)
        return Done()

    def generate(self, tenant: Tenant, rng: random.Random, decoder) -> Done:
        """A vericache generate through the router, kept for the token check."""
        prompt = rng.choice(tenant.prompts)
        new_tokens = self.bench.config.new_tokens
        reply = decoder.generate(token_ids=prompt, max_new_tokens=new_tokens, mode="vericache")
        self.recorder.generated(Generation(prompt, "vericache", list(reply.tokens)))
        return Done()


def ticks(start: float, per_s: float, end: float = float("inf")) -> Iterator[float]:
    """The due times of a fixed rate from `start` until `end`."""
    k = 0
    while (due := start + k / per_s) < end:
        yield due
        k += 1


# ---- attacks -------------------------------------------------------------------------------


class Attack:
    """One finding's attack: `loops()` run, each at its fixed rate, from `start` until
    `stop`; `did` counts what it did (streams opened, bytes sent, connections held, the
    statuses it was refused with)."""

    finding = ""
    summary = ""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.stopping = threading.Event()
        self.did: Counter = Counter()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.channels: dict[str, grpc.Channel] = {}
        self.error = ""
        """Why the attack could not start ("" when it did)."""

    def setup(self) -> None:
        """What the attack prepares before its loops start (tenants, payloads)."""

    def loops(self) -> list[tuple[float, Callable[[], None]]]:
        """(per second, one action) pairs."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Let go of what the attack holds (after its loops ended)."""

    def start(self) -> Attack:
        self.setup()
        for per_s, action in self.loops():
            thread = threading.Thread(target=self._loop, args=(per_s, action), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> dict[str, int]:
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self.teardown()
        for channel in self.channels.values():
            channel.close()
        return dict(sorted(self.did.items()))

    def _loop(self, per_s: float, action: Callable[[], None]) -> None:
        for due in ticks(time.monotonic(), per_s):
            if self.stopping.wait(max(0.0, due - time.monotonic())):
                return
            try:
                action()
            except grpc.RpcError as error:
                self.note(f"{action.__name__} refused {error.code().name}")
            except OSError as error:
                self.note(f"{action.__name__} socket error {type(error).__name__}")

    def note(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.did[what] += n

    def channel(self, address: str) -> grpc.Channel:
        """One channel per address (no message size limit of its own)."""
        if address not in self.channels:
            options = [("grpc.max_send_message_length", -1),
                       ("grpc.max_receive_message_length", -1)]  # fmt: skip
            self.channels[address] = grpc.insecure_channel(address, options=options)
        return self.channels[address]

    def call(self, address: str, method: str, payload: bytes, token: str | None, timeout=10):
        """A raw unary call: the response's bytes (RpcError when refused)."""
        unary = self.channel(address).unary_unary(method)
        return unary(payload, metadata=bearer(token), timeout=timeout)


def bearer(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Streams:
    """Client streams an attack holds open on one shard; when the shard ends one, its end
    status is counted. `messages(gone)` is each stream's request iterator; `gone` is set
    once its call ended."""

    def __init__(self, attack: Attack, address: str, method: str, token: str) -> None:
        self.attack, self.token = attack, token
        self.call = attack.channel(address).stream_unary(method)
        self.futures: list = []

    def open(self, messages: Callable[[threading.Event], Iterator[bytes]]) -> None:
        gone = threading.Event()
        future = self.call.future(messages(gone), metadata=bearer(self.token), timeout=600)
        future.add_done_callback(lambda f: self._ended(f, gone))
        self.futures.append(future)
        self.attack.note("streams opened")

    def _ended(self, future, gone: threading.Event) -> None:
        gone.set()
        if self.attack.stopping.is_set():
            return
        error = future.exception() if not future.cancelled() else None
        self.attack.note(f"streams ended {error.code().name if error else 'OK'}")

    def alive(self) -> int:
        self.futures = [f for f in self.futures if not f.done()]
        return len(self.futures)

    def close(self) -> None:
        for future in self.futures:
            future.cancel()


def held(attack: Attack, gone: threading.Event, every_s: float = 0.25) -> bool:
    """Waits `every_s`: whether the stream is still open and the attack still on."""
    return not gone.wait(every_s) and not attack.stopping.is_set()


def put_header(layout: KVLayout, tokens: list[int]) -> bytes:
    """A PutRequest header for every chunk of `tokens`."""
    chunks = list(range(-(-len(tokens) // layout.chunk_tokens)))
    header = pb.PutHeader(layout=layout.to_proto(pb), token_ids=tokens, chunk_indices=chunks)
    return pb.PutRequest(header=header).SerializeToString()


def padded_segments(padding: int) -> bytes:
    """A PutRequest carrying one 64-byte segment (layer 0, chunk 0 of SMALL) whose Segment
    message also carries `padding` bytes in an unknown field (number 15, length-delimited)."""
    size = SMALL.segment_bytes(SMALL.chunk_tokens)
    segment = (
        bytes([wire.SEGMENT_LAYER, 0, wire.SEGMENT_CHUNK, 0, wire.SEGMENT_DATA])
        + wire.varint(size)
        + b"\x07" * size
        + bytes([15 << 3 | 2])
        + wire.varint(padding)
        + bytes(padding)
    )
    batch = bytes([wire.REPEATED_SEGMENT]) + wire.varint(len(segment)) + segment
    return bytes([wire.PUT_SEGMENTS]) + wire.varint(len(batch)) + batch


def random_tokens(count: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(count)]


class PaddedPuts(Attack):
    finding = "2"
    summary = "12 Put streams held open, each one 64 B segment in a 60 MB unknown field"
    streams = 12
    padding = 60_000_000

    def setup(self) -> None:
        token = self.bench.attacker("padder")
        self.message = padded_segments(self.padding)
        self.puts = [Streams(self, a, STORE + "Put", token) for a in self.bench.shards()]

    def loops(self):
        return [(2.0, self.keep)]  # re-opens at most 2 a second, as streams are cut

    def keep(self) -> None:
        if sum(s.alive() for s in self.puts) >= self.streams:
            return
        self.puts[self.did["streams opened"] % len(self.puts)].open(self.messages)

    def messages(self, gone: threading.Event) -> Iterator[bytes]:
        yield put_header(SMALL, random_tokens(SMALL.chunk_tokens))
        yield self.message
        self.note("bytes sent", len(self.message))
        yield EMPTY_BATCH  # so that gRPC's sender lets go of the padded message
        while held(self, gone):
            continue

    def teardown(self) -> None:
        for streams in self.puts:
            streams.close()


class HeldBudget(Attack):
    finding = "3"
    summary = "2 Puts per shard declaring 7.5 and 0.5 GiB, kept alive by empty batches"
    declared = (15 * GiB // 2, GiB // 2)

    def setup(self) -> None:
        token = self.bench.attacker("holder")
        self.puts = {
            (address, size): Streams(self, address, STORE + "Put", token)
            for address in self.bench.shards()
            for size in self.declared
        }

    def loops(self):
        return [(1.0, self.keep)]

    def keep(self) -> None:
        for (_, size), streams in self.puts.items():
            if not streams.alive():
                streams.open(lambda gone, size=size: self.messages(gone, size))
                self.note("bytes declared", size)

    def messages(self, gone: threading.Event, size: int) -> Iterator[bytes]:
        yield put_header(BIG, random_tokens(size // BIG.chunk_bytes(1)))
        while held(self, gone, every_s=0.05):
            self.note("empty batches sent")
            yield EMPTY_BATCH

    def teardown(self) -> None:
        for streams in self.puts.values():
            streams.close()


class CallCap(Attack):
    finding = "4"
    summary = "16 idle Put streams per shard from each of two tenants"
    per_tenant = 16

    def setup(self) -> None:
        tokens = [self.bench.attacker(f"idler{i}") for i in range(2)]
        self.puts = [
            Streams(self, address, STORE + "Put", token)
            for token in tokens
            for address in self.bench.shards()
        ]

    def loops(self):
        return [(self.bench.config.attack_rate, self.keep)]

    def keep(self) -> None:
        streams = min(self.puts, key=lambda s: s.alive())
        if streams.alive() < self.per_tenant:
            streams.open(self.idle)

    def idle(self, gone: threading.Event) -> Iterator[bytes]:
        while held(self, gone):
            continue
        yield from ()

    def teardown(self) -> None:
        for streams in self.puts:
            streams.close()


class Sockets:
    """Raw TCP connections an attack holds; `sweep` counts those the server closed (and
    what it said first, when anything)."""

    def __init__(self, attack: Attack, what: str) -> None:
        self.attack, self.what = attack, what
        self.held: list[socket.socket] = []

    def open(self, address: str, first: bytes = b"", peer: bool = True) -> socket.socket:
        """A connection to `address`, sending `first`; from ANOTHER_HOST when `peer` (an
        unauthenticated peer) and the server is on loopback."""
        host, port = address.rsplit(":", 1)
        source = (ANOTHER_HOST, 0) if peer and host.startswith("127.") else None
        sock = socket.create_connection((host, int(port)), timeout=5, source_address=source)
        if first:
            sock.sendall(first)
            self.attack.note("bytes sent", len(first))
        self.held.append(sock)
        self.attack.note(f"{self.what} opened")
        return sock

    def sweep(self) -> None:
        poller = select.poll()
        by_fd = {s.fileno(): s for s in self.held}
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        for fd, _ in poller.poll(0):
            sock = by_fd[fd]
            try:
                said = sock.recv(64, socket.MSG_DONTWAIT)
            except OSError:
                said = b""
            if said and not said.startswith((b"HTTP/1.0 503", b"HTTP/1.1 503")):
                continue  # an answer, still open
            self.attack.note(f"{self.what} refused 503" if said else f"{self.what} cut")
            self.held.remove(sock)
            sock.close()

    def alive(self) -> int:
        return len(self.held)

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held.clear()


class DataPlane(Attack):
    finding = "5"
    summary = "OpenFetch tickets never redeemed; unauthenticated data-plane connections"
    hold = 300
    """Unauthenticated connections held per shard (more than the plane's 256 in all)."""

    def setup(self) -> None:
        self.token = self.bench.attacker("tickets")
        config = self.bench.workload.client_config()
        with contextlib.closing(StoreClient(self.bench.shards(), self.token, config)) as store:
            ids, kv = prefix_of(random.getrandbits(62), 1)
            store.publish_prefix(ids, kv, LAYOUT)
        self.requests = {a: self.fetch_request(a, ids) for a in self.bench.shards()}
        self.planes = {a: self.data_address(a) for a in self.bench.shards()}
        self.sockets = Sockets(self, "connections")
        self.issued = 0

    def fetch_request(self, address: str, ids: list[int]) -> bytes:
        lookup = pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=ids)
        found = pb.LookupResponse.FromString(
            self.call(address, STORE + "Lookup", lookup.SerializeToString(), self.token)
        )
        chunk = pb.ChunkRef(key=found.chunk_keys[0], tokens=LAYOUT.chunk_tokens)
        return pb.FetchRequest(layout=LAYOUT.to_proto(pb), chunks=[chunk]).SerializeToString()

    def data_address(self, address: str) -> str:
        reply = pb.DescribeResponse.FromString(
            self.call(address, STORE + "Describe", b"", self.token)
        )
        return next(s.data_address for s in reply.shards if s.address == address)

    def loops(self):
        rate = self.bench.config.attack_rate
        return [(2 * rate, self.ticket), (rate, self.connect)]

    def ticket(self) -> None:
        """OpenFetch at twice the attack rate: 60 s of it would be 2,400 tickets (30 s TTL)."""
        addresses = list(self.requests)
        address = addresses[self.issued % len(addresses)]
        self.issued += 1
        self.call(address, STORE + "OpenFetch", self.requests[address], self.token)
        self.note("tickets issued")

    def connect(self) -> None:
        self.sockets.sweep()
        if self.sockets.alive() < self.hold * len(self.planes):
            planes = list(self.planes.values())
            self.sockets.open(planes[self.did["connections opened"] % len(planes)])

    def teardown(self) -> None:
        self.sockets.sweep()
        self.sockets.close()


class PreAuth(Attack):
    finding = "6"
    summary = "unknown tokens, 60 MB unary messages without a token, amplification"
    huge = 60_000_000

    def setup(self) -> None:
        self.token = self.bench.attacker("amplifier")
        self.targets = [(a, STORE + "Describe") for a in self.bench.shards()]
        self.targets += [(a, DECODER + "Info") for a in self.bench.decoders()]
        self.padded = pb.LookupRequest(layout=LAYOUT.to_proto(pb)).SerializeToString()
        self.padded += bytes([15 << 3 | 2]) + wire.varint(self.huge) + bytes(self.huge)
        self.amplifiers = self.amplifying_requests()
        self.count = 0

    def amplifying_requests(self) -> list[tuple[str, str, str, bytes]]:
        """(what, address, method, request): one token id over the shard's limit (a
        million), chunk_tokens=1, a prompt of as many tokens."""
        shard, front = self.bench.shards()[0], self.bench.front()
        million = list(range(bench_max_tokens(self.bench) + 1))
        fine = LAYOUT.to_proto(pb)
        fine.chunk_tokens = 1
        generate = dpb.GenerateRequest(max_new_tokens=4, mode="vericache")
        generate.token_ids.ids.extend(million)
        return [
            ("Lookup of max_tokens + 1", shard, STORE + "Lookup",
             pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=million).SerializeToString()),
            ("Lookup chunk_tokens=1", shard, STORE + "Lookup",
             pb.LookupRequest(layout=fine, token_ids=million[:60_000]).SerializeToString()),
            ("Generate of max_tokens + 1", front, DECODER + "Generate",
             generate.SerializeToString()),
        ]  # fmt: skip

    def loops(self):
        return [(self.bench.config.attack_rate, self.unknown_token), (1.0, self.big_unary),
                (2.0, self.amplify)]  # fmt: skip

    def next(self) -> int:
        self.count += 1
        return self.count

    def unknown_token(self) -> None:
        address, method = self.targets[self.next() % len(self.targets)]
        self.note("unknown tokens sent")
        self.call(address, method, b"", secrets.token_urlsafe(24))
        self.note("unknown token ACCEPTED")

    def big_unary(self) -> None:
        shards = self.bench.shards()
        self.note("bytes sent", len(self.padded))
        self.call(shards[self.next() % len(shards)], STORE + "Lookup", self.padded, None)
        self.note("60 MB unary ACCEPTED")

    def amplify(self) -> None:
        what, address, method, request = self.amplifiers[self.next() % len(self.amplifiers)]
        self.note("bytes sent", len(request))
        try:
            if method.endswith("Generate"):
                call = self.channel(address).unary_stream(method)
                for _ in call(request, metadata=bearer(self.token), timeout=30):
                    pass
            else:
                self.call(address, method, request, self.token)
            self.note(f"{what} ACCEPTED")
        except grpc.RpcError as error:
            self.note(f"{what} refused {error.code().name}")


FOREIGN_PEERS = r"""
import json, select, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
host, port, rate, hold, seconds = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6])
held, did, start, k = [], {"connections opened": 0, "connections cut": 0}, time.monotonic(), 0
try:
    while time.monotonic() - start < seconds:
        time.sleep(max(0.0, start + k / rate - time.monotonic()))
        k += 1
        for s in list(held):
            if select.select([s], [], [], 0)[0]:
                held.remove(s)
                s.close()
                did["connections cut"] += 1
        if len(held) < hold:
            try:
                held.append(socket.create_connection((host, port), timeout=5))
                did["connections opened"] += 1
            except OSError as e:
                did["refused " + type(e).__name__] = did.get("refused " + type(e).__name__, 0) + 1
finally:
    did["connections still open"] = len(held)
    print(json.dumps(did), flush=True)
"""
"""Run as another local user: connections to the gateway at a fixed rate, held."""


def bench_max_tokens(bench: Bench) -> int:
    """Token ids a shard takes in one request (`ShardConfig.max_tokens`)."""
    return bench.deployment.config.shard(0).max_tokens


def runnable_by_anyone(path: str) -> bool:
    """Whether any local user may run the program at `path` (every folder on its way
    searchable, the file executable by others)."""
    real = Path(os.path.realpath(path))
    return all(p.stat().st_mode & 0o001 for p in (real, *real.parents))


class Gateway(Attack):
    finding = "8"
    summary = "gateway: another user's connections; PUTs declaring 256 MiB, never sent"
    foreign_hold = 64

    def setup(self) -> None:
        self.address = self.bench.deployment.lmcache
        self.sockets = Sockets(self, "256 MiB PUTs")
        self.foreign = self.foreign_peers()

    def foreign_peers(self) -> subprocess.Popen | None:
        if os.geteuid() != 0:
            self.note("foreign peers not run (needs root to act as another user)")
            return None
        host, port = self.address.rsplit(":", 1)
        python = next(filter(runnable_by_anyone, (sys.executable, "/usr/bin/python3")), None)
        if python is None:
            self.note("foreign peers not run (no Python another user may run)")
            return None
        args = [python, "-c", FOREIGN_PEERS, host, port, str(self.bench.config.attack_rate),
                str(self.foreign_hold), str(self.bench.config.seconds + 30)]  # fmt: skip
        return subprocess.Popen(args, user=FOREIGN_UID, group=FOREIGN_UID, cwd="/",
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    def loops(self):
        return [(1.0, self.big_put)]

    def big_put(self) -> None:
        """Keep 2 connections each holding a PUT header declaring 256 MiB, no payload."""
        self.sockets.sweep()
        if self.sockets.alive() < 2:
            key = f"attack@1@0@{secrets.token_hex(8)}@half"
            put = client_header(Command.PUT, key, 256 * MiB)
            self.sockets.open(self.address, put, peer=False)  # this user: admitted

    def teardown(self) -> None:
        self.sockets.sweep()
        self.sockets.close()
        if self.foreign is not None:
            self.foreign.terminate()
            with contextlib.suppress(ValueError, subprocess.TimeoutExpired):
                out, _ = self.foreign.communicate(timeout=30)
                for what, n in json.loads(out or "{}").items():
                    self.note(f"foreign uid {FOREIGN_UID}: {what}", n)


class MetricsAndWatch(Attack):
    finding = "10"
    summary = "slow clients on every metrics endpoint; Health.Watch of made-up names"
    hold = 32
    """Slow connections held per metrics endpoint (its limit is 8)."""

    def setup(self) -> None:
        self.endpoints = [url.split("//", 1)[1].split("/", 1)[0]
                          for url in self.bench.deployment.metrics.values()]  # fmt: skip
        self.grpc = self.bench.shards() + self.bench.decoders()
        self.sockets = Sockets(self, "slow connections")
        self.count = 0

    def loops(self):
        rate = self.bench.config.attack_rate
        return [(rate, self.slow), (rate, self.watch)]

    def slow(self) -> None:
        """A connection that sends the first byte of a request and never the rest."""
        self.sockets.sweep()
        if self.sockets.alive() < self.hold * len(self.endpoints):
            endpoint = self.endpoints[self.did["slow connections opened"] % len(self.endpoints)]
            self.sockets.open(endpoint, b"G")

    def watch(self) -> None:
        self.count += 1
        address = self.grpc[self.count % len(self.grpc)]
        request = b"\x0a\x20" + secrets.token_hex(16).encode()  # service: a made-up name
        watch = self.channel(address).unary_stream(HEALTH_WATCH)
        call = watch(request, timeout=5)
        try:
            first = next(call)
        finally:
            call.cancel()
        self.note("watches answered " + ("SERVICE_UNKNOWN" if first == UNKNOWN else repr(first)))

    def teardown(self) -> None:
        self.sockets.sweep()
        self.sockets.close()


ATTACK_CLASSES = (PaddedPuts, HeldBudget, CallCap, DataPlane, PreAuth, Gateway, MetricsAndWatch)
ATTACKS: dict[str, type[Attack]] = {a.finding: a for a in ATTACK_CLASSES}


# ---- health and memory ---------------------------------------------------------------------


class Components(Processes):
    """RSS of every component's process: shards and decoders (whose bounds are judged),
    routers and the gateway (reported)."""

    def actors(self) -> dict[str, object]:
        d = self.deployment
        actors = super().actors() | {f"router-{i}": a for i, a in d.router_actors.items()}
        if d.gateway_actor is not None:
            actors["lmcache-gateway"] = d.gateway_actor
        return actors


def probes(bench: Bench) -> dict[str, Callable[[], None]]:
    """What "healthy" asks of each component: each raises when it does not answer."""
    token = bench.victim.token
    checks: dict[str, Callable[[], None]] = {}
    for address in bench.shards():
        checks[f"shard {address}"] = lambda a=address: grpc_probe(a, STORE + "Describe", token)
    for address in bench.decoders():
        checks[f"decoder {address}"] = lambda a=address: grpc_probe(a, DECODER + "Info", token)
    if bench.deployment.lmcache:
        checks["lmcache-gateway"] = lambda: gateway_probe(bench.deployment.lmcache)
    for name, url in bench.deployment.metrics.items():
        checks[f"metrics {name}"] = lambda u=url: scrape(u, bench.deployment.metrics_token)
    return checks


def grpc_probe(address: str, method: str, token: str) -> None:
    """The gRPC health check answers SERVING, and `method` answers the victim."""
    with grpc.insecure_channel(address) as channel:
        reply = channel.unary_unary(HEALTH_CHECK)(b"", timeout=5)
        if reply != SERVING:
            raise RuntimeError(f"health check answered {reply!r}")
        channel.unary_unary(method)(b"", metadata=bearer(token), timeout=5)


def gateway_probe(address: str) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(client_header(Command.HEALTH, "health"))
        reply = sock.recv(36)
    if len(reply) < 4 or int.from_bytes(reply[:4], sys.byteorder) != ReturnCode.SUCCESS:
        raise RuntimeError(f"HEALTH answered {reply!r}")


def health(bench: Bench, within_s: float = 10.0) -> dict[str, str]:
    """Each component's probe, tried for up to `within_s`: "ok" or its last error."""
    out = {}
    for name, probe in probes(bench).items():
        deadline, last = time.monotonic() + within_s, ""
        while True:
            try:
                probe()
                out[name] = "ok"
                break
            except Exception as error:  # noqa: BLE001 - any failure is "not healthy"
                last = f"{type(error).__name__}: {str(error)[:160]}"
            if time.monotonic() > deadline:
                out[name] = last
                break
            time.sleep(0.5)
    return out


def bounds(bench: Bench, rss_start: dict[str, int]) -> dict[str, int]:
    """The RSS each shard and decoder must stay under, as the deployment states it."""
    config = bench.deployment.config
    out = {}
    for name, start in rss_start.items():
        if name.startswith("shard-"):
            shard = config.shard(int(name.split("-")[1]))
            out[name] = start + shard.receive_bytes + shard.memory_bytes + RSS_SLACK
        elif name.startswith("decoder-"):
            out[name] = start + (bench.config.kv_budget or 0) + RSS_SLACK
    return out


# ---- phases --------------------------------------------------------------------------------


def run_phase(bench: Bench, name: str, attack: Attack | None, benign: bool) -> dict:
    """The victim's load for one phase beside `attack` (or the benign neighbour)."""
    config = bench.config
    recorder, beside = Recorder(), Recorder()
    processes = Components(bench.deployment, every_s=1.0).start()
    started = start(attack)
    stop = threading.Event()
    neighbour = None
    if benign:
        driver = Driver(bench, bench.neighbour, config.attack_rate, beside)
        neighbour = threading.Thread(target=driver.run, args=(config.seconds, stop))
        neighbour.start()
    t0 = time.monotonic()
    victim = Driver(bench, bench.victim, config.rate, recorder)
    victim.run(config.seconds)
    seconds = time.monotonic() - t0
    healthy = health(bench)  # under attack still
    did = attack.stop() if started else {}
    if attack is not None and not started:
        did = {f"could not start: {attack.error}": 1}
    if neighbour is not None:
        stop.set()
        neighbour.join()
        did = neighbour_did(beside)
    processes.stop()
    return row(bench, name, attack, recorder, victim, seconds, healthy, did, processes)


def start(attack: Attack | None) -> bool:
    """Start `attack`: whether it started (else its error is kept, and the phase runs)."""
    if attack is None:
        return False
    try:
        attack.start()
        return True
    except Exception as error:  # noqa: BLE001 - reported in the table, judged a miss
        attack.error = f"{type(error).__name__}: {str(error)[:200]}"
        with contextlib.suppress(Exception):  # what it had set up, if anything
            attack.stop()
        return False


def neighbour_did(recorder: Recorder) -> dict[str, int]:
    """What the benign neighbour did: its operations, and its failures by status."""
    did = Counter(o.status for o in recorder.outcomes)
    return {"operations": len(recorder.outcomes)} | {
        (k if k == "OK" else f"failed {k}"): v for k, v in sorted(did.items())
    }


def row(bench, name, attack, recorder, victim, seconds, healthy, did, processes) -> dict:
    """One phase's figures."""
    outcomes = recorder.outcomes
    summary = summarise(outcomes, seconds, OPERATIONS)
    ok = [o.seconds for o in outcomes if o.status == "OK"]
    tokens = check_generations(bench.workload, bench.runner, recorder.generations,
                               bench.references)  # fmt: skip
    return {
        "phase": name,
        "attack": attack.summary if attack else "",
        "seconds": seconds,
        "offered_per_s": victim.issued / seconds,
        "skipped": victim.skipped,
        "ops": len(outcomes),
        "ok_per_s": len(ok) / seconds,
        "failed": summary["errors"] | ({MISS: summary["misses"]} if summary["misses"] else {}),
        "p50_s": percentile(ok, 0.50),
        "p99_s": percentile(ok, 0.99),
        "operations": summary["operations"],
        "verified_bytes": summary["verified_bytes"],
        "lost_bytes": summary["lost_bytes"],
        "tokens": tokens,
        "rss_peak": dict(processes.peak),
        "healthy": healthy,
        "did": did,
    }


def verdict(result: dict) -> list[str]:
    """Every target that does not hold (empty: all hold)."""
    phases = {p["phase"]: p for p in result["phases"]}
    benign, baseline = phases.get("benign"), phases.get("baseline")
    failures = []
    for p in result["phases"]:
        failures += [f"{p['phase']}: {t}" for t in targets(p, benign, baseline, result["bounds"])]
    if sum(p["tokens"]["checked"] for p in result["phases"]) == 0:
        failures.append("no generation was checked")
    if sum(p["verified_bytes"] for p in result["phases"]) == 0:
        failures.append("no fetched byte was verified")
    return failures


def targets(p: dict, benign: dict | None, baseline: dict | None, rss_bounds: dict) -> list[str]:
    """The targets phase `p` misses."""
    out = [] if p["ops"] else ["the victim did no operation"]
    if p["failed"]:
        out.append(f"victim operations failed: {p['failed']}")
    if p["tokens"]["wrong_tokens"] or p["lost_bytes"]:
        out.append(f"wrong tokens {p['tokens']['wrong_tokens']}, lost bytes {p['lost_bytes']}")
    if any(v != "ok" for v in p["healthy"].values()):
        out.append(f"unhealthy: {sorted(k for k, v in p['healthy'].items() if v != 'ok')}")
    for name, peak in p["rss_peak"].items():
        if name in rss_bounds and peak > rss_bounds[name]:
            out.append(f"{name} RSS {peak >> 20} MiB over its bound {rss_bounds[name] >> 20} MiB")
    if p["phase"] in ("baseline", "benign"):
        return out
    if not p["did"] or any(k.startswith("could not start") for k in p["did"]):
        out.append(f"the attack did not run: {p['did']}")
    if benign is not None and p["p99_s"] > 2 * benign["p99_s"]:
        out.append(f"p99 {p['p99_s']:.3f} s > 2x benign {benign['p99_s']:.3f} s")
    share = min(p["offered_per_s"], baseline["ok_per_s"]) if baseline else p["offered_per_s"]
    if p["ok_per_s"] < 0.9 * share:
        out.append(f"throughput {p['ok_per_s']:.2f}/s < 0.9x its share {share:.2f}/s")
    return out


def run(config: AttackConfig, deployment, model, runner) -> dict:
    """Every phase against a running deployment; the figures."""
    bench = Bench(config, deployment, model, runner)
    try:
        rss_start = Components(deployment).rss()
        phases = [run_phase(bench, "baseline", None, False), run_phase(bench, "benign", None, True)]
        for finding in config.attacks:
            attack = ATTACKS[finding](bench)
            phases.append(run_phase(bench, f"attack {finding}", attack, False))
    finally:
        bench.close()
    result = {"rss_start": rss_start, "bounds": bounds(bench, rss_start), "phases": phases}
    result["verdict"] = verdict(result)
    return result


@contextlib.contextmanager
def attack_deployment(config: AttackConfig, redis_url: str | None = None) -> Iterator:
    """`bench/load.py`'s deployment, with a KV budget and an LMCache gateway."""
    with deployment_for(config.load(), redis_url, memory_bytes=config.memory_bytes,
                        kv_budget=config.kv_budget, lmcache_port=0) as deployment:  # fmt: skip
        yield deployment


# ---- the table -----------------------------------------------------------------------------


def print_table(result: dict) -> None:
    phases = {p["phase"]: p for p in result["phases"]}
    benign = phases.get("benign")
    print(f"{'phase':<10} {'ops':>5} {'failed':>6} {'p50 s':>7} {'p99 s':>7} {'p99/ben':>7} "
          f"{'ok/s':>5} {'offer':>5} {'shard RSS MiB':>14} {'decoder MiB':>12} {'healthy':>7} "
          f"{'wrong':>5}  attack did")  # fmt: skip
    for p in result["phases"]:
        ratio = p["p99_s"] / benign["p99_s"] if benign and benign["p99_s"] else float("nan")
        print(
            f"{p['phase']:<10} {p['ops']:>5} {sum(p['failed'].values()):>6} {p['p50_s']:>7.3f} "
            f"{p['p99_s']:>7.3f} {ratio:>7.2f} {p['ok_per_s']:>5.2f} {p['offered_per_s']:>5.2f} "
            f"{peak(p, result, 'shard-'):>14} {peak(p, result, 'decoder-'):>12} "
            f"{'yes' if all(v == 'ok' for v in p['healthy'].values()) else 'NO':>7} "
            f"{p['tokens']['wrong_tokens']:>5}  {did_line(p['did'])}"
        )
    print("\nper operation, p99 s (failed):")
    for p in result["phases"]:
        cells = [f"{op} {r['p99_s']:.3f} ({r['count'] - r['ok']})"
                 for op, r in p["operations"].items()]  # fmt: skip
        print(f"  {p['phase']:<10} " + ", ".join(cells))


def peak(p: dict, result: dict, prefix: str) -> str:
    """The largest peak of a kind of component, and its bound: "peak/bound"."""
    names = [n for n in p["rss_peak"] if n.startswith(prefix)]
    if not names:
        return "-"
    name = max(names, key=lambda n: p["rss_peak"][n])
    bound = result["bounds"].get(name)
    return f"{p['rss_peak'][name] >> 20}/{bound >> 20 if bound else '-'}"


def did_line(did: dict) -> str:
    return "; ".join(f"{k} {v}" for k, v in did.items()) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = AttackConfig()
    ap.add_argument("--quick", action="store_true", help="12 s phases (about 3 minutes)")
    ap.add_argument("--seconds", type=float, default=defaults.seconds)
    ap.add_argument("--rate", type=float, default=defaults.rate)
    ap.add_argument("--attack-rate", type=float, default=defaults.attack_rate)
    ap.add_argument("--attacks", nargs="*", choices=sorted(ATTACKS), default=defaults.attacks)
    ap.add_argument("--out", type=Path, default=Path("bench/results/attack.json"))
    args = ap.parse_args()
    config = AttackConfig(seconds=args.seconds, rate=args.rate, attack_rate=args.attack_rate,
                          attacks=tuple(args.attacks))  # fmt: skip
    config = quick(config) if args.quick else config
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    with attack_deployment(config) as deployment:
        result = run(config, deployment, model, runner)
    print_table(result)
    print("\ntargets:", "all hold" if not result["verdict"] else "")
    for failure in result["verdict"]:
        print(f"  MISSED {failure}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": asdict(config), "machine": platform.platform(), **result}
    args.out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0 if not result["verdict"] else 1


if __name__ == "__main__":
    sys.exit(main())
