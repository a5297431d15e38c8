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
(`numerics.cpu.forward.exact_kernel_id`).

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

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


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


def build(verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension; raises when that fails."""
    from torch.utils.cpp_extension import load

    if not cpu_supported():
        raise RuntimeError("the fused exact-attention kernel needs an x86-64 CPU with AVX2/FMA")
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


def _load_or_warn() -> ModuleType | None:
    if not wanted():
        return None
    try:
        return _import_prebuilt() or build()
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch kernel
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
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
