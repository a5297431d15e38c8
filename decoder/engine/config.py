"""The engine's one typed configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from decoder.config import PLACEMENTS, Mode, Placement
from decoder.horizon import HorizonPolicy

EngineMode = Literal["full", "lossy", "vericache"]
ENGINE_MODES: tuple[EngineMode, ...] = ("full", "lossy", "vericache")


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
    kv_budget: int | None = None
    """KV bytes the engine may hold (None: unlimited); admission waits for room."""
    staging_depth: int = 2
    """Layers of full prefix KV staged (and prefetched) at once for exact passes."""
    stagger: bool | None = None
    """Spread verifications of requests over different prefixes across iterations (True),
    or align every request's verification into one pass (False). None decides from
    measurements: stagger while passes wait on the pull of the full KV (a slow link), align
    while they do not (compute-bound: one pass reads the weights once for everyone)."""
    recompute: bool = True
    """Recompute a prefix locally when its full KV cannot be read (if the budget allows)."""
    resident: bool = True
    """vericache mode: keep prefixes' full KV resident here while the budget has room after
    admitting every queued request (most-shared prefixes first); passes over a resident
    prefix verify without pulling. Residents are dropped (back to pull-to-verify) as soon as
    a queued request needs their bytes."""
    max_bypass: int = 8
    """Admission fairness (`decoder.engine.queue`): how many later requests may be admitted
    past one that does not fit yet before it waits alone for room (0: first come, first
    served)."""
    placement: Placement = "auto"
    """vericache mode: where verification passes attend a stored prefix that is not
    resident here. `near`: on the shards holding it (near-data attention, `decoder.near_data`:
    per layer the pass's query rows go out and per-chunk partials come back), when its
    source offers it (a store prefix whose shards run this decoder's kernel fingerprint);
    `pull`: its full KV is pulled for every pass; `auto` (default): near-data when offered,
    else pull. A resident copy (`resident`) is used before either."""
    ngram: int = 0
    """Prompt-lookup speculation (`decoder.engine.ngram`): at most this many tokens copied
    from the prompt and output so far are proposed per forward and checked in that forward
    (0: off). In `vericache` and `lossy` mode the compressed-KV drafter checks them (several
    drafts per draft forward); in `full` mode the exact verifier does (classic lossless
    prompt-lookup decoding). Only tokens the mode would emit without proposals are emitted.
    A ceiling: each forward feeds as many as pay under its measured costs and the request's
    guess acceptance (`decoder.horizon.guess_count`)."""

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.draft_mode not in ("exact", "fast"):
            raise ValueError(f"draft_mode must be 'exact' or 'fast', got {self.draft_mode!r}")
        if self.kv_budget is not None and self.kv_budget <= 0:
            raise ValueError(f"kv_budget must be > 0 bytes, got {self.kv_budget}")
        if self.max_bypass < 0:
            raise ValueError(f"max_bypass must be >= 0, got {self.max_bypass}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.staging_depth < 1:
            raise ValueError(f"staging_depth must be >= 1, got {self.staging_depth}")
        HorizonPolicy(self.horizon, self.max_horizon)  # validates both
        if not 0 <= self.ngram <= self.max_horizon:
            raise ValueError(
                f"ngram must be in [0, max_horizon={self.max_horizon}], got {self.ngram}"
            )
