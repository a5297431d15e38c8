"""grpc.aio used from two event loops at once, against a real gRPC server on loopback:
`quiet_grpc_wakeups` keeps grpc's spurious wake-up errors out of the log, and nothing
else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent import futures

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefix_store.client import quiet_grpc_wakeups

CALLS = 300


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@contextlib.contextmanager
def asyncio_errors():
    """The asyncio log's error messages while the block runs."""
    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    collect = Collect(logging.ERROR)
    logging.getLogger("asyncio").addHandler(collect)
    try:
        yield errors
    finally:
        logging.getLogger("asyncio").removeHandler(collect)


def two_loops_calling(address: str, quiet: bool) -> list[str]:
    """Two loops, each on a thread of its own, making CALLS grpc.aio calls to `address`
    (every one answered); the asyncio log's errors meanwhile."""

    async def calls() -> None:
        if quiet:
            quiet_grpc_wakeups(asyncio.get_running_loop())
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(CALLS):
                reply = await stub.Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    with asyncio_errors() as errors, futures.ThreadPoolExecutor(2) as threads:
        for loop in [threads.submit(asyncio.run, calls()) for _ in range(2)]:
            loop.result()
    return errors


def test_two_loops_log_no_spurious_wakeup_errors(health_server):
    if not two_loops_calling(health_server, quiet=False):
        pytest.skip("this grpcio no longer logs spurious wake-ups (grpc/grpc#25364)")
    assert two_loops_calling(health_server, quiet=True) == []


def test_other_errors_still_reach_the_log():
    def fails() -> None:
        raise BlockingIOError("not grpc's")

    async def main() -> None:
        quiet_grpc_wakeups(asyncio.get_running_loop())
        asyncio.get_running_loop().call_soon(fails)
        await asyncio.sleep(0.05)

    with asyncio_errors() as errors:
        asyncio.run(main())
    assert len(errors) == 1 and "fails" in errors[0]
