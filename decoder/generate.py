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
    samplings = [sampling or SamplingParams()]
    return generate_full_each(
        runner,
        prompts,
        samplings,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        mode=mode,
    )[0]


def generate_full_each(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    samplings: Sequence[SamplingParams],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    mode: Mode = "exact",
) -> list[list[GenerationResult]]:
    """`generate_full` of the prompts under each of `samplings` (results[s][i]: prompt i
    under samplings[s]), with one prefill per prompt: its KV is copied for every further
    sampling, and all of them decode in one batch. The tokens are those of a
    `generate_full` call per sampling (in exact mode a request's tokens do not depend on
    the batch); the timings are shared."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not samplings:
        raise ValueError("at least one sampling is needed")
    if mode == "exact":
        runner.ensure_exact_supported()  # once per process; kept out of the timings below
    eos = set(eos_token_ids)
    t0 = time.perf_counter()
    prefilled, last = _prefill(runner, prompts, max_new_tokens, mode)
    prefill_s = time.perf_counter() - t0
    samplers = [Sampler(s) for s in samplings]
    caches = [
        c if s == 0 else c.clone(max_new_tokens) for s in range(len(samplers)) for c in prefilled
    ]
    per_seq = [sampler for sampler in samplers for _ in prompts]  # in `caches` order
    outputs = [[per_seq[j].choose(last[j % len(prompts)], 0)] for j in range(len(caches))]
    t1 = time.perf_counter()
    steps = _decode(runner, caches, outputs, per_seq, eos, max_new_tokens, mode)
    decode_s = time.perf_counter() - t1
    results = []
    for s, sampler in enumerate(samplers):
        mine = outputs[s * len(prompts) : (s + 1) * len(prompts)]
        results.append(
            [
                _result(out, eos, prompt, prefill_s, decode_s, steps, sampler.params)
                for out, prompt in zip(mine, prompts, strict=True)
            ]
        )
    return results


def _prefill(runner, prompts, max_new_tokens, mode) -> tuple[list, list]:
    """Every prompt's KV cache (with room for the new tokens) and its last logits."""
    caches = [runner.new_cache(capacity=len(p) + max_new_tokens) for p in prompts]
    logits = runner.forward(
        [SeqInput.extend(c, p) for c, p in zip(caches, prompts, strict=True)], mode
    )
    return caches, [lg[-1] for lg in logits]


def _decode(runner, caches, outputs, samplers, eos, max_new_tokens, mode) -> int:
    """One token per step for every live sequence until each is finished; the steps."""
    live = [i for i, out in enumerate(outputs) if not _finished(out, eos, max_new_tokens)]
    steps = 0
    while live:
        logits = runner.forward([SeqInput.extend(caches[i], outputs[i][-1:]) for i in live], mode)
        steps += 1
        for i, lg in zip(live, logits, strict=True):
            outputs[i].append(samplers[i].choose(lg[-1], len(outputs[i])))
        live = [i for i in live if not _finished(outputs[i], eos, max_new_tokens)]
    return steps


def _finished(out: list[int], eos: set[int], max_new_tokens: int) -> bool:
    return out[-1] in eos or len(out) >= max_new_tokens


def _result(out, eos, prompt, prefill_s, decode_s, steps, params) -> GenerationResult:
    total = prefill_s + decode_s
    result = GenerationResult(
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
    if not params.greedy:
        result.stats["seed"] = params.seed
    return result
