"""A decoder worker's engines: one per mode, compressor spec and n-gram setting, all over one
runner and one KV budget, stepped by the `ModelThread`. Idle engines beyond `max_engines`
are closed least recently used first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from decoder.budget import KVBudget
from decoder.engine import Engine, EngineConfig
from decoder.runner import ModelRunner
from decoder.service.config import DecoderConfig
from decoder.service.model_thread import ModelThread


@dataclass(eq=False)
class _Slot:
    engine: Engine
    users: int = 0
    """Requests that obtained the engine and have not ended (it is not closed under them)."""


@dataclass(frozen=True)
class PoolFigures:
    """What the pool's engines hold (Info)."""

    engines: int
    in_flight: int
    """Requests being decoded."""
    queued: int
    """Requests waiting for admission."""


class EnginePool:
    """Engines by (mode, spec, n-gram); thread-safe."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: frozenset[int],
        budget: KVBudget,
        model: ModelThread,
        config: DecoderConfig,
    ) -> None:
        self.runner = runner
        self.eos = eos
        self.budget = budget
        self.model = model
        self.config = config
        self._slots: OrderedDict[tuple[str, str, int], _Slot] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def engine(self, mode: str, compressor: str, ngram: int) -> Iterator[Engine]:
        """The engine of a mode and spec, kept while the block runs; afterwards idle
        engines beyond `max_engines` are closed, least recently used first."""
        key = (mode, compressor if mode != "full" else "", ngram)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(self._new_engine(mode, compressor, ngram))
                self.model.add_engine(slot.engine)
            self._slots.move_to_end(key)
            slot.users += 1
        try:
            yield slot.engine
        finally:
            with self._lock:
                slot.users -= 1
                idle = self._idle()
            for engine in idle:
                self.model.remove_engine(engine)

    def _new_engine(self, mode: str, compressor: str, ngram: int) -> Engine:
        config = EngineConfig(
            mode=mode,
            compressor=compressor,
            staging_depth=self.config.staging_depth,
            ngram=ngram,
            resident=self.config.resident_prefixes,
            placement=self.config.placement,
        )
        return Engine(self.runner, config, self.eos, self.budget)

    def _idle(self) -> list[Engine]:
        """Unused engines beyond `max_engines`, least recently used first, forgotten."""
        excess = len(self._slots) - self.config.max_engines
        idle = [k for k, s in self._slots.items() if not s.users and not s.engine.busy]
        return [self._slots.pop(key).engine for key in idle[: max(0, excess)]]

    def engines(self) -> list[Engine]:
        with self._lock:
            return [slot.engine for slot in self._slots.values()]

    def figures(self) -> PoolFigures:
        engines = self.engines()
        return PoolFigures(
            len(engines),
            sum(e.in_flight for e in engines),
            sum(e.queued for e in engines),
        )
