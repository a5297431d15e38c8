"""A hostile client that knows nothing of the project: it learns a service's methods and
messages from the server's own reflection, then sends garbage bytes and well-formed
messages with wild values to every method. Used by the hostile-input sweeps."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

# What a server may answer to hostile input: anything but "we broke" (UNKNOWN, INTERNAL).
BROKEN = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
WILD_INTS = (0, 1, 2**31 - 1, 2**32 - 1)
WILD_INT64 = (*WILD_INTS, 2**63 - 1, 2**64 - 1)
WILD_STRINGS = ("", "x" * 300, "../../etc/passwd", "\u202e\x00", "snapkv:budget=99")


@dataclass(frozen=True)
class Method:
    path: str
    request: type
    client_streaming: bool
    server_streaming: bool


def methods(channel: grpc.Channel, service: str) -> list[Method]:
    """Every method of `service`, with its request class, from the server's reflection."""
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    found = pool.FindServiceByName(service)
    return [
        Method(
            f"/{service}/{m.name}",
            message_factory.GetMessageClass(m.input_type),
            m.client_streaming,
            m.server_streaming,
        )
        for m in found.methods
    ]


def wild_message(cls: type, rng: random.Random, depth: int = 0):
    """A well-formed message of `cls` whose fields hold extreme or nonsensical values."""
    message = cls()
    oneofs_done = set()
    for field in message.DESCRIPTOR.fields:
        if field.containing_oneof is not None:
            if field.containing_oneof.name in oneofs_done or rng.random() < 0.5:
                continue
            oneofs_done.add(field.containing_oneof.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                values = [
                    wild_message(
                        message_factory.GetMessageClass(field.message_type), rng, depth + 1
                    )
                ]
                if field.is_repeated:
                    getattr(message, field.name).extend(values * rng.choice((1, 3)))
                else:
                    getattr(message, field.name).CopyFrom(values[0])
            continue
        values = [wild_scalar(field, rng) for _ in range(rng.choice((1, 5, 2000)))]
        if field.is_repeated:
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, values[0])
    return message


def wild_scalar(field: FieldDescriptor, rng: random.Random):
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return rng.choice(WILD_STRINGS)
    if kind == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 16, 64, 4096)))
    if kind == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice((0.0, -1.0, 1e30, float("inf"), float("nan")))
    if kind in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return rng.choice((0, -1, 2**31 - 1, -(2**31)))
    if kind in (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED64,
    ):
        return rng.choice((0, -1, 2**63 - 1, -(2**63)))
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return rng.choice(WILD_INT64)
    if kind == FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    return rng.choice(WILD_INTS)  # uint32, fixed32


def payloads(method: Method, rng: random.Random, count: int) -> Iterator[bytes]:
    """Garbage bytes, an empty message, then well-formed wild messages."""
    yield b""
    yield rng.randbytes(64)
    yield b"\xff" * 32
    for _ in range(count):
        yield wild_message(method.request, rng).SerializeToString()


def call(channel: grpc.Channel, method: Method, payload: bytes, metadata, timeout: float):
    """The status code one call ends with (OK included)."""
    kind = (method.client_streaming, method.server_streaming)
    try:
        if kind == (False, False):
            channel.unary_unary(method.path)(payload, metadata=metadata, timeout=timeout)
        elif kind == (False, True):
            for _ in channel.unary_stream(method.path)(payload, metadata=metadata, timeout=timeout):
                pass
        elif kind == (True, False):
            channel.stream_unary(method.path)(
                iter([payload, payload]), metadata=metadata, timeout=timeout
            )
        else:
            for _ in channel.stream_stream(method.path)(
                iter([payload]), metadata=metadata, timeout=timeout
            ):
                pass
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def sweep(address: str, service: str, tokens: list[str], count: int = 6, timeout: float = 30):
    """Every method, every payload, as every token ("" = none): (method, code, details) of
    each call that ended UNKNOWN or INTERNAL."""
    rng = random.Random(20261203)
    broken = []
    with grpc.insecure_channel(address) as channel:
        for method in methods(channel, service):
            for token in tokens:
                metadata = [("authorization", f"Bearer {token}")] if token else []
                for payload in payloads(method, rng, count):
                    code, details = call(channel, method, payload, metadata, timeout)
                    if code in BROKEN:
                        broken.append((method.path, code, details))
    return broken
