"""The exact-mode self-check's result is cached on disk: a second process reads it instead
of running the check; another thread count (or a damaged file) runs it again."""

from __future__ import annotations

import json

import pytest
import torch

from decoder import selfcheck
from decoder.config import RunnerConfig
from decoder.runner import ModelRunner


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(selfcheck, "kernel_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(selfcheck, "_RESULTS", {})  # a fresh process
    return tmp_path / "selfcheck"


def run_check_counted(monkeypatch) -> list:
    runs = []
    real = selfcheck._run_check

    def counted(*args):
        runs.append(args)
        return real(*args)

    monkeypatch.setattr(selfcheck, "_run_check", counted)
    return runs


def test_a_second_process_reads_the_result(cache, monkeypatch, builtin_model):
    runs = run_check_counted(monkeypatch)
    config, weights, rc = builtin_model.config, builtin_model.weights, RunnerConfig()
    assert selfcheck.check_exact_mode(ModelRunner, config, weights, rc) is None
    files = list(cache.glob("*.json"))
    assert len(runs) == 1 and len(files) == 1
    assert json.loads(files[0].read_text())["problem"] is None
    monkeypatch.setattr(selfcheck, "_RESULTS", {})  # the next process
    assert selfcheck.check_exact_mode(ModelRunner, config, weights, rc) is None
    assert len(runs) == 1  # read, not run


def test_another_thread_count_or_a_damaged_file_runs_it_again(cache, monkeypatch, builtin_model):
    runs = run_check_counted(monkeypatch)
    config, weights, rc = builtin_model.config, builtin_model.weights, RunnerConfig()
    threads = torch.get_num_threads()
    selfcheck.check_exact_mode(ModelRunner, config, weights, rc)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        selfcheck.check_exact_mode(ModelRunner, config, weights, rc)
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 2 and len(list(cache.glob("*.json"))) == 2
    for path in cache.glob("*.json"):
        path.write_text('{"problem": 7')  # torn
    monkeypatch.setattr(selfcheck, "_RESULTS", {})
    assert selfcheck.check_exact_mode(ModelRunner, config, weights, rc) is None
    assert len(runs) == 3


def test_a_cached_refusal_is_kept_as_a_refusal(cache, monkeypatch, builtin_model):
    monkeypatch.setattr(selfcheck, "_run_check", lambda *a: "logits differ at token 3")
    args = ModelRunner, builtin_model.config, builtin_model.weights, RunnerConfig()
    assert selfcheck.check_exact_mode(*args) == "logits differ at token 3"
    monkeypatch.setattr(selfcheck, "_RESULTS", {})
    monkeypatch.setattr(selfcheck, "_run_check", lambda *a: pytest.fail("ran again"))
    assert selfcheck.check_exact_mode(*args) == "logits differ at token 3"
