"""A PrefixStore handler's unexpected failure, end to end over loopback with real Redis: the
caller gets INTERNAL with a request id and nothing of the error (no text, paths or
secrets); the shard's log has that id with the traceback; typed errors keep their status
and message; the shard serves on."""

from __future__ import annotations

import logging
import re

import grpc
import pytest
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.status import REQUEST_ID
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(500, 532))
INTERNAL = r"internal error \(request id ([0-9a-f]{12})\); see the server log"


def _secret(*args, **kwargs):
    raise RuntimeError("secret-detail at /var/lib/vericache/token=abc")


def _lookup(channel, auth):
    request = pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=TOKENS)
    return pb_grpc.PrefixStoreStub(channel).Lookup(request, metadata=auth, timeout=10)


def _fetch(channel, auth):
    chunks = [pb.ChunkRef(key=1, tokens=16)]
    request = pb.FetchRequest(layout=LAYOUT.to_proto(pb), chunks=chunks)
    return list(pb_grpc.PrefixStoreStub(channel).Fetch(request, metadata=auth, timeout=10))


@pytest.mark.parametrize(
    ("method", "internal", "call"),
    [("Lookup", "lookup", _lookup), ("Fetch", "fetch", _fetch)],
    ids=["unary", "streaming"],
)
def test_an_unexpected_failure_is_internal_with_only_a_request_id(
    method, internal, call, store, metadata, monkeypatch, caplog
):
    server = store.start()
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT)
    monkeypatch.setattr(server.shard, internal, _secret)
    caplog.set_level(logging.ERROR)
    auth = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            call(channel, auth)
        error = failed.value
        assert error.code() == grpc.StatusCode.INTERNAL
        found = re.fullmatch(INTERNAL, error.details())
        assert found, error.details()
        assert dict(error.trailing_metadata())[REQUEST_ID] == found[1]
        records = [r for r in caplog.records if found[1] in r.getMessage()]
        assert len(records) == 1 and f"PrefixStore.{method}" in records[0].getMessage()
        assert records[0].exc_info is not None and records[0].exc_info[0] is RuntimeError
        assert "secret-detail" in caplog.text and "Traceback" in caplog.text
        monkeypatch.undo()  # the shard serves on
        assert _lookup(channel, auth).cached_tokens == len(TOKENS)


def test_typed_errors_keep_their_status_and_message(store, metadata, caplog):
    store.start()
    token = metadata.add_tenant("alice")
    caplog.set_level(logging.ERROR)
    auth = (("authorization", f"Bearer {token}"),)
    with (
        grpc.insecure_channel(store.endpoints[0]) as channel,
        pytest.raises(grpc.RpcError) as failed,
    ):
        _fetch(channel, auth)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert "request id" not in failed.value.details()
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
