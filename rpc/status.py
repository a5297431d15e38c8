"""One mechanism for every server: typed errors become gRPC status codes (`StatusMap`),
and a handler's failure ends its call (`StatusMap.abort`).

Each tier declares its own table of its errors (the store's is `prefix_store.status.CODES`,
which its clients read backwards) and names the map below it, whose errors its calls may
also fail with: a decoder's map falls back on the store's. The abort is written here once:
a typed error's message goes to the caller as it is (it names the field at fault); a call
refused by call limits carries `retry-after-ms`; a failure relayed from another server
(`Relayed`) ends as it ended there; anything unexpected is INTERNAL with a message that
carries only a fresh request id (no exception text, paths or secrets), logged under that
id with its traceback.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import NoReturn

import grpc

from prefix_store import status as store
from prefix_store.errors import LimitExceeded

log = logging.getLogger(__name__)


class Relayed(Exception):
    """A call forwarded to another server failed there: it ends here with that server's
    status, details and trailing metadata, as they came."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, tuple(trailing or ())


class StatusMap:
    """A tier's errors -> status codes: the most derived class of an error's that `codes`
    lists, else the map `below`'s answer, else INTERNAL (never UNKNOWN)."""

    def __init__(
        self,
        codes: Mapping[type[BaseException], grpc.StatusCode],
        below: StatusMap | None = None,
        logger: logging.Logger = log,
    ) -> None:
        """logger: where unexpected failures are logged (the tier's own logger)."""
        self.codes = dict(codes)
        self.below = below
        self.log = logger

    def code_of(self, error: BaseException) -> grpc.StatusCode:
        """The status a call that failed with `error` ends with."""
        if isinstance(error, Relayed):
            return error.code
        for cls in type(error).__mro__:
            if cls in self.codes:
                return self.codes[cls]
        return grpc.StatusCode.INTERNAL if self.below is None else self.below.code_of(error)

    def abort(self, context: grpc.ServicerContext, error: BaseException, where: str) -> NoReturn:
        """End a failed call with `error`'s status; `where` (Service.Method) names it in the
        log when it is unexpected."""
        if isinstance(error, Relayed):
            context.set_trailing_metadata(error.trailing)
            context.abort(error.code, error.details)
        code = self.code_of(error)
        if isinstance(error, LimitExceeded):
            context.set_trailing_metadata(((store.RETRY_AFTER, str(store.BUSY_RETRY_MS)),))
        if code != grpc.StatusCode.INTERNAL:
            context.abort(code, str(error) or type(error).__name__)
        request_id = uuid.uuid4().hex[:12]
        self.log.error("%s: internal error (request id %s)", where, request_id, exc_info=error)
        context.set_trailing_metadata(((store.REQUEST_ID, request_id),))
        context.abort(code, f"internal error (request id {request_id}); see the server log")


STORE = StatusMap(store.CODES, logger=logging.getLogger("prefix_store.status"))
"""The store's errors, the family below every tier: a decoder's call that fails with a
store error fails with its code."""
