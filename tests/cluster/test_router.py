"""The router deployed by `vericache serve` (real Ray actors, real gRPC, the built-in
model): a decoder killed with SIGKILL in the middle of 4 concurrent streams, every stream
completes identical to in-process full-KV decoding with no token duplicated or missing;
the decoder restarted receives new prefixes; `status` shows the routers' view."""

from __future__ import annotations

import inspect
import json
import os
import signal
import textwrap
import threading

import pytest
import ray

from cluster.cli import main
from decoder.service.client import DecoderClient, GenerateReply
from prefix_store.config import MiB
from tests.cluster.conftest import deployed
from tests.references import full_kv_batch

pytestmark = pytest.mark.cluster

NEW = 24


@pytest.fixture(scope="module")
def service(redis_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("vericache-home")
    with deployed(
        redis_server.url, home, shards=1, memory_bytes=512 * MiB, disk_bytes=0, decoders=2
    ) as deployment:  # fmt: skip
        yield deployment


def busiest(actors: dict) -> tuple[int, object]:
    """The decoder (index, actor) with the most requests in flight."""
    in_flight = {i: ray.get(a.info.remote(), timeout=30)["in_flight"] for i, a in actors.items()}
    v = max(in_flight, key=in_flight.get)
    assert in_flight[v] > 0, in_flight
    return v, actors[v]


def test_a_decoder_killed_mid_stream_loses_nothing(
    service, metadata, builtin_model, builtin_runner, capsys
):
    token = metadata.add_tenant("router-a")
    text = inspect.getsource(textwrap)
    prompts = [builtin_model.encode(text[i * 2500 :])[:300] for i in range(4)]
    want = full_kv_batch(builtin_runner, builtin_model, prompts, NEW)
    router = service.routers[0]
    replies = [GenerateReply() for _ in prompts]
    pieces: list[list[list[int]]] = [[] for _ in prompts]
    started = threading.Barrier(len(prompts) + 1)
    errors = []

    def stream(i):
        try:
            with DecoderClient(router, token, timeout_s=600) as client:
                for n, piece in enumerate(
                    client.stream(
                        reply=replies[i], token_ids=prompts[i], max_new_tokens=NEW, mode="full"
                    )  # fmt: skip
                ):
                    pieces[i].append(piece.tokens)
                    if n == 0:
                        started.wait(300)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(300)  # every stream has tokens
    v, victim = busiest(service.decoder_actors)  # the router may have placed all 4 on one
    os.kill(ray.get(victim.pid.remote(), timeout=30), signal.SIGKILL)
    for t in threads:
        t.join(600)
    assert not errors, errors
    for i, reply in enumerate(replies):
        assert reply.tokens == want[i]
        assert sum(pieces[i], []) == want[i]  # nothing duplicated or missing
    moved = [r for r in replies if r.stats["router"]["failovers"]]
    assert moved and all(r.stats["worker"] == f"decoder-{1 - v}" for r in moved)

    service.decoder_actors.pop(v)
    service.decoders.pop(v)
    service.start_decoder(v)  # back, on a new port: the router is told
    views = service.router_view()[0]
    assert len(views) == 2 and all(v["healthy"] for v in views)
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert {"router-0", "decoder-0", "decoder-1", "shard-0"} <= set(live)
    assert live["router-0"]["failovers"] >= len(moved)
