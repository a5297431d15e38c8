"""What every routing policy implements: rank the live decoders for one request.

A policy is asked once per request (`ranking`: it may take a turn, or fix the request's
place in a hash order, there) and gives back a function that ranks the live decoders,
best first, from their loads; the relay applies it again before every attempt, since the
live set and the loads change while a request is retried. A policy never sees a request's
bytes or its caller, only its prefix identity (`decoder.router.identity`), and keeps no
state but its own (a turn counter): a restarted router routes as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from decoder.router.config import RouterConfig


@dataclass(frozen=True)
class Load:
    """What a decoder holds now: requests in flight or queued, and its KV budget use."""

    requests: int = 0
    budget_use: float = 0.0


Ranking = Callable[[Mapping[str, Load]], list[str]]
"""loads (live decoder endpoint -> its load) -> those decoders in the order to try them."""


class Policy(ABC):
    """How a router chooses a request's decoder. Thread-safe: many requests ask at once."""

    name: ClassVar[str]
    """Its name in `RouterConfig.policy` and `vericache serve --router-policy`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        """The policy as a router's configuration sets it up."""

    @abstractmethod
    def ranking(self, identity: int) -> Ranking:
        """The ranking of the request whose prefix identity is `identity`; an empty
        mapping of loads (no live decoder) ranks as []."""
