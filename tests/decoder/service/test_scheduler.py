"""The decoder's model thread stopping: what it had not run yet (a queued job, a request
queued in an engine) and what arrives afterwards fail with ShuttingDown (UNAVAILABLE), so
their callers retry on another decoder. Real engine and built-in model."""

from __future__ import annotations

import threading

import grpc
import pytest

from decoder.engine import Engine, EngineConfig, Request, prefill_prefix
from decoder.errors import ShuttingDown
from decoder.service.model_thread import ModelThread
from decoder.service.status import code_of
from tests.waiting import eventually


def test_stop_fails_what_was_queued_and_what_comes_later(builtin_model, builtin_runner):
    scheduler = ModelThread()
    running, release = threading.Event(), threading.Event()
    first = threading.Thread(target=scheduler.call, args=(lambda: running.set() or release.wait(),))
    first.start()
    running.wait(timeout=10)  # the model thread is busy with the first job
    queued: list[BaseException] = []

    def second() -> None:
        try:
            scheduler.call(lambda: None)
        except BaseException as error:  # noqa: BLE001 - checked below
            queued.append(error)

    waiter = threading.Thread(target=second)
    waiter.start()
    assert eventually(lambda: len(scheduler._jobs) == 1)
    engine = Engine(builtin_runner, EngineConfig(mode="full"), builtin_model.eos_token_ids)
    scheduler.add_engine(engine)
    prefix = prefill_prefix(builtin_runner, builtin_model.encode("def add(a, b):"))
    ticket = scheduler.submit(engine, Request(prefix, [13], 4), lambda tokens: None)
    stopping = threading.Thread(target=scheduler.stop)
    stopping.start()
    assert eventually(lambda: scheduler._stopped)
    release.set()
    for thread in (first, waiter, stopping):
        thread.join(timeout=10)
    assert len(queued) == 1 and isinstance(queued[0], ShuttingDown)
    with pytest.raises(ShuttingDown):
        ticket.wait()
    with pytest.raises(ShuttingDown):
        scheduler.call(lambda: None)
    with pytest.raises(ShuttingDown):
        scheduler.submit(engine, Request(prefix, [13], 4), lambda tokens: None)
    assert code_of(ShuttingDown("x")) == grpc.StatusCode.UNAVAILABLE
