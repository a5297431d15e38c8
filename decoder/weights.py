"""Model weights in the layout the runner computes with (fused projections, fp32)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from decoder.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block. Linear weights are [out_features, in_features]."""

    attn_norm: torch.Tensor  # [d]
    wqkv: torch.Tensor  # [(H + 2*KVH) * D, d]: q, k, v projections stacked
    wo: torch.Tensor  # [d, H * D]
    mlp_norm: torch.Tensor  # [d]
    w_gate_up: torch.Tensor  # [2 * I, d]: gate and up projections stacked
    w_down: torch.Tensor  # [d, I]
    bqkv: torch.Tensor | None = None  # [(H + 2*KVH) * D]: q, k, v biases (Qwen2), or none

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the block."""
        own = (self.attn_norm, self.wqkv, self.wo, self.mlp_norm, self.w_gate_up, self.w_down)
        return own if self.bqkv is None else (*own, self.bqkv)

    def without_linears(self) -> LayerWeights:
        """The block's norms alone (empty tensors for its matrices)."""
        empty = torch.empty(0)
        return replace(self, wqkv=empty, wo=empty, w_gate_up=empty, w_down=empty)


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """All weights of a Llama-family model."""

    embed: torch.Tensor  # [V, d]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [V, d]; the same tensor as `embed` when embeddings are tied

    def truncated(self, num_layers: int) -> ModelWeights:
        """The same model with only its first `num_layers` blocks (shares storage)."""
        return replace(self, layers=self.layers[:num_layers])

    def without_linears(self) -> ModelWeights:
        """These weights without the layers' linear matrices (empty tensors in their place):
        what a runner keeps once it has packed them (`ModelRunner.release_source_weights`)."""
        return replace(self, layers=tuple(layer.without_linears() for layer in self.layers))

    @property
    def nbytes(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += layer.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)


def weights_from_hf_state(config: ModelConfig, get: Callable[[str], torch.Tensor]) -> ModelWeights:
    """Build weights from Hugging Face Llama parameter names; `get(name)` returns a tensor.

    Raises KeyError naming the first missing parameter.
    """
    head = head_from_hf_state(config, get)
    layers = tuple(layers_from_hf_state(config, get))
    check_shapes(config, head.embed, layers, head.lm_head)
    return replace(head, layers=layers)


def head_from_hf_state(config: ModelConfig, get: Callable[[str], torch.Tensor]) -> ModelWeights:
    """The weights outside the blocks (embedding, final norm, LM head), with no layers."""
    embed = _f32(get, "model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else _f32(get, "lm_head.weight")
    return ModelWeights(
        embed=embed, layers=(), final_norm=_f32(get, "model.norm.weight"), lm_head=lm_head
    )


def layers_from_hf_state(
    config: ModelConfig, get: Callable[[str], torch.Tensor]
) -> Iterator[LayerWeights]:
    """The blocks one at a time, in order, so that a caller may pack each and let it go
    before the next is read (`check_shapes` the head and the first one)."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = LayerWeights(
            attn_norm=_f32(get, p + "input_layernorm.weight"),
            wqkv=torch.cat([_f32(get, p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            wo=_f32(get, p + "self_attn.o_proj.weight"),
            mlp_norm=_f32(get, p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([_f32(get, p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]),
            w_down=_f32(get, p + "mlp.down_proj.weight"),
            bqkv=(
                torch.cat([_f32(get, p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                if config.qkv_bias
                else None
            ),
        )
        yield layer


def _f32(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    return get(name).to(torch.float32).contiguous()


def check_shapes(config: ModelConfig, embed, layers, lm_head) -> None:
    c = config
    expected = {
        "embed": ((c.vocab_size, c.hidden_size), embed.shape),
        "lm_head": ((c.vocab_size, c.hidden_size), lm_head.shape),
        "wqkv": (
            ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            layers[0].wqkv.shape,
        ),
        "w_gate_up": ((2 * c.intermediate_size, c.hidden_size), layers[0].w_gate_up.shape),
        "w_down": ((c.hidden_size, c.intermediate_size), layers[0].w_down.shape),
    }
    if c.qkv_bias:
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        expected["bqkv"] = ((qkv_rows,), layers[0].bqkv.shape)
    for name, (want, got) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"weight {name} has shape {tuple(got)}, config implies {want}")


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> ModelWeights:
    """Random weights for a config: for tests and self-checks on tiny models."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rnd(c.hidden_size)

    layers = tuple(
        LayerWeights(
            attn_norm=norm(),
            wqkv=rnd((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            wo=rnd(c.hidden_size, c.num_heads * c.head_dim),
            mlp_norm=norm(),
            w_gate_up=rnd(2 * c.intermediate_size, c.hidden_size),
            w_down=rnd(c.hidden_size, c.intermediate_size),
            bqkv=rnd((c.num_heads + 2 * c.num_kv_heads) * c.head_dim) if c.qkv_bias else None,
        )
        for _ in range(c.num_layers)
    )
    embed = rnd(c.vocab_size, c.hidden_size) * 20
    lm_head = embed if c.tie_word_embeddings else rnd(c.vocab_size, c.hidden_size)
    return ModelWeights(embed=embed, layers=layers, final_norm=norm(), lm_head=lm_head)
