"""What a call's request may be: the message of each method (`REQUESTS`, `STREAMS`), the
bound of the small ones, and the KV layout a request names (`layout_of`)."""

from __future__ import annotations

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import InvalidArgument
from prefix_store.layout import KVLayout

SMALL_REQUEST = 64 * 1024
"""Largest request of Describe, Stats and the artifact methods with one request (they carry
a few names)."""
SMALL_REQUESTS = frozenset(
    {"Describe", "Stats", "FetchArtifact", "OpenPutArtifact", "OpenFetchArtifact"}
)
REQUESTS = {
    "Describe": pb.DescribeRequest,
    "Lookup": pb.LookupRequest,
    "Delete": pb.DeleteRequest,
    "OpenFetch": pb.FetchRequest,
    "OpenPut": pb.PutHeader,
    "Stats": pb.StatsRequest,
    "Fetch": pb.FetchRequest,
    "FetchArtifact": pb.FetchArtifactRequest,
    "OpenPutArtifact": pb.ArtifactId,
    "OpenFetchArtifact": pb.FetchArtifactRequest,
}
"""The request message of each method with one request; `app.handlers` passes them raw."""
STREAMS = {"Put": None, "PutArtifact": pb.PutArtifactRequest, "Attend": pb.AttendRequest}
"""The message of each client stream; None: the handler parses the raw bytes (Put: `wire`)."""


def layout_of(message) -> KVLayout:
    """The KV layout a request names (InvalidArgument when it names none)."""
    if not message.HasField("layout"):
        raise InvalidArgument("layout: required")
    return KVLayout.from_proto(message.layout)
