"""The service deployed with `ray up` onto real hosts: network namespaces on this machine,
each with its own address, SSH server, processes, /tmp and home (cluster/testbed.py), from
cluster/local.yaml as an operator would use it (see `LocalCluster` for the one
difference). Needs root: runs in CI. Skips, saying which, only without root or network
namespaces (`TestbedUnsupported`); any other failure to build the hosts (a missing tool,
apt-get, no free subnet) fails."""

from __future__ import annotations

import base64
import inspect
import json
import re
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster.testbed import LocalCluster, Testbed, TestbedConfig, TestbedUnsupported
from decoder.loader import default_cache_dir
from decoder.service.client import DecoderClient, GenerateReply
from decoder.store_source import kv_layout
from prefix_store.client import StoreClient
from tests.cluster.conftest import DRIVER
from tests.references import full_kv_tokens

pytestmark = [pytest.mark.multihost, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("head", "storage1", "storage2", "decoder1")
NEW = 24
PARTITION_S = 30
"""Every node's `--partition-s` (the default is 60): how long a cut-off host keeps its Ray
node. The link-down test keeps its cut shorter; `ray down` waits for it on the workers."""
SERVE = (
    "vericache serve --address auto --detach --host 0.0.0.0 --shards 2 --decoders 1 "
    "--port 7000 --data-port 7100 --decoder-port 7200 --redis-port 6380 "
    "--memory-bytes 1GiB --disk-bytes 0"
)


@pytest.fixture(scope="module")
def testbed():
    bed = Testbed(TestbedConfig(hosts=HOSTS, carry=(ROOT, default_cache_dir())))
    try:
        bed.start()
    except TestbedUnsupported as reason:
        bed.close()
        pytest.skip(f"multi-host tests need root and network namespaces: {reason}")
    except BaseException:
        bed.close()
        raise
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def cluster(testbed):
    """`ray up` (cluster/local.yaml), then the service deployed with `ray exec ...
    serve --detach`; `ray down` at the end. Yields (cluster, store endpoints, decoder)."""
    ray_cluster = LocalCluster(
        testbed,
        ROOT,
        head="head",
        storage=["storage1", "storage2"],
        decoder=["decoder1"],
        partition_s=PARTITION_S,
    )
    try:
        ray_cluster.up()
        out = ray_cluster.exec(SERVE)
        stores = re.findall(r"store\s+(\S+:\d+)", out)
        decoders = re.findall(r"decoder\s+(\S+:\d+)", out)
        assert len(stores) == 2 and len(decoders) == 1, out
        yield ray_cluster, stores, decoders[0]
    finally:
        ray_cluster.down()


def tenant(cluster: LocalCluster, name: str) -> str:
    out = cluster.exec(f"vericache tenant add {name}")
    return [line for line in out.split() if re.fullmatch(r"[A-Za-z0-9_\-]{20,}", line)][-1]


def first_json(text: str):
    return json.JSONDecoder().raw_decode(text[text.index("{") :])[0]


@pytest.fixture(scope="module")
def document(builtin_model):
    """A ~700-token source file: the prefix (two full 256-token chunks and a partial one,
    spread over both storage hosts)."""
    return builtin_model.decode(builtin_model.encode(inspect.getsource(textwrap))[:700])


def reference(runner, model, ids, new=NEW):
    return full_kv_tokens(runner, model, ids, new)


def test_ray_up_places_the_service_on_its_hosts(testbed, cluster):
    _, stores, decoder = cluster
    storage = {testbed.hosts[name].address for name in ("storage1", "storage2")}
    assert {s.rsplit(":", 1)[0] for s in stores} == storage  # one shard on each storage host
    assert decoder.rsplit(":", 1)[0] == testbed.hosts["decoder1"].address


def test_the_clusters_ray_refuses_a_driver_without_its_token(testbed, cluster):
    """Ray on the hosts `ray up` started requires the token the head made and `ray up`
    copied: a driver on a worker host with none (nor any ~/.ray/auth_token: an empty home)
    is refused by the head, so it cannot run code on the cluster; with the copied token
    file it connects."""
    host = testbed.hosts["decoder1"]
    script = base64.b64encode(DRIVER.encode()).decode()
    head = f"{testbed.hosts['head'].address}:6379"
    run = (
        f"echo {script} | base64 -d > /tmp/driver.py; H=$(mktemp -d); "
        f"env -u RAY_AUTH_MODE -u RAY_AUTH_TOKEN_PATH HOME=$H python /tmp/driver.py {head}; "
        "T=${VERICACHE_HOME:-$HOME/.vericache}/ray_token; "
        f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$T HOME=$H python /tmp/driver.py {head}"
    )
    out = host.ssh(f"source ~/.bashrc; {run}").stdout.splitlines()
    refused, connected = [line for line in out if line.startswith(("refused:", "connected:"))]
    assert refused == "refused: ConnectionError"
    assert connected.startswith("connected:") and int(connected.split()[-1]) > 0


def test_publish_on_one_host_generate_on_others(
    testbed, cluster, document, builtin_model, builtin_runner
):
    ray_cluster, _, decoder = cluster
    token = tenant(ray_cluster, "alice")
    head, other = testbed.hosts["head"], testbed.hosts["storage2"]
    (head.directory / "tmp" / "doc.txt").write_text(document)
    published = head.ssh(
        f"source ~/.bashrc; vericache publish --endpoint {decoder} --token {token} "
        "--file /tmp/doc.txt --compressor snapkv:budget=0.125 --json"
    )
    assert first_json(published.stdout)["tokens"] > 600

    question = "\n# Question: what does dedent do?\n"
    prompt_ids = builtin_model.encode(document + question)
    want = reference(builtin_runner, builtin_model, prompt_ids)
    with DecoderClient(decoder, token) as client:  # from outside the cluster
        reply = client.generate(token_ids=prompt_ids, max_new_tokens=NEW)
    assert reply.tokens == want
    assert reply.stats["cached_tokens"] > 600 and reply.stats["mode"] == "vericache"

    (other.directory / "tmp" / "prompt.txt").write_text(document + question)
    out = other.ssh(
        f"source ~/.bashrc; vericache generate --endpoint {decoder} --token {token} "
        f"--prompt-file /tmp/prompt.txt --max-new-tokens {NEW} --mode vericache --json"
    )
    assert first_json(out.stdout)["tokens"] == want


def live_shards(cluster: LocalCluster) -> int:
    return len(first_json(cluster.exec("vericache status --json"))["shards"])


def test_storage_link_down_mid_request_replica_then_rejoin(
    testbed, cluster, document, builtin_model, builtin_runner
):
    ray_cluster, _, decoder = cluster
    token = tenant(ray_cluster, "bob")
    doc_ids = builtin_model.encode(document)
    prompt = doc_ids + builtin_model.encode("\n# Rewrite fill() in one line:\n")[1:]
    want = reference(builtin_runner, builtin_model, prompt, new=48)
    storage1 = testbed.hosts["storage1"]
    with DecoderClient(decoder, token) as client:
        client.publish(token_ids=doc_ids, compressors=["snapkv:budget=0.125"])
        got: list[int] = []
        reply = GenerateReply()
        cut = threading.Event()
        cut_at = 0.0
        try:
            for piece in client.stream(token_ids=prompt, max_new_tokens=48, horizon=2, reply=reply):
                got.extend(piece.tokens)
                if len(got) >= 4 and not cut.is_set():
                    storage1.link(False)  # packets dropped, nothing reset
                    cut_at = time.monotonic()
                    cut.set()
        finally:
            storage1.link(True)
            cut_s = time.monotonic() - cut_at
        assert cut.is_set()
        # the cut must end before Ray gives storage1 up: otherwise its shard is gone, not back
        assert cut_s < PARTITION_S, f"the link was down {cut_s:.0f} s"
        assert reply.tokens == want and got == want
        assert reply.stats["recomputed"] is False  # the replica served it

        deadline = time.monotonic() + 90
        while live_shards(ray_cluster) < 2:  # heartbeats resume: the shard rejoins
            assert time.monotonic() < deadline, "storage1's shard did not rejoin within 90 s"
            time.sleep(2)
        again = client.generate(token_ids=prompt, max_new_tokens=48)
        assert again.tokens == want


def test_shaped_links_limit_pulls_and_decoding_stays_exact(
    testbed, cluster, document, builtin_model, builtin_runner
):
    ray_cluster, stores, decoder = cluster
    token = tenant(ray_cluster, "carol")
    doc_ids = builtin_model.encode(document)
    prompt = doc_ids + builtin_model.encode("\n# What does indent() return?\n")[1:]
    want = reference(builtin_runner, builtin_model, prompt)
    storage = [testbed.hosts[name] for name in ("storage1", "storage2")]
    rate = 125e6  # 1 Gbit/s per storage host
    config = builtin_model.config
    with DecoderClient(decoder, token) as client:
        client.publish(token_ids=doc_ids, compressors=["snapkv:budget=0.125"])
        try:
            for host in storage:
                host.shape(rate)
            with StoreClient(list(stores), token) as store:  # from outside the cluster
                cached = store.lookup(doc_ids, kv_layout(config, builtin_model.fingerprint))
                k = torch.empty(config.num_layers, config.num_kv_heads, cached.tokens,
                                config.head_dim)  # fmt: skip
                started = time.perf_counter()
                pulled = store.fetch_layers(cached, k, torch.empty_like(k))
                seconds = time.perf_counter() - started
            # the pull crossed both shaped links and no faster than they allow (a slower
            # machine only lowers the rate; the buckets add 2 x 0.5 MB of burst)
            assert pulled > 25e6 and pulled / seconds <= 2 * rate * 1.1
            reply = client.generate(token_ids=prompt, max_new_tokens=NEW)
            assert reply.tokens == want and reply.stats["pulled_bytes"] > 0
        finally:
            for host in storage:
                host.shape(None)


def deployment_key(cluster: LocalCluster) -> bytes:
    """The deployment's provenance key, from the head host's state directory."""
    path = '"${VERICACHE_HOME:-$HOME/.vericache}/state/provenance.key"'
    return base64.b64decode(cluster.exec(f"base64 -w0 {path}").split()[-1])


def test_near_data_verification_across_shaped_links_is_exact(
    testbed, cluster, document, builtin_model, builtin_runner
):
    """A decoder outside the storage hosts verifies near the data across links shaped to
    1 Gbit/s: the shards on the storage hosts attend the prefix's chunks and return
    partials; the tokens are full-KV decoding's and the prefix's KV never crosses a link."""
    from decoder.service.config import DecoderConfig
    from decoder.service.server import DecoderServer
    from decoder.service.worker import DecoderWorker

    ray_cluster, stores, decoder = cluster
    token = tenant(ray_cluster, "dave")
    doc_ids = builtin_model.encode(document)
    prompt = doc_ids + builtin_model.encode("\n# Where is the margin computed?\n")[1:]
    want = reference(builtin_runner, builtin_model, prompt)
    with DecoderClient(decoder, token) as client:
        client.publish(token_ids=doc_ids, compressors=["snapkv:budget=0.125"])
    config = DecoderConfig(
        store_endpoints=tuple(stores),
        worker_id="near",
        provenance_key=deployment_key(ray_cluster),
        placement="near",
        resident_prefixes=False,
    )
    server = DecoderServer(config, worker=DecoderWorker(config, builtin_model))
    server.start()
    storage = [testbed.hosts[name] for name in ("storage1", "storage2")]
    try:
        for host in storage:
            host.shape(125e6)
        with DecoderClient(server.address, token) as client:
            reply = client.generate(token_ids=prompt, max_new_tokens=NEW)
    finally:
        for host in storage:
            host.shape(None)
        server.stop()
    stats = reply.stats
    assert reply.tokens == want
    assert stats["near_passes"] > 0
    assert stats["pulled_bytes"] <= stats["full_bytes"] * 256 / stats["prefix_tokens"]
    assert stats["near_bytes"] / stats["near_passes"] < stats["full_bytes"] / 10


def ray_processes(host) -> str:
    return host.ssh("pgrep -fa '[r]aylet|[g]cs_server|[r]edis-server|[r]ay::' || true").stdout


def test_ray_down_leaves_nothing_running(testbed, cluster):
    """`ray down` with the local provider runs `ray stop` on the head only (Ray 2.60); each
    worker's raylet exits, with its actors, once it has lost the head for `vericache node
    start --partition-s` (PARTITION_S). Then nothing of Ray, Redis or the service is left."""
    ray_cluster, _, _ = cluster
    assert "stopped" in ray_cluster.exec("vericache stop")  # the service first, Ray stays
    ray_cluster.down()
    assert ray_processes(testbed.hosts["head"]).strip() == ""
    deadline = time.monotonic() + 300  # the partition, then shutdown (~130 s seen for 60 s)
    for host in testbed.hosts.values():
        while left := ray_processes(host).strip():
            assert time.monotonic() < deadline, f"{host.name} still runs: {left[:300]}"
            time.sleep(5)
