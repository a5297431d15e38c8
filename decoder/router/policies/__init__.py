"""Routing policies, one file each behind one interface (`base.Policy`), as SGLang's router
keeps them: a new policy is one new file and one line in `POLICIES`.

- `affinity`: prefix affinity with bounded loads (the default).
- `round-robin`: each request to the next live decoder (the baseline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decoder.router.policies.affinity import Affinity
from decoder.router.policies.base import Load, Policy, Ranking
from decoder.router.policies.round_robin import RoundRobin

if TYPE_CHECKING:
    from decoder.router.config import RouterConfig

POLICIES: dict[str, type[Policy]] = {Affinity.name: Affinity, RoundRobin.name: RoundRobin}
"""Policy name -> its class."""


def make_policy(config: RouterConfig) -> Policy:
    """The policy `config.policy` names (one of `POLICIES`: the config checked it)."""
    return POLICIES[config.policy].from_config(config)


__all__ = ["POLICIES", "Affinity", "Load", "Policy", "Ranking", "RoundRobin", "make_policy"]
