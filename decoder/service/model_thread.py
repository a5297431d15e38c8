"""The one thread that runs the model on a decoder worker.

Everything that computes with the runner (engine steps, publish prefills, artifact builds)
runs here, one thing at a time: the runner's kernels already use every core, and exact
mode's guarantees assume nothing else runs in between. Jobs (`call`) run between engine
steps; busy engines (one per mode and compressor spec) take turns step by step, so a
long request never starves another mode's requests.

An engine keeps a request's failure to that request (`Engine.step`); an error that escapes a
step anyway (its state is then unknown) fails what that engine holds with that error, and the
engine stays registered: other engines, and later requests to this one, are served.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from decoder.engine import Engine, Request, Ticket, TokenListener
from decoder.errors import ShuttingDown

log = logging.getLogger(__name__)
T = TypeVar("T")


class ModelThread:
    """The model thread: jobs and engine steps, one at a time, until `stop`. Once stopped,
    every call, submission and job still queued fails with `ShuttingDown`."""

    def __init__(self) -> None:
        self._engines: list[Engine] = []
        self._jobs: deque[tuple[Callable, Future]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="decoder-model", daemon=True)
        self._thread.start()

    def add_engine(self, engine: Engine) -> None:
        with self._wake:
            self._engines.append(engine)

    def remove_engine(self, engine: Engine) -> None:
        """Stop stepping an idle engine (its caller guarantees nothing is submitted to it
        any more) and close it."""
        with self._wake:
            self._engines.remove(engine)
        engine.close()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the model thread and return its result (or raise its error)."""
        future: Future = Future()
        with self._wake:
            self._check_running()
            self._jobs.append((fn, future))
            self._wake.notify()
        return future.result()

    def submit(
        self, engine: Engine, request: Request, on_tokens: TokenListener, tenant: str = ""
    ) -> Ticket:
        """Submit `tenant`'s `request` to `engine` (one of this thread's) and wake the
        loop. Under the loop's lock, so that a request is either refused here or failed by
        `stop`."""
        with self._wake:
            self._check_running()
            ticket = engine.submit(request, on_tokens=on_tokens, tenant=tenant)
            self._wake.notify()
        return ticket

    def notify(self) -> None:
        """Something changed that a waiting engine may make progress on."""
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        """Finish the job or step under way, then fail everything queued or in flight with
        `ShuttingDown` (so its callers can retry on another decoder)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()
        for engine in self._engines:
            self._abort(engine, _shutting_down())
            engine.close()
        while self._jobs:
            _, future = self._jobs.popleft()
            future.set_exception(_shutting_down())

    def _check_running(self) -> None:
        if self._stopped:
            raise _shutting_down()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._jobs and not self._any_busy():
                    self._wake.wait(timeout=1.0)
                if self._stopped:
                    return
                job = self._jobs.popleft() if self._jobs else None
                engines = list(self._engines)
            if job is not None:
                fn, future = job
                try:
                    future.set_result(fn())
                except BaseException as error:  # handed to the caller
                    future.set_exception(error)
            progress = job is not None
            for engine in engines:
                if engine.busy:
                    try:
                        progress |= engine.step()
                    except Exception as error:  # a bug: fail what it holds, keep serving
                        log.exception("engine step failed")
                        self._abort(engine, error)
            if not progress:  # every queue waits for room: sleep until something changes
                with self._wake:
                    if not self._jobs and not self._stopped:
                        self._wake.wait(timeout=0.05)

    @staticmethod
    def _abort(engine: Engine, error: Exception) -> None:
        try:
            engine.abort(error)
        except Exception:
            log.exception("engine abort failed")

    def _any_busy(self) -> bool:
        return any(engine.busy for engine in self._engines)


def _shutting_down() -> ShuttingDown:
    return ShuttingDown("the decoder is shutting down; retry on another decoder")
