"""The engine: one runner, one KV budget, continuous batching over three modes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV, CompressorPipeline, parse_compressor
from decoder.engine.admission import Admission
from decoder.engine.config import EngineConfig
from decoder.engine.exact import ExactPasses
from decoder.engine.guesses import Guesses
from decoder.engine.planner import RoundPlanner
from decoder.engine.prefix_work import compressed
from decoder.engine.request import Prefix, Request, Ticket, TokenListener
from decoder.engine.residency import Residency
from decoder.engine.speculative import Speculator
from decoder.engine.state import InFlight, Running, grouped
from decoder.engine.stats import EngineStats
from decoder.errors import Cancelled
from decoder.generate import GenerationResult
from decoder.horizon import CostModel, HorizonPolicy
from decoder.runner import ModelRunner
from decoder.staging import LayerRing

log = logging.getLogger(__name__)


class Engine:
    """Decodes requests with one runner under one KV budget. `submit` is thread-safe; one
    thread calls `step` (or `run`, which submits a batch and steps until it is done)."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        budget: KVBudget | None = None,
    ) -> None:
        """budget: shared with other engines of the same worker; default: one of
        `config.kv_budget` bytes for this engine alone."""
        self.runner = runner
        self.config = config or EngineConfig()
        self.eos = frozenset(eos_token_ids)
        self.pipeline: CompressorPipeline | None = (
            None if self.config.mode == "full" else parse_compressor(self.config.compressor)
        )
        if self.config.mode != "full" and self.config.draft_mode == "fast":
            runner.prepare_fast()  # before any draft step is timed
        self.costs = CostModel()
        self.guesses = Guesses(self.config.ngram, self.costs)
        self.budget = budget if budget is not None else KVBudget(self.config.kv_budget)
        self.ring = LayerRing(runner.config, runner.rc.key_chunk, self.config.staging_depth)
        self.stats = EngineStats()
        self.flight = InFlight()
        self.residency = Residency(runner, self.config, self.budget, self.ring, self.flight)
        self.exact = ExactPasses(runner, self.ring, self.config.placement, self.residency.recover)
        self.planner = RoundPlanner(
            HorizonPolicy(self.config.horizon, self.config.max_horizon),
            self.costs,
            self.config.stagger,
            self.ring.stats,
            self.stats,
            lambda r: self.admission.drafting.room(r),
        )
        self.admission = Admission(
            runner,
            self.config,
            self.pipeline,
            self.budget,
            self.ring,
            self.eos,
            self.stats,
            self.flight,
            self.residency,
            self.planner.drafts,
        )
        self.speculator = Speculator(
            runner,
            self.config.draft_mode,
            self.exact,
            self.costs,
            self.stats,
            self._each,
            self.eos,
        )
        self._iteration = 0

    # -- public API -------------------------------------------------------------------------

    @property
    def observe_window(self) -> int:
        """Prefix queries a prefill must keep for this engine's compressor."""
        return self.pipeline.observe_window if self.pipeline else 0

    @property
    def in_flight(self) -> int:
        """Requests being decoded."""
        return len(self.flight.running)

    @property
    def queued(self) -> int:
        """Requests waiting for admission."""
        return self.admission.queued

    @property
    def busy(self) -> bool:
        """Requests in flight or queued."""
        return bool(self.in_flight or self.queued)

    def compressed(self, prefix: Prefix) -> CompressedKV:
        """The prefix's compressed KV for this engine's spec, built once per prefix."""
        assert self.pipeline is not None, "full mode compresses nothing"
        return compressed(self.pipeline, prefix, self.runner.config)

    def submit(
        self, request: Request, on_tokens: TokenListener | None = None, tenant: str = ""
    ) -> Ticket:
        """Queue a request; `tenant` is whose it is (admission is fair between tenants)."""
        ticket = Ticket(request, on_tokens, tenant)
        self.admission.submit(ticket)
        return ticket

    def run(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Decode every request to its stop; results in request order."""
        if not requests:
            raise ValueError("run needs at least one request")
        tickets = [self.submit(r) for r in requests]
        while not all(t.done for t in tickets):
            self.step()
        return [t.wait() for t in tickets]

    def step(self) -> bool:
        """Admit what fits, prefill the new requests, advance everything one iteration.
        Returns False when nothing could be done (the queue waits for room).

        Errors end requests, not the engine: one raised for one request (admission, its
        draft state, sampling, listener) or for the requests over one prefix (their draft
        pass) fails those alone; one raised by a pass shared by several prefixes fails the
        requests in flight. Either way the others, the queue and later submissions go on;
        a failed request's ticket raises its error."""
        self.runner.ensure_exact_supported()
        fresh = self.admission.admit()  # schedule
        live: list[Running] = []
        try:  # run
            if fresh:
                self._prefill(fresh)
            live = [r for r in self.flight.running if not r.done]
            if live:
                self._advance(live)
        except Exception as error:  # not attributable to a request: a bug in a shared pass
            log.exception("an engine pass failed; failing the requests in flight")
            self.ring.cancel()
            for r in self.flight.running:
                r.fail(error)
        self.admission.retire(self._deliver)  # postprocess
        return bool(fresh or live)

    def close(self) -> None:
        """Stop the prefetch reader and fail whatever is still queued or in flight."""
        self.abort(RuntimeError("the engine was closed"))

    def abort(self, error: BaseException) -> None:
        """Fail everything queued or in flight with `error`. The engine stays usable:
        requests submitted afterwards are served."""
        self.ring.cancel()
        for t in self.admission.drain():
            t.finish(None, error)
        for r in self.flight.running:
            r.fail(error)
        self.admission.retire(self._deliver)

    # -- one iteration ----------------------------------------------------------------------

    def _prefill(self, fresh: list[Running]) -> None:
        """Exact prefill of the new requests' suffixes: their first token."""
        t0 = time.perf_counter()
        logits = self.exact.run([(r, r.req.suffix, "last") for r in fresh])
        seconds = time.perf_counter() - t0
        self._each(fresh, logits, lambda r, lg: _first_token(r, lg, seconds))
        if self.config.mode == "vericache":
            started = [r for r in fresh if not r.done]
            self.planner.plan(started, self._iteration, self.flight.running)

    def _advance(self, live: list[Running]) -> None:
        {
            "full": self._full_step,
            "lossy": self._lossy_step,
            "vericache": self._vericache_step,
        }[self.config.mode](live)
        self._iteration += 1

    def _full_step(self, live: list[Running]) -> None:
        """Full-KV baseline: one exact step over the resident prefixes, checking each
        request's n-gram guesses in the same pass (when on)."""
        t0 = time.perf_counter()
        self.guesses.exact(live)
        self.speculator.verify(live)
        self.stats.full_s += time.perf_counter() - t0
        self.stats.full_steps += 1
        self.stats.steps += 1

    def _lossy_step(self, live: list[Running]) -> None:
        """Compressed decoding (not lossless): one draft-mode step, emitted as is."""
        self.stats.steps += 1
        guess = self.guesses.drafted()
        self.speculator.decode(live, lambda r: guess(r, r.remaining - 1))

    def _vericache_step(self, live: list[Running]) -> None:
        """Requests still drafting draft one token; requests whose round is drafted verify
        together; the next pass's pull starts before the draft step. Requests keep their
        own rounds, so a short horizon never waits for a long one."""
        drafting = [r for r in live if _drafting(r, self.eos)]
        upcoming = [r for r in live if r not in drafting or len(r.drafts) + 1 >= r.horizon]
        pulled = dict.fromkeys(r.group for r in grouped(upcoming, lambda r: r.group))
        pulled = [g for g in pulled if g.resident is None and not self.exact.attends_near(g)]
        if pulled:
            self.ring.begin([g.pass_group() for g in pulled])
        if drafting:
            guess = self.guesses.drafted()  # never past the round's horizon:
            self.speculator.draft(drafting, lambda r: guess(r, r.horizon - len(r.drafts) - 1))
        ready = [r for r in live if not r.done and not _drafting(r, self.eos)]
        if ready:
            self.guesses.exact([r for r in ready if r.horizon == 0])
            self.speculator.verify(ready)
            verified = [r for r in ready if not r.done]
            self.planner.plan(verified, self._iteration + 1, self.flight.running)

    def _each(self, requests: list[Running], values: Sequence, work: Callable) -> None:
        """`work(r, value)` for each request still running; an error fails that one alone."""
        for r, value in zip(requests, values, strict=True):
            if r.done:
                continue
            try:
                work(r, value)
            except Exception as error:
                log.warning("a request failed alone: %r", error, exc_info=True)
                r.fail(error)

    # -- results ----------------------------------------------------------------------------

    def _deliver(self, r: Running) -> None:
        try:
            result = self._result(r)
        except Exception as error:
            log.warning("a request's result failed: %r", error, exc_info=True)
            r.ticket.finish(None, error)
            return
        r.ticket.finish(result, None)

    def _result(self, r: Running) -> GenerationResult:
        s = r.stats
        now = time.perf_counter()
        decode_s = now - r.decode_start
        busy = s.compress_s + s.prefill_s + decode_s
        group = r.group
        stats: dict[str, float | int | str] = {
            "mode": self.config.mode,
            "prefix_tokens": group.source.length,
            "prompt_tokens": group.source.length + len(r.req.suffix),
            "generated_tokens": len(r.out),
            "compress_s": round(s.compress_s, 4),
            "prefill_s": round(s.prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "queue_s": round(r.admitted - r.ticket.submitted, 4),
            "latency_s": round(now - r.ticket.submitted, 4),
            "tokens_per_s": round(len(r.out) / busy, 3) if busy > 0 else 0.0,
            "full_bytes": group.source.nbytes,
            "pulled_bytes": int(s.pulled_bytes),
            "near_bytes": int(s.near_bytes),
            "near_passes": s.near_passes,
            "near_wire_s": round(s.near_wire_s, 4),
            "near_shard_s": round(s.near_shard_s, 4),
            "near_retries": s.near_retries,
            "peak_staging_bytes": self.exact.peak_staging_bytes,
            "recomputed": group.local,
            "resident_prefix": group.resident is not None,
        }
        if r.req.sampling.temperature > 0:
            stats["seed"] = r.sampler.params.seed
        if group.draft is not None:
            compressed = group.draft.compressed
            stats.update(
                compressor=compressed.spec,
                compressed_bytes=compressed.nbytes,
                compression_ratio=round(compressed.ratio, 3),
            )
        if self.config.ngram:
            stats.update(s.ngram())
        if self.config.mode == "vericache":
            stats.update(s.speculation(len(r.out)))
            stats.update(
                fetch_s=round(self.ring.stats.read_s, 4),
                fetch_stall_s=round(self.ring.stats.stall_s, 4),
                draft_s=round(self.stats.draft_s - r.at_admission.draft_s, 4),
                verify_s=round(self.stats.verify_s - r.at_admission.verify_s, 4),
            )
        stats.update(self.stats.step_times(since=r.at_admission))
        stats["batch_steps"] = int(self.stats.steps - r.at_admission.steps)
        return GenerationResult(tokens=r.out, stop_reason=r.stop_reason or "length", stats=stats)


def _first_token(r: Running, logits: torch.Tensor, prefill_s: float) -> None:
    """A prefilled request: its first token, and its draft tail mirrors its exact one."""
    r.start(prefill_s)
    r.emit([r.sampler.choose(logits[-1], 0)])
    if r.draft is not None:
        r.draft.copy_tail(r.tail, 0, len(r.tail))


def _drafting(r: Running, eos: frozenset[int]) -> bool:
    """Whether the request's round still drafts (not at its horizon, no end token drafted)."""
    last = r.drafts[-1] if r.drafts else None
    return len(r.drafts) < r.horizon and not (last in eos or last in r.req.stop_ids)


__all__ = ["Cancelled", "Engine"]
