"""Chaos: faults injected one after another into a real deployment under load (issue 15).

The load of `bench/load.py` runs in the background the whole time. Each fault in turn is
injected, held for `--hold` seconds, repaired, and the service watched until it is healthy
again: every shard in the membership, and a probe (a fresh tenant's publish, lookup and
bitwise fetch through the store SDK, and a two-token generate) succeeds. The run fails
(`verdict`, exit 1) unless:

- every fault proves it took effect, by what was measured in its window (`Fault.evidence`:
  failovers, unreachable shards or failed calls; a generate in flight when the decoder
  died; blobs flipped and detected; corruption in transit detected by the client), and
  its "observed" text is built from those figures;
- no wrong token: every lossless generation of the run is checked against in-process
  full-KV decoding at the end (counted per fault window);
- no lost or torn committed bytes: every fetched byte is compared with what was published,
  every prefix committed is read back at the end, and a miss is a loss unless the shards'
  counters explain it (`bench.load.Losses`); every shard's blobs are what it charges its
  tenants (held == charged);
- no operation failed with a status its window does not expect (`Fault.allowed`; none
  before the first fault), none with an exception;
- the service healthy again after every fault (its recovery time is the figure).

Faults (`--faults` picks some; those needing root are skipped without it):
- shard-kill-fetch / shard-kill-put: kill -9 a shard process while clients fetch or
  publish; repaired by starting it again on its disk tier.
- shard-stop: SIGSTOP a shard (a hung host), SIGCONT as the repair.
- redis-restart: the metadata plane restarts; shards register again.
- disk-full: the shard's disk tier's filesystem (a tmpfs, root) fills up; repaired by
  freeing the space.
- decoder-kill: kill -9 the decoder mid-request; a new decoder is started on its port.
- disk-corrupt: bytes of stored blobs flipped on disk (a rotting disk).
- transit-corrupt: bytes flipped on their way out of the shards, after the shards' own
  checks (`prefix_store.faults`).
- attend-corrupt: near-data attention partials flipped on their way out of the shards
  (`--placement near`, where every lossless generation verifies near the data): the
  decoders' sessions detect them (CRC-32C) and read them from the replica, or redo the pass
  with the prefix pulled; no generation fails and no token differs.

With `--placement near` the decoders attend every prefix on the shards (Attend streams, no
resident copies), so every fault also meets near-data verification: a shard killed or
stopped mid-pass, a corrupt blob read for partials. Each window counts the lossless
generations that verified near the data (`near_generations`).

Usage: python bench/chaos.py [--clients 16] [--tenants 4] [--hold 15] [--faults ...]
       [--placement auto|near|pull] [--out bench/results/chaos.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import (  # noqa: E402
    ANSWERED,
    LAYOUT,
    LOSSLESS,
    MISS,
    Generation,
    LoadConfig,
    Outcome,
    Processes,
    Recorder,
    Workload,
    check_generations,
    error_samples,
    errors_of,
    integrity,
    prefix_of,
    print_checks,
    summarise,
)
from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.config import PLACEMENTS  # noqa: E402
from decoder.progress import progress  # noqa: E402
from decoder.service.client import DecoderClient  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import ClientConfig, MiB  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402

RECOVERY_LIMIT_S = 180.0
BITE_S = 60.0
"""How much longer than its hold a fault that needs traffic to show (a full disk) is kept,
at most, while traffic of its own (`Chaos.push`) makes it show."""
OUTAGE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
"""What calls to a component that is down or hung may fail with."""


@dataclass
class Fault:
    name: str
    expected: str
    inject: Callable[[Chaos], Callable[[], dict[str, int]]]
    """Injects the fault; returns the repair, which returns what the fault measured."""
    observed: str
    """What was observed, from the fault's and its window's figures (`Window.figures`)."""
    evidence: tuple[tuple[str, ...], ...]
    """Each group: at least one of these figures must be > 0, or the fault did nothing."""
    allowed: frozenset[str] = OUTAGE
    """Statuses operations started in its window may fail with."""
    needs_root: bool = False
    needs_near: bool = False
    """Takes effect only where decoders verify near the data (`--placement near`)."""


@dataclass
class FaultRun:
    """One fault as it ran: its window [start, the next fault's start) and its figures."""

    fault: Fault
    start: float
    recovery_s: float | None
    """From the repair until healthy again (None: never, within RECOVERY_LIMIT_S)."""
    measured: dict[str, int]
    events: dict[str, int]
    """What the tenants' store clients met in the window (`StoreClient.events`)."""
    repair_error: str = ""


# ---- the deployment ----------------------------------------------------------------------


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports (so restarts keep their address),
    below the kernel's ephemeral range: a port found free there can be taken by any
    outgoing connection before the deployment binds it (a chaos run once failed so)."""
    for _ in range(200):
        base = random.randint(10_000, _ephemeral_start() - count - 1)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports found")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


DISK_TIER = 512 * MiB
"""Each shard's disk tier in a chaos run."""


@contextlib.contextmanager
def chaos_deployment(config: LoadConfig, own_disk: bool) -> Iterator[Deployment]:
    """A deployment whose shards and decoders keep their ports across restarts, with small
    tiers (so that load spills to disk); with `own_disk` (root), shard 0's disk tier is on
    its own tmpfs, a little larger than the tier, so that it fills only when the disk-full
    fault fills it (a tier larger than its filesystem would fail writes all along)."""
    with tempfile.TemporaryDirectory(prefix="vericache-chaos-") as home:
        state = Path(home) / "state"
        mounted = None
        if own_disk:
            mounted = state / "shards" / "shard-0"
            mounted.mkdir(parents=True)
            size = f"size={DISK_TIER + 64 * MiB}"
            subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mounted)], check=True)
        try:
            serve = ServeConfig(
                shards=config.shards,
                decoders=config.decoders,
                decoder_threads=config.decoder_threads,
                memory_bytes=16 * MiB,  # the load spills to disk
                disk_bytes=DISK_TIER,
                state_dir=state,
                port=free_ports(config.shards),
                data_port=free_ports(config.shards),
                decoder_port=free_ports(config.decoders),
                **config.serving(),
            )
            with Deployment(serve) as deployment:
                yield deployment
        finally:
            if mounted is not None:
                subprocess.run(["umount", "-l", str(mounted)], check=False)


class Chaos:
    """The deployment, its load, and the probes and repairs the faults use."""

    def __init__(self, deployment: Deployment, workload: Workload) -> None:
        self.deployment = deployment
        self.workload = workload
        self.metadata = Metadata(deployment.redis_url)
        self.processes = Processes(deployment)
        self._probe_count = 0

    # ---- processes -------------------------------------------------------------------

    def shard_pid(self, index: int) -> int:
        return ray.get(self.deployment.actors[index].pid.remote(), timeout=30)

    def kill_shard(self, index: int) -> int:
        """kill -9 a shard; returns how many blobs it held in memory (lost with it: each
        explains a miss)."""
        in_memory = self.workload.counters.observe().get(index, {}).get("memory_blobs", 0)
        os.kill(self.shard_pid(index), signal.SIGKILL)
        self.workload.losses.explain("killed_in_memory", in_memory)
        actor = self.deployment.actors.pop(index)
        self.deployment.endpoints.pop(index, None)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        return in_memory

    def restart_shard(self, index: int) -> None:
        self.deployment.start_shard(index)

    def kill_decoder(self, index: int, wait_s: float = 60.0) -> int:
        """kill -9 a decoder once a generate is in flight (waiting up to `wait_s`);
        returns how many were."""
        deadline = time.monotonic() + wait_s
        while not self.workload.recorder.in_flight("generate") and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight = self.workload.recorder.in_flight("generate")
        actor = self.deployment.decoder_actors.pop(index)
        os.kill(ray.get(actor.pid.remote(), timeout=30), signal.SIGKILL)
        self.deployment.decoders.pop(index, None)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        return in_flight

    def shard_disk(self, index: int) -> Path:
        return Path(self.deployment.config.state_dir) / "shards" / f"shard-{index}"

    def push(self, seconds: float) -> None:
        """Publish new prefixes of a tenant of its own for `seconds` (failures expected):
        traffic that fills the memory tiers, so that they spill to disk now."""
        token = self.metadata.add_tenant(f"pusher-{os.getpid()}-{time.monotonic_ns()}")
        config = ClientConfig(timeout_s=5, stream_timeout_s=10, retries=1)
        deadline = time.monotonic() + seconds
        with StoreClient(self.workload.endpoints(), token, config) as client:
            while time.monotonic() < deadline:
                seed = random.getrandbits(62)
                with contextlib.suppress(Exception):
                    client.publish_prefix(*prefix_of(seed, self.workload.config.prefix_chunks),
                                          LAYOUT)  # fmt: skip

    # ---- health ----------------------------------------------------------------------

    def healthy(self) -> bool:
        """Every shard registered, and a fresh tenant's store round trip and a generate
        succeed (bitwise for the bytes)."""
        try:
            if len(self.metadata.shards()) < self.deployment.config.shards:
                return False
            if len(self.deployment.decoders) < self.deployment.config.decoders:
                return False
            self._probe_count += 1
            token = self.metadata.add_tenant(f"probe-{os.getpid()}-{self._probe_count}")
            tokens = [(self._probe_count * 131 + t) % 50_000 for t in range(LAYOUT.chunk_tokens)]
            g = torch.Generator().manual_seed(self._probe_count)
            shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, len(tokens), LAYOUT.head_dim)
            kv = torch.randn(shape, generator=g)
            config = ClientConfig(timeout_s=5, stream_timeout_s=10, retries=1)
            endpoints = self.workload.endpoints()
            with StoreClient(endpoints, token, config) as client:
                prefix = client.publish_prefix(tokens, kv, LAYOUT).prefix
                shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
                k, v = torch.empty(shape), torch.empty(shape)
                client.fetch_layers(client.lookup(tokens, LAYOUT), k, v)
                if not (torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])):
                    return False
            decoder = self.workload.decoders()[0]
            with DecoderClient(decoder, token, timeout_s=60) as d:
                d.generate(text="def add(a, b):", max_new_tokens=2)
            return True
        except Exception:  # noqa: BLE001 - not yet
            return False

    def recover(self) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < RECOVERY_LIMIT_S:
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        return None

    def shard_stats(self) -> dict[int, dict]:
        """Every live shard's stats now, by index (read from the shards themselves)."""
        return self.workload.counters.observe()

    def grew(self, before: dict[int, dict], *keys: str) -> int:
        """How much `keys` grew on the shards since `before` (a shard restarted since:
        from 0)."""
        after = self.shard_stats()
        return sum(after[i].get(k, 0) - before.get(i, {}).get(k, 0) for i in after for k in keys)


# ---- the faults --------------------------------------------------------------------------


Repair = Callable[[], dict[str, int]]


def shard_kill(index: int) -> Callable[[Chaos], Repair]:
    """kill -9 shard `index`, then read back every committed prefix at once, while the
    clients still list it: their calls meet the dead shard and go on from the replicas
    (under a slow load, the window's own operations may all route around it once the
    membership drops it, leaving no evidence)."""

    def inject(chaos: Chaos) -> Repair:
        in_memory = chaos.kill_shard(index)
        chaos.workload.sweep()

        def repair() -> dict[str, int]:
            chaos.restart_shard(index)
            return {"in_memory": in_memory}

        return repair

    return inject


def shard_stop(chaos: Chaos) -> Repair:
    pid = chaos.shard_pid(1)
    os.kill(pid, signal.SIGSTOP)

    def repair() -> dict[str, int]:
        os.kill(pid, signal.SIGCONT)
        return {}

    return repair


def redis_run_id(url: str) -> str:
    import redis

    with redis.Redis.from_url(url) as client:
        return client.info("server")["run_id"]


def redis_restart(chaos: Chaos) -> Repair:
    redis = chaos.deployment.redis
    assert redis is not None, "the deployment's own Redis"
    before = redis_run_id(chaos.deployment.redis_url)
    redis.stop()

    def repair() -> dict[str, int]:
        redis.start()
        return {"restarted": int(redis_run_id(chaos.deployment.redis_url) != before)}

    return repair


def disk_full(chaos: Chaos) -> Repair:
    disk = chaos.shard_disk(0)
    filler = disk / "filler.fill"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        while True:  # until the filesystem has no room left (ENOSPC)
            f.write(b"\0" * (1 << 20))
    before = chaos.shard_stats()

    def repair() -> dict[str, int]:
        deadline = time.monotonic() + BITE_S  # held until a write met the full disk
        while not (failed := chaos.grew(before, "disk_write_errors")):
            if time.monotonic() > deadline:
                break
            chaos.push(1.0)
        lost = chaos.grew(before, "lost_spills")
        filler.unlink()
        return {"disk_write_errors": failed, "lost_spills": lost}

    return repair


def decoder_kill(chaos: Chaos) -> Repair:
    in_flight = chaos.kill_decoder(0)

    def repair() -> dict[str, int]:
        chaos.deployment.start_decoder(0)
        return {"in_flight": in_flight}

    return repair


def load_blobs(disk: Path) -> list[Path]:
    """The blob files of the load's store prefixes (the sweep reads them all back)."""
    found = []
    for path in sorted(disk.glob("*.blob")):
        with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
            f.seek(4)
            header = json.loads(f.read(int.from_bytes(f.read(4), "little")))
            if header["layout"]["model_id"] == LAYOUT.model_id:
                found.append(path)
    return found


def disk_corrupt(chaos: Chaos) -> Repair:
    before = chaos.shard_stats()
    blobs = load_blobs(chaos.shard_disk(1))
    flipped = 0
    for path in random.Random(0).sample(blobs, min(8, len(blobs))):
        with contextlib.suppress(OSError), open(path, "r+b") as f:
            f.seek(-1 - flipped, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1

    def repair() -> dict[str, int]:
        chaos.workload.sweep()  # read everything back: corrupt copies are met and dropped
        return {"flipped": flipped, "detected": chaos.grew(before, "corrupt")}

    return repair


def arm_shards(actors: list, injector: str, frames: int) -> int:
    """Arm every shard's `injector` (an actor method: `inject_transit_faults`,
    `inject_attend_faults`) for its next `frames` (0 disarms); how many all corrupted so far."""
    return sum(ray.get([getattr(a, injector).remote(frames) for a in actors], timeout=30))


def transit_corrupt(chaos: Chaos) -> Repair:
    """Corrupt the next layers leaving each shard; the workload reads everything back at
    once (so that its clients, not only the decoders' own, meet some) and again at the
    repair."""
    actors = list(chaos.deployment.actors.values())
    before = arm_shards(actors, "inject_transit_faults", 8)
    chaos.workload.sweep()

    def repair() -> dict[str, int]:
        chaos.workload.sweep()
        return {"corrupted": arm_shards(actors, "inject_transit_faults", 0) - before}

    return repair


def attend_corrupt(chaos: Chaos) -> Repair:
    """Corrupt the next Attend answers leaving each shard (the partials of one near-data
    query each); only decoders attend (`--placement near`), and a generation per tenant
    over its stored document makes them attend now (the clients' own generations come at
    random)."""
    actors = list(chaos.deployment.actors.values())
    before = arm_shards(actors, "inject_attend_faults", 8)
    chaos.workload.generate_each("vericache")

    def repair() -> dict[str, int]:
        return {"corrupted_partials": arm_shards(actors, "inject_attend_faults", 0) - before}

    return repair


WINDOW = (
    "{failovers} fetch failovers, {unreachable} calls finding a shard unreachable, {errors} failed"
)
FAULTS = {
    f.name: f
    for f in (
        Fault(
            "shard-kill-fetch",
            "fetches continue from the replica; nothing lost",
            shard_kill(1),
            "shard-1 killed with {in_memory} blobs in memory, restarted on its disk tier; "
            + WINDOW,
            (("failovers", "unreachable", "errors"),),
        ),
        Fault(
            "shard-kill-put",
            "publishes complete on the survivor (missing replicas reported); nothing lost",
            shard_kill(0),
            "shard-0 killed with {in_memory} blobs in memory, restarted on its disk tier; "
            "{missing_replicas} replicas reported missing; " + WINDOW,
            (("missing_replicas", "unreachable", "errors"),),
        ),
        Fault(
            "shard-stop",
            "calls to it time out and go to the replica",
            shard_stop,
            "shard-1 stopped (SIGSTOP), then continued; " + WINDOW,
            (("failovers", "unreachable", "errors"),),
        ),
        Fault(
            "redis-restart",
            "shards register again; data intact",
            redis_restart,
            "redis-server restarted on its append-only file (new run id: {restarted}); " + WINDOW,
            (("restarted",), ("errors", "unreachable")),
        ),
        Fault(
            "disk-full",
            "puts needing the disk fail RESOURCE_EXHAUSTED or evict; accounting exact",
            disk_full,
            "shard-0 disk full: {disk_write_errors} failed disk writes, {lost_spills} evicted "
            "blobs lost; {errors} operations failed",
            (("disk_write_errors",),),
            frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"}),
            needs_root=True,
        ),
        Fault(
            "decoder-kill",
            "its streams fail UNAVAILABLE; a new decoder serves; no wrong token",
            decoder_kill,
            "decoder-0 killed with {in_flight} generates in flight, {generate_errors} failed; "
            "a new decoder started on its port",
            (("in_flight",), ("generate_errors",)),
            OUTAGE | {"CANCELLED"},
        ),
        Fault(
            "disk-corrupt",
            "detected on read, read from the replica",
            disk_corrupt,
            "{flipped} blobs flipped on shard-1's disk; {detected} detected (read or scrub), "
            "{data_loss_failovers} fetches went on from the replica; {misses} misses",
            (("flipped",), ("detected",)),
            frozenset(),
        ),
        Fault(
            "transit-corrupt",
            "detected by the client, read from the replica (a miss if both copies were hit)",
            transit_corrupt,
            "{corrupted} fetched layers corrupted in transit; {transit_detected} detected by "
            "the client; {misses} misses",
            (("corrupted",), ("transit_detected",)),
            frozenset(),
        ),
        Fault(
            "attend-corrupt",
            "detected by the decoder, read from the replica or pulled; no wrong token",
            attend_corrupt,
            "{corrupted_partials} near-data answers corrupted in transit (only decoders "
            "attend: each reached a decoder's check); {near_generations} generations started "
            "in the window verified near the data, {near_retries} passes redone pulling, "
            "{generate_errors} failed",
            (("corrupted_partials",),),
            frozenset(),
            needs_near=True,
        ),
    )
}


# ---- running it --------------------------------------------------------------------------


def run_fault(chaos: Chaos, fault: Fault, hold_s: float) -> FaultRun:
    events = chaos.workload.events()
    start = time.monotonic()
    repair, measured, error = None, {}, ""
    try:
        repair = fault.inject(chaos)
        time.sleep(hold_s)
        measured = repair()
    except Exception as failure:  # noqa: BLE001 - reported, the next fault still runs
        error = f"{type(failure).__name__}: {failure}"
    recovery = chaos.recover()
    grown = chaos.workload.events()
    grown.subtract(events)
    return FaultRun(fault, start, recovery, measured, +grown, error)


def window(outcomes: list[Outcome], generations: list[Generation], wrong: int) -> dict:
    """The figures of one window's operations and generations (those started in it);
    `wrong`: how many of the generations had a wrong token."""
    errors = errors_of(outcomes)
    return {
        "operations": len(outcomes),
        "errors": sum(errors.values()),
        "by_status": errors,
        "samples": error_samples(outcomes),
        "misses": sum(o.status == MISS for o in outcomes),
        "generate_errors": sum(o.op == "generate" and o.status not in ANSWERED for o in outcomes),
        "missing_replicas": sum(o.missing_replicas for o in outcomes),
        "lost_bytes": sum(o.lost_bytes for o in outcomes),
        "checked_generations": sum(g.mode in LOSSLESS for g in generations),
        "near_generations": sum(g.near_passes > 0 for g in generations),
        "near_retries": sum(g.near_retries for g in generations),
        "wrong_generations": wrong,
    }


def fault_result(run: FaultRun, figures: dict) -> dict:
    """One fault's row: what it measured, its window, its evidence."""
    events = run.events
    evidence = {
        **run.measured,
        **{k: v for k, v in figures.items() if isinstance(v, int)},
        "failovers": sum(v for k, v in events.items() if k.startswith("failover.")),
        "unreachable": events.get("unreachable", 0),
        "transit_detected": events.get("failover.CorruptInTransit", 0),
        "data_loss_failovers": events.get("failover.DataLoss", 0),
    }
    observed = run.fault.observed.format_map(defaultdict(int, evidence))
    if run.repair_error:
        observed = f"injection or repair failed: {run.repair_error}"
    return {
        "fault": run.fault.name,
        "expected": run.fault.expected,
        "observed": observed,
        "recovery_s": run.recovery_s,
        "evidence": evidence,
        "required": [list(group) for group in run.fault.evidence],
        "allowed": sorted(run.fault.allowed),
        "errors": figures["by_status"],
        "error_samples": figures["samples"],
        "repair_error": run.repair_error,
        "lost_bytes": figures["lost_bytes"],
        "checked_generations": figures["checked_generations"],
    }


def windows(runs: list[FaultRun], workload: Workload, tokens: dict, calm_start: float) -> tuple:
    """The calm window (before the first fault) and each fault's row."""
    bounds = [r.start for r in runs] + [float("inf")]
    generations = workload.recorder.generations

    def between(a: float, b: float) -> dict:
        gens = [g for g in generations if a <= g.started < b]
        wrong = sum(a <= t < b for t in tokens["wrong_at"])
        return window(workload.recorder.since(a, b), gens, wrong)

    calm = between(calm_start, bounds[0])
    rows = [fault_result(r, between(r.start, end)) for r, end in zip(runs, bounds[1:], strict=True)]
    return calm, rows


def run(config: LoadConfig, deployment: Deployment, model, runner, faults, hold_s) -> dict:
    workload = ChaosWorkload(config, deployment, model)
    chaos = Chaos(deployment, workload)
    rss_start = chaos.processes.rss()
    driver = threading.Thread(target=workload.drive_until_stopped, daemon=True)
    calm_start = time.monotonic()
    driver.start()
    runs = []
    try:
        time.sleep(min(10.0, hold_s))  # warm: every operation under way
        for fault in (bar := progress(faults, desc="chaos", unit="fault")):
            bar.set_postfix_str(fault.name)
            runs.append(run_fault(chaos, fault, hold_s))
    finally:
        workload.stop()
        driver.join(timeout=config.timeout_s + 60)
    seconds = time.monotonic() - calm_start
    sweep = Recorder()
    workload.sweep(sweep)  # every committed prefix, read back once
    stats = chaos.shard_stats()
    accounting = {s["shard_id"]: (s["held_bytes"], s["usage_bytes"]) for s in stats.values()}
    tokens = check_generations(workload, runner)
    rss_end = chaos.processes.rss()
    workload.close()
    calm, rows = windows(runs, workload, tokens, calm_start)
    totals = summarise(workload.recorder.outcomes + sweep.outcomes, seconds)
    return {
        "faults": rows,
        "calm": calm,
        "lost_bytes": totals["lost_bytes"],
        "verified_bytes": totals["verified_bytes"],
        "misses": totals["misses"],
        "errors": totals["errors"],
        "sweep": {
            "prefixes": len(sweep.outcomes),
            "misses": sum(o.status == MISS for o in sweep.outcomes),
        },
        "losses": workload.losses.figures(),
        "accounting": accounting,
        "tokens": tokens,
        "rss": {"start": rss_start, "end": rss_end},
    }


class ChaosWorkload(Workload):
    """The load, run until stopped, with short client timeouts (faults are expected)."""

    def __init__(self, config: LoadConfig, deployment: Deployment, model) -> None:
        super().__init__(config, deployment, model)
        self._stopped = threading.Event()

    def client_config(self) -> ClientConfig:
        return ClientConfig(timeout_s=5, stream_timeout_s=15, retries=2)

    def drive_until_stopped(self) -> None:
        threads = [
            threading.Thread(target=self.client, args=(i, float("inf")), daemon=True)
            for i in range(self.config.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()


def print_table(result: dict) -> None:
    print(
        f"{'fault':<17} {'recovery s':>10} {'lost':>6} {'checked':>7}  observed / expected / errors"
    )
    for r in result["faults"]:
        recovery = f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else "never"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "-"
        print(f"{r['fault']:<17} {recovery:>10} {r['lost_bytes']:>6} "
              f"{r['checked_generations']:>7}  {r['observed']}")  # fmt: skip
        print(f"{'':<44}expected: {r['expected']}; errors: {errors}")
        for status, samples in sorted(r["error_samples"].items()):
            if status not in r["allowed"]:  # what the verdict fails on: say what it was
                for sample in samples:
                    print(f"{'':<44}{status}: {sample}")


def verdict(result: dict) -> list[str]:
    """What went wrong (empty: every fault took effect, proved itself and passed)."""
    problems = integrity(result)
    for shard, (held, charged) in result["accounting"].items():
        if held != charged:
            problems.append(f"{shard}: holds {held} bytes but charges {charged}")
    if result["calm"]["errors"]:
        problems.append(f"before any fault, operations failed: {result['calm']['by_status']}")
    for r in result["faults"]:
        problems += [f"{r['fault']}: {p}" for p in fault_problems(r)]
    return problems


def fault_problems(row: dict) -> list[str]:
    """One fault's: no repair error, healthy again, every evidence group shown, no failure
    with a status its window does not expect."""
    problems = []
    if row["repair_error"]:
        problems.append(f"injection or repair failed: {row['repair_error']}")
    if row["recovery_s"] is None:
        problems.append(f"not healthy within {RECOVERY_LIMIT_S:.0f} s")
    for group in row["required"]:
        if not any(row["evidence"].get(name, 0) > 0 for name in group):
            problems.append(f"no evidence it took effect ({' or '.join(group)}: 0)")
    unexpected = {
        k: v
        for k, v in row["errors"].items()
        if k not in row["allowed"] and not k.startswith("exception:")
    }
    if unexpected:
        problems.append(f"operations failed with statuses it does not expect: {unexpected}")
    return problems


def selected(names: list[str] | None, placement: str = "auto") -> list[Fault]:
    """The faults to run: `names` (None: all), less those this run cannot inject (not root;
    near-data faults unless the decoders verify near the data)."""
    faults = [FAULTS[n] for n in names] if names else list(FAULTS.values())
    for reason, cannot in (
        ("not root", lambda f: f.needs_root and os.geteuid() != 0),
        ("not --placement near", lambda f: f.needs_near and placement != "near"),
    ):
        skipped = [f.name for f in faults if cannot(f)]
        if skipped:
            print(f"{reason}: skipping {', '.join(skipped)}")
        faults = [f for f in faults if not cannot(f)]
    return faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--hold", type=float, default=15.0, help="seconds each fault lasts")
    ap.add_argument("--faults", nargs="+", choices=sorted(FAULTS))
    ap.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="auto",
        help="where decoders verify; near: every lossless generation attends near the data",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/chaos.json"))
    args = ap.parse_args()
    faults = selected(args.faults, args.placement)
    config = LoadConfig(clients=args.clients, tenants=args.tenants, placement=args.placement)
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    own_disk = any(f.name == "disk-full" for f in faults)
    with chaos_deployment(config, own_disk) as deployment:
        result = run(config, deployment, model, runner, faults, args.hold)
    print_table(result)
    problems = verdict(result)
    print_checks(result)
    print(f"accounting (held, charged) {result['accounting']}")
    for name in sorted(result["rss"]["end"]):
        start, end = result["rss"]["start"].get(name), result["rss"]["end"][name]
        print(f"{name:<10} RSS start {start} end {end}")
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": asdict(config), "machine": platform.platform(), **result}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
