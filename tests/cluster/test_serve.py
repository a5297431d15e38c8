"""The store deployed as Ray actors (a real local Ray): shards crash mid-fetch and the
client continues from a replica; a restarted shard finds its disk tier; the operator
commands (tenant, namespace, status) against the deployment's Redis; what the deployment
leaves reachable (Ray only with its token) and readable (its files: the owner alone)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import ray
import torch

from cluster import ray_auth
from cluster.cli import main
from prefix_store.client import StoreClient, sync
from prefix_store.client.sync import receive
from prefix_store.config import ClientConfig, MiB
from prefix_store.layout import KVLayout
from tests.cluster.conftest import deployed, driver
from tests.waiting import eventually

pytestmark = pytest.mark.cluster

LAYOUT = KVLayout("test-model@1", "float32", num_layers=8, num_kv_heads=4, head_dim=64)
TOKENS = list(range(7, 7 + 4096 + 100))


@pytest.fixture(scope="module")
def deployment(redis_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("vericache-home")
    with deployed(
        redis_server.url,
        home,
        shards=2,
        memory_bytes=256 * MiB,
        disk_bytes=512 * MiB,
        decoders=0,
    ) as deployment:
        yield deployment


def tenant(name: str, redis_url: str, capsys) -> str:
    capsys.readouterr()
    assert main(["tenant", "add", name, "--redis-url", redis_url]) == 0
    return capsys.readouterr().out.strip()


def client(deployment, token):
    config = ClientConfig(message_bytes=256 * 1024, window_bytes=MiB, streams=1)
    return StoreClient(list(deployment.endpoints.values()), token, config)


def test_shards_are_ray_actors_serving_and_registered(deployment):
    stats = deployment.stats()
    assert sorted(s["shard_id"] for s in stats) == ["shard-0", "shard-1"]
    assert all(s["memory_capacity"] == 256 * MiB for s in stats)


def test_a_shard_killed_mid_fetch_fails_over_to_its_replica(deployment, capsys):
    token = tenant("crash-test", deployment.redis_url, capsys)
    kv = torch.randn(8, 2, 4, len(TOKENS), 64)
    with client(deployment, token) as c:
        prefix = c.publish_prefix(TOKENS, kv, LAYOUT).prefix
        k = torch.empty(8, 4, prefix.tokens, 64)
        v = torch.empty_like(k)
        layers = c.iter_layers(prefix, k, v)
        assert next(layers) == 0
        threading.Thread(target=deployment.kill_shard, args=(1,)).start()  # SIGKILL-like
        assert list(layers) == list(range(1, 8))
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    deployment.start_shard(1)  # rejoins (its memory tier died with it)


def test_a_frozen_shard_mid_fetch_is_left_for_its_replica(deployment, capsys, monkeypatch):
    """A shard that stops answering without closing anything (a dead link or host looks
    the same: SIGSTOP here) is given up after `idle_timeout_s` without progress; later
    transfers prefer its replica while it is quarantined, and use it again afterwards.

    The freeze is injected at one exact point of the fetch: shard-1 has granted its
    data-plane ticket and the client is about to read the bytes (a freeze after a
    given layer would race the transfer, which can finish first on loopback)."""
    token = tenant("freeze-test", deployment.redis_url, capsys)
    kv = torch.randn(8, 2, 4, len(TOKENS), 64)
    config = ClientConfig(streams=2, idle_timeout_s=2.0, quarantine_s=10.0)
    pid = ray.get(deployment.actors[1].__ray_call__.remote(lambda self: os.getpid()))
    contacted, frozen = [], threading.Event()

    def freezing_receive(address, *args, **kwargs):
        contacted.append(address)
        if address == frozen_address and not frozen.is_set():
            frozen.set()
            os.kill(pid, signal.SIGSTOP)
        return receive(address, *args, **kwargs)

    monkeypatch.setattr(sync, "receive", freezing_receive)
    with StoreClient(list(deployment.endpoints.values()), token, config) as c:
        frozen_address = c.topology.data_addresses["shard-1"]
        prefix = c.publish_prefix(TOKENS, kv, LAYOUT).prefix
        k = torch.empty(8, 4, prefix.tokens, 64)
        v = torch.empty_like(k)
        try:
            assert list(c.iter_layers(prefix, k, v)) == list(range(8))
            assert frozen.is_set()
            assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
            assert c.suspects() == {"shard-1"}
            k.zero_(), v.zero_()
            contacted.clear()
            c.fetch_layers(prefix, k, v)  # quarantined: shard-0 alone serves it
            assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
            assert contacted and frozen_address not in contacted
        finally:
            os.kill(pid, signal.SIGCONT)
        assert eventually(lambda: not c.suspects(), timeout_s=60, every_s=0.2)
        k.zero_(), v.zero_()
        contacted.clear()
        c.fetch_layers(prefix, k, v)  # both shards again
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
        assert frozen_address in contacted
        assert deployment.stats()[1]["shard_id"] == "shard-1"  # answering again


def test_a_restarted_shard_serves_its_disk_tier(deployment, capsys):
    token = tenant("restart-test", deployment.redis_url, capsys)
    kv = torch.randn(8, 2, 4, len(TOKENS), 64)
    with client(deployment, token) as c:
        c.publish_prefix(TOKENS, kv, LAYOUT)
    deployment.stop_shard(1)  # graceful: the memory tier is written to disk
    deployment.stop_shard(0)
    deployment.start_shard(0)  # only shard-0, fresh process: everything from its disk
    with client(deployment, token) as c:
        assert set(c.topology.shards) == {"shard-0"}
        prefix = c.lookup(TOKENS + [1, 2], LAYOUT)
        assert prefix.tokens == len(TOKENS)
        k = torch.empty(8, 4, prefix.tokens, 64)
        v = torch.empty_like(k)
        c.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    deployment.start_shard(1)


def test_operator_commands(deployment, capsys, monkeypatch):
    url = deployment.redis_url
    tenant("ops-a", url, capsys)
    tenant("ops-b", url, capsys)
    assert main(["tenant", "add", "ops-a", "--redis-url", url]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["tenant", "add", "Bad Name", "--redis-url", url]) == 2
    assert main(["namespace", "add", "docs", "--member", "ops-a", "--redis-url", url]) == 0
    assert main(["namespace", "add", "docs", "--member", "ghost", "--redis-url", url]) == 2
    capsys.readouterr()
    assert main(["status", "--redis-url", url]) == 0
    out = capsys.readouterr().out
    assert "shard-0" in out and "shard-1" in out and "ops-a" in out and "docs" in out
    assert "faults" in out.splitlines()[1]
    assert main(["status", "--redis-url", url, "--json"]) == 0
    shards = json.loads(capsys.readouterr().out)["shards"]
    assert all(s["corrupt"] == s["lost_spills"] == s["disk_write_errors"] == 0 for s in shards)
    with client(deployment, tenant("ops-c", url, capsys)) as store:  # Describe: one call
        assert store.topology.tenant == "ops-c"
    assert main(["status"]) == 0  # finds the deployment through its state file
    out = capsys.readouterr().out
    assert "live (from the metrics endpoints)" in out and "unreachable" not in out
    assert main(["status", "--json"]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert sorted(live) == ["shard-0", "shard-1"]
    assert all("memory_bytes" in f and f["url"].startswith("http://") for f in live.values())
    assert sum(f.get("requests", 0) for f in live.values()) > 0
    assert deployment.metrics_token not in json.dumps(live)

    def interrupt(seconds):
        assert seconds == 0.5
        raise KeyboardInterrupt

    monkeypatch.setattr("cluster.store_cli.time.sleep", interrupt)
    assert main(["status", "--watch", "0.5"]) == 0  # one refresh, then Ctrl-C
    out = capsys.readouterr().out
    assert "live (from the metrics endpoints)" in out and "every 0.5 s" in out
    assert main(["status", "--watch", "0"]) == 2


def test_embedded_ray_requires_the_token_from_a_private_file(deployment, tmp_path):
    """Whoever reaches the embedded Ray's ports cannot run code without the token, which
    lives in a 0600 file of the deployment's home (never ~/.ray/auth_token at 0644)."""
    token = ray_auth.token_file()
    assert token.parent == Path(os.environ["VERICACHE_HOME"])
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    address = ray.get_runtime_context().gcs_address
    assert driver(address, {}, tmp_path) == "refused: ConnectionError"
    wrong = tmp_path / "wrong"
    wrong.write_text("0" * 64)
    assert driver(address, ray_auth.auth_environment(wrong), tmp_path).startswith("refused")
    assert driver(address, ray_auth.auth_environment(token), tmp_path).startswith("connected")


def test_state_keys_and_shard_directories_are_the_owners_alone(deployment):
    """The state file (the Redis password), the provenance key, the Ray token and every
    directory under the deployment's home (shards' disk tiers included): 0600 files, 0700
    directories. (Blob files: tests/prefix_store/tiers/test_disk.py.)"""
    home = Path(os.environ["VERICACHE_HOME"])
    found = {p.relative_to(home).as_posix() for p in home.rglob("*")}
    assert {"cluster.json", "ray_token", "state/provenance.key", "state/shards/shard-0"} <= found
    for path in [home, *home.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path.relative_to(home.parent)} is {oct(mode)}"


def test_no_process_carries_a_secret_in_its_arguments(deployment):
    """What `ps` shows every local user: no process of the deployment (Ray's, the actors',
    Redis) has the Redis password, the metrics token or the Ray token in its arguments."""
    password = deployment.redis_url.split("@")[0].rsplit(":", 1)[1]
    secrets = {
        "redis password": password,
        "metrics token": deployment.metrics_token,
        "ray token": ray_auth.token_file().read_text().strip(),
    }
    assert all(len(value) >= 16 for value in secrets.values())
    seen = 0
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, PermissionError, NotADirectoryError, ProcessLookupError):
            continue
        seen += "ray" in cmdline
        for name, value in secrets.items():
            assert value not in cmdline, f"the {name} is in the arguments of process {proc.name}"
    assert seen >= 3  # the deployment's Ray processes were looked at


def test_the_deployments_own_ports_listen_on_loopback_only(deployment, capsys):
    """Embedded, every port the service opens (shards' gRPC and data plane, metrics, and
    Redis) binds 127.0.0.1; Ray's own ports need its token (above)."""
    token = tenant("ports", deployment.redis_url, capsys)
    with client(deployment, token) as c:
        data = list(c.topology.data_addresses.values())
    ours = [*deployment.endpoints.values(), *data, *deployment.metrics.values()]
    ports = {int(address.rstrip("/").rsplit(":", 1)[1].split("/")[0]) for address in ours}
    ports.add(int(deployment.redis_url.rsplit(":", 1)[1].split("/")[0]))
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    bound = {}
    for line in listening.splitlines():
        local = line.split()[3]
        host, port = local.rsplit(":", 1)
        address = ipaddress.ip_address(host.strip("[]").replace("*", "::"))
        bound.setdefault(int(port), set()).add(
            str(getattr(address, "ipv4_mapped", None) or address)
        )
    assert len(ports) >= 2 * 2 + 1 and ports <= bound.keys()
    assert {port: bound[port] for port in ports} == {port: {"127.0.0.1"} for port in ports}
