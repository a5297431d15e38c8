"""Health checking keeps no state for service names a caller makes up: a Watch of one is
answered SERVICE_UNKNOWN and nothing is filed for it. Real gRPC servers on loopback."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.health import HealthServicer
from tests.waiting import eventually

SERVICE = "vericache.v1.PrefixStore"
Status = health_pb2.HealthCheckResponse


@pytest.fixture
def served():
    servicer = HealthServicer((SERVICE, ""))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, health_pb2_grpc.HealthStub(channel)
    server.stop(0)


def test_watches_of_made_up_names_are_answered_and_leave_nothing(served):
    servicer, stub = served
    streams = [stub.Watch(health_pb2.HealthCheckRequest(service=f"x{i}")) for i in range(200)]
    assert {next(stream).status for stream in streams} == {Status.SERVICE_UNKNOWN}
    assert servicer.watched() == 0  # while all 200 are open
    for stream in streams:
        stream.cancel()
    assert servicer.watched() == 0


def test_a_served_name_is_watched_and_forgotten_when_its_watch_ends(served):
    servicer, stub = served
    stream = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert next(stream).status == Status.SERVING
    assert servicer.watched() == 1
    servicer.set(SERVICE, Status.NOT_SERVING)
    assert next(stream).status == Status.NOT_SERVING
    stream.cancel()
    assert eventually(lambda: servicer.watched() == 0)
    assert stub.Check(health_pb2.HealthCheckRequest(service="")).status == Status.SERVING


def test_a_shard_answers_a_made_up_name_service_unknown(store):
    store.start()
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service="made-up"))
        assert next(stream).status == Status.SERVICE_UNKNOWN
        stream.cancel()
        assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == (Status.SERVING)
