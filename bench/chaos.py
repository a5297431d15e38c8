"""Chaos: faults injected one after another into a real deployment under load (issue 15).

The load of `bench/load.py` runs in the background the whole time. Each fault in turn is
injected, held for `--hold` seconds, repaired, and the service watched until it is healthy
again: every shard in the membership, and a probe (a fresh tenant's publish, lookup and
bitwise fetch through the store SDK, and a two-token generate) succeeds. Then:

- no wrong token: every lossless generation of the run is checked against in-process
  full-KV decoding at the end (a sample of `--sample`);
- no lost or torn committed bytes: every fetched byte is compared with what was published,
  and at the end every shard's blobs are what it charges its tenants (held == charged);
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

Usage: python bench/chaos.py [--clients 16] [--tenants 4] [--hold 15] [--faults ...]
       [--sample 16] [--out bench/results/chaos.json]
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
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import (  # noqa: E402
    LAYOUT,
    LoadConfig,
    Processes,
    Workload,
    check_generations,
)
from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.progress import progress  # noqa: E402
from decoder.service.client import DecoderClient  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import ClientConfig, MiB  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402

RECOVERY_LIMIT_S = 180.0


@dataclass
class FaultResult:
    fault: str
    expected: str
    observed: str
    recovery_s: float | None
    """From the repair until healthy again (None: never, within RECOVERY_LIMIT_S)."""
    lost_bytes: int
    errors: dict[str, int]


@dataclass
class Fault:
    name: str
    expected: str
    inject: Callable[[Chaos], Callable[[], str]]
    """Injects the fault; returns the repair, which returns what was observed."""
    needs_root: bool = False


# ---- the deployment ----------------------------------------------------------------------


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports (so restarts keep their address)."""
    for _ in range(200):
        base = random.randint(20_000, 60_000)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports found")


@contextlib.contextmanager
def chaos_deployment(config: LoadConfig, disk_fs_bytes: int | None) -> Iterator[Deployment]:
    """A deployment whose shards and decoders keep their ports across restarts, with small
    tiers (so that load spills to disk), shard 0's disk tier on its own small tmpfs when
    `disk_fs_bytes` is given (root)."""
    with tempfile.TemporaryDirectory(prefix="vericache-chaos-") as home:
        state = Path(home) / "state"
        mounted = None
        if disk_fs_bytes:
            mounted = state / "shards" / "shard-0"
            mounted.mkdir(parents=True)
            size = f"size={disk_fs_bytes}"
            subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mounted)], check=True)
        try:
            serve = ServeConfig(
                shards=config.shards,
                decoders=config.decoders,
                memory_bytes=16 * MiB,  # the load spills to disk
                disk_bytes=1024 * MiB,
                state_dir=state,
                port=free_ports(config.shards),
                data_port=free_ports(config.shards),
                decoder_port=free_ports(config.decoders),
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

    def kill_shard(self, index: int) -> None:
        os.kill(self.shard_pid(index), signal.SIGKILL)
        actor = self.deployment.actors.pop(index)
        self.deployment.endpoints.pop(index, None)
        with contextlib.suppress(Exception):
            ray.kill(actor)

    def restart_shard(self, index: int) -> None:
        self.deployment.start_shard(index)

    def kill_decoder(self, index: int) -> None:
        actor = self.deployment.decoder_actors.pop(index)
        os.kill(ray.get(actor.pid.remote(), timeout=30), signal.SIGKILL)
        self.deployment.decoders.pop(index, None)
        with contextlib.suppress(Exception):
            ray.kill(actor)

    def shard_disk(self, index: int) -> Path:
        return Path(self.deployment.config.state_dir) / "shards" / f"shard-{index}"

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

    def shard_stats(self) -> list[dict]:
        return [r.info for r in self.metadata.shards()]


# ---- the faults --------------------------------------------------------------------------


def shard_kill(index: int) -> Callable[[Chaos], Callable[[], str]]:
    def inject(chaos: Chaos) -> Callable[[], str]:
        chaos.kill_shard(index)

        def repair() -> str:
            chaos.restart_shard(index)
            return f"shard-{index} killed; restarted on its disk tier"

        return repair

    return inject


def shard_stop(chaos: Chaos) -> Callable[[], str]:
    pid = chaos.shard_pid(1)
    os.kill(pid, signal.SIGSTOP)

    def repair() -> str:
        os.kill(pid, signal.SIGCONT)
        return "shard-1 stopped (SIGSTOP), then continued"

    return repair


def redis_restart(chaos: Chaos) -> Callable[[], str]:
    redis = chaos.deployment.redis
    assert redis is not None, "the deployment's own Redis"
    redis.stop()

    def repair() -> str:
        redis.start()
        return "redis-server stopped, started again on its append-only file"

    return repair


def disk_full(chaos: Chaos) -> Callable[[], str]:
    disk = chaos.shard_disk(0)
    filler = disk / "filler.fill"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        while True:  # until the filesystem has no room left (ENOSPC)
            f.write(b"\0" * (1 << 20))
    before = {s["shard_id"]: s for s in chaos.shard_stats()}

    def repair() -> str:
        filler.unlink()
        after = {s["shard_id"]: s for s in chaos.shard_stats()}

        def grew(key: str) -> int:
            return sum(after[s].get(key, 0) - before.get(s, {}).get(key, 0) for s in after)

        lost, errors = grew("lost_spills"), grew("disk_write_errors")
        return f"shard-0 disk full: {errors} failed disk writes, {lost} evicted blobs lost"

    return repair


def decoder_kill(chaos: Chaos) -> Callable[[], str]:
    chaos.kill_decoder(0)

    def repair() -> str:
        chaos.deployment.start_decoder(0)
        return "decoder-0 killed mid-request; a new decoder started on its port"

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


def disk_corrupt(chaos: Chaos) -> Callable[[], str]:
    before = sum(s.get("corrupt", 0) for s in chaos.shard_stats())
    blobs = load_blobs(chaos.shard_disk(1))
    flipped = 0
    for path in random.Random(0).sample(blobs, min(8, len(blobs))):
        with contextlib.suppress(OSError), open(path, "r+b") as f:
            f.seek(-1 - flipped, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1

    def repair() -> str:
        chaos.workload.sweep()  # read everything back: corrupt copies are met and dropped
        detected = sum(s.get("corrupt", 0) for s in chaos.shard_stats()) - before
        return f"{flipped} blobs flipped on shard-1's disk; {detected} detected on read"

    return repair


def transit_corrupt(chaos: Chaos) -> Callable[[], str]:
    actors = list(chaos.deployment.actors.values())
    before = sum(ray.get([a.inject_transit_faults.remote(4) for a in actors], timeout=30))

    def repair() -> str:
        chaos.workload.sweep()
        fired = sum(ray.get([a.inject_transit_faults.remote(0) for a in actors], timeout=30))
        return f"{fired - before} fetched layers corrupted in transit"

    return repair


FAULTS = {
    f.name: f
    for f in (
        Fault(
            "shard-kill-fetch",
            "fetches continue from the replica; nothing lost",
            shard_kill(1),
        ),
        Fault(
            "shard-kill-put",
            "publishes complete on the survivor (missing replicas reported); nothing lost",
            shard_kill(0),
        ),
        Fault("shard-stop", "calls to it time out and go to the replica", shard_stop),
        Fault("redis-restart", "shards register again; data intact", redis_restart),
        Fault(
            "disk-full",
            "puts needing the disk fail RESOURCE_EXHAUSTED or evict; accounting exact",
            disk_full,
            needs_root=True,
        ),
        Fault(
            "decoder-kill",
            "its streams fail UNAVAILABLE; a new decoder serves; no wrong token",
            decoder_kill,
        ),
        Fault("disk-corrupt", "detected on read, read from the replica", disk_corrupt),
        Fault(
            "transit-corrupt",
            "detected by the client, read from the replica (a miss if both copies were hit)",
            transit_corrupt,
        ),
    )
}


# ---- running it --------------------------------------------------------------------------


def run_fault(chaos: Chaos, fault: Fault, hold_s: float) -> FaultResult:
    start = time.monotonic()
    repair = fault.inject(chaos)
    time.sleep(hold_s)
    try:
        observed = repair()
    except Exception as error:  # noqa: BLE001 - reported, the next fault still runs
        observed = f"repair failed: {type(error).__name__}: {error}"
    recovery = chaos.recover()
    window = chaos.workload.recorder.since(start)
    return FaultResult(
        fault.name,
        fault.expected,
        observed,
        recovery,
        sum(o.lost_bytes for o in window),
        dict(Counter(o.status for o in window if o.status != "OK")),
    )


def run(config: LoadConfig, deployment: Deployment, model, runner, faults, hold_s) -> dict:
    workload = ChaosWorkload(config, deployment, model)
    chaos = Chaos(deployment, workload)
    rss_start = chaos.processes.rss()
    driver = threading.Thread(target=workload.drive_until_stopped, daemon=True)
    driver.start()
    results = []
    try:
        time.sleep(min(10.0, hold_s))  # warm: every operation under way
        for fault in (bar := progress(faults, desc="chaos", unit="fault")):
            bar.set_postfix_str(fault.name)
            results.append(run_fault(chaos, fault, hold_s))
    finally:
        workload.stop()
        driver.join(timeout=config.timeout_s + 60)
    workload.sweep()
    accounting = {s["shard_id"]: (s["held_bytes"], s["usage_bytes"]) for s in chaos.shard_stats()}
    tokens = check_generations(workload, runner, config.sample)
    rss_end = chaos.processes.rss()
    workload.close()
    outcomes = workload.recorder.outcomes
    return {
        "faults": [asdict(r) for r in results],
        "lost_bytes": sum(o.lost_bytes for o in outcomes),
        "verified_bytes": sum(o.verified_bytes for o in outcomes),
        "exceptions": sum(o.status.startswith("exception:") for o in outcomes),
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

    def sweep(self) -> None:
        """Read every prefix published so far back once (each checked bitwise)."""
        for tenant in self.tenants:
            for seed in tenant.everything():
                self.run("fetch", lambda t=tenant, s=seed: self.verify(t, s))


def print_table(result: dict) -> None:
    print(f"{'fault':<17} {'recovery s':>10} {'lost':>6}  observed / expected / errors")
    for r in result["faults"]:
        recovery = f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else "never"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "-"
        print(f"{r['fault']:<17} {recovery:>10} {r['lost_bytes']:>6}  {r['observed']}")
        print(f"{'':<36}expected: {r['expected']}; errors: {errors}")


def verdict(result: dict) -> list[str]:
    """What went wrong (empty: every fault passed)."""
    problems = []
    if result["lost_bytes"]:
        problems.append(f"{result['lost_bytes']} bytes read back wrong")
    if result["tokens"]["wrong_tokens"]:
        problems.append(f"{result['tokens']['wrong_tokens']} wrong tokens")
    if result["exceptions"]:
        problems.append(f"{result['exceptions']} operations failed with an exception (a bug)")
    for shard, (held, charged) in result["accounting"].items():
        if held != charged:
            problems.append(f"{shard}: holds {held} bytes but charges {charged}")
    for r in result["faults"]:
        if r["recovery_s"] is None:
            problems.append(f"{r['fault']}: not healthy within {RECOVERY_LIMIT_S:.0f} s")
    return problems


def selected(names: list[str] | None) -> list[Fault]:
    faults = [FAULTS[n] for n in names] if names else list(FAULTS.values())
    if os.geteuid() != 0:
        skipped = [f.name for f in faults if f.needs_root]
        if skipped:
            print(f"not root: skipping {', '.join(skipped)}")
        faults = [f for f in faults if not f.needs_root]
    return faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--hold", type=float, default=15.0, help="seconds each fault lasts")
    ap.add_argument("--faults", nargs="+", choices=sorted(FAULTS))
    ap.add_argument("--sample", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench/results/chaos.json"))
    args = ap.parse_args()
    faults = selected(args.faults)
    config = LoadConfig(clients=args.clients, tenants=args.tenants, sample=args.sample)
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    disk_fs = 96 * MiB if any(f.name == "disk-full" for f in faults) else None
    with chaos_deployment(config, disk_fs) as deployment:
        result = run(config, deployment, model, runner, faults, args.hold)
    print_table(result)
    problems = verdict(result)
    tokens = result["tokens"]
    print(
        f"\nbytes verified {result['verified_bytes']}, lost {result['lost_bytes']}; "
        f"generations checked {tokens['checked']}, wrong tokens {tokens['wrong_tokens']}; "
        f"accounting {result['accounting']}"
    )
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
