"""Token choice from logits: greedy, or seeded sampling that drafter and verifier share.

Sampling is Gumbel-max over the temperature-scaled, top-k/top-p filtered logits. The
Gumbel noise for output position `i` (0 = the first generated token) is drawn from a
generator seeded by a hash of `(seed, i)` alone (DESIGN.md section 1). So the token chosen
at position i is a pure function of the logits, the parameters, the seed and i: the
drafter and the verifier make the same choice whenever their logits agree, and a request's
tokens never depend on the batch or on how many tokens were verified at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request turns logits into tokens."""

    temperature: float = 0.0
    """0 means greedy (arg-max, lowest id on ties)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    seed: int | None = None
    """Sampling seed; None picks one at random (reported in the stats, so reruns can match)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> SamplingParams:
        """These parameters with a concrete seed (a fresh random one when sampling unseeded)."""
        if self.greedy or self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, secrets.randbits(63))


class Sampler:
    """Chooses the token at a given output position from that position's logits."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params.resolved()

    def choose(self, logits: torch.Tensor, index: int) -> int:
        """logits: [V] (any float dtype); index: the output position being chosen."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.double() / p.temperature
        kept = _kept(scores, p.top_k, p.top_p)
        noisy = scores[kept] + _gumbel(p.seed, index, scores.shape[0], kept)
        return int(kept[torch.argmax(noisy)])  # ids ascend: ties go to the lowest id

    def choose_rows(self, logits: torch.Tensor, first_index: int) -> list[int]:
        """logits: [n, V] for output positions first_index .. first_index + n - 1."""
        return [self.choose(row, first_index + j) for j, row in enumerate(logits)]


def _kept(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The ids of the tokens that top-k / top-p keep, ascending (ties at the edge kept).
    Top-p sorts only what top-k kept: the Gumbel-max choice among them is the choice over
    every token with the others masked out, at the cost of a few dozen tokens, not V."""
    if top_k and top_k < scores.shape[0]:
        kth = torch.topk(scores, top_k).values[-1]
        kept = torch.nonzero(scores >= kth).squeeze(1)
    else:
        kept = torch.arange(scores.shape[0])
    if top_p < 1.0:
        ordered, order = torch.sort(scores[kept], descending=True, stable=True)
        probs = torch.softmax(ordered, dim=0)
        before = torch.cumsum(probs, dim=0) - probs  # mass strictly before each token
        kept = torch.sort(kept[order[before < top_p]]).values
    return kept


def _gumbel(seed: int, index: int, size: int, kept: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of the `kept` tokens at position `index`: drawn for all `size`
    tokens, so that a token's noise does not depend on which others are kept."""
    generator = torch.Generator().manual_seed(_mix(seed, index))
    uniform = torch.rand(size, generator=generator, dtype=torch.float64)[kept]
    return -torch.log(-torch.log(uniform.clamp_(min=1e-300)))


def _mix(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit generator seed per position."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
