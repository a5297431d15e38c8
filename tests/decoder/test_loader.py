"""Model loading: the built-in GGUF model (converted once) and local Hugging Face folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest
import torch

from decoder.errors import ModelLoadError
from decoder.generate import generate_full
from decoder.loader import BUILTIN_MODEL, load_model
from decoder.runner import ModelRunner, SeqInput


def test_builtin_model_is_smollm2(builtin_model):
    c = builtin_model.config
    assert builtin_model.name == BUILTIN_MODEL
    shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    assert shape == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and builtin_model.weights.lm_head is builtin_model.weights.embed
    assert (builtin_model.path / "model.safetensors").exists()
    assert (builtin_model.path / "tokenizer.json").exists()
    assert builtin_model.decode(builtin_model.encode("hello world")) == "hello world"
    assert builtin_model.eos_token_ids == (2,)


def test_later_loads_reuse_the_converted_folder(builtin_model):
    marker = builtin_model.path / "vericache-model.json"
    before = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = load_model()
    elapsed = time.perf_counter() - start
    assert marker.stat().st_mtime_ns == before, "the GGUF was converted again"
    assert again.fingerprint == builtin_model.fingerprint
    assert torch.equal(again.weights.layers[3].wqkv, builtin_model.weights.layers[3].wqkv)
    print(f"built-in model reload: {elapsed:.2f}s")


@pytest.mark.slow
def test_first_load_converts_the_gguf_into_an_empty_cache(tmp_path, builtin_model):
    fresh = load_model(cache_dir=tmp_path)
    assert fresh.path.is_relative_to(tmp_path)
    assert not list(fresh.path.parent.glob(".convert-*")), "temporary folder left behind"
    assert torch.equal(fresh.weights.embed, builtin_model.weights.embed)
    assert torch.equal(fresh.weights.layers[-1].w_down, builtin_model.weights.layers[-1].w_down)


@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory, builtin_model):
    """A small random Llama saved by transformers: untied, GQA, Llama 3 RoPE scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=builtin_model.config.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(builtin_model.path / name, folder / name)
    return folder, model


def test_hf_folder_logits_match_transformers(tiny_hf_folder):
    folder, hf = tiny_hf_folder
    model = load_model(folder)
    assert not model.config.tie_word_embeddings and model.config.rope.kind == "llama3"
    runner = ModelRunner(model.config, model.weights)
    tokens = model.encode("def add(a, b):\n    return a + b\n" * 6)
    ours = runner.forward([SeqInput.extend(runner.new_cache(), tokens, "all")])[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    result = generate_full(runner, [tokens], max_new_tokens=8)[0]
    assert len(result.tokens) == 8


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no-config", "no config.json"),
        ("no-weights", r"no \*.safetensors"),
        ("bad-type", "unsupported model_type 'gpt2'"),
        ("no-tokenizer", "no tokenizer.json"),
        ("missing-tensor", "weight 'model.norm.weight' not found"),
    ],
)
def test_broken_folders_are_clear_errors(tiny_hf_folder, tmp_path, breakage, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_folder[0], folder)
    if breakage == "no-config":
        (folder / "config.json").unlink()
    elif breakage == "no-weights":
        for f in folder.glob("*.safetensors"):
            f.unlink()
    elif breakage == "bad-type":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    elif breakage == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    elif breakage == "missing-tensor":
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        del state["model.norm.weight"]
        save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder)


def test_not_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "missing")


def test_the_fingerprint_covers_every_weight_byte(tiny_hf_folder, tmp_path):
    """A fine-tune of the same architecture (one weight changed, deep in the file, same
    header) is another model: its chunk keys and provenance statements differ."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_folder[0], folder)
    base = load_model(folder).fingerprint
    assert load_model(folder).fingerprint == base  # the cached digest, same bytes
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's last element
    weights.write_bytes(bytes(data))
    tuned = load_model(folder).fingerprint
    assert tuned != base
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    assert load_model(folder).fingerprint == base


def test_a_weight_file_rewritten_in_place_with_its_old_mtime_is_hashed_again(tmp_path):
    """Same name, size, inode and mtime (restored with utime), other bytes: the cached
    digest must not be reused (the change of ctime tells)."""
    from decoder.loader import _file_digest

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 4096)
    first = _file_digest(path)
    st = path.stat()
    with open(path, "r+b") as f:  # in place: the inode stays
        f.write(b"b")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    while path.stat().st_ctime_ns == st.st_ctime_ns:  # the same coarse clock tick
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    assert _file_digest(path) == hashlib.sha256(b"b" + b"a" * 4095).hexdigest() != first
