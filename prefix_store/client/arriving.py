"""A buffer another thread is still filling, in order (`Arriving`): `put_artifact` can send
from it while its bytes arrive, each piece as soon as it is in, so a relay (the LMCache
gateway) forwards a payload while it is still receiving it instead of after."""

from __future__ import annotations

import threading

from prefix_store.errors import Aborted


class Arriving:
    """`buffer` is filled from its start by one producer, which calls `arrived(n)` once its
    first n bytes are in and `failed(error)` if it stops short; readers `wait(end)` for the
    first `end` bytes (Aborted if the filling failed first). Thread-safe."""

    def __init__(self, buffer, filled: int = 0) -> None:
        self.buffer = memoryview(buffer).cast("B")
        self.nbytes = self.buffer.nbytes
        self._filled = filled
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def arrived(self, filled: int) -> None:
        with self._cond:
            self._filled = filled
            self._cond.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait(self, end: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._filled >= end or self._error is not None)
            if self._filled < end:
                raise Aborted(f"the artifact's bytes stopped arriving: {self._error}")


def pieces(data, size: int):
    """(start, view) of `data` (bytes-like, or `Arriving`: each piece once it is in) in
    pieces of `size` bytes."""
    arriving = data if isinstance(data, Arriving) else None
    view = data.buffer if arriving is not None else memoryview(data).cast("B")
    for start in range(0, view.nbytes, size):
        end = min(start + size, view.nbytes)
        if arriving is not None:
            arriving.wait(end)
        yield start, view[start:end]


def nbytes(data) -> int:
    return data.nbytes if isinstance(data, Arriving) else memoryview(data).nbytes
