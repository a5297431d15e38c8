"""The service deployed with `ray up` onto real hosts: network namespaces on this machine,
each with its own address, SSH server, /tmp and home (cluster/testbed.py), built from
cluster/deploy/local.yaml as an operator would use it. Needs root: runs in CI; skips with
the reason elsewhere.

The hosts share this machine's disk, so the rendered config points the hosts at this
checkout (already installed: its `make install` setup command is a no-op) instead of
syncing a copy; every other command of the config runs as written.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from cluster.testbed import Testbed, TestbedConfig, TestbedUnavailable
from decoder.generate import generate_full
from decoder.loader import default_cache_dir
from decoder.service.client import DecoderClient, GenerateReply

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
HOSTS = ("head", "storage1", "storage2", "decoder1")
NEW = 24
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
    except TestbedUnavailable as reason:
        bed.close()
        pytest.skip(f"multi-host tests need root and network namespaces: {reason}")
    except BaseException:
        bed.close()
        raise
    yield bed
    bed.close()


def render(bed: Testbed) -> Path:
    """cluster/deploy/local.yaml with the testbed's addresses, key and checkout."""
    config = yaml.safe_load((ROOT / "cluster/deploy/local.yaml").read_text())
    head, s1, s2, d1 = (bed.hosts[name].address for name in HOSTS)
    config["cluster_name"] = bed.tag
    config["provider"].update(head_ip=head, worker_ips=[s1, s2, d1])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(bed.hosts["head"].key)}
    config["file_mounts"] = {}
    swaps = {
        "~/vericache": str(ROOT),
        "$HOME/vericache": str(ROOT),
        "--ip 10.0.0.10": f"--ip {head}",
        "--storage 10.0.0.11,10.0.0.12": f"--storage {s1},{s2}",
        "--decoder 10.0.0.13": f"--decoder {d1}",
        "vericache node start": "vericache node start --object-store-bytes 200000000",
    }
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        commands = []
        for command in config[key]:
            for old, new in swaps.items():
                command = command.replace(old, new)
            commands.append(command)
        config[key] = commands
    assert sum("vericache node start" in c for c in config["worker_start_ray_commands"]) == 1
    assert f"--storage {s1},{s2}" in config["worker_start_ray_commands"][-1]
    path = bed.directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ray_cli(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"ray {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def alive_nodes(bed: Testbed) -> int:
    probe = "import ray; ray.init(address='auto'); print(sum(n['Alive'] for n in ray.nodes()))"
    result = bed.hosts["head"].ssh(f'source ~/.bashrc; python -c "{probe}"', check=False)
    lines = result.stdout.strip().splitlines()
    return int(lines[-1]) if result.returncode == 0 and lines and lines[-1].isdigit() else 0


@pytest.fixture(scope="module")
def cluster(testbed):
    """`ray up`, then the service deployed with `ray exec ... serve --detach`; `ray down` at
    the end. Yields (config path, store endpoints, decoder endpoint)."""
    config = render(testbed)
    try:
        ray_cli("up", "-y", "--no-config-cache", str(config))
        deadline = time.monotonic() + 300
        while alive_nodes(testbed) < len(HOSTS):
            assert time.monotonic() < deadline, "the worker hosts did not join within 300 s"
            time.sleep(3)
        out = ray_cli("exec", str(config), SERVE)
        stores = re.findall(r"store\s+(\S+:\d+)", out)
        decoders = re.findall(r"decoder\s+(\S+:\d+)", out)
        assert len(stores) == 2 and len(decoders) == 1, out
        yield config, stores, decoders[0]
    finally:
        subprocess.run([RAY, "down", "-y", str(config)], capture_output=True, timeout=300)
        for leftover in Path("/tmp/ray").glob(f"cluster-{testbed.tag}.*"):
            leftover.unlink()  # `ray up`'s record of the cluster on this machine


def on_head(config: Path, command: str) -> str:
    return ray_cli("exec", str(config), command)


def tenant(config: Path, name: str) -> str:
    out = on_head(config, f"vericache tenant add {name}")
    return [line for line in out.split() if re.fullmatch(r"[A-Za-z0-9_\-]{20,}", line)][-1]


@pytest.fixture(scope="module")
def document(builtin_model):
    """A ~1200-token source file: the prefix."""
    return builtin_model.decode(builtin_model.encode(inspect.getsource(textwrap))[:1200])


def reference(runner, model, ids, new=NEW):
    return generate_full(runner, [ids], max_new_tokens=new, eos_token_ids=model.eos_token_ids)[
        0
    ].tokens


def test_ray_up_places_the_service_on_its_hosts(testbed, cluster):
    _, stores, decoder = cluster
    storage = {testbed.hosts[name].address for name in ("storage1", "storage2")}
    assert {s.rsplit(":", 1)[0] for s in stores} == storage  # one shard on each storage host
    assert decoder.rsplit(":", 1)[0] == testbed.hosts["decoder1"].address


def test_publish_on_one_host_generate_on_others(
    testbed, cluster, document, builtin_model, builtin_runner
):
    config, _, decoder = cluster
    token = tenant(config, "alice")
    head, other = testbed.hosts["head"], testbed.hosts["storage2"]
    (head.directory / "tmp" / "doc.txt").write_text(document)
    published = head.ssh(
        f"source ~/.bashrc; vericache publish --endpoint {decoder} --token {token} "
        "--file /tmp/doc.txt --compressor snapkv:budget=0.125 --json"
    )
    assert json.loads(published.stdout.strip().splitlines()[-1])["tokens"] > 1000

    question = "\n# Question: what does dedent do?\n"
    prompt_ids = builtin_model.encode(document + question)
    want = reference(builtin_runner, builtin_model, prompt_ids)
    with DecoderClient(decoder, token) as client:  # from outside the cluster
        reply = client.generate(token_ids=prompt_ids, max_new_tokens=NEW)
    assert reply.tokens == want
    assert reply.stats["cached_tokens"] > 1000 and reply.stats["mode"] == "vericache"

    (other.directory / "tmp" / "prompt.txt").write_text(document + question)
    out = other.ssh(
        f"source ~/.bashrc; vericache generate --endpoint {decoder} --token {token} "
        f"--prompt-file /tmp/prompt.txt --max-new-tokens {NEW} --mode vericache --json"
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["tokens"] == want


def live_shards(config: Path) -> int:
    status = json.loads(on_head(config, "vericache status --json").strip().splitlines()[-1])
    return len(status["shards"])


def test_storage_link_down_mid_request_replica_then_rejoin(
    testbed, cluster, document, builtin_model, builtin_runner
):
    config, _, decoder = cluster
    token = tenant(config, "bob")
    doc_ids = builtin_model.encode(document)
    prompt = doc_ids + builtin_model.encode("\n# Rewrite fill() in one line:\n")[1:]
    want = reference(builtin_runner, builtin_model, prompt, new=48)
    storage1 = testbed.hosts["storage1"]
    with DecoderClient(decoder, token) as client:
        client.publish(token_ids=doc_ids, compressors=["snapkv:budget=0.125"])
        got: list[int] = []
        reply = GenerateReply()
        cut = threading.Event()
        try:
            for piece in client.stream(token_ids=prompt, max_new_tokens=48, horizon=2, reply=reply):
                got.extend(piece.tokens)
                if len(got) >= 4 and not cut.is_set():
                    storage1.link(False)  # packets dropped, nothing reset
                    cut.set()
        finally:
            storage1.link(True)
        assert cut.is_set() and reply.tokens == want and got == want
        assert reply.stats["recomputed"] is False  # the replica served it

        deadline = time.monotonic() + 90
        while live_shards(config) < 2:  # heartbeats resume: the shard rejoins
            assert time.monotonic() < deadline, "storage1's shard did not rejoin within 90 s"
            time.sleep(2)
        again = client.generate(token_ids=prompt, max_new_tokens=48)
        assert again.tokens == want
