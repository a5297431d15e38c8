"""fp32 CPU kernels.

- `fused`: the fused exact-attention C++ extension (csrc/exact_attention.cpp): build, load,
  identity.
- `partials`: near-data attention, per-chunk partials and their fold with that extension.
- `forward`: the forward pass's building blocks, in an exact and a fast flavour.
"""
