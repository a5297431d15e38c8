"""One identity domain per request (issue 28, item 8): once a decoder streamed a request's
first tokens, the router moves the request only to a decoder of the same model id (model
and exact kernel). Real decoders over a real shard: the built-in model, and a tiny model
of another identity; the first is stopped mid-stream. Before, the request moved to the
other model and ended in DATA_LOSS; now it fails UNAVAILABLE naming the domain, and with
a same-domain decoder beside, it is continued there without a gap."""

from __future__ import annotations

import threading

import pytest

from decoder.generate import generate_full
from decoder.internal import load_or_create_credential
from decoder.loader import load_model
from decoder.router import RouterConfig, RouterServer
from decoder.router.server import load_tokenizer
from decoder.service.client import DecoderClient, GenerateReply
from prefix_store.config import ClientConfig
from prefix_store.errors import Unavailable
from tests.decoder.router.test_router import client_salt, documents, owner
from tests.decoder.service.conftest import serve
from tests.decoder.test_hf_models import tiny
from tests.waiting import eventually

NEW = 24


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, builtin_model):
    """A tiny random Llama with the built-in tokenizer: another identity domain."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("other-model")
    tiny(LlamaConfig, LlamaForCausalLM, folder, builtin_model)
    return load_model(folder)


def deployment(store, tmp_path, models):
    credential = tmp_path / "internal.token"
    load_or_create_credential(credential)
    decoders = [serve(store.endpoints, m, worker_id=f"decoder-{i}", internal_token_file=credential)
                for i, m in enumerate(models)]  # fmt: skip
    config = RouterConfig(tuple(store.endpoints), decoders=tuple(d.address for d in decoders),
                          client=ClientConfig(timeout_s=10, retries=2, backoff_s=0.05),
                          poll_s=0.2, internal_token_file=credential)  # fmt: skip
    router = RouterServer(config, tokenizer=load_tokenizer(None))
    router.start()
    assert eventually(lambda: all(router.servicer.members.model_id(d.address) for d in decoders))
    return router, decoders


def stream_stopping_first(router, decoders, token, prompt, store) -> tuple[GenerateReply, str]:
    """Stream `prompt` through the router, stopping the decoder it went to after 3 tokens."""
    first = owner(prompt, client_salt(store, token), decoders)
    victim = next(d for d in decoders if d.address == first)
    stopped = threading.Event()
    reply = GenerateReply()
    with DecoderClient(router.address, token) as client:
        for _ in client.stream(reply=reply, token_ids=prompt, max_new_tokens=NEW, mode="full"):
            if not stopped.is_set() and len(reply.tokens) >= 3:
                stopped.set()
                victim.server.stop(0)
    return reply, first


def prompt_owned_by(model, store, token, decoders, index: int) -> list[int]:
    """A prompt the router sends to `decoders[index]` first: one of 64 (the tenant's salt
    and the decoders' ports are random; 8 left it none about once in 128 runs)."""
    salt, wanted = client_salt(store, token), decoders[index].address
    doc = documents(model, 1)[0]
    prompts = (model.encode(f"# Part {i} of the module:\n") + doc for i in range(64))
    return next(p for p in prompts if owner(p, salt, decoders) == wanted)


def test_a_request_never_moves_to_another_identity_domain(
    store, tmp_path, metadata, builtin_model, other_model
):
    router, decoders = deployment(store, tmp_path, [builtin_model, other_model])
    try:
        ids = {router.servicer.members.model_id(d.address) for d in decoders}
        assert len(ids) == 2, ids  # two domains
        token = metadata.add_tenant("alice")
        prompt = prompt_owned_by(builtin_model, store, token, decoders, 0)
        with pytest.raises(Unavailable, match="only decoders of model id"):  # not DATA_LOSS
            stream_stopping_first(router, decoders, token, prompt, store)
    finally:
        router.stop(0)
        for d in decoders[1:]:
            d.server.stop(0)


def test_within_its_domain_a_request_moves_without_a_gap(
    store, tmp_path, metadata, builtin_model, builtin_runner, other_model
):
    router, decoders = deployment(store, tmp_path, [builtin_model, other_model, builtin_model])
    try:
        token = metadata.add_tenant("alice")
        prompt = prompt_owned_by(builtin_model, store, token, decoders, 0)
        want = generate_full(builtin_runner, [prompt], max_new_tokens=NEW,
                             eos_token_ids=builtin_model.eos_token_ids)[0].tokens  # fmt: skip
        reply, first = stream_stopping_first(router, decoders, token, prompt, store)
        assert reply.tokens == want
        assert reply.stats["router"]["decoders"] == [first, decoders[2].address]
    finally:
        router.stop(0)
        for d in decoders[1:]:
            d.server.stop(0)
