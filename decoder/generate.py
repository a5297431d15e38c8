"""Full-KV generation: the reference decoder every lossless mode is compared against."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from decoder.config import Mode
from decoder.runner import ModelRunner, SeqInput
from decoder.sampling import Sampler, SamplingParams

StopReason = Literal["eos", "length"]


@dataclass
class GenerationResult:
    """Generated token ids (the prompt excluded) and how generation went."""

    tokens: list[int]
    stop_reason: StopReason
    stats: dict[str, float | int] = field(default_factory=dict)


def generate_full(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    mode: Mode = "exact",
    sampling: SamplingParams | None = None,
) -> list[GenerationResult]:
    """Full-KV decoding of a batch of prompts: prefill, then one token per step.

    Tokens are chosen greedily, or sampled with `sampling` (the same parameters and seed
    for every prompt; the noise depends only on the seed and the output position). Each
    request stops at its first EOS token (which is included) or after `max_new_tokens`
    tokens. In exact mode a request's tokens do not depend on the batch.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if mode == "exact":
        runner.ensure_exact_supported()  # once per process; kept out of the timings below
    eos = set(eos_token_ids)
    sampler = Sampler(sampling or SamplingParams())
    caches = [runner.new_cache(capacity=len(p) + max_new_tokens) for p in prompts]
    t0 = time.perf_counter()
    logits = runner.forward(
        [SeqInput.extend(c, p) for c, p in zip(caches, prompts, strict=True)], mode
    )
    prefill_s = time.perf_counter() - t0
    outputs: list[list[int]] = [[sampler.choose(lg[-1], 0)] for lg in logits]
    live = [i for i, out in enumerate(outputs) if not _finished(out, eos, max_new_tokens)]
    steps = 0
    t1 = time.perf_counter()
    while live:
        logits = runner.forward([SeqInput.extend(caches[i], outputs[i][-1:]) for i in live], mode)
        steps += 1
        for i, lg in zip(live, logits, strict=True):
            outputs[i].append(sampler.choose(lg[-1], len(outputs[i])))
        live = [i for i in live if not _finished(outputs[i], eos, max_new_tokens)]
    decode_s = time.perf_counter() - t1
    results = [
        _result(out, eos, prompt, prefill_s, decode_s, steps)
        for out, prompt in zip(outputs, prompts, strict=True)
    ]
    if not sampler.params.greedy:
        for r in results:
            r.stats["seed"] = sampler.params.seed
    return results


def _finished(out: list[int], eos: set[int], max_new_tokens: int) -> bool:
    return out[-1] in eos or len(out) >= max_new_tokens


def _result(out, eos, prompt, prefill_s, decode_s, steps) -> GenerationResult:
    total = prefill_s + decode_s
    return GenerationResult(
        tokens=out,
        stop_reason="eos" if out[-1] in eos else "length",
        stats={
            "prompt_tokens": len(prompt),
            "generated_tokens": len(out),
            "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_steps": steps,
            "tokens_per_s": round(len(out) / total, 3) if total > 0 else 0.0,
        },
    )
