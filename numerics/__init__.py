"""Kernels both tiers run: the decoder's forward pass and shards' near-data attention.

A kernel here knows tensors, not models or stores, so a shard imports it without the
decoder and a decoder without the store. Exact KV and near-data offload are keyed by a
kernel's identity (`numerics.cpu.forward.exact_kernel_id`, `numerics.cpu.partials.
kernel_fingerprint`), which depends on the kernel's source bytes and arithmetic only,
never on where its files live.

- `numerics.cpu`: fp32 CPU kernels (the fused AVX2 exact-attention extension and the torch
  building blocks around it). A GPU sibling (`numerics.gpu`, issue 28) goes beside it.

Not named `kernels`: that is Hugging Face's kernel-hub distribution (installed here with
transformers, which imports it when found), and a package of ours would shadow it.
"""
