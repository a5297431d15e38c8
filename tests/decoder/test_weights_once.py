"""Weights held once: after `release_source_weights` a runner keeps each layer's linear
weights only packed (plus the draft copy it was asked for), counted by storage; its
outputs do not change; the CLI's in-process generate reports what it holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from decoder.config import RunnerConfig
from decoder.generate import generate_full
from decoder.runner import ModelRunner


def linear_storages(runner) -> list[int]:
    """Data pointers of every plain (non-opaque) linear-weight tensor the runner holds."""
    out = []
    for layer in runner.weights.layers:
        out += [t.data_ptr() for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
                if t.numel()]  # fmt: skip
    return out


def test_released_runner_holds_each_layer_once_and_decodes_the_same(builtin_model):
    prompt = builtin_model.encode("def fibonacci(n):")
    eos = builtin_model.eos_token_ids
    runner = ModelRunner(builtin_model.config, builtin_model.weights, RunnerConfig())
    before = generate_full(runner, [prompt], max_new_tokens=12, eos_token_ids=eos)[0].tokens
    held = runner.weight_bytes
    assert len(linear_storages(runner)) == 4 * builtin_model.config.num_layers
    freed = runner.release_source_weights(draft=True)
    assert linear_storages(runner) == []  # the unpacked matrices are gone from the runner
    assert freed > 0.5 * builtin_model.weights.nbytes
    assert runner.weight_bytes == held - freed + runner.draft_weight_bytes
    assert runner.draft_weight_bytes > 0  # fast mode's copy, built before the release
    assert generate_full(runner, [prompt], max_new_tokens=12, eos_token_ids=eos)[0].tokens == before
    assert builtin_model.weights.layers[0].wqkv.numel() > 0  # the caller's weights untouched


def test_a_runner_loaded_block_by_block_holds_each_once_and_decodes_the_same(builtin_model):
    from decoder.loader import load_runner

    prompt = builtin_model.encode("def fibonacci(n):")
    eos = builtin_model.eos_token_ids
    model, runner = load_runner(draft=True)
    assert model.weights is None and model.fingerprint == builtin_model.fingerprint
    assert linear_storages(runner) == [] and runner.draft_weight_bytes > 0
    assert len(runner.layers) == builtin_model.config.num_layers
    reference = ModelRunner(builtin_model.config, builtin_model.weights, RunnerConfig())
    want = generate_full(reference, [prompt], max_new_tokens=12, eos_token_ids=eos)[0].tokens
    assert generate_full(runner, [prompt], max_new_tokens=12, eos_token_ids=eos)[0].tokens == want
    fast = generate_full(runner, [prompt], max_new_tokens=4, eos_token_ids=eos, mode="fast")
    assert len(fast[0].tokens) == 4


def test_fast_mode_after_a_release_without_draft_is_a_clear_error(builtin_model):
    runner = ModelRunner(builtin_model.config, builtin_model.weights, RunnerConfig())
    runner.release_source_weights(draft=False)
    prompt = builtin_model.encode("x = 1")
    with pytest.raises(RuntimeError, match="release_source_weights"):
        generate_full(runner, [prompt], max_new_tokens=2, eos_token_ids=(), mode="fast")
    assert torch.get_num_threads() >= 1


def test_generate_json_reports_weights_kv_and_peak_memory():
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--prompt", "def f(n):",
         "--max-new-tokens", "4", "--json"],  # fmt: skip
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    stats = json.loads(done.stdout)["stats"]
    assert 400e6 < stats["weight_bytes"] < 800e6  # packed linears, embedding, tied head
    assert stats["kv_bytes"] > 0 and stats["peak_rss_bytes"] > stats["weight_bytes"]
