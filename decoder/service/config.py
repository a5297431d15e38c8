"""The decoder worker's typed configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from decoder.config import Placement
from prefix_store.config import ClientConfig
from prefix_store.limits import CallBounds
from prefix_store.metrics import MetricsConfig
from prefix_store.tls import TLSConfig

DEFAULT_COMPRESSOR = "snapkv:budget=0.125"
MAX_NGRAM = 32
"""Most prompt-lookup guesses per forward a request may ask for (the engines' max horizon)."""


MAX_NEW_TOKENS = 4096
"""A decoder's default bound on one request's new tokens."""
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_IDS = 16, 256, 64
"""Bounds of a Generate request's stop strings and stop token ids."""


@dataclass(frozen=True)
class DecoderConfig:
    """One decoder worker: where the store is, what it may hold, how it listens."""

    store_endpoints: tuple[str, ...]
    """host:port of one or more prefix-store shards (the rest is discovered)."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port (0 = any free port; the bound one is reported)."""
    advertise_host: str | None = None
    """Host clients should use (default: `host`)."""
    worker_id: str = "decoder-0"
    model: str | None = None
    """A local Hugging Face folder; None = the built-in model."""
    kv_budget: int | None = None
    """KV bytes this worker may hold (compressed prefixes, tails, staging; the full-KV
    baseline's resident prefixes); None = unlimited. Weights are not in it: the process
    also holds the model once packed for the exact kernels plus the drafter's fp16 copy
    (`Info.weight_bytes`: about 0.92 GB for the built-in model) and the runtime (about
    0.3 GB), so a machine needs kv_budget + weight_bytes + ~0.3 GB per decoder; the Info
    RPC and the metrics report weight bytes, KV bytes in use and peak RSS."""
    default_compressor: str = DEFAULT_COMPRESSOR
    staging_depth: int = 2
    """Layers of full prefix KV staged (and prefetched) at once per exact pass."""
    ngram: int = 0
    """Prompt-lookup guesses per forward for requests that do not say (0: off; see
    `EngineConfig.ngram`)."""
    resident_prefixes: bool = True
    """vericache: keep the full KV of prefixes in flight here while the KV budget has room
    (verified without pulling; given back when a request needs the bytes). False: every
    verification pulls (see `EngineConfig.resident`)."""
    placement: Placement = "auto"
    """vericache: where passes attend a stored prefix that is not resident: on its shards
    (`near`, near-data attention), by pulling its full KV (`pull`), or near-data whenever
    the shards run this worker's kernel (`auto`; see `EngineConfig.placement`)."""
    threads: int | None = None
    """torch CPU threads (None: torch's choice)."""
    max_new_tokens: int = MAX_NEW_TOKENS
    """Upper bound a request may ask for."""
    max_workers: int = 32
    """Concurrent RPCs served."""
    calls: CallBounds = field(default_factory=CallBounds)
    """Concurrent calls per tenant and in all (below `max_workers`)."""
    prefix_cache: int = 8
    """Idle prefixes (with their compressed artifacts, charged to the KV budget) kept for
    the next request; fewer when the budget needs their bytes."""
    max_engines: int = 8
    """Engines (one per mode, compressor spec and n-gram setting) kept once idle; idle ones
    beyond this are closed, least recently used first."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """How this worker's store clients connect (`client.tls`: TLS to the shards)."""
    tls: TLSConfig | None = None
    """Serve gRPC over TLS (mTLS when it has a client CA); None: in the clear. PEM bytes, so
    that a decoder actor on another host needs no certificate file."""
    store_clients: int = 64
    """Callers' store clients kept (one per token, each with channels to the shards); the
    least recently used beyond this is closed once no call or cached prefix uses it."""
    auth_recheck_s: float = 2.0
    """Seconds a kept client's token is trusted before the store is asked again: a rotated
    or removed token is refused within this (plus the store's own 2 s token cache)."""
    provenance_key: bytes | None = field(default=None, repr=False)
    """The deployment's private provenance key (32 bytes, `prefix_store.provenance`): this
    worker signs the KV it publishes with it and verifies only against KV it signed. None:
    a key of this worker's own, so that it trusts only what it published itself (other
    workers recompute such prefixes). In-process callers only: a deployment names the file
    instead (`provenance_key_file`), so that the key is never an actor argument."""
    provenance_key_file: Path | None = None
    """The file holding the deployment's private provenance key (0600), read on the
    worker's own host when it starts (`vericache serve` names `<state dir>/provenance.key`,
    which `ray up` copies to every host); overrides `provenance_key`."""
    internal_token_file: Path | None = None
    """The deployment's internal credential (0600, `decoder.internal`), read on the
    worker's own host when it starts: routers present it to read Info, the only method it
    may call (`vericache serve` names `<state dir>/internal.token`). None: Info for tenants
    only."""
    metrics: MetricsConfig | None = None
    """Serve Prometheus metrics on their own port (`decoder.service.metrics`); None: none."""
    audit_rate: float = 0.0
    """Share of finished vericache requests (and full ones with n-gram guesses) decoded
    again with full KV off the hot path and compared token for token
    (`decoder.service.audit`); 0: off."""
    audit_queue: int = 4
    """Sampled requests waiting for their audit; a sample beyond this is skipped."""

    def __post_init__(self) -> None:
        if self.calls.total + self.calls.reserved >= self.max_workers:
            raise ValueError(
                "calls.total + calls.reserved must be below max_workers (threads for health checks)"
            )
        if not self.store_endpoints:
            raise ValueError("store_endpoints: at least one host:port is required")
        if self.kv_budget is not None and self.kv_budget <= 0:
            raise ValueError(f"kv_budget must be > 0 bytes, got {self.kv_budget}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if not 0 <= self.ngram <= MAX_NGRAM:
            raise ValueError(f"ngram must be in [0, {MAX_NGRAM}], got {self.ngram}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {self.max_engines}")
        if self.store_clients < 1:
            raise ValueError(f"store_clients must be >= 1, got {self.store_clients}")
        if not 0 <= self.audit_rate <= 1:
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")
        if self.audit_queue < 1:
            raise ValueError(f"audit_queue must be >= 1, got {self.audit_queue}")
        if self.auth_recheck_s < 0:
            raise ValueError(f"auth_recheck_s must be >= 0 s, got {self.auth_recheck_s}")
