"""Token ids on the wire: what every RPC that carries a prompt accepts (both ends check
them, so a client fails before it sends what a shard would refuse)."""

from __future__ import annotations

from collections.abc import Sequence

from prefix_store.errors import InvalidArgument

MAX_TOKEN_ID = 1 << 31
"""Token ids are in [0, MAX_TOKEN_ID) (int32 on the wire and in chunk keys)."""


def validate_tokens(
    token_ids: Sequence[int], field_name: str = "token_ids", limit: int | None = None
) -> list[int]:
    """The ids as a list, checked: at most `limit` of them (counted before they are read
    into a list), each in [0, 2^31)."""
    if limit is not None and len(token_ids) > limit:
        raise InvalidArgument(
            f"{field_name}: {len(token_ids)} token ids exceed the limit of {limit}"
        )
    ids = list(token_ids)
    if ids and (min(ids) < 0 or max(ids) >= MAX_TOKEN_ID):
        raise InvalidArgument(f"{field_name}: token ids must be in [0, 2^31)")
    return ids
