"""`vericache node start` (a `ray up` start command) and the `ray up` configs themselves.
The start commands are checked as built; starting Ray on real hosts is what
test_multihost.py does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.cli import build_parser, main
from cluster.node_cli import NodeConfig, ray_environment, ray_start_command

ROOT = Path(__file__).resolve().parents[2]
LISTS = {"storage": ("10.0.0.11", "10.0.0.12"), "decoder": ("10.0.0.13",)}


def resources_of(command: list[str]) -> dict:
    found = [arg for arg in command if arg.startswith("--resources=")]
    return json.loads(found[0].split("=", 1)[1]) if found else {}


def test_each_worker_host_finds_its_role_by_address():
    config = NodeConfig(address="10.0.0.10:6379", **LISTS, storage_slots=4)
    storage = ray_start_command(config, "10.0.0.12")
    assert "--address=10.0.0.10:6379" in storage and "--node-ip-address=10.0.0.12" in storage
    assert resources_of(storage) == {"storage": 4}
    assert resources_of(ray_start_command(config, "10.0.0.13")) == {"decoder": 1}
    both = NodeConfig(address="10.0.0.10:6379", storage=("10.0.0.11",), decoder=("10.0.0.11",))
    assert resources_of(ray_start_command(both, "10.0.0.11")) == {"storage": 8, "decoder": 1}


def test_cloud_node_types_bring_their_own_resources():
    # no lists: Ray's per-node-type resource override applies, nothing is added here
    assert resources_of(ray_start_command(NodeConfig(address="10.0.0.10:6379"), "10.0.0.9")) == {}


def test_head_starts_the_autoscaler_and_tolerates_partitions(tmp_path):
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({"provider": {"type": "local"}}))
    head = NodeConfig(head=True, ip="10.0.0.10", autoscaling_config=str(local), partition_s=60)
    command = ray_start_command(head, "10.0.0.10")
    assert "--head" in command and f"--autoscaling-config={local}" in command
    env = ray_environment(head)
    assert env["RAY_health_check_failure_threshold"] == "20"  # 20 x 3 s = 60 s
    assert env["RAY_enable_autoscaler_v2"] == "0"  # on premises: v2 skips a listed host
    cloud = tmp_path / "aws.yaml"
    cloud.write_text(yaml.safe_dump({"provider": {"type": "aws"}}))
    assert "RAY_enable_autoscaler_v2" not in ray_environment(
        NodeConfig(head=True, autoscaling_config=str(cloud))
    )
    worker = NodeConfig(address="10.0.0.10:6379", partition_s=90)
    assert ray_environment(worker) == {"RAY_gcs_rpc_server_reconnect_timeout_s": "90"}


def head_command(*flags: str) -> list[str]:
    """The head's `ray start` command as `vericache node start --head FLAGS` builds it."""
    ns = build_parser().parse_args(["node", "start", "--head", *flags])
    return ray_start_command(ns.parse(ns), None)


def test_the_dashboard_binds_loopback_unless_the_operator_asks_otherwise():
    # whoever reaches the dashboard can submit a Ray job: run code on every host
    dashboard = [arg for arg in head_command() if arg.startswith("--dashboard-host")]
    assert dashboard == ["--dashboard-host=127.0.0.1"]
    assert "--dashboard-host=10.0.0.10" in head_command("--dashboard-host", "10.0.0.10")
    worker = ray_start_command(NodeConfig(address="10.0.0.10:6379"), "10.0.0.11")
    assert not any(arg.startswith("--dashboard-host") for arg in worker)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head", "--address", "10.0.0.10:6379"], "either --head or --address"),
        ([], "either --head or --address"),
        (["--head", "--storage", "storage-1"], "'storage-1' is not an IP address"),
        (["--address", "127.0.0.1:6379", "--storage", "10.9.9.9"], "neither --storage nor"),
        (["--head", "--autoscaling-config", "/nonexistent.yaml"], "does not exist"),
        (["--head", "--partition-s", "0"], "--partition-s"),
        (["--head", "--dashboard-host", "any"], "--dashboard-host: 'any' is not an IP address"),
    ],
)
def test_bad_node_flags_exit_2_with_one_line(argv, message, capsys):
    assert main(["node", "start", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0


def test_detach_needs_a_cluster_address(capsys):
    assert main(["serve", "--detach"]) == 2
    assert "detach: needs a Ray cluster address" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["local.yaml", "aws.yaml"])
def test_ray_up_configs_are_valid_ray_cluster_configs(name):
    config = yaml.safe_load((ROOT / "cluster" / name).read_text())
    validate_config(prepare_config(config))  # Ray's own schema, as `ray up` checks it
    commands = " ".join(config["setup_commands"])
    assert "make install" in commands  # installs the project as the README does
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert sum("vericache node start" in c for c in starts) == 2
    assert not any("dashboard-host" in c for c in starts)  # the dashboard stays on loopback
