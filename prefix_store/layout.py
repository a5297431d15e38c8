"""The KV layout: what the bytes of a chunk mean, and their sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefix_store.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
"""The element types a layout may declare, with their sizes in bytes. Only `torch_dtype`
needs torch: a router, gateway or SDK user that never handles tensors does not import it
(about 2.5 CPU-seconds and 190 MB per process)."""
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_CHUNK_TOKENS = 65536
"""Absolute limits of any layout; a shard accepts a narrower range (`LayoutBounds`)."""


@dataclass(frozen=True, slots=True)
class LayoutBounds:
    """The layouts a shard stores and looks up: per-dimension limits (within the absolute
    MAX_* ones), so that no request can declare a token or a chunk of absurd size. Room
    for real models (hundreds of layers, MHA with 128 heads, MLA's 576-wide latent) and
    for the synthetic layouts of the LMCache gateway and the benchmarks (1 x 1 x 1)."""

    max_layers: int = 512
    max_kv_heads: int = 256
    max_head_dim: int = 1024
    min_chunk_tokens: int = 16
    """Smaller chunks make a key (a hash, a lookup probe) per few tokens: 1 would be one
    per token."""
    max_chunk_tokens: int = 4096
    max_itemsize: int = 4
    """Bytes per element (float32 is 4)."""
    max_token_bytes: int = 64 << 20
    """K and V of one token over all layers (num_layers * 2 * kv_heads * head_dim *
    itemsize): 9 MiB for a 96-layer, 96-head float32 model."""

    def check(self, layout: KVLayout, where: str = "layout") -> None:
        """InvalidArgument naming the first dimension of `layout` out of these bounds."""
        for name, value, low, high in (
            ("num_layers", layout.num_layers, 1, self.max_layers),
            ("num_kv_heads", layout.num_kv_heads, 1, self.max_kv_heads),
            ("head_dim", layout.head_dim, 1, self.max_head_dim),
            ("chunk_tokens", layout.chunk_tokens, self.min_chunk_tokens, self.max_chunk_tokens),
            ("dtype size", layout.itemsize, 1, self.max_itemsize),
            ("bytes per token", layout.chunk_bytes(1), 1, self.max_token_bytes),
        ):
            if not low <= value <= high:
                raise InvalidArgument(
                    f"{where}.{name}: {value} is not within this shard's limits [{low}, {high}]"
                )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Model identity and KV geometry. A chunk is layer-major: per layer K then V,
    each [num_kv_heads, tokens, head_dim] in `dtype`."""

    model_id: str
    """Model identity, e.g. "SmolLM2-135M-Instruct@<weights digest>"."""
    dtype: str
    """One of DTYPES."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = 256
    """Tokens per full chunk; a prefix's last chunk may be shorter."""

    def __post_init__(self) -> None:
        if not self.model_id or len(self.model_id) > 256:
            raise InvalidArgument("layout.model_id: must be 1-256 characters")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"layout.dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name, top in (
            ("num_layers", MAX_LAYERS),
            ("num_kv_heads", MAX_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("chunk_tokens", MAX_CHUNK_TOKENS),
        ):
            value = getattr(self, name)
            if not 1 <= value <= top:
                raise InvalidArgument(f"layout.{name}: {value} is not in [1, {top}]")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    def half_bytes(self, tokens: int) -> int:
        """Bytes of K (or V) of one layer for `tokens` tokens."""
        return self.num_kv_heads * tokens * self.head_dim * self.itemsize

    def segment_bytes(self, tokens: int) -> int:
        """Bytes of one layer of one chunk (K then V)."""
        return 2 * self.half_bytes(tokens)

    def chunk_bytes(self, tokens: int) -> int:
        return self.num_layers * self.segment_bytes(tokens)

    def identity(self) -> tuple:
        """What seeds the chunk keys (everything that changes the meaning of the bytes)."""
        return (
            self.model_id,
            self.dtype,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.chunk_tokens,
        )

    def to_proto(self, pb) -> object:
        return pb.KVLayout(
            model_id=self.model_id,
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            chunk_tokens=self.chunk_tokens,
        )

    @classmethod
    def from_proto(cls, message) -> KVLayout:
        return cls(
            model_id=message.model_id,
            dtype=message.dtype,
            num_layers=message.num_layers,
            num_kv_heads=message.num_kv_heads,
            head_dim=message.head_dim,
            chunk_tokens=message.chunk_tokens,
        )
