"""Prefix store throughput over loopback: put and fetch of full-KV payloads.

Payload: the built-in model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
fp32) for an 8K-token prefix, 377 MB. For 1, 2 and 4 shards (Ray actors, each its own
process, replication 1 so every byte crosses the link once) the client publishes a new
prefix (`publish_prefix`, two-phase puts) and fetches it into preallocated tensors
(`fetch_layers`), checking every fetch bitwise. Side by side in the same run:

- raw TCP: one preallocated buffer over a loopback socket (the link's limit here);
- LMCache's own remote server (`python -m lmcache.v1.server HOST PORT cpu`, the `lm://`
  backend) driven by LMCache's own client (`LMCServerConnector` over a `LocalCPUBackend`),
  on 11.8 MB chunks of the same bytes (bench/store_baselines.py);
- the same LMCache client and payload through VeriCache's LMCache gateway
  (`prefix_store.lmcache`, in this process), which stores each chunk into the shards as one
  tenant's object (a PutArtifact/FetchArtifact per chunk, replication 1 as above).

GB/s counts payload bytes (1e9) over wall time: the median of `--repeats` (3) runs, with
their range [min-max] in the table and under "spread" in the JSON (bench/stats.py).

Memory warm-up: on the virtual machines this was developed on, the first touch of memory
the guest has never used runs at ~0.7-0.9 GB/s (the host backs it lazily), while memory
used before is filled at ~2.7 GB/s. Every put stores new bytes, so without care whichever
system runs on fresh memory looks slow. `--prefault-gib` (default 8) first touches that
much memory in a throwaway process, so every system below runs on warm pages.

Usage: python bench/bench_store.py [--shards 1 2 4] [--tokens 8192] [--repeats 3]
       [--message-mib 1] [--streams 2] [--prefault-gib 8] [--out bench/results/store.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import store_baselines  # noqa: E402
from bench.stats import DEFAULT_REPEATS, row_text, spread, spreads_json  # noqa: E402
from cluster.serve import Deployment, ServeConfig  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402
from prefix_store.config import ClientConfig, GiB, MiB  # noqa: E402
from prefix_store.layout import KVLayout  # noqa: E402
from prefix_store.lmcache import GatewayConfig, LMCacheGateway  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402

LMCACHE_ROW = "LMCache's own server"
GATEWAY_ROW = "LMCache client → VeriCache gateway"
LAYOUT = KVLayout(
    "SmolLM2-135M-Instruct", "float32", num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=256
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--message-mib", type=float, default=1.0)
    parser.add_argument("--streams", type=int, default=2, help="parallel streams per transfer")
    parser.add_argument("--skip-lmcache", action="store_true")
    parser.add_argument("--prefault-gib", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/store.json"))
    return parser.parse_args(argv)


def measure_store(shards: int, args, kv: torch.Tensor) -> dict:
    payload = LAYOUT.chunk_bytes(args.tokens)
    with tempfile.TemporaryDirectory() as state:
        os.environ["VERICACHE_HOME"] = state
        config = ServeConfig(
            shards=shards, memory_bytes=4 * GiB, disk_bytes=0, state_dir=Path(state), replication=1
        )
        with Deployment(config) as deployment:
            token = Metadata(deployment.redis_url).add_tenant("bench")
            client_config = ClientConfig(
                message_bytes=int(args.message_mib * MiB), streams=args.streams
            )
            endpoints = list(deployment.endpoints.values())
            with StoreClient(endpoints, token, client_config) as client:
                result = transfer_runs(client, args, kv, payload)
            if not args.skip_lmcache:
                result["gateway"] = measure_gateway(endpoints, token, args)
            return result


def measure_gateway(endpoints: list[str], token: str, args) -> dict:
    """LMCache's own client (the same driver and payload as the LMCache row) through
    VeriCache's LMCache gateway, which stores into these shards as tenant `token`."""
    config = GatewayConfig(tuple(endpoints), token, max_object_bytes=64 * MiB)
    with LMCacheGateway(config) as gateway:
        port = int(gateway.address.rsplit(":", 1)[1])
        n_chunks = args.tokens // store_baselines.CHUNK_TOKENS
        return store_baselines.measure_lmcache_client(
            port, store_baselines.CHUNK_BYTES, n_chunks, args.repeats
        )


def transfer_runs(client: StoreClient, args, kv: torch.Tensor, payload: int) -> dict:
    k = torch.zeros(LAYOUT.num_layers, LAYOUT.num_kv_heads, args.tokens, LAYOUT.head_dim)
    v = torch.zeros_like(k)
    put_s, fetch_s, equal = [], [], True
    for repeat in range(args.repeats):
        tokens = list(range(repeat * 100_000, repeat * 100_000 + args.tokens))
        start = time.perf_counter()
        result = client.publish_prefix(tokens, kv, LAYOUT)
        put_s.append(time.perf_counter() - start)
        assert result.stored_bytes == payload, "every chunk is new: all bytes must be stored"
        prefix = client.lookup(tokens, LAYOUT)
        start = time.perf_counter()
        client.fetch_layers(prefix, k, v)
        fetch_s.append(time.perf_counter() - start)
        equal &= torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
        k.zero_()
        v.zero_()
    return {
        **rates(payload, put_s, fetch_s),
        "put_runs_s": put_s,
        "fetch_runs_s": fetch_s,
        "bitwise_equal": equal,
    }


def rates(nbytes: int, put_s: list[float], fetch_s: list[float]) -> dict:
    """Figures "put_gbps" and "fetch_gbps": the median GB/s of runs moving `nbytes` in each of
    `put_s` / `fetch_s` seconds, with both figures' range over the runs under "spread"."""
    figures = {
        "put_gbps": spread(nbytes / s / 1e9 for s in put_s),
        "fetch_gbps": spread(nbytes / s / 1e9 for s in fetch_s),
    }
    return {key: figure.median for key, figure in figures.items()} | {
        "spread": spreads_json(figures)
    }


def lmcache_rates(result: dict) -> dict:
    """A row's figures from `store_baselines.measure_lmcache_client`'s result."""
    return {
        **rates(result["total_bytes"], result["put_runs_s"], result["get_runs_s"]),
        "bitwise_equal": result["bitwise_equal"],
    }


def prefault(gib: float) -> float:
    """Touch `gib` GiB in a child process (then freed); returns the seconds it took."""
    if gib <= 0:
        return 0.0
    code = f"import numpy; numpy.ones(int({gib} * (1 << 30)), dtype=numpy.uint8)"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def table(rows: list[dict]) -> str:
    header = (
        "| system | shards | put GB/s [min-max] | fetch GB/s [min-max] | put vs LMCache "
        "| fetch vs LMCache | fetch vs raw TCP | bitwise |"
    )
    lines = [header, "|" + "---|" * 8]
    lm = next((r for r in rows if r["system"] == LMCACHE_ROW), None)
    raw = next(r for r in rows if r["system"] == "raw tcp")
    for r in rows:
        put_ratio = f"{r['put_gbps'] / lm['put_gbps']:.2f}" if lm else "-"
        fetch_ratio = f"{r['fetch_gbps'] / lm['fetch_gbps']:.2f}" if lm else "-"
        lines.append(
            f"| {r['system']} | {r.get('shards', '-')} | {row_text(r, 'put_gbps')} "
            f"| {row_text(r, 'fetch_gbps')} | {put_ratio} | {fetch_ratio} "
            f"| {r['fetch_gbps'] / raw['fetch_gbps']:.2f} | {r.get('bitwise_equal', '-')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    payload = LAYOUT.chunk_bytes(args.tokens)
    print(
        f"payload: {args.tokens} tokens x {LAYOUT.num_layers} layers = {payload / 1e6:.0f} MB",
        flush=True,
    )
    seconds = prefault(args.prefault_gib)
    print(f"memory warm-up: touched {args.prefault_gib:g} GiB in {seconds:.1f} s", flush=True)
    rows = []
    raw = store_baselines.measure_raw_socket(payload, repeats=args.repeats)
    rows.append(
        {
            "system": "raw tcp",
            **rates(payload, raw["send_runs_s"], raw["recv_runs_s"]),
            "bitwise_equal": raw["intact"],
        }
    )
    print(f"raw tcp: recv {raw['recv_gbps']:.2f} GB/s, send {raw['send_gbps']:.2f}", flush=True)
    if not args.skip_lmcache:
        n_chunks = args.tokens // store_baselines.CHUNK_TOKENS
        lm = store_baselines.measure_lmcache(store_baselines.CHUNK_BYTES, n_chunks, args.repeats)
        rows.append({"system": LMCACHE_ROW, **lmcache_rates(lm)})
        print(f"lmcache: put {lm['put_gbps']:.2f} GB/s, get {lm['get_gbps']:.2f}", flush=True)
    kv = torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, args.tokens, LAYOUT.head_dim)
    for shards in args.shards:
        result = measure_store(shards, args, kv)
        gateway = result.pop("gateway", None)
        rows.append({"system": "vericache", "shards": shards, **result})
        print(
            f"vericache x{shards}: put {result['put_gbps']:.2f} GB/s, "
            f"fetch {result['fetch_gbps']:.2f}",
            flush=True,
        )
        if gateway is not None:
            rows.append({"system": GATEWAY_ROW, "shards": shards, **lmcache_rates(gateway)})
            print(
                f"{GATEWAY_ROW} x{shards}: put {gateway['put_gbps']:.2f} GB/s, "
                f"get {gateway['get_gbps']:.2f}",
                flush=True,
            )
    print()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "payload_bytes": payload,
                "tokens": args.tokens,
                "repeats": args.repeats,
                "message_mib": args.message_mib,
                "streams": args.streams,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
