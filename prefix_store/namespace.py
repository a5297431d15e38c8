"""Namespaces: the unit of isolation. Keys are seeded with a namespace's salt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Namespace:
    """A namespace a caller may use. `id` is internal ("tenant:NAME" or "shared:NAME");
    `name` is what the caller writes ("" for its private namespace)."""

    id: str
    name: str
    salt: bytes
