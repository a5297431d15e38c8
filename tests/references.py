"""Full-KV references: in-process decoding of a prompt, computed once per test process for
each prompt, length and sampler (several tests check against the same prompts).

Decoding several prompts together gives each one's tokens alone (exact mode is
batch-invariant: tests/decoder/test_exactness.py), so `full_kv_batch` decodes the prompts
it has not seen in one batch, which costs about one prompt's decode steps instead of one per
prompt."""

from __future__ import annotations

from decoder.generate import generate_full
from decoder.sampling import SamplingParams

_TOKENS: dict[tuple, list[int]] = {}


def full_kv_tokens(
    runner, model, prompt, new_tokens: int, sampling: SamplingParams | None = None
) -> list[int]:
    """The tokens full-KV decoding of `prompt` emits (`new_tokens` at most; greedy by
    default), decoded by `runner` on the first call and remembered (a fresh list each call)."""
    return full_kv_batch(runner, model, [prompt], new_tokens, sampling)[0]


def full_kv_batch(
    runner, model, prompts, new_tokens: int, sampling: SamplingParams | None = None
) -> list[list[int]]:
    """`full_kv_tokens` of each prompt; those not decoded before are decoded together."""
    sampling = sampling or SamplingParams()
    keys = [(id(runner), tuple(p), new_tokens, sampling) for p in prompts]
    missing = list(dict.fromkeys(k for k in keys if k not in _TOKENS))
    if missing:
        results = generate_full(
            runner,
            [list(k[1]) for k in missing],
            max_new_tokens=new_tokens,
            eos_token_ids=model.eos_token_ids,
            sampling=sampling,
        )
        _TOKENS.update((k, r.tokens) for k, r in zip(missing, results, strict=True))
    return [list(_TOKENS[k]) for k in keys]
