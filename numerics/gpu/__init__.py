"""Exact-mode kernels for CUDA decoders, written in Triton (DESIGN.md section 5).

The exact-mode contract is the CPU's (`numerics.cpu.forward`): a token's result is a
function of its own inputs and of the keys at positions up to its own, whatever else the
call computes. On a GPU the vendor kernels break it (cuBLAS picks split-K and tile shapes
by the number of rows; flash attention's results change with the query block), so exact
mode runs kernels of the project's own, each with one fixed configuration:

- `kernels.linear`: y = x @ W^T over fixed [block_m, block_n] output tiles, the reduction
  over K in fixed `block_k` steps in order, no split-K: a row's result never depends on
  how many rows the call has or what they hold;
- `kernels.rms_norm`: one program per row, its sum of squares over one fixed block;
- `kernels.rope`: one program per token (rotate-half, as the CPU's `apply_rope`);
- `kernels.attention`: a row's keys in chunks of `key_chunk` absolute positions up to its
  own (the CPU kernel's scheme): every chunk's partials (max, sum, weighted values) are
  computed in parallel, for the query heads of a kv head together, then each row folds
  its own in position order; keys after it are never read.

Their configuration (`Tiles`) and source enter `kernel_id`, as the CPU kernel's do: exact KV
made by one set of kernels is never verified against by another. (The key chunk is the
runner's setting, as on CPU.)

Tested on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before
anything imports `triton.language`: tests/conftest.py sets it), at small fp32 shapes:
indexing, masking, and the invariance itself. Importing this package needs no Triton;
`kernels` does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

KERNELS_SOURCE = Path(__file__).with_name("kernels.py")


def block_size(value: int) -> bool:
    """Whether `value` can size a kernel's block: a power of two of at least 16 (`tl.dot`'s
    smallest operand)."""
    return value >= 16 and not value & (value - 1)


@dataclass(frozen=True, slots=True)
class Tiles:
    """The one tile configuration of `kernels.linear` (never tuned per call: a shape chosen
    by the number of rows would make a row's bits depend on its batch). Each must be a power
    of two of at least 16 (`tl.dot`'s smallest operand)."""

    block_m: int = 64
    """Rows of x per program."""
    block_n: int = 64
    """Output features per program."""
    block_k: int = 32
    """The reduction's step: x's columns per `tl.dot`, accumulated in order in fp32."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not block_size(value):
                raise ValueError(f"Tiles.{name}: {value} is not a power of two >= 16")


DEFAULT_TILES = Tiles()


def kernel_id(tiles: Tiles = DEFAULT_TILES) -> str:
    """Names this set of exact kernels: a digest of their source (comments included) and of
    the tile configuration; any change to either gives a new id (a miss, never a wrong hit)."""
    digest = hashlib.sha256(KERNELS_SOURCE.read_bytes())
    digest.update(f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}".encode())
    return f"triton-{digest.hexdigest()[:12]}"
