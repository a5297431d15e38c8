"""Full-KV references: in-process decoding of a prompt, computed once per test process for
each prompt, length and sampler (several tests check against the same prompts)."""

from __future__ import annotations

from decoder.generate import generate_full
from decoder.sampling import SamplingParams

_TOKENS: dict[tuple, list[int]] = {}


def full_kv_tokens(
    runner, model, prompt, new_tokens: int, sampling: SamplingParams | None = None
) -> list[int]:
    """The tokens full-KV decoding of `prompt` emits (`new_tokens` at most; greedy by
    default), decoded by `runner` on the first call and remembered (a fresh list each call)."""
    sampling = sampling or SamplingParams()
    key = (id(runner), tuple(prompt), new_tokens, sampling)
    if key not in _TOKENS:
        _TOKENS[key] = generate_full(
            runner,
            [prompt],
            max_new_tokens=new_tokens,
            eos_token_ids=model.eos_token_ids,
            sampling=sampling,
        )[0].tokens
    return list(_TOKENS[key])
