"""The admission queue: who is considered next when the KV budget frees up (DESIGN.md
section 4).

Strict first come, first served lets one request that cannot fit yet stall every request
behind it, and lets one tenant's burst delay everyone else's. Here:

- **Per-tenant round robin.** Each tenant's tickets wait in arrival order; candidates are
  offered one tenant at a time in turn, starting after the tenant admitted last.
- **Bounded bypass.** A ticket that does not fit may be passed by later ones, but each
  admission past it counts; once a ticket has been passed `max_bypass` times it is the only
  candidate until it fits (the requests in flight finish and free its bytes), so no
  request starves.

Pure bookkeeping, no model: not thread-safe (admission holds its lock around calls).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class _Waiting(Generic[T]):
    item: T
    tenant: str
    order: int
    refused: bool = False
    """Found no room at its last consideration."""
    bypassed: int = 0


@dataclass
class FairQueue(Generic[T]):
    """Waiting items by tenant; `candidates()` says which to try, in which order."""

    max_bypass: int = 8
    lookahead: int = 16
    """At most this many candidates per `candidates()` call (bounds a step's work)."""
    _tenants: OrderedDict[str, deque[_Waiting[T]]] = field(default_factory=OrderedDict)
    _entries: dict[int, _Waiting[T]] = field(default_factory=dict)
    _arrivals: Iterator[int] = field(default_factory=count)

    def __post_init__(self) -> None:
        if self.max_bypass < 0 or self.lookahead < 1:
            raise ValueError("max_bypass must be >= 0 and lookahead >= 1")

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, item: T, tenant: str = "") -> None:
        entry = _Waiting(item, tenant, next(self._arrivals))
        self._tenants.setdefault(tenant, deque()).append(entry)
        self._entries[id(item)] = entry

    def items(self) -> list[T]:
        """Every waiting item, in arrival order."""
        return [e.item for e in sorted(self._entries.values(), key=lambda e: e.order)]

    def candidates(self) -> list[T]:
        """What to try now, in order: the starving item alone if there is one, else the
        tenants' items interleaved round robin (each tenant's in arrival order)."""
        starving = self._starving()
        if starving is not None:
            return [starving.item]
        queues = [list(q) for q in self._tenants.values()]
        out: list[T] = []
        depth = 0
        while len(out) < self.lookahead and any(depth < len(q) for q in queues):
            out += [q[depth].item for q in queues if depth < len(q)]
            depth += 1
        return out[: self.lookahead]

    def blocked(self) -> bool:
        """Whether a starving item must be admitted before any other."""
        return self._starving() is not None

    def refused(self, item: T) -> None:
        """`item` was tried and does not fit yet."""
        self._entries[id(item)].refused = True

    def admitted(self, item: T) -> None:
        """`item` leaves the queue admitted: every refused item that arrived before it was
        passed once more, and its tenant goes to the back of the round."""
        entry = self._remove(item)
        for other in self._entries.values():
            if other.refused and other.order < entry.order:
                other.bypassed += 1
        if entry.tenant in self._tenants:
            self._tenants.move_to_end(entry.tenant)

    def remove(self, item: T) -> None:
        """`item` leaves the queue without being admitted (failed, cancelled)."""
        self._remove(item)

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        gone = [e.item for e in self._entries.values() if predicate(e.item)]
        for item in gone:
            self._remove(item)
        return gone

    def _remove(self, item: T) -> _Waiting[T]:
        entry = self._entries.pop(id(item))
        queue = self._tenants[entry.tenant]
        queue.remove(entry)
        if not queue:
            del self._tenants[entry.tenant]
        return entry

    def _starving(self) -> _Waiting[T] | None:
        starving = [e for e in self._entries.values() if e.bypassed >= self.max_bypass]
        return min(starving, key=lambda e: e.order) if starving else None
