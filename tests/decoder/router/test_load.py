"""The router learns decoders' load from their Info, presenting the deployment's internal
credential: it ranks the less-loaded decoder first, falls back to its own counts when a
decoder refuses the credential, and reads a real decoder's Info with it.

Stand-in decoders serve health checking and Info alone (the figures a test sets), checking
the credential as a decoder does; the last test uses a real decoder and store.
"""

from __future__ import annotations

import grpc
import pytest
from vericache.v1 import decoder_pb2 as dpb

from decoder.internal import InternalCredential, load_or_create_credential
from decoder.router.config import RouterConfig
from decoder.router.members import Members
from decoder.router.policies import Load, make_policy
from decoder.router.policies.affinity import rendezvous
from rpc.server import grpc_server
from tests.decoder.service.conftest import serve
from tests.waiting import eventually

SERVICE = "vericache.v1.Decoder"


class StandIn:
    """A decoder's Info and health, reporting `info`; only `credential` may read it."""

    def __init__(self, credential: InternalCredential, info: dpb.InfoResponse) -> None:
        self.credential, self.info = credential, info
        method = grpc.unary_unary_rpc_method_handler(
            self.Info,
            request_deserializer=dpb.InfoRequest.FromString,
            response_serializer=dpb.InfoResponse.SerializeToString,
        )
        handler = grpc.method_handlers_generic_handler(SERVICE, {"Info": method})
        self.server, port = grpc_server(handler, SERVICE, "127.0.0.1:0", None, workers=2,
                                        name="standin")  # fmt: skip
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def Info(self, request, context):  # noqa: N802 - the gRPC method's name
        token = dict(context.invocation_metadata()).get("authorization", "")
        if not self.credential.matches(token.removeprefix("Bearer ")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown token")
        return self.info


@pytest.fixture
def credential_file(tmp_path):
    path = tmp_path / "internal.token"
    load_or_create_credential(path)
    return path


@pytest.fixture
def stand_ins(credential_file):
    credential = load_or_create_credential(credential_file)
    busy = dpb.InfoResponse(in_flight=5, queued=3, kv_budget=1000, kv_used=400)
    idle = dpb.InfoResponse(in_flight=0, queued=0, kv_budget=1000, kv_used=100)
    servers = [StandIn(credential, busy), StandIn(credential, idle)]
    yield servers
    for server in servers:
        server.server.stop(0)


def members_of(servers, credential_file) -> tuple[RouterConfig, Members]:
    config = RouterConfig(
        ("127.0.0.1:1",),
        decoders=tuple(s.address for s in servers),
        internal_token_file=credential_file,
        poll_s=0.05,
    )
    return config, Members(config)


def test_the_less_loaded_decoder_by_its_info_is_ranked_first(stand_ins, credential_file):
    busy, idle = stand_ins
    config, members = members_of(stand_ins, credential_file)
    try:
        want = {busy.address: Load(8, 0.4), idle.address: Load(0, 0.1)}
        assert eventually(lambda: members.loads() == want), members.loads()
        identity = next(i for i in range(100) if rendezvous(i, list(want))[0] == busy.address)
        ranking = make_policy(config).ranking(identity)
        assert ranking(members.loads()) == [idle.address, busy.address]  # busy is past its bound
        assert ranking({d: Load() for d in want})[0] == busy.address  # idle: affinity decides
    finally:
        members.close()


def test_a_decoder_refusing_the_credential_counts_as_this_routers_load(
    stand_ins, credential_file, tmp_path, caplog
):
    other = tmp_path / "other.token"
    load_or_create_credential(other)
    _, members = members_of(stand_ins, other)
    try:
        assert eventually(lambda: all(s["healthy"] for s in members.snapshot()))
        assert eventually(lambda: all(m.refused for m in members._members.values()))
        assert set(members.loads().values()) == {Load()}
        assert caplog.text.count("refuses the deployment's internal credential") == 2
        assert other.read_text().strip() not in caplog.text
    finally:
        members.close()


def test_a_router_named_a_missing_credential_does_not_start(tmp_path):
    config = RouterConfig(("127.0.0.1:1",), internal_token_file=tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="internal credential .* missing on this host"):
        Members(config)


def test_a_router_reads_a_real_decoders_info_with_the_credential(
    store, builtin_model, credential_file
):
    decoder = serve(store.endpoints, builtin_model, internal_token_file=credential_file)
    _, members = members_of([decoder], credential_file)
    try:
        member = members._members[decoder.address]
        assert eventually(lambda: member.failures == 0 and member.healthy)
        assert eventually(lambda: decoder_info_calls(decoder) >= 2)
        assert not member.refused
    finally:
        members.close()
        decoder.stop(0)


def decoder_info_calls(decoder) -> float:
    """Info calls the decoder answered OK (its RPC counter)."""
    registry = decoder.worker.metrics.registry
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if labels.get("method") == "Info" and labels.get("code") == "OK":
                total += sample.value if sample.name.endswith("_total") else 0
    return total
