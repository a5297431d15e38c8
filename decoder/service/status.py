"""The one place where decoder-side errors become gRPC status codes, and where a Decoder
handler's failure ends its call (`abort`)."""

from __future__ import annotations

import logging
from typing import NoReturn

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
from prefix_store import status as store_status
from prefix_store.errors import StoreError

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A Generate or Publish request that cannot be served as sent."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CompressorSpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverBudget, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unreachable, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (ArtifactFormatError, grpc.StatusCode.DATA_LOSS),
    (ExactModeUnsupported, grpc.StatusCode.FAILED_PRECONDITION),
    (Cancelled, grpc.StatusCode.CANCELLED),
)


def code_of(error: BaseException) -> grpc.StatusCode:
    """The status a Decoder RPC fails with; anything unexpected is INTERNAL."""
    if isinstance(error, StoreError):
        return store_status.code_of(error)
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, error: BaseException, where: str) -> NoReturn:
    """End a failed Decoder call with `error`'s status; anything unexpected is INTERNAL with
    only a request id, logged with its traceback under that id (`prefix_store.status.abort`)."""
    store_status.abort(context, error, where, code_of=code_of, logger=log)
