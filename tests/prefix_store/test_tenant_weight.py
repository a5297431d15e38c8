"""A tenant's fair-share weight and admin role: set by `vericache tenant add --weight W
[--admin]`, validated (finite, > 0; else exit status 2), stored in Redis, and told to the
tenant's servers (Describe carries them to decoders and routers). Real Redis."""

from __future__ import annotations

import pytest

from cluster.cli import main
from prefix_store.errors import InvalidArgument


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as done:  # argparse refuses a bad value itself
        return done.code


def test_the_cli_stores_a_weight_and_the_admin_role(redis_server, metadata, capsys):
    url = redis_server.url
    assert exit_status(["tenant", "add", "heavy", "--weight", "2.5", "--redis-url", url]) == 0
    assert exit_status(["tenant", "add", "ops", "--admin", "--redis-url", url]) == 0
    assert exit_status(["tenant", "add", "plain", "--redis-url", url]) == 0
    heavy, ops, plain = (metadata.tenant(n) for n in ("heavy", "ops", "plain"))
    assert (heavy.weight, heavy.admin) == (2.5, False)
    assert (ops.weight, ops.admin) == (1.0, True)
    assert (plain.weight, plain.admin) == (1.0, False)
    for bad in ("0", "-1", "inf", "nan", "heavy"):
        assert (
            exit_status(["tenant", "add", f"w{len(bad)}", "--weight", bad, "--redis-url", url]) == 2
        )
        assert "not a weight" in capsys.readouterr().err
    assert metadata.tenant("w1") is None


def test_the_metadata_plane_refuses_a_bad_weight(metadata):
    with pytest.raises(InvalidArgument, match="finite number > 0"):
        metadata.add_tenant("zero", weight=0.0)


def test_describe_tells_the_caller_its_weight_and_role(store, metadata):
    store.start("shard-0")
    with store.client(metadata.add_tenant("heavy", weight=2.0)) as client:
        assert (client.topology.weight, client.topology.admin) == (2.0, False)
    with store.client(metadata.add_tenant("ops", admin=True)) as client:
        assert (client.topology.weight, client.topology.admin) == (1.0, True)
