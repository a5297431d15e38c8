"""The generated stubs are what `make proto` produces from the .proto files today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_proto_files(tmp_path):
    protos = sorted((ROOT / "proto").glob("vericache/v1/*.proto"))
    assert protos, "no .proto files found"
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *map(str, protos),
    ]
    subprocess.run(command, check=True, capture_output=True)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*")}
    committed_root = ROOT / "proto" / "gen"
    for relative, text in fresh.items():
        committed = committed_root / relative
        assert committed.exists(), f"{relative} missing: run `make proto`"
        assert committed.read_text() == text, (
            f"{relative} drifted from the .proto: run `make proto`"
        )


def test_stubs_import_as_vericache_v1_not_a_top_level_proto_package():
    from vericache.v1 import prefix_store_pb2, prefix_store_pb2_grpc

    assert prefix_store_pb2.DESCRIPTOR.package == "vericache.v1"
    assert hasattr(prefix_store_pb2_grpc, "PrefixStoreStub")
