"""Shared fixtures: the real built-in model, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def builtin_model():
    from decoder.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def builtin_runner(builtin_model):
    from decoder.runner import ModelRunner

    runner = ModelRunner(builtin_model.config, builtin_model.weights)
    runner.ensure_exact_supported()
    return runner
