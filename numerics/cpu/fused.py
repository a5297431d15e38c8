"""The fused exact-attention kernel (numerics/cpu/csrc/exact_attention.cpp): build,
load, identity.

`make install` builds it ahead of time (`build()`); at run time `module()` imports the
prebuilt library directly (no compiler involved), building it first only when it is
missing. The build lives in the user cache under a name derived from everything that
changes the binary: the source, the compiler flags, torch's version and the Python ABI.

When the kernel cannot be used (the CPU lacks AVX2/FMA, the build fails, or
`VERICACHE_EXACT_KERNEL=torch`), `module()` returns None after one warning and exact mode
runs the torch implementation in `numerics.cpu.forward`. The two give different bits, so the
kernel in use is part of the identity of the exact KV a decoder stores and looks up
(`numerics.cpu.forward.exact_kernel_id`). Of those three causes only the first and last are
expected: a failed build on a CPU that supports the kernel is an installation fault, which
`install()` (`make install`) and `missing_kernel_reason()` (the test suite's guard) report.

It lives in `numerics`, beside the decoder's other kernels, because shards run it too:
near-data attention (`numerics.cpu.partials`) computes attention partials over stored chunks
with the very kernel decoders fold them with. It knows nothing of models.

The identity hashes the source's bytes, never its path: moving the file changes nothing,
but editing it (a comment included) changes every exact KV key and fingerprint. So the
source's own comments still name its former path, prefix_store/attention/kernel.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "exact_attention.cpp"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math")
"""-ffp-contract=off: no multiply-add is fused unless the source says so (the bits are the
source's, whatever the compiler)."""
ENV = "VERICACHE_EXACT_KERNEL"
"""`torch` forces the torch implementation; `fused` (or unset) uses the fused kernel
when it can be built and loaded."""

UNSUPPORTED_CPU = "this machine is not x86-64 Linux with AVX2 and FMA"

_lock = threading.Lock()
_loaded: dict[str, ModuleType | str | None] = {}
"""This process's decision: "module" (the extension or None) and, after a failure, "error"."""


def source_digest() -> str:
    """Hex SHA-256 of the kernel's source and compiler flags: what its bits depend on."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()


def module_name() -> str:
    """The extension's name, unique per source, flags, torch version and Python ABI."""
    h = hashlib.sha256(source_digest().encode())
    h.update(f"{torch.__version__}|{sys.implementation.cache_tag}|{sys.platform}".encode())
    return f"vericache_exact_attention_{h.hexdigest()[:16]}"


def build_dir() -> Path:
    """Where the extension is built: $VERICACHE_CACHE/kernels/<name> (else the user cache)."""
    return cache_dir() / "kernels" / module_name()


def cache_dir() -> Path:
    """$VERICACHE_CACHE, else $XDG_CACHE_HOME/vericache (where converted models live too)."""
    if env := os.environ.get("VERICACHE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vericache"


def cpu_supported() -> bool:
    """True when this CPU runs AVX2 and FMA code (what the kernel is compiled for)."""
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((x for x in flags.splitlines() if x.startswith("flags")), "")
    return {"avx2", "fma"} <= set(line.split())


def wanted() -> bool:
    """False when VERICACHE_EXACT_KERNEL asks for the torch implementation."""
    choice = os.environ.get(ENV, "fused").strip().lower()
    if choice not in ("fused", "torch"):
        raise ValueError(f"{ENV} must be 'fused' or 'torch', got {choice!r}")
    return choice == "fused"


def unsupported_reason() -> str | None:
    """Why this process is not meant to run the fused kernel, else None.

    Not meant to: the CPU cannot run it (`cpu_supported()` is False), or
    VERICACHE_EXACT_KERNEL=torch asks for the torch implementation. Anywhere else the kernel
    must load, and `missing_kernel_reason()` says why it did not.
    """
    if not cpu_supported():
        return UNSUPPORTED_CPU
    if not wanted():
        return f"{ENV}=torch asks for the torch implementation"
    return None


def missing_kernel_reason() -> str | None:
    """Why the fused kernel is not loaded where it should be, else None.

    None when this process runs the kernel, and when it is not meant to
    (`unsupported_reason()`). Otherwise the kernel failed to build or load on a CPU that
    supports it: an installation fault, not a platform limit, named with the failure.
    Decides `module()` first when this process has not yet.
    """
    if unsupported_reason() is not None or module() is not None:
        return None
    error = _loaded.get("error") or "no error recorded"
    return f"the fused exact-attention kernel did not load on a CPU that supports it: {error}"


def install() -> int:
    """`make install`'s step: build the kernel where the CPU can run it; an exit status.

    0 when it is built, and when the CPU cannot run it (said in one line: exact mode then
    runs the torch implementation); 1 when the build fails on a CPU that supports it (the
    compiler's output, then a one-line error naming its last line, on stderr).
    """
    if not cpu_supported():
        print(
            f"fused exact-attention kernel not built: {UNSUPPORTED_CPU}; exact mode runs "
            "the slower torch implementation"
        )
        return 0
    try:
        path = build().__file__
    except Exception as exc:  # noqa: BLE001 - any failure is reported, then fails the install
        if "\n" in str(exc).strip():
            print(str(exc).strip(), file=sys.stderr)  # the compiler's output
        print(
            "error: the fused exact-attention kernel did not build on a CPU that supports it: "
            + _last_line(exc),
            file=sys.stderr,
        )
        return 1
    print("fused exact-attention kernel ready:", path)
    return 0


def build(verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension; raises when that fails."""
    from torch.utils.cpp_extension import load

    if not cpu_supported():
        raise RuntimeError(f"the fused exact-attention kernel cannot run: {UNSUPPORTED_CPU}")
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return load(
        name=module_name(),
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        build_directory=str(directory),
        verbose=verbose,
    )


def module() -> ModuleType | None:
    """The loaded extension, or None (after one warning) when exact mode must use torch.

    Decided once per process: every exact forward of a process uses the same kernel.
    """
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _load_or_warn()
        return _loaded["module"]


def _last_line(exc: BaseException) -> str:
    """The last line of an exception's message (a compiler's summary), else its type."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _load_or_warn() -> ModuleType | None:
    """The extension, or None after one warning (the failure kept as _loaded["error"])."""
    if not wanted():
        return None
    try:
        return _import_prebuilt() or build()
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch kernel
        reason = _loaded["error"] = _last_line(exc)
        warnings.warn(
            f"fused exact-attention kernel unavailable ({reason}); exact mode uses the "
            "slower torch implementation",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _import_prebuilt() -> ModuleType | None:
    """Import the built library without invoking the compiler; None when it is not there."""
    if not cpu_supported():
        raise RuntimeError("this CPU lacks AVX2/FMA")
    name = module_name()
    if name in sys.modules:
        return sys.modules[name]
    library = next(iter(sorted(build_dir().glob(f"{name}*.so"))), None)
    if library is None:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod
