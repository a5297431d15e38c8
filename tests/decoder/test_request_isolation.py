"""A failure tied to one request fails that request alone: the other requests in the same
engine (and in the same passes) still equal full-KV decoding token for token, and the engine
keeps serving. A failure of a pass shared by several prefixes fails that pass's requests,
and the queue and later requests are served."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import replace

import pytest

from decoder.compressors import CompressedKV
from decoder.compressors.artifact import ArtifactFormatError
from decoder.compressors.kivi import QuantizedLayer
from decoder.engine import Engine, EngineConfig, Request, prefill_prefix
from decoder.generate import generate_full

NEW = 16
SNAPKV = "snapkv:budget=0.125"
KIVI = "kivi:bits=4,residual=32"


@pytest.fixture(scope="module")
def doc(builtin_model):
    return builtin_model.encode(inspect.getsource(textwrap))[:520]


@pytest.fixture(scope="module")
def suffixes(builtin_model):
    questions = ["# What does fill do?", "# Summarise.", "# List the classes."]
    return [builtin_model.encode(f"\n{q}\n")[1:] for q in questions]


@pytest.fixture(scope="module")
def references(builtin_model, builtin_runner, doc, suffixes):
    return [
        r.tokens
        for r in generate_full(
            builtin_runner,
            [doc + s for s in suffixes],
            max_new_tokens=NEW,
            eos_token_ids=builtin_model.eos_token_ids,
        )
    ]


def engine(runner, model, **config) -> Engine:
    """An engine whose vericache passes pull (failures of shared passes are what is tested)."""
    config.setdefault("horizon", 4)
    config.setdefault("resident", False)
    return Engine(runner, EngineConfig(**config), model.eos_token_ids)


def drain(e: Engine, tickets) -> None:
    """Step the engine until every ticket has ended (a raising step fails the test)."""
    while not all(t.done for t in tickets):
        e.step()


def _zero_layers(good: CompressedKV) -> CompressedKV:
    return replace(good, layers=[])


def _half_head_dim(good: CompressedKV) -> CompressedKV:
    """Every dense layer's keys and values cut to half the head dim."""
    for layer in good.layers:
        half = layer.k.shape[-1] // 2
        layer.k, layer.v = layer.k[..., :half].contiguous(), layer.v[..., :half].contiguous()
    return good


def _narrow_residual(good: CompressedKV) -> CompressedKV:
    """A quantized layer whose full-precision residual has the wrong head dim."""
    layer = good.layers[7]
    layer.residual_k, layer.residual_v = layer.residual_k[..., :-8], layer.residual_v[..., :-8]
    return good


@pytest.mark.parametrize(
    ("spec", "corrupt", "message"),
    [
        (SNAPKV, _zero_layers, r"0 layers, want the model's \d+"),
        (SNAPKV, _half_head_dim, r"layer 0: k: shape \[\d+, \d+, 32\], want \[\d+, \d+, 64\]"),
        (KIVI, _narrow_residual, r"layer 7: residual_k: shape"),
    ],
    ids=["zero-layers", "wrong-head-dim", "wrong-quantized-residual"],
)
def test_an_artifact_that_does_not_fit_fails_its_own_requests_alone(
    spec, corrupt, message, builtin_model, builtin_runner, doc, suffixes, references
):
    bad, good = prefill_prefix(builtin_runner, doc), prefill_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, compressor=spec)
    bad.artifacts[e.pipeline.spec] = corrupt(e.compressed(bad))
    tickets = [
        e.submit(Request(bad, suffixes[0], NEW)),
        e.submit(Request(good, suffixes[1], NEW)),
        e.submit(Request(bad, suffixes[2], NEW)),
        e.submit(Request(good, suffixes[2], NEW)),
    ]
    drain(e, tickets)
    for ticket in (tickets[0], tickets[2]):
        with pytest.raises(ArtifactFormatError, match=message):
            ticket.wait()
    assert tickets[1].wait().tokens == references[1]
    assert tickets[3].wait().tokens == references[2]
    assert e.budget.used == 0 and not e.busy


class FaultyLayer(QuantizedLayer):
    """A quantized layer that fits the model but fails when decoded (a corrupted copy)."""

    def __init__(self, layer: QuantizedLayer) -> None:
        vars(self).update(vars(layer))

    def materialize(self):
        raise RuntimeError("corrupted layer")


def test_a_draft_pass_that_fails_over_one_prefix_fails_only_its_requests(
    builtin_model, builtin_runner, doc, suffixes, references
):
    bad, good = prefill_prefix(builtin_runner, doc), prefill_prefix(builtin_runner, doc)
    e = engine(builtin_runner, builtin_model, compressor=KIVI, stagger=False)
    e.compressed(bad).layers[5] = FaultyLayer(e.compressed(bad).layers[5])
    tickets = [e.submit(Request(p, s, NEW)) for p, s in zip((bad, good), suffixes, strict=False)]
    drain(e, tickets)
    with pytest.raises(RuntimeError, match="corrupted layer"):
        tickets[0].wait()
    assert tickets[1].wait().tokens == references[1]
    # The engine goes on: a later request over the good prefix decodes as before.
    assert e.run([Request(good, suffixes[2], NEW)])[0].tokens == references[2]
    assert e.budget.used == 0


def test_a_request_whose_listener_raises_fails_alone(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = prefill_prefix(builtin_runner, doc)  # one prefix: both verify in the same passes
    e = engine(builtin_runner, builtin_model, compressor=SNAPKV)

    def hang_up(tokens: list[int]) -> None:
        raise BrokenPipeError("the caller went away")

    streamed: list[int] = []
    tickets = [
        e.submit(Request(prefix, suffixes[0], NEW), on_tokens=hang_up),
        e.submit(Request(prefix, suffixes[1], NEW), on_tokens=streamed.extend),
    ]
    drain(e, tickets)
    with pytest.raises(BrokenPipeError):
        tickets[0].wait()
    assert tickets[1].wait().tokens == references[1] == streamed
    assert e.budget.used == 0


def test_a_token_outside_the_vocabulary_fails_at_admission_alone(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefix = prefill_prefix(builtin_runner, doc)
    vocab = builtin_model.config.vocab_size
    e = engine(builtin_runner, builtin_model, compressor=SNAPKV)
    tickets = [
        e.submit(Request(prefix, [*suffixes[0][:-1], vocab], NEW)),
        e.submit(Request(prefix, suffixes[1], NEW)),
    ]
    drain(e, tickets)
    with pytest.raises(ValueError, match=rf"token id {vocab} is outside the vocabulary"):
        tickets[0].wait()
    assert tickets[1].wait().tokens == references[1]


class FlakyRunner:
    """The real runner, whose `fail_at`-th exact forward raises (a fault in a shared pass)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.exact_calls = 0
        self.fail_at: int | None = None

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, seqs, mode="exact"):
        if mode == "exact":
            self.exact_calls += 1
            if self.exact_calls == self.fail_at:
                raise RuntimeError("kernel fault")
        return self._runner.forward(seqs, mode)


def test_a_failed_shared_pass_fails_its_requests_and_the_engine_serves_on(
    builtin_model, builtin_runner, doc, suffixes, references
):
    prefixes = [prefill_prefix(builtin_runner, doc) for _ in range(4)]  # distinct prefixes
    probe = engine(builtin_runner, builtin_model, stagger=False)
    probe.run([Request(prefixes[0], suffixes[0], NEW)])
    runner = FlakyRunner(builtin_runner)
    limit = int(probe.budget.peak * 2.5)  # two requests in flight, the third waits
    e = engine(runner, builtin_model, stagger=False, kv_budget=limit)
    first = [e.submit(Request(p, s, NEW)) for p, s in zip(prefixes[1:3], suffixes, strict=False)]
    queued = e.submit(Request(prefixes[3], suffixes[2], NEW))
    e.step()  # admits two, prefills them (exact pass 1), drafts
    assert e.in_flight == 2 and e.queued == 1
    runner.fail_at = runner.exact_calls + 1  # their next verification
    drain(e, first)
    for ticket in first:
        with pytest.raises(RuntimeError, match="kernel fault"):
            ticket.wait()
    drain(e, [queued])
    assert queued.wait().tokens == references[2]
    assert e.run([Request(prefixes[1], suffixes[0], NEW)])[0].tokens == references[0]
    assert e.budget.used == 0
