"""Decoder requests as a real decoder parses them (`decoder.service.server`: authenticate,
then `parse`, then `DecoderWorker.parse_generate` and the sampling checks). Structure-
aware: a valid GenerateRequest, PublishRequest or InfoRequest with wild field values, then
byte damage. Clear error: a precise status (INVALID_ARGUMENT naming the field, ...), never
UNKNOWN or INTERNAL nor a hang; the decoder keeps serving."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from vericache.v1 import decoder_pb2 as dpb

from tests.fuzz.mutate import mutated, share
from tests.fuzz.test_grpc_requests import wild
from tests.hostile import BROKEN, Method, call

VALID = {
    "Generate": dpb.GenerateRequest(
        text="The capital of France is",
        max_new_tokens=2,
        sampling=dpb.Sampling(temperature=0.5, top_k=4, top_p=0.9, seed=1),
        mode="vericache",
        compressor="snapkv:budget=0.5",
    ),
    "Publish": dpb.PublishRequest(
        text="A shared prefix of a few words.", compressors=["snapkv:budget=0.5"]
    ),
    "Info": dpb.InfoRequest(),
}


@pytest.fixture(scope="module")
def decoder(shard, builtin_model):
    from decoder.service.config import DecoderConfig
    from decoder.service.server import DecoderServer
    from decoder.service.worker import DecoderWorker
    from prefix_store.config import ClientConfig

    store, token = shard
    config = DecoderConfig(
        tuple(store.endpoints),
        max_new_tokens=4,
        client=ClientConfig(timeout_s=10, retries=2, backoff_s=0.05),
    )
    server = DecoderServer(config, DecoderWorker(config, model=builtin_model))
    server.start()
    with grpc.insecure_channel(server.address) as channel:
        yield channel, (("authorization", f"Bearer {token}"),)
    server.stop(0)


def send(channel, method: str, raw: bytes, metadata):
    target = Method(f"/vericache.v1.Decoder/{method}", None, False, method == "Generate")
    return call(channel, target, raw, metadata, timeout=120)


@share(0.2)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_a_decoder_answers_every_request(decoder, method, data):
    channel, metadata = decoder
    raw = data.draw(mutated(wild(VALID[method]), max_edits=2))
    code, details = send(channel, method, raw, metadata)
    event(f"{method}: {code.name}")
    assert code not in BROKEN | {grpc.StatusCode.DEADLINE_EXCEEDED}, (method, code, details)
    assert send(channel, "Info", b"", metadata)[0] == grpc.StatusCode.OK
