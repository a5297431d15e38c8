"""Real model families load as they are computed by `transformers`, or are refused by name:
tiny random Qwen2 (q/k/v biases) and Mistral (a sliding window) folders saved by
transformers give the same logits and greedy tokens as transformers; a weight the runner
would not use, or an architectural feature it does not implement, is an error naming it,
never silently ignored (a Qwen2 folder once decoded wrong tokens with no error)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from decoder.errors import ModelLoadError
from decoder.generate import generate_full
from decoder.loader import load_model
from decoder.runner import ModelRunner, SeqInput

NEW_TOKENS = 16
TEXT = "def add(a, b):\n    return a + b\n" * 4


def save(model, folder, builtin_model) -> None:
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(builtin_model.path / name, folder / name)


def tiny(config_class, model_class, folder, builtin_model, **extra):
    config = config_class(
        vocab_size=builtin_model.config.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # logits spread out: no near-ties among greedy choices
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        **extra,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    save(model, folder, builtin_model)
    return model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, builtin_model):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model = tiny(Qwen2Config, Qwen2ForCausalLM, folder, builtin_model)
    with torch.no_grad():  # biases that matter (transformers initialises them to zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    save(model, folder, builtin_model)
    return folder, model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, builtin_model):
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mistral")
    return folder, tiny(MistralConfig, MistralForCausalLM, folder, builtin_model, sliding_window=96)


def agrees_with_transformers(folder, hf) -> None:
    """Same logits over a prompt, and the same greedy continuation token for token."""
    model = load_model(folder)
    runner = ModelRunner(model.config, model.weights)
    tokens = model.encode(TEXT)
    ours = runner.forward([SeqInput.extend(runner.new_cache(), tokens, "all")])[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    greedy = generate_full(runner, [tokens], max_new_tokens=NEW_TOKENS)[0].tokens
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=NEW_TOKENS, do_sample=False,
                      eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert greedy == out[0, len(tokens) :].tolist()


def test_qwen2_with_its_qkv_biases_matches_transformers(qwen2):
    folder, hf = qwen2
    assert load_model(folder).config.qkv_bias
    agrees_with_transformers(folder, hf)


def test_mistral_matches_transformers_within_its_sliding_window(mistral):
    folder, hf = mistral
    config = load_model(folder).config
    assert config.max_position_embeddings == 96  # beyond the window, full attention differs
    agrees_with_transformers(folder, hf)


def test_qwen2_sliding_window_applies_only_when_used():
    from decoder.config import ModelConfig

    base = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 4096,
            "sliding_window": 1024}  # fmt: skip
    assert ModelConfig.from_hf(base).max_position_embeddings == 4096
    used = base | {"use_sliding_window": True}
    assert ModelConfig.from_hf(used).max_position_embeddings == 1024


def edited(folder, tmp_path, state_edit=None, config_edit=None):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    if state_edit is not None:
        state = load_file(str(copy / "model.safetensors"))
        state_edit(state)
        save_file(state, str(copy / "model.safetensors"))
    if config_edit is not None:
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(config | config_edit))
    return copy


def test_a_weight_the_runner_does_not_use_is_an_error_naming_it(qwen2, tmp_path):
    def add_norm(state):  # Qwen3's q_norm, which this runner does not implement
        state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    folder = edited(qwen2[0], tmp_path, state_edit=add_norm)
    named = r"does not use weight\(s\) model\.layers\.0\.self_attn\.q_norm"
    with pytest.raises(ModelLoadError, match=named):
        load_model(folder)


def test_a_qwen2_folder_read_as_llama_leaves_its_biases_unused(qwen2, tmp_path):
    folder = edited(qwen2[0], tmp_path, config_edit={"model_type": "llama"})
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias"):
        load_model(folder)


def test_rotary_buffers_of_older_checkpoints_are_not_weights(qwen2, tmp_path):
    def add_inv_freq(state):
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    assert load_model(edited(qwen2[0], tmp_path, state_edit=add_inv_freq)).config.qkv_bias


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_llama_biases_are_refused_by_name(qwen2, tmp_path, flag):
    folder = edited(qwen2[0], tmp_path, config_edit={"model_type": "llama", flag: True})
    with pytest.raises(ModelLoadError, match=f"{flag}: models with these biases"):
        load_model(folder)
