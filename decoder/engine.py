"""The decode loop over a batch of requests: full-KV, lossy, and VeriCache (draft/verify).

A request is a cached prefix (its full KV behind a `FullKVSource`, plus the queries its
prefill observed) and at least one suffix token. Every mode first prefills the suffix in
exact mode against the full prefix, streamed layer by layer, which gives the request's
exact tail KV and its first token. Then:

- `full`: the whole prefix KV is made resident and decoded with in exact mode, one token
  per step (the baseline every lossless claim is measured against);
- `lossy`: decodes with the compressed prefix plus the tail alone, one token per step in
  the draft runner mode (what users of KV compression run today; not lossless);
- `vericache`: rounds of `x` drafted tokens (compressed prefix + tail) and one exact
  verification of `x + 1` tokens over the full prefix (streamed) + tail. The longest run
  of drafts equal to the verifier's own choices is accepted, plus the verifier's next
  token; everything after it is rolled back, and the accepted tokens' verified KV
  replaces their draft KV. Only verifier choices are ever emitted.

Tokens are chosen by `decoder.sampling.Sampler`, keyed by output position, so the tokens
of `vericache` are exactly the tokens of `full` (greedy or seeded sampling), whatever the
batch, horizon or compressor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from decoder.compressors import CompressedKV, CompressorPipeline, parse_compressor
from decoder.config import Mode
from decoder.draft_cache import DraftCache
from decoder.generate import GenerationResult
from decoder.horizon import Acceptance, CostModel, HorizonPolicy
from decoder.kv_cache import KVCache
from decoder.kv_source import (
    FullKVSource,
    LocalKVSource,
    StagedCache,
    StagingArea,
    assemble_layer,
)
from decoder.runner import ModelRunner, SeqInput
from decoder.sampling import Sampler, SamplingParams

EngineMode = Literal["full", "lossy", "vericache"]
ENGINE_MODES: tuple[EngineMode, ...] = ("full", "lossy", "vericache")


@dataclass
class Prefix:
    """A cached prefix: its tokens, its full KV source, and what its prefill observed."""

    tokens: list[int]
    source: FullKVSource
    observed: list[torch.Tensor] | None = None
    """Per layer, the rotated queries of the prefix's last tokens ([w, H, D])."""
    artifacts: dict[str, CompressedKV] = field(default_factory=dict)
    """Compressed KV per canonical compressor spec, built once and shared by requests."""

    def __post_init__(self) -> None:
        if self.source.length != len(self.tokens):
            raise ValueError(
                f"prefix has {len(self.tokens)} tokens but its KV source holds {self.source.length}"
            )


@dataclass
class Request:
    """One generation: a cached prefix and the prompt tokens after it (at least one)."""

    prefix: Prefix
    suffix: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    horizon: int | None = None
    """Drafted tokens per verification for this request; None follows the engine's config."""

    def __post_init__(self) -> None:
        if not self.suffix:
            raise ValueError("a request needs at least one prompt token after its prefix")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.horizon is not None and self.horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {self.horizon}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decodes."""

    mode: EngineMode = "vericache"
    compressor: str = "snapkv:budget=0.125"
    """Compressor spec for `lossy` and `vericache` (see `decoder.compressors`)."""
    horizon: int | None = None
    """Drafted tokens per verification; None chooses per request (auto)."""
    max_horizon: int = 32
    """Upper bound of the automatic horizon."""
    draft_mode: Mode = "fast"
    """Runner mode of draft steps (and of lossy decoding)."""

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.draft_mode not in ("exact", "fast"):
            raise ValueError(f"draft_mode must be 'exact' or 'fast', got {self.draft_mode!r}")
        HorizonPolicy(self.horizon, self.max_horizon)  # validates both


def prefill_prefix(runner: ModelRunner, tokens: Sequence[int], observe: int = 128) -> Prefix:
    """Exact prefill of a prefix into host memory, keeping its last `observe` queries."""
    tokens = list(tokens)
    cache = runner.new_cache(capacity=len(tokens))
    observed = None
    if tokens:
        seq = SeqInput.extend(cache, tokens, logits="none", observe=observe)
        runner.forward([seq], "exact")
        observed = seq.observed
    return Prefix(tokens, LocalKVSource(cache, len(tokens)), observed)


def split_prompt(
    runner: ModelRunner, prompt: Sequence[int], observe: int = 128
) -> tuple[Prefix, list[int]]:
    """An in-process prompt: everything but its last token becomes the cached prefix."""
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    return prefill_prefix(runner, prompt[:-1], observe), list(prompt[-1:])


@dataclass
class _Active:
    """A request in flight."""

    req: Request
    sampler: Sampler
    tail: KVCache
    eos: frozenset[int]
    out: list[int] = field(default_factory=list)
    draft: DraftCache | None = None
    resident: KVCache | None = None  # full mode: the whole KV
    drafts: list[int] = field(default_factory=list)
    horizon: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    stats: dict[str, float] = field(
        default_factory=lambda: {"verifications": 0, "drafted": 0, "accepted": 0, "draft_steps": 0}
    )
    stop_reason: str = ""

    @property
    def last(self) -> int:
        return self.out[-1]

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.out)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def emit(self, tokens: Sequence[int]) -> int:
        """Append verified tokens up to a stop; returns how many were taken."""
        taken = 0
        for token in tokens:
            if self.done:
                break
            self.out.append(token)
            taken += 1
            if token in self.eos:
                self.stop_reason = "eos"
            elif self.remaining <= 0:
                self.stop_reason = "length"
        return taken


class Engine:
    """Decodes batches of requests with one runner; owns no request between calls."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.runner = runner
        self.config = config or EngineConfig()
        self.eos = frozenset(eos_token_ids)
        self.pipeline: CompressorPipeline | None = (
            None if self.config.mode == "full" else parse_compressor(self.config.compressor)
        )
        self.policy = HorizonPolicy(self.config.horizon, self.config.max_horizon)
        self.costs = CostModel()
        self.staging = StagingArea(runner.config, runner.rc.key_chunk)
        self.timers: dict[str, float] = {}

    @property
    def observe_window(self) -> int:
        """Prefix queries a prefill must keep for this engine's compressor."""
        return self.pipeline.observe_window if self.pipeline else 0

    def compressed(self, prefix: Prefix) -> CompressedKV:
        """The prefix's compressed KV for this engine's spec, built once per prefix."""
        assert self.pipeline is not None
        spec = self.pipeline.spec
        if spec not in prefix.artifacts:
            c = self.runner.config
            prefix.artifacts[spec] = self.pipeline.compress(
                prefix.source, prefix.observed, c.num_layers, c.num_kv_heads, c.head_dim
            )
        return prefix.artifacts[spec]

    def run(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Decode every request to its stop; results in request order."""
        if not requests:
            raise ValueError("run needs at least one request")
        self.runner.ensure_exact_supported()
        self.timers = {"draft_s": 0.0, "verify_s": 0.0, "steps": 0}
        self.staging.fetch_s = 0.0
        t0 = time.perf_counter()
        active = [self._admit(r) for r in requests]
        compress_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._prefill_suffixes(active)
        prefill_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        decode = {
            "full": self._decode_full,
            "lossy": self._decode_lossy,
            "vericache": self._decode_vericache,
        }[self.config.mode]
        decode(active)
        decode_s = time.perf_counter() - t2
        return [self._result(a, compress_s, prefill_s, decode_s) for a in active]

    # -- admission and suffix prefill ------------------------------------------------------

    def _admit(self, req: Request) -> _Active:
        capacity = len(req.suffix) + req.max_new_tokens + self.config.max_horizon + 1
        tail = KVCache(self.runner.config, granule=self.runner.rc.key_chunk, capacity=capacity)
        active = _Active(req, Sampler(req.sampling), tail, self.eos)
        if self.pipeline is not None:
            compressed = self.compressed(req.prefix)
            c = self.runner.config
            active.draft = DraftCache(compressed, capacity, c.num_kv_heads, c.head_dim)
        return active

    def _prefill_suffixes(self, active: list[_Active]) -> None:
        seqs = [SeqInput.extend(self._staged(a, len(a.req.suffix)), a.req.suffix) for a in active]
        logits = self.runner.forward(seqs, "exact")
        for a, lg in zip(active, logits, strict=True):
            a.emit([a.sampler.choose(lg[-1], 0)])
            if a.draft is not None:
                a.draft.copy_tail(a.tail, 0, len(a.tail))

    def _staged(self, a: _Active, extra: int) -> StagedCache:
        return StagedCache(a.req.prefix.source, a.tail, self.staging, extra)

    # -- full-KV baseline -------------------------------------------------------------------

    def _decode_full(self, active: list[_Active]) -> None:
        for a in active:
            a.resident = self._resident_copy(a)
        while live := [a for a in active if not a.done]:
            seqs = [SeqInput.extend(a.resident, [a.last]) for a in live]
            self.timers["steps"] += 1
            for a, lg in zip(live, self.runner.forward(seqs, "exact"), strict=True):
                a.emit([a.sampler.choose(lg[-1], len(a.out))])

    def _resident_copy(self, a: _Active) -> KVCache:
        """The prefix's full KV read into memory, followed by the request's tail."""
        source = a.req.prefix.source
        cache = self.runner.new_cache(capacity=source.length + len(a.tail) + a.remaining)
        for index, layer in enumerate(cache.layers):
            assemble_layer(source, a.tail, index, len(a.tail), layer)
        return cache

    # -- lossy ------------------------------------------------------------------------------

    def _decode_lossy(self, active: list[_Active]) -> None:
        while live := [a for a in active if not a.done]:
            seqs = [SeqInput.extend(a.draft, [a.last]) for a in live]
            self.timers["steps"] += 1
            for a, lg in zip(live, self.runner.forward(seqs, self.config.draft_mode), strict=True):
                a.emit([a.sampler.choose(lg[-1], len(a.out))])

    # -- VeriCache --------------------------------------------------------------------------

    def _decode_vericache(self, active: list[_Active]) -> None:
        """Each iteration: one draft step for every request still drafting, then one
        verification pass for every request whose round is drafted. Requests keep their
        own rounds, so a short horizon never waits for a long one."""
        for a in active:
            self._plan_round(a)
        while live := [a for a in active if not a.done]:
            drafting = [a for a in live if self._drafting(a)]
            if drafting:
                self._draft_step(drafting)
            ready = [a for a in live if not self._drafting(a)]
            if ready:
                self._verify(ready)
                for a in ready:
                    self._plan_round(a)

    def _plan_round(self, a: _Active) -> None:
        horizon = a.req.horizon
        if horizon is None:
            horizon = self.policy.choose(a.acceptance, self.costs)
        a.horizon = max(0, min(horizon, a.remaining - 1))
        a.drafts = []

    def _drafting(self, a: _Active) -> bool:
        return len(a.drafts) < a.horizon and not (a.drafts and a.drafts[-1] in self.eos)

    def _draft_step(self, drafting: list[_Active]) -> None:
        t0 = time.perf_counter()
        seqs = [SeqInput.extend(a.draft, [a.drafts[-1] if a.drafts else a.last]) for a in drafting]
        logits = self.runner.forward(seqs, self.config.draft_mode)
        for a, lg in zip(drafting, logits, strict=True):
            a.drafts.append(a.sampler.choose(lg[-1], len(a.out) + len(a.drafts)))
            a.stats["draft_steps"] += 1
        seconds = time.perf_counter() - t0
        self.costs.record_draft_step(seconds, len(drafting))
        self.timers["draft_s"] += seconds
        self.timers["steps"] += 1

    def _verify(self, live: list[_Active]) -> None:
        t0 = time.perf_counter()
        kept = [len(a.tail) for a in live]
        seqs = [
            SeqInput.extend(self._staged(a, len(a.drafts) + 1), [a.last, *a.drafts], "all")
            for a in live
        ]
        logits = self.runner.forward(seqs, "exact")
        seconds = time.perf_counter() - t0
        self.costs.record_verification(len(seqs), sum(s.tokens.numel() for s in seqs), seconds)
        self.timers["verify_s"] += seconds
        for a, lg, before in zip(live, logits, kept, strict=True):
            choices = a.sampler.choose_rows(lg, len(a.out))
            accepted = 0
            while accepted < len(a.drafts) and a.drafts[accepted] == choices[accepted]:
                accepted += 1
            a.acceptance.record(len(a.drafts), accepted)
            a.stats["verifications"] += 1
            a.stats["drafted"] += len(a.drafts)
            a.stats["accepted"] += accepted
            taken = a.emit(choices[: accepted + 1])
            # Verified KV of the inputs [last, d_1 .. d_accepted] stays; the rest rolls back.
            a.tail.truncate(before + taken)
            a.draft.truncate(before)
            a.draft.copy_tail(a.tail, before, before + taken)

    # -- results ----------------------------------------------------------------------------

    def _result(
        self, a: _Active, compress_s: float, prefill_s: float, decode_s: float
    ) -> GenerationResult:
        s = a.stats
        total = compress_s + prefill_s + decode_s
        stats: dict[str, float | int | str] = {
            "mode": self.config.mode,
            "prefix_tokens": a.req.prefix.source.length,
            "prompt_tokens": a.req.prefix.source.length + len(a.req.suffix),
            "generated_tokens": len(a.out),
            "compress_s": round(compress_s, 4),
            "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "tokens_per_s": round(len(a.out) / total, 3) if total > 0 else 0.0,
            "full_bytes": a.req.prefix.source.nbytes,
            "peak_staging_bytes": self.staging.peak_bytes,
        }
        if a.req.sampling.temperature > 0:
            stats["seed"] = a.sampler.params.seed
        if a.draft is not None:
            compressed = self.compressed(a.req.prefix)
            stats.update(
                compressor=compressed.spec,
                compressed_bytes=compressed.nbytes,
                compression_ratio=round(compressed.ratio, 3),
            )
        if self.config.mode == "vericache":
            v = max(1, s["verifications"])
            stats.update(
                verifications=int(s["verifications"]),
                drafted=int(s["drafted"]),
                accepted=int(s["accepted"]),
                draft_steps=int(s["draft_steps"]),
                accepted_per_verification=round(s["accepted"] / v, 3),
                tokens_per_verification=round((len(a.out) - 1) / v, 3),
                fetch_s=round(self.staging.fetch_s, 4),
                draft_s=round(self.timers["draft_s"], 4),
                verify_s=round(self.timers["verify_s"], 4),
            )
        stats["batch_steps"] = int(self.timers["steps"])
        return GenerationResult(tokens=a.out, stop_reason=a.stop_reason or "length", stats=stats)
