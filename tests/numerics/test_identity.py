"""The kernels' identities depend on the source's bytes only, never on where it lives.

Exact KV is stored under `exact_kernel_id` and near-data offload matches on
`kernel_fingerprint`, so moving the kernel's files must leave both unchanged.
"""

from __future__ import annotations

import shutil

import pytest

from numerics.cpu import fused, partials
from numerics.cpu.forward import exact_kernel_id

SOURCE_DIGEST = "48e6e414cbbeec67c137f4dea0daacece4ff80d21245e8c2956c0670bfea8885"
"""The digest of exact_attention.cpp and its flags. A change here changes the key of every
exact KV stored with the fused kernel: only an intended change of the kernel's source (its
comments included) or flags may change it."""


def test_the_source_digest_is_pinned():
    assert fused.source_digest() == SOURCE_DIGEST


@pytest.mark.fused_kernel
def test_the_exact_kernel_id_names_the_pinned_digest():
    assert exact_kernel_id(64) == f"fused-avx2-{SOURCE_DIGEST[:12]}"


def test_identity_is_the_same_wherever_the_source_lives(tmp_path, monkeypatch):
    before = (fused.source_digest(), fused.module_name(), exact_kernel_id(64))
    moved = tmp_path / "elsewhere" / "renamed.cpp"
    moved.parent.mkdir()
    shutil.copyfile(fused.SOURCE, moved)
    monkeypatch.setattr(fused, "SOURCE", moved)
    assert (fused.source_digest(), fused.module_name(), exact_kernel_id(64)) == before


@pytest.mark.fused_kernel
def test_the_fingerprint_is_the_same_wherever_the_source_lives(tmp_path, monkeypatch):
    before = partials.kernel_fingerprint()
    moved = tmp_path / "renamed.cpp"
    shutil.copyfile(fused.SOURCE, moved)
    monkeypatch.setattr(fused, "SOURCE", moved)
    partials.kernel_fingerprint.cache_clear()
    try:
        assert partials.kernel_fingerprint() == before
    finally:
        partials.kernel_fingerprint.cache_clear()
