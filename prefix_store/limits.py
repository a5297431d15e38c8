"""What a server lets its callers hold at once (`CallBounds`), as shards, decoders and
routers are configured; `rpc.limits` enforces it (call slots by fair share, idle streams).
Here, not in the server toolkit, because the configs the client SDK reads name it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CallBounds:
    """What a server lets its callers hold at once."""

    per_tenant: int = 16
    """Concurrent calls of one tenant at most, whatever its fair share."""
    total: int = 28
    """Concurrent calls of all tenants, shared by fair share (a tenant alone gets half at
    weight 1; see `prefix_store.shares`): keep `total + reserved` below the server's
    threads, so that health checks and reflection always find one."""
    reserved: int = 2
    """Call slots only the admin role (`Tenant.admin`) may take, beside `total`."""
    stream_idle_s: float = 30.0
    """A client stream that sends no message for this long is cancelled."""

    def __post_init__(self) -> None:
        if not 1 <= self.per_tenant <= self.total:
            raise ValueError("CallBounds: need 1 <= per_tenant <= total")
        if self.stream_idle_s <= 0:
            raise ValueError("CallBounds.stream_idle_s must be > 0")
        if self.reserved < 0:
            raise ValueError("CallBounds.reserved must be >= 0")
