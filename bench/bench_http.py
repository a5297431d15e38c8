"""The OpenAI-compatible HTTP API against gRPC, under the same load, through the same router.

Everything real, on this machine, as `vericache serve --http-port` deploys it: Ray actors
for one store shard, one decoder serving the built-in model and a router serving both the
`Decoder` gRPC service and the HTTP API (`decoder.http`), and a Redis; the load comes from
this process. Each run sends `--streams` (4) concurrent streaming requests, greedy,
`--max-new-tokens` (64) each, over distinct prompts: once through the official `openai`
client (asyncio, streaming chat completions) and once through gRPC (grpc.aio, the
router's Generate), both with every stream started at once, in alternating order from run
to run. The outputs of the two must be identical (else the bench exits 1).

Columns: aggregate tokens/s (all generated tokens over the load's wall time) and its ratio
to gRPC's; time to first token p50; inter-event latency p50/p99 (the time between two
successive pieces of a stream: each decoder event is one SSE chunk and one gRPC message).
Figures are medians over `--repeats` (3) runs with their range (bench/stats.py).

Usage: python bench/bench_http.py [--streams 4] [--max-new-tokens 64] [--repeats 3]
       [--out bench/results/http.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import DEFAULT_REPEATS, spread  # noqa: E402

TOPICS = ["rivers", "mountains", "bridges", "libraries", "volcanoes", "trains", "gardens",
          "lighthouses", "deserts", "orchestras", "glaciers", "markets"]  # fmt: skip
MODEL = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/http.json"))
    return parser.parse_args(argv)


class Service:
    """A deployment on this machine (Ray actors: a shard, a decoder, a router serving HTTP
    too, each in its own process, as `vericache serve --http-port` runs them)."""

    def __init__(self, home: Path) -> None:
        from cluster.serve import Deployment, ServeConfig
        from decoder.loader import load_model
        from prefix_store.config import GiB
        from prefix_store.metadata import Metadata

        os.environ["VERICACHE_HOME"] = str(home)
        config = ServeConfig(
            shards=1, memory_bytes=1 * GiB, disk_bytes=0, state_dir=home / "state",
            decoders=1, http_port=0, metrics=False,
        )  # fmt: skip
        self.deployment = Deployment(config).start()
        self.address, self.http_url = self.deployment.routers[0], self.deployment.http[0]
        self.token = Metadata(self.deployment.redis_url).add_tenant("bench")
        self.tokenizer = load_model().tokenizer

    def close(self) -> None:
        self.deployment.stop()


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % 12]}."}]


async def one_http(client, i: int, new: int) -> dict:
    start = time.perf_counter()
    arrivals, text, tokens = [], "", 0
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages(i), max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "text": text}


async def one_grpc(stub, token: str, ids: list[int], new: int) -> dict:
    from decoder.service.client import generate_request

    request = generate_request(token_ids=ids, max_new_tokens=new).SerializeToString()
    start = time.perf_counter()
    arrivals, text, tokens = [], "", 0
    async for event in stub(request, metadata=(("authorization", f"Bearer {token}"),)):
        if event.HasField("tokens"):
            tokens += len(event.tokens.ids)
            if event.tokens.text:
                arrivals.append(time.perf_counter())
                text += event.tokens.text
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "text": text}


async def load(service: Service, way: str, streams: int, new: int) -> dict:
    import grpc
    import openai

    from decoder.service.client import generate_stub

    started = time.perf_counter()
    if way == "http":
        client = openai.AsyncOpenAI(base_url=f"{service.http_url}/v1",
                                    api_key=service.token, max_retries=0)  # fmt: skip
        async with client:
            results = await asyncio.gather(*(one_http(client, i, new) for i in range(streams)))
    else:
        tokenizer = service.tokenizer
        prompts = [tokenizer.apply_chat_template(messages(i), add_generation_prompt=True)
                   for i in range(streams)]  # fmt: skip
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generate_stub(channel)
            jobs = (one_grpc(stub, service.token, p, new) for p in prompts)
            results = await asyncio.gather(*jobs)
    wall = time.perf_counter() - started
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_s": statistics.median(r["arrivals"][0] - r["start"] for r in results),
        "itl_p50_s": statistics.median(gaps),
        "itl_p99_s": statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else gaps[0],
        "texts": [r["text"] for r in results],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(Path(tmp))
        try:
            asyncio.run(load(service, "grpc", 2, 8))  # warm up both paths
            asyncio.run(load(service, "http", 2, 8))
            runs: dict[str, list[dict]] = {"grpc": [], "http": []}
            for repeat in range(args.repeats):
                order = ("http", "grpc") if repeat % 2 == 0 else ("grpc", "http")
                for way in order:
                    runs[way].append(asyncio.run(load(service, way, args.streams,
                                                      args.max_new_tokens)))  # fmt: skip
        finally:
            service.close()
    identical = all(
        h["texts"] == g["texts"] for h, g in zip(runs["http"], runs["grpc"], strict=True)
    )
    keys = ("tokens_per_s", "ttft_s", "itl_p50_s", "itl_p99_s")
    rows = {way: {k: spread(r[k] for r in runs[way]) for k in keys} for way in runs}
    base = rows["grpc"]["tokens_per_s"].median
    print(f"{args.streams} concurrent streams x {args.max_new_tokens} new tokens, "
          f"medians of {args.repeats} runs [range]; outputs identical: {identical}")  # fmt: skip
    print("| way | tok/s | vs gRPC | TTFT p50 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|")
    for way in ("grpc", "http"):
        r = rows[way]
        print(
            f"| {way} | {r['tokens_per_s'].text()} | {r['tokens_per_s'].median / base:.3f}x | "
            f"{r['ttft_s'].scaled(1e3).text('.0f')} | {r['itl_p50_s'].scaled(1e3).text('.1f')} | "
            f"{r['itl_p99_s'].scaled(1e3).text('.1f')} |"
        )
    result = {
        "bench": "http",
        "machine": platform.machine(),
        "streams": args.streams,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "identical": identical,
        "ratio_tokens_per_s": rows["http"]["tokens_per_s"].median / base,
        "rows": {way: {k: v.to_json() for k, v in r.items()} for way, r in rows.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
