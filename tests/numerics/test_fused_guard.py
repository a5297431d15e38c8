"""The fused kernel's guard: where the CPU can run the kernel, a process without it is a
fault that fails the suite and `make install`, never a skip; where it cannot, that is said.

The tests needing the kernel are marked `fused_kernel` (tests/conftest.py,
`require_fused_kernel`); the guard's decisions are tested here against sabotaged loading.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from numerics.cpu import fused
from tests.conftest import require_fused_kernel

COMPILER_ERROR = "exact_attention.cpp:12:3: error: 'fold' was not declared in this scope"


def test_the_kernel_is_loaded_wherever_the_cpu_can_run_it():
    """The guard itself, on this machine."""
    if reason := fused.unsupported_reason():
        pytest.skip(f"the fused kernel is not meant to run here: {reason}")
    assert fused.missing_kernel_reason() is None
    assert fused.module() is not None


@pytest.fixture
def supported(monkeypatch):
    """A process on a CPU that runs the kernel, wanting it, that has not loaded it yet."""
    monkeypatch.setattr(fused, "_loaded", {})
    monkeypatch.setattr(fused, "cpu_supported", lambda: True)
    monkeypatch.delenv(fused.ENV, raising=False)


@pytest.fixture
def broken_build(monkeypatch):
    """No prebuilt library, and a build that fails as a compiler error does."""
    built = []

    def build(verbose: bool = False):
        built.append(verbose)
        raise RuntimeError(
            f"Error building extension 'vericache_exact_attention':\n{COMPILER_ERROR}"
        )

    monkeypatch.setattr(fused, "_import_prebuilt", lambda: None)
    monkeypatch.setattr(fused, "build", build)
    return built


def test_a_failed_build_on_a_supporting_cpu_is_reported(supported, broken_build):
    with pytest.warns(RuntimeWarning, match="unavailable"):
        reason = fused.missing_kernel_reason()
    assert reason == (
        "the fused exact-attention kernel did not load on a CPU that supports it: " + COMPILER_ERROR
    )


def test_a_kernel_decided_missing_is_reported(supported, monkeypatch):
    monkeypatch.setattr(fused, "_loaded", {"module": None})
    assert "did not load" in fused.missing_kernel_reason()


def test_a_loaded_kernel_is_no_problem(supported, monkeypatch):
    monkeypatch.setattr(fused, "_loaded", {"module": ModuleType("stand_in")})
    assert fused.missing_kernel_reason() is None
    require_fused_kernel()  # neither skips nor fails


def test_a_cpu_without_avx2_is_not_a_fault(supported, broken_build, monkeypatch):
    monkeypatch.setattr(fused, "cpu_supported", lambda: False)
    assert fused.missing_kernel_reason() is None
    assert fused.unsupported_reason() == fused.UNSUPPORTED_CPU
    assert broken_build == []


def test_asking_for_the_torch_kernel_is_not_a_fault(supported, broken_build, monkeypatch):
    monkeypatch.setenv(fused.ENV, "torch")
    assert fused.missing_kernel_reason() is None
    assert "VERICACHE_EXACT_KERNEL=torch" in fused.unsupported_reason()
    assert broken_build == []


def test_marked_tests_fail_on_a_supporting_cpu_without_the_kernel(supported, broken_build):
    with pytest.warns(RuntimeWarning), pytest.raises(pytest.fail.Exception) as failed:
        require_fused_kernel()
    assert COMPILER_ERROR in str(failed.value)


def test_marked_tests_skip_saying_why_where_the_cpu_cannot(supported, monkeypatch):
    monkeypatch.setattr(fused, "cpu_supported", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="not x86-64 Linux with AVX2 and FMA"):
        require_fused_kernel()


def test_install_fails_on_a_failed_build_where_the_cpu_can_run_it(supported, broken_build, capsys):
    assert fused.install() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert COMPILER_ERROR in err  # the compiler's output first
    assert err[-1].startswith("error: the fused exact-attention kernel did not build")
    assert COMPILER_ERROR in err[-1]


def test_install_says_so_and_goes_on_where_the_cpu_cannot(
    supported, broken_build, monkeypatch, capsys
):
    monkeypatch.setattr(fused, "cpu_supported", lambda: False)
    assert fused.install() == 0
    assert "not built: this machine is not x86-64 Linux" in capsys.readouterr().out
    assert broken_build == []


def test_install_reports_the_built_kernel(supported, monkeypatch, capsys):
    built = ModuleType("built")
    built.__file__ = "/cache/kernel.so"
    monkeypatch.setattr(fused, "build", lambda: built)
    assert fused.install() == 0
    assert "fused exact-attention kernel ready: /cache/kernel.so" in capsys.readouterr().out
