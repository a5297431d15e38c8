"""grpc.aio in several asyncio event loops of one process (an application's own loop beside
the router's HTTP loop, or one loop per thread).

grpc.aio wakes every loop that has used it through one shared notification socket; the
first loop to read it takes the wake-up, and each other loop's reader raises
BlockingIOError, which asyncio logs as "Exception in callback
PollerCompletionQueue._handle_events" with a traceback (grpc/grpc#25364; grpcio 1.78 still
does it). Nothing fails: the call completes on the loop that read the byte. On a busy
process this is hundreds of error logs a minute that mean nothing, and they bury real ones.
`quiet_grpc_wakeups` drops exactly those from a loop's log.
"""

from __future__ import annotations

import asyncio


def quiet_grpc_wakeups(loop: asyncio.AbstractEventLoop) -> None:
    """Make `loop` drop grpc.aio's spurious wake-up errors (see the module), passing every
    other exception to the handler it had (asyncio's default when none was set)."""
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if is_grpc_wakeup(context):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def is_grpc_wakeup(context: dict) -> bool:
    """Whether an asyncio error context is grpc.aio's spurious wake-up: BlockingIOError
    raised by its completion queue's reader callback."""
    handle = context.get("handle")
    return isinstance(context.get("exception"), BlockingIOError) and (
        "PollerCompletionQueue._handle_events" in repr(handle)
    )
