"""Namespaces: the unit of isolation. Keys are seeded with a namespace's salt."""

from __future__ import annotations

from dataclasses import dataclass

OWNER, WRITER, READER = "owner", "writer", "reader"
"""Roles in a namespace: readers look up and fetch; writers also store (publish through a
decoder, or raw SDK puts); the owner also deletes what others stored. A tenant owns its
private namespace. Anyone may delete what it stored itself (its quota pays for it)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """A namespace a caller may use. `id` is internal ("tenant:NAME" or "shared:NAME");
    `name` is what the caller writes ("" for its private namespace)."""

    id: str
    name: str
    salt: bytes
    role: str = OWNER
    """The caller's role in it (`OWNER`, `WRITER`, `READER`)."""

    @property
    def writable(self) -> bool:
        return self.role != READER
