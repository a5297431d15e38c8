"""`vericache node start` (a `ray up` start command) and the `ray up` configs themselves.
The start commands are checked as built; starting Ray on real hosts is what
test_multihost.py does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster import node_cli, ray_auth
from cluster.cli import build_parser, main
from cluster.node_cli import (
    START_ATTEMPTS,
    NodeConfig,
    provision_secrets,
    ray_environment,
    ray_start_command,
)
from tests.cluster.conftest import driver

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
    assert ray_environment(worker)["RAY_gcs_rpc_server_reconnect_timeout_s"] == "90"


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
    # Ray's token (and the provenance key) go from the head to every worker host
    assert {"~/.vericache/ray_token", "~/.vericache/state/provenance.key"} <= set(
        config["cluster_synced_files"]
    )


def test_every_host_runs_ray_with_token_authentication(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path))
    token = str(tmp_path / "ray_token")
    for config in (NodeConfig(head=True), NodeConfig(address="10.0.0.10:6379")):
        env = ray_environment(config)
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == token
    given = NodeConfig(head=True, ray_token_file="/etc/vericache/ray_token")
    assert ray_environment(given)["RAY_AUTH_TOKEN_PATH"] == "/etc/vericache/ray_token"


def test_the_head_makes_the_token_and_key_private_and_keeps_them(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path / "home"))
    provision_secrets(NodeConfig(head=True))
    token, key = tmp_path / "home" / "ray_token", tmp_path / "home" / "state" / "provenance.key"
    first = token.read_text()
    assert len(first) == 64 and key.stat().st_size == 32
    for path, mode in ((token, 0o600), (key, 0o600), (token.parent, 0o700), (key.parent, 0o700)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    token.chmod(0o644)
    provision_secrets(NodeConfig(head=True))  # a restart keeps them, tightened
    assert token.read_text() == first and stat.S_IMODE(token.stat().st_mode) == 0o600


def test_a_worker_without_the_token_does_not_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path))
    assert main(["node", "start", "--address", "127.0.0.1:6379", "--ip", "127.0.0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Ray token file" in err and "missing" in err and err.count("\n") == 0


@pytest.mark.cluster
def test_a_head_started_by_node_start_refuses_a_driver_without_the_token(tmp_path, monkeypatch):
    """The head's real `ray start` with the command and environment `node start` builds: a
    driver with no token (nor any ~/.ray/auth_token) is refused; one with it connects."""
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path / "home"))
    config = NodeConfig(head=True, port=free_port(), num_cpus=1, object_store_bytes=80_000_000)
    provision_secrets(config)
    scratch = Path(tempfile.mkdtemp(prefix="vcray", dir="/tmp"))  # Ray's socket paths are short
    command = ray_start_command(config, None) + [
        "--block", f"--temp-dir={scratch}", "--include-dashboard=false",
    ]  # fmt: skip
    address = f"127.0.0.1:{config.port}"
    env = ray_auth.auth_environment(ray_auth.token_file())
    head = None
    try:
        for _ in range(START_ATTEMPTS):  # as `node start`: a head that gave up starts again
            head = subprocess.Popen(
                command,
                env={**os.environ, **ray_environment(config)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            if wait_connected(address, env, tmp_path, alive=lambda h=head: h.poll() is None):
                break
            assert head.poll() is not None, "the head runs but never took a driver"
            subprocess.run(["pkill", "-9", "-f", str(scratch)], check=False)  # what it left
        else:
            pytest.fail(f"the head exited before taking a driver, {START_ATTEMPTS} times")
        assert driver(address, {}, tmp_path) == "refused: ConnectionError"
    finally:
        if head is not None:
            head.terminate()
        subprocess.run(["pkill", "-9", "-f", str(scratch)], check=False)
        if head is not None:
            head.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)


def wait_connected(
    address: str, env: dict, home: Path, timeout_s: float = 240, alive=lambda: True
) -> bool:
    """Whether a driver connects within `timeout_s`, while `alive()` (the head runs). Each
    try gets at most 60 s, then a fresh driver tries: under the full suite on 2 cores one
    driver, started while the head was starting, hung in `ray.init` past its 120 s; and a
    head whose raylet missed Ray's fixed 30 s registration wait exits (`node start` runs
    `ray start` again then: RAY_STARTUP_TIMED_OUT)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and alive():
        if driver(address, env, home, timeout_s=min(60, left)).startswith("connected"):
            return True
    return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ray_starts_failing(monkeypatch, *outputs: tuple[int, str]) -> list[list[str]]:
    """`ray` commands as `node start` runs them: each `ray start` exits with the next of
    `outputs` (exit status, stderr), then succeeds; returns the commands run."""
    ran: list[list[str]] = []

    def run(command, **_):
        ran.append(command)
        starts = sum(c[1] == "start" for c in ran)
        code, err = (
            outputs[starts - 1] if command[1] == "start" and starts <= len(outputs) else (0, "")
        )
        return subprocess.CompletedProcess(command, code, "", err)

    monkeypatch.setattr(node_cli.subprocess, "run", run)
    return ran


TIMED_OUT = "Exception: The current node timed out during startup. This could happen because"


def test_a_start_that_missed_rays_startup_wait_is_stopped_and_run_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path))
    ran = ray_starts_failing(monkeypatch, (1, TIMED_OUT))
    assert node_cli.run_start(NodeConfig(head=True, ip="127.0.0.1")) == 0
    assert [c[1:3] for c in ran] == [["start", "--disable-usage-stats"], ["stop", "--force"],
                                     ["start", "--disable-usage-stats"]]  # fmt: skip


def test_node_start_fails_after_its_attempts_and_at_once_on_another_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path))
    ran = ray_starts_failing(monkeypatch, (1, TIMED_OUT), (1, TIMED_OUT))
    assert node_cli.run_start(NodeConfig(head=True, ip="127.0.0.1")) == 1
    assert [c[1] for c in ran] == ["start", "stop", "start"]
    ran = ray_starts_failing(monkeypatch, (1, "ConnectionError: GCS at 10.0.0.1:6379 is down"))
    assert node_cli.run_start(NodeConfig(head=True, ip="127.0.0.1")) == 1
    assert [c[1] for c in ran] == ["start"]
