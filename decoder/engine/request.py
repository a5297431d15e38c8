"""What callers hand the engine (prefixes, requests) and what they get back (tickets)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoder.compressors import CompressedKV
from decoder.engine.ngram import NgramTable
from decoder.generate import GenerationResult
from decoder.kv_source import FullKVSource
from decoder.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Prefix:
    """A cached prefix: its tokens, its full KV source, and what its prefill observed."""

    tokens: list[int]
    source: FullKVSource
    observed: list[torch.Tensor] | None = None
    """Per layer, the rotated queries of the prefix's last tokens ([w, H, D])."""
    artifacts: dict[str, CompressedKV] = field(default_factory=dict)
    """Compressed KV per canonical compressor spec, built once and shared by requests. One
    put here by the caller (e.g. fetched from the store) is validated against the model
    before use; one that does not fit fails the requests over it (ArtifactFormatError)."""

    _ngrams: NgramTable | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def ngrams(self) -> NgramTable:
        """The index of the prefix's n-grams (built on first use, shared by its requests)."""
        if self._ngrams is None:
            self._ngrams = NgramTable(self.tokens)
        return self._ngrams

    def __post_init__(self) -> None:
        if self.source.length != len(self.tokens):
            raise ValueError(
                f"prefix has {len(self.tokens)} tokens but its KV source holds {self.source.length}"
            )


class ArtifactSource(Protocol):
    """Where a request's prefix gets its compressed KV when it has none yet for a spec
    (`Request.artifacts`; the decoder service's prefix cache: fetched from the store or
    built, as the request's caller). Called on the engine's thread."""

    def load(self, spec: str) -> CompressedKV:
        """The compressed KV for `spec`, checked against the model: neither kept nor charged."""
        ...

    def keep(self, spec: str, kv: CompressedKV) -> None:
        """Keep `kv` with the prefix for later requests; its bytes, which the caller has
        reserved from the budget, are then the keeper's to release."""
        ...


@dataclass
class Request:
    """One generation: a cached prefix and the prompt tokens after it (at least one)."""

    prefix: Prefix
    suffix: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    horizon: int | None = None
    """Drafted tokens per verification for this request; None follows the engine's config."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end the request as an end-of-sequence token does (it is the last
    token), with stop reason "stop"."""
    prepaid: int = 0
    """Budget bytes the caller already reserved for this request's prefix KV, held in
    local memory (a prompt prefilled on the decoder before it was queued). Admission takes
    them over as part of the prefix's charge; a request that ends without being admitted
    has them released."""
    artifacts: ArtifactSource | None = None
    """Where the prefix's compressed KV comes from when `prefix.artifacts` lacks the
    engine's spec: loaded only when the request's group is admitted to draft, or first
    drafts (a group held as full KV holds it may never), and charged to the budget then;
    None: built here from the prefix, uncharged."""

    def __post_init__(self) -> None:
        if not self.suffix:
            raise ValueError("a request needs at least one prompt token after its prefix")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.horizon is not None and self.horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {self.horizon}")
        if self.prepaid < 0:
            raise ValueError(f"prepaid must be >= 0 bytes, got {self.prepaid}")


TokenListener = Callable[[list[int]], None]


class Ticket:
    """A submitted request: verified tokens reach `on_tokens` as they are accepted; `wait`
    returns the result (or raises the error that ended the request)."""

    def __init__(
        self, request: Request, on_tokens: TokenListener | None = None, tenant: str = ""
    ) -> None:
        self.request = request
        self.on_tokens = on_tokens
        self.tenant = tenant
        """Whose request (admission is fair between tenants; "" in-process)."""
        self.prepaid = request.prepaid
        """`request.prepaid` bytes not yet taken over by admission or released."""
        self.submitted = time.perf_counter()
        self.on_done: Callable[[], None] | None = None
        """Called once, from the engine's thread, when the request has ended."""
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.stopping = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Ask the engine to drop the request (the caller went away); thread-safe."""
        self.cancelled = True

    def stop(self) -> None:
        """Ask the engine to end the request with the tokens it has (a stop string in its
        text): it finishes with stop reason "stop" at its next step; thread-safe."""
        self.stopping = True

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        """End the ticket once (later calls are ignored) and call `on_done`."""
        if self._done.is_set():
            return
        self.result, self.error = result, error
        self._done.set()
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:  # the request has ended either way
                log.exception("a request's on_done listener failed")
