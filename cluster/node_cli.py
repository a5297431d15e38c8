"""`vericache node start`: start Ray on a cluster host with the resources of its role.

The `ray up` configs (cluster/) run it as their start command. Roles decide where the
service's actors land (DESIGN.md section 7): a storage host advertises the `storage`
resource (shards go there, spread across those hosts), a decoder host advertises `decoder`
(decoder workers go there, on its GPUs when it has some). On an on-premises cluster every
worker runs the same start command, so the command names the storage and decoder hosts by
address and each host finds its own role; a cloud node type advertises its role through
Ray's own resource override instead (pass no lists).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster import ray_auth
from cluster.paths import internal_token_file, make_private, private_umask, provenance_key_file
from cluster.roles import DECODER_RESOURCE, STORAGE_RESOURCE
from prefix_store.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One host's Ray node."""

    head: bool = False
    address: str | None = None
    """The head's Ray address HOST:PORT (workers)."""
    ip: str | None = None
    """This host's address for Ray; None: the one it uses to reach the head."""
    port: int = 6379
    """The head's Ray (GCS) port."""
    storage: tuple[str, ...] = ()
    """Addresses of the storage hosts."""
    decoder: tuple[str, ...] = ()
    """Addresses of the decoder hosts."""
    storage_slots: int = 8
    """Shards a storage host may carry."""
    num_cpus: int | None = None
    object_store_bytes: int | None = None
    partition_s: float = 60.0
    """How long a host may be cut off before Ray gives it up (the head declares it dead,
    its raylet exits, and what ran there dies). Store clients fail over within seconds on
    their own; a storage host whose link comes back within this time keeps its shard and
    its memory tier, and rejoins. Give every host the same value."""
    autoscaling_config: str | None = None
    """Head: the cluster config `ray up` left there (~/ray_bootstrap_config.yaml), so that
    the head's autoscaler starts the worker hosts."""
    dashboard_host: str = "127.0.0.1"
    """Head: the address Ray's dashboard (port 8265) binds. Loopback by default: whoever
    reaches it can submit a Ray job, i.e. run code on the cluster and read everything."""
    ray_token_file: str | None = None
    """The file holding Ray's token (0600); None: $VERICACHE_RAY_TOKEN_FILE, else
    ~/.vericache/ray_token. The head creates it when absent; a worker requires it."""

    def __post_init__(self) -> None:
        if self.head == (self.address is not None):
            raise ValueError("give either --head or --address HEAD:PORT")
        if self.partition_s <= 0:
            raise ValueError("--partition-s: must be > 0")
        if self.storage_slots < 1:
            raise ValueError("--storage-slots: must be >= 1")
        for flag, listed in (
            ("--storage", self.storage),
            ("--decoder", self.decoder),
            ("--ip", (self.ip,) if self.ip else ()),
            ("--dashboard-host", (self.dashboard_host,)),
        ):
            for address in listed:
                check_ip(flag, address)


def check_ip(flag: str, address: str) -> None:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"{flag}: {address!r} is not an IP address") from None


def add_commands(sub) -> None:
    node = sub.add_parser("node", help="cluster hosts: start Ray with this host's role")
    actions = node.add_subparsers(dest="action", required=True, parser_class=sub._parser_class)
    start = actions.add_parser("start", help="start Ray on this host (a ray up start command)")
    start.add_argument("--head", action="store_true", help="this host is the head")
    start.add_argument("--address", help="the head's Ray address HOST:PORT (worker hosts)")
    start.add_argument("--ip", help="this host's address (default: the one toward the head)")
    start.add_argument("--port", type=int, default=6379, help="head: Ray port (default 6379)")
    start.add_argument("--storage", default="", help="comma-separated storage host addresses")
    start.add_argument("--decoder", default="", help="comma-separated decoder host addresses")
    start.add_argument("--storage-slots", type=int, default=8, help="shards per storage host")
    start.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    start.add_argument("--object-store-bytes", type=int, help="Ray object store size")
    start.add_argument(
        "--partition-s",
        type=float,
        default=60.0,
        help="seconds a host may be cut off before Ray gives it up (default 60; same on all)",
    )
    start.add_argument(
        "--autoscaling-config", help="head: ~/ray_bootstrap_config.yaml (set by ray up)"
    )
    start.add_argument(
        "--dashboard-host",
        default="127.0.0.1",
        help="head: address the Ray dashboard binds (default 127.0.0.1; it runs jobs for "
        "anyone who reaches it: use `ray dashboard CLUSTER.yaml` to forward it over SSH)",
    )
    start.add_argument(
        "--ray-token-file",
        help="file holding Ray's token (default ~/.vericache/ray_token; the head creates it, "
        "ray up copies it to the workers)",
    )
    start.set_defaults(parse=parse_start, run=run_start)


def parse_start(ns) -> NodeConfig:
    try:
        return NodeConfig(
            head=ns.head,
            address=ns.address,
            ip=ns.ip,
            port=ns.port,
            storage=_addresses(ns.storage),
            decoder=_addresses(ns.decoder),
            storage_slots=ns.storage_slots,
            num_cpus=ns.num_cpus,
            object_store_bytes=ns.object_store_bytes,
            partition_s=ns.partition_s,
            autoscaling_config=ns.autoscaling_config,
            dashboard_host=ns.dashboard_host,
            ray_token_file=ns.ray_token_file,
        )
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def node_ip(config: NodeConfig) -> str | None:
    """This host's address: given, or the source address of a route toward the head."""
    if config.ip or config.head:
        return config.ip
    host = config.address.rpartition(":")[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def resources(config: NodeConfig, ip: str | None) -> dict[str, float]:
    """The custom resources of this host's role; fails when lists are given that do not
    name this host (a worker in no role would only run Ray)."""
    found = {}
    if ip in config.storage:
        found[STORAGE_RESOURCE] = config.storage_slots
    if ip in config.decoder:
        found[DECODER_RESOURCE] = 1
    if not found and (config.storage or config.decoder) and not config.head:
        raise InvalidArgument(
            f"this host ({ip}) is in neither --storage nor --decoder; "
            "list it in one of them, or pass neither list"
        )
    return found


def ray_start_command(config: NodeConfig, ip: str | None) -> list[str]:
    command = [str(Path(sys.executable).parent / "ray"), "start", "--disable-usage-stats"]
    if config.head:
        command += ["--head", f"--port={config.port}", f"--dashboard-host={config.dashboard_host}"]
    else:
        command += [f"--address={config.address}"]
    if ip:
        command += [f"--node-ip-address={ip}"]
    if found := resources(config, ip):
        command += [f"--resources={json.dumps(found)}"]
    if config.num_cpus is not None:
        command += [f"--num-cpus={config.num_cpus}"]
    if config.object_store_bytes is not None:
        command += [f"--object-store-memory={config.object_store_bytes}"]
    if config.autoscaling_config:
        command += [f"--autoscaling-config={config.autoscaling_config}"]
    return command


HEALTH_CHECK_PERIOD_MS = 3000


def ray_environment(config: NodeConfig) -> dict[str, str]:
    """Ray's token authentication, always on; how long Ray tolerates a partition: a
    worker's raylet waits `partition_s` for the head; the head's GCS health checks (one
    every 3 s) declare a node dead after as long. On premises, also the autoscaler that
    starts every listed worker host."""
    env = ray_auth.auth_environment(ray_auth.token_file(config.ray_token_file))
    if not config.head:
        env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(math.ceil(config.partition_s))
        return env
    failures = max(1, math.ceil(config.partition_s * 1000 / HEALTH_CHECK_PERIOD_MS))
    env |= {
        "RAY_health_check_period_ms": str(HEALTH_CHECK_PERIOD_MS),
        "RAY_health_check_timeout_ms": str(HEALTH_CHECK_PERIOD_MS),
        "RAY_health_check_failure_threshold": str(failures),
    }
    if provider_type(config.autoscaling_config) == "local":
        # Ray 2.60's autoscaler v2 (the `ray up` default) counts an on-premises head as one
        # of the workers of the provider's single node type, so one listed host never
        # starts; v1 starts them all.
        env["RAY_enable_autoscaler_v2"] = "0"
    return env


def provider_type(autoscaling_config: str | None) -> str | None:
    if not autoscaling_config:
        return None
    path = Path(autoscaling_config).expanduser()
    if not path.exists():
        raise InvalidArgument(f"--autoscaling-config: {path} does not exist")
    return (yaml.safe_load(path.read_text()) or {}).get("provider", {}).get("type")


def provision_secrets(config: NodeConfig) -> None:
    """The head makes the Ray token, the provenance key and the internal credential when
    absent (0600, in 0700 directories); every host then requires the token. `ray up` copies
    them to the workers."""
    token = ray_auth.token_file(config.ray_token_file)
    if not config.head:
        ray_auth.require_token(token)
        for directory in (token.parent, provenance_key_file().parent):
            if directory.is_dir():
                make_private(directory)  # made by `ray up`'s copy with the shell's umask
        return
    from decoder.internal import load_or_create_credential
    from prefix_store.provenance import load_or_create_key

    with private_umask():
        ray_auth.provision_token(token)
        load_or_create_key(provenance_key_file())
        load_or_create_credential(internal_token_file())


RAY_STARTUP_TIMED_OUT = "timed out during startup"
"""What `ray start` prints when its new raylet has not registered with the GCS within Ray's
fixed 30 s (ray._private.node; no setting changes it). On a busy host this is a slow start,
not a fault: seen for `ray up`'s nodes on 2 cores kept busy by other work."""
START_ATTEMPTS = 2


def run_start(config: NodeConfig) -> int:
    """`ray start` for this host's role; a start that missed Ray's registration wait is
    stopped (`ray stop --force`: what it left on this host) and run again, `START_ATTEMPTS`
    times in all. Each attempt's output is printed when it ends."""
    ip = node_ip(config)
    command = ray_start_command(config, ip)
    env = {**os.environ, **ray_environment(config)}
    provision_secrets(config)
    for _ in range(START_ATTEMPTS - 1):
        done = _ray_start(command, env)
        if done.returncode == 0 or RAY_STARTUP_TIMED_OUT not in done.stdout + done.stderr:
            return done.returncode
        print("vericache node: Ray's node missed its startup wait; starting it again", flush=True)
        subprocess.run([command[0], "stop", "--force"], env=env, capture_output=True)
    return _ray_start(command, env).returncode


def _ray_start(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    print("vericache node:", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    print(done.stdout, end="", flush=True)
    print(done.stderr, end="", file=sys.stderr, flush=True)
    return done
