"""What the engine measures per request, and the result it hands back."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """Counters of one request in flight (turned into `GenerationResult.stats` at the end)."""

    verifications: int = 0
    drafted: int = 0
    """Tokens proposed to the verifier."""
    accepted: int = 0
    """Proposed tokens the verifier agreed with (before the first mismatch of each round)."""
    draft_steps: int = 0
    """Draft forwards this request took part in."""
    proposed: int = 0
    """Prompt-lookup (n-gram) tokens proposed to a forward that checked them."""
    proposals_taken: int = 0
    """Of which the checking forward agreed with (drafts, or tokens emitted directly)."""
    pulled_bytes: float = 0.0
    """Its share of the full prefix KV read for it."""
    near_bytes: float = 0.0
    """Its share of the bytes near-data passes exchanged with the shards (queries out,
    partials back) instead of pulling."""
    near_passes: int = 0
    """Exact passes that attended its prefix on the shards."""
    near_wire_s: float = 0.0
    """Its share of the time those passes waited for partials (round trips, shard compute)."""
    near_shard_s: float = 0.0
    """Of which the shards computed."""
    near_retries: int = 0
    """Exact passes undone while attending its prefix on the shards (a shard busy, or a
    failure its replicas could not cover: corrupt partials from both copies, no copy left)
    and redone with the prefix pulled; no token left them."""
    compress_s: float = 0.0
    prefill_s: float = 0.0
    rounds: Counter = field(default_factory=Counter)
    """Verifications by the number of drafts they accepted."""
    policy: Counter = field(default_factory=Counter)
    """Rounds planned by the reason of their horizon (`decoder.horizon.Choice.reason`)."""
    gain: float | None = None
    """The horizon policy's expected speed over plain exact steps, at its latest choice."""

    def chose(self, choice) -> None:
        """A round was planned with `choice` (a `decoder.horizon.Choice`)."""
        self.policy[choice.reason] += 1
        if choice.gain is not None:
            self.gain = choice.gain

    def record_round(self, drafted: int, accepted: int) -> None:
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rounds[accepted] += 1

    def speculation(self, generated: int) -> dict[str, float | int]:
        """The draft/verify figures of the result (vericache mode)."""
        v = max(1, self.verifications)
        return {
            "verifications": self.verifications,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_steps": self.draft_steps,
            "accepted_per_verification": round(self.accepted / v, 3),
            "tokens_per_verification": round((generated - 1) / v, 3),
            "drafts_per_draft_step": round(self.drafted / max(1, self.draft_steps), 3),
            "accepted_histogram": {str(k): n for k, n in sorted(self.rounds.items())},
            "policy": dict(sorted(self.policy.items())),
            "modelled_gain": None if self.gain is None else round(self.gain, 3),
        }

    def ngram(self) -> dict[str, int]:
        """The prompt-lookup figures of the result (when n-gram speculation is on)."""
        return {"ngram_proposed": self.proposed, "ngram_accepted": self.proposals_taken}


@dataclass
class EngineStats:
    """What one engine measures over its life (a request's figures are the difference
    between the engine's stats at its end and a copy taken at its admission)."""

    draft_s: float = 0.0
    """Seconds spent in draft forwards."""
    draft_steps: int = 0
    verify_s: float = 0.0
    """Seconds spent in verification passes."""
    verify_passes: int = 0
    full_s: float = 0.0
    """Seconds spent in full-KV decode steps."""
    full_steps: int = 0
    steps: int = 0
    """Batch iterations (a draft step, a full step or a lossy step each)."""

    def copy(self) -> EngineStats:
        return dataclasses.replace(self)

    def step_times(self, since: EngineStats) -> dict[str, float]:
        """Mean seconds of the engine's draft and full-KV steps since `since` (a request's
        life), for the kinds it took: what the DESIGN.md section 10 bound divides."""
        times = {}
        for kind in ("draft", "full"):
            steps = getattr(self, f"{kind}_steps") - getattr(since, f"{kind}_steps")
            if steps > 0:
                seconds = getattr(self, f"{kind}_s") - getattr(since, f"{kind}_s")
                times[f"{kind}_step_s"] = round(seconds / steps, 5)
        return times
