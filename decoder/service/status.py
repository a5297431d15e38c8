"""The decoder's errors as gRPC status codes (`STATUS`): its own table, over the store's
(a decoder's call that fails with a store error fails with that error's code); the calls
end through `rpc.status.StatusMap.abort`."""

from __future__ import annotations

import logging

import grpc

from decoder.errors import (
    ArtifactFormatError,
    Cancelled,
    CompressorSpecError,
    ExactModeUnsupported,
    OverBudget,
    ShuttingDown,
    Unreachable,
)
from rpc.status import STORE, StatusMap


class BadRequest(ValueError):
    """A Generate or Publish request that cannot be served as sent."""


STATUS = StatusMap(
    {
        BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
        CompressorSpecError: grpc.StatusCode.INVALID_ARGUMENT,
        OverBudget: grpc.StatusCode.RESOURCE_EXHAUSTED,
        Unreachable: grpc.StatusCode.UNAVAILABLE,
        ShuttingDown: grpc.StatusCode.UNAVAILABLE,
        ArtifactFormatError: grpc.StatusCode.DATA_LOSS,
        ExactModeUnsupported: grpc.StatusCode.FAILED_PRECONDITION,
        Cancelled: grpc.StatusCode.CANCELLED,
    },
    below=STORE,
    logger=logging.getLogger(__name__),
)
"""A Decoder RPC's status for each failure; anything unexpected is INTERNAL."""
code_of = STATUS.code_of
