"""Where the deployment's internal credential comes from: the head makes it (0600) beside
the provenance key and keeps it, `ray up` copies it to every host, and `serve` names the
file to decoders and routers (never the secret itself)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from cluster.node_cli import NodeConfig, provision_secrets
from cluster.serve import ServeConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_head_makes_the_internal_credential_private_and_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path / "home"))
    provision_secrets(NodeConfig(head=True))
    path = tmp_path / "home" / "state" / "internal.token"
    first = path.read_text()
    assert first.startswith("vci_") and stat.S_IMODE(path.stat().st_mode) == 0o600
    provision_secrets(NodeConfig(head=True))  # a restart keeps it
    assert path.read_text() == first


@pytest.mark.parametrize("name", ["local.yaml", "aws.yaml"])
def test_ray_up_copies_the_internal_credential_to_every_host(name):
    config = yaml.safe_load((ROOT / "cluster" / name).read_text())
    assert "~/.vericache/state/internal.token" in config["cluster_synced_files"]


def test_serve_names_the_credential_file_to_decoders_and_routers(tmp_path):
    config = ServeConfig(state_dir=tmp_path)
    want = tmp_path / "internal.token"
    assert config.decoder(0, ["127.0.0.1:1"]).internal_token_file == want
    router = config.router(0, ["127.0.0.1:1"], ["127.0.0.1:2"])
    assert router.internal_token_file == want and router.decoders == ("127.0.0.1:2",)
