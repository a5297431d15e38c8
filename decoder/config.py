"""Typed configuration of the decoder: the model's architecture and the runner's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Mode = Literal["exact", "fast"]
Placement = Literal["auto", "near", "pull"]
"""Where a verification pass attends a stored prefix that is not resident (see
`decoder.engine.config.EngineConfig.placement`)."""
PLACEMENTS: tuple[Placement, ...] = ("auto", "near", "pull")
DraftWeights = Literal["fp32", "int8", "fp16", "bf16"]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters (default and Llama 3 frequency scaling)."""

    theta: float = 10000.0
    """Base of the rotary frequencies (`rope_theta`)."""
    kind: Literal["default", "llama3"] = "default"
    """`llama3` applies Llama 3.1's low/high frequency rescaling."""
    factor: float = 1.0
    """llama3 only: context extension factor."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max / high_freq_factor are untouched."""
    original_max_positions: int = 8192
    """llama3 only: the context length the model was pretrained with."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder-only model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    """The longest context the runner computes this model correctly for: the model's own
    limit, or its sliding attention window when that is shorter (`from_hf`)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    """The q, k and v projections carry biases (Qwen2)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict of a Llama-family model (Llama,
        Mistral, Qwen2). Every architectural feature the runner does not implement is
        refused by name (ValueError), never ignored: biases other than Qwen2's q/k/v ones,
        activations other than SiLU, rope types other than default and llama3."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"unsupported model_type {model_type!r}: expected a Llama-family model"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{flag}: models with these biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: expected 'silu'")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope=_rope_from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=context_limit(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qkv_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always have biases
        )


def context_limit(hf: dict[str, Any]) -> int:
    """The model's context limit, capped at its sliding attention window (Mistral's
    `sliding_window`; Qwen2's when `use_sliding_window`): the runner attends every key, which
    equals sliding-window attention only while the context fits in the window."""
    limit = hf.get("max_position_embeddings", 8192)
    window = hf.get("sliding_window")
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window"):
        window = None
    return min(limit, window) if window else limit


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_positions=params["original_max_position_embeddings"],
        )
    raise ValueError(f"unsupported rope type {kind!r}: expected 'default' or 'llama3'")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Knobs of the model runner."""

    row_tile: int = 1
    """Exact mode pads the rows of linear layers to a multiple of this; 1 where the packed
    (oneDNN) kernel is row-invariant down to one row, 16 for plain MKL (self-checked)."""
    attention_row_tile: int = 4
    """Exact mode pads attention query rows to a multiple of this (MKL's batched products
    were row-invariant from 4 rows on the development machines; self-checked)."""
    key_chunk: int = 256
    """Exact mode splits attention keys into chunks of this many absolute positions."""
    query_block: int = 256
    """Exact mode computes attention for at most this many query tokens at once (memory)."""
    threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    self_check: bool = True
    """Run the exact-mode self-check before the first exact forward."""
    draft_weights: DraftWeights = "fp16"
    """Precision of the linear weights in fast (draft) mode: "fp16" (weights rounded to
    fp16, fp32 arithmetic), "int8" (per-channel weights, activations quantized per call),
    "bf16", or "fp32" (the exact weights, no copy). The copy is built at the first fast
    forward (`ModelRunner.draft_weight_bytes` says its size); exact mode always uses the
    fp32 weights. On the development machines fp16 drafted the same tokens as fp32 at 2-3x
    its speed for 1-4 rows; int8 was a little faster but drafted about 8% other tokens
    (DESIGN.md section 10). fp16 and int8 need torch's fbgemm engine; without it, fast mode
    falls back to fp32 with a warning."""

    def __post_init__(self) -> None:
        for name in ("row_tile", "attention_row_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunnerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.key_chunk < 32 or self.key_chunk & (self.key_chunk - 1):
            raise ValueError(
                f"RunnerConfig.key_chunk must be a power of two >= 32, got {self.key_chunk}"
            )
        if self.query_block < 1:
            raise ValueError(f"RunnerConfig.query_block must be positive, got {self.query_block}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"RunnerConfig.threads must be positive, got {self.threads}")
        if self.draft_weights not in get_args(DraftWeights):
            raise ValueError(
                f"RunnerConfig.draft_weights must be one of {get_args(DraftWeights)}, "
                f"got {self.draft_weights!r}"
            )


def ceil_to(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n (and >= multiple)."""
    return max(multiple, math.ceil(n / multiple) * multiple)
