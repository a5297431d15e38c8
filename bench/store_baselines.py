"""Loopback baselines for the KV-store throughput benchmark.

Reference points, all over 127.0.0.1 only:

- ``measure_lmcache``: LMCache's own remote server (``python -m lmcache.v1.server``, run as
  a subprocess) driven by LMCache's own client, ``LMCServerConnector`` (the ``lm://``
  remote connector) over a ``LocalCPUBackend`` that allocates the memory objects. Payload:
  KV chunks in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens, kv_heads * head_dim]``
  for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32): 46,080 bytes per token, so
  a 256-token chunk is 11,796,480 bytes. ``measure_lmcache_client`` is the same driver
  against any ``lm://`` server, e.g. VeriCache's LMCache gateway (bench/bench_store.py).
- ``measure_raw_socket``: the loopback TCP limit: one preallocated buffer pushed with
  ``sendall`` on a memoryview and pulled with ``recv_into`` a preallocated bytearray, in
  both directions.

GB is 1e9 bytes. Times are medians over ``repeats`` runs.

Usage: python bench/store_baselines.py [--n-chunks 32] [--repeats 3] [--skip-lmcache]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

HOST = "127.0.0.1"

# SmolLM2-135M KV layout (LMCache KV_2LTD: [2, layers, tokens, kv_heads * head_dim]).
NUM_LAYERS = 30
NUM_KV_HEADS = 3
HEAD_DIM = 64
DTYPE_BYTES = 4  # fp32
TOKEN_BYTES = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 46,080
CHUNK_TOKENS = 256
CHUNK_BYTES = CHUNK_TOKENS * TOKEN_BYTES  # 11,796,480

LMCACHE_LOG_LEVEL = "WARNING"
SERVER_START_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- helpers


def _gbps(n_bytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes)."""
    return n_bytes / seconds / 1e9


def _free_port() -> int:
    """A TCP port on HOST that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until something accepts TCP connections on HOST:port.

    Raises RuntimeError if ``proc`` exits first or ``timeout_s`` passes.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server did not accept connections on {HOST}:{port} in {timeout_s}s")


def _stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Terminate ``proc``, killing it if it does not exit within ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _quiet_lmcache() -> None:
    """Raise LMCache's log threshold to LMCACHE_LOG_LEVEL.

    LMCache reads ``LMCACHE_LOG_LEVEL`` when each module creates its logger, so the env var
    covers modules imported later (and the server subprocess, which inherits it); loggers
    that already exist get their level set directly.
    """
    os.environ.setdefault("LMCACHE_LOG_LEVEL", LMCACHE_LOG_LEVEL)
    level = getattr(logging, os.environ["LMCACHE_LOG_LEVEL"].upper(), logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(level)


# --------------------------------------------------------------------------- LMCache


@contextlib.contextmanager
def _lmcache_server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m lmcache.v1.server HOST port cpu``; always terminated on exit.

    The server's output goes to a temporary file and is quoted if it fails to start.
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.server", HOST, str(port), "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
        try:
            try:
                _wait_for_port(port, proc, SERVER_START_TIMEOUT_S)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n--- server output ---\n{_tail(log)}") from e
            yield proc
        finally:
            _stop_process(proc)


def _tail(log: IO[bytes], n_chars: int = 4000) -> str:
    """The last ``n_chars`` characters written to ``log``."""
    log.seek(0)
    return log.read().decode(errors="replace")[-n_chars:]


def _make_backend(chunk_tokens: int, n_buffers: int) -> LocalCPUBackend:
    """A CPU-only ``LocalCPUBackend`` with room for ``n_buffers`` chunks.

    Its allocator is the one LMCache builds itself on this config (a MixedMemoryAllocator
    over one preallocated host buffer); ``local_cpu=False`` keeps it from acting as a hot
    cache, so it is only the allocator the remote connector receives into.
    """
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    size_gb = (n_buffers * chunk_tokens * TOKEN_BYTES + (64 << 20)) / 1024**3
    config = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": chunk_tokens,
            "local_cpu": False,
            "max_local_cpu_size": size_gb,
            "remote_url": f"lm://{HOST}:0",
        }
    )
    metadata = LMCacheMetadata(
        model_name="smollm2-135m",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(NUM_LAYERS, 2, chunk_tokens, NUM_KV_HEADS, HEAD_DIM),
        chunk_size=chunk_tokens,
    )
    # Without an LMCache controller it warns "Controller message sender is not initialized"
    # on every construction; that is expected here, so hide it.
    backend_logger = logging.getLogger("lmcache.v1.storage_backend.local_cpu_backend")
    level = backend_logger.level
    backend_logger.setLevel(logging.ERROR)
    try:
        return LocalCPUBackend(config, metadata, dst_device="cpu")
    finally:
        backend_logger.setLevel(level)


def _make_payload(backend: LocalCPUBackend, n_chunks: int, seed: int = 0) -> list[MemoryObj]:
    """``n_chunks`` backend-allocated KV chunks filled with random fp32 values."""
    import torch

    assert backend.metadata is not None
    shape = backend.metadata.get_shapes()[0]
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(n_chunks):
        obj = backend.allocate(shape, torch.float32)
        if obj is None or obj.tensor is None:
            raise RuntimeError("LocalCPUBackend could not allocate a payload chunk")
        obj.tensor.normal_(generator=gen)
        chunks.append(obj)
    return chunks


def _same_bytes(a: MemoryObj, b: MemoryObj) -> bool:
    """Whether two memory objects hold bitwise-identical data of the same shape and dtype."""
    import torch

    if a.tensor is None or b.tensor is None:
        return False
    if a.get_shape() != b.get_shape() or a.get_dtype() != b.get_dtype():
        return False
    return torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))


def _key(chunk_hash: int) -> Any:
    """A CacheEngineKey for chunk ``chunk_hash`` of the SmolLM2 model."""
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(
        model_name="smollm2-135m",
        world_size=1,
        worker_id=0,
        chunk_hash=chunk_hash,
        dtype=torch.float32,
    )


async def _put_all(conn: LMCServerConnector, keys: list[Any], chunks: list[MemoryObj]) -> float:
    """Put every chunk; seconds until the server has stored them all.

    The lm:// protocol has no PUT acknowledgement, so the phase ends with one EXIST
    round trip on the same connection: the server handles a connection's commands in
    order, so its reply means every PUT before it was received and stored.
    """
    t0 = time.perf_counter()
    for key, obj in zip(keys, chunks, strict=True):
        await conn.put(key, obj)
    stored = await conn.exists(keys[-1])
    elapsed = time.perf_counter() - t0
    if not stored:
        raise RuntimeError("server does not hold the last chunk after the put phase")
    return elapsed


async def _get_all(conn: LMCServerConnector, keys: list[Any]) -> tuple[float, list[MemoryObj]]:
    """Get every key; (seconds, received memory objects)."""
    t0 = time.perf_counter()
    got = []
    for key in keys:
        obj = await conn.get(key)
        if obj is None:
            raise RuntimeError(f"server returned nothing for chunk {key.chunk_hash}")
        got.append(obj)
    return time.perf_counter() - t0, got


async def _run_lmcache_rounds(
    conn: LMCServerConnector, chunks: list[MemoryObj], repeats: int
) -> tuple[list[float], list[float], bool]:
    """``repeats`` put-all then get-all rounds, each on fresh keys.

    Returns (put seconds per round, get seconds per round, all reads bitwise equal).
    """
    put_s: list[float] = []
    get_s: list[float] = []
    equal = True
    n = len(chunks)
    for r in range(repeats):
        keys = [_key(r * n + i) for i in range(n)]
        put_s.append(await _put_all(conn, keys, chunks))
        seconds, got = await _get_all(conn, keys)
        get_s.append(seconds)
        equal = equal and all(_same_bytes(a, b) for a, b in zip(chunks, got, strict=True))
        for obj in got:
            obj.ref_count_down()
    return put_s, get_s, equal


def measure_lmcache(chunk_bytes: int, n_chunks: int, repeats: int = 3) -> dict[str, Any]:
    """Put then get ``n_chunks`` KV chunks through LMCache's own server and client.

    Starts ``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` on a free port and drives it
    with ``measure_lmcache_client``. The server is terminated on return and on error.
    """
    _check_sizes(chunk_bytes, n_chunks, repeats)
    port = _free_port()
    with _lmcache_server(port):
        return measure_lmcache_client(port, chunk_bytes, n_chunks, repeats)


def measure_lmcache_client(
    port: int, chunk_bytes: int, n_chunks: int, repeats: int = 3
) -> dict[str, Any]:
    """Put then get ``n_chunks`` KV chunks with LMCache's own client against the ``lm://``
    server at 127.0.0.1:``port`` (LMCache's own server, or VeriCache's LMCache gateway).

    ``LMCServerConnector`` over a CPU ``LocalCPUBackend`` (one asyncio event loop, the chunks
    written and read one at a time, as the connector serializes its socket anyway).
    ``chunk_bytes`` must be a whole number of SmolLM2-135M tokens (46,080 bytes each).
    Every round uses new keys.

    Returns put/get GB/s (medians), the per-round seconds, and whether every chunk read
    back was bitwise equal to the chunk written.
    """
    _check_sizes(chunk_bytes, n_chunks, repeats)
    _quiet_lmcache()  # before the import, so LMCache's loggers start quiet
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector

    backend = _make_backend(chunk_bytes // TOKEN_BYTES, 2 * n_chunks)
    chunks = _make_payload(backend, n_chunks)
    loop = asyncio.new_event_loop()
    try:
        conn = LMCServerConnector(HOST, port, loop, backend)
        try:
            put_s, get_s, equal = loop.run_until_complete(
                _run_lmcache_rounds(conn, chunks, repeats)
            )
        finally:
            loop.run_until_complete(conn.close())
    finally:
        loop.close()
        for obj in chunks:
            obj.ref_count_down()
        backend.close()
    total = chunk_bytes * n_chunks
    return {
        "put_gbps": _gbps(total, statistics.median(put_s)),
        "get_gbps": _gbps(total, statistics.median(get_s)),
        "put_runs_s": put_s,
        "get_runs_s": get_s,
        "bitwise_equal": equal,
        "chunk_bytes": chunk_bytes,
        "n_chunks": n_chunks,
        "total_bytes": total,
        "repeats": repeats,
    }


def _check_sizes(chunk_bytes: int, n_chunks: int, repeats: int) -> None:
    if chunk_bytes <= 0 or chunk_bytes % TOKEN_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {TOKEN_BYTES}")
    if n_chunks <= 0 or repeats <= 0:
        raise ValueError("n_chunks and repeats must be positive")


# --------------------------------------------------------------------------- raw socket


def _pattern_buffer(n_bytes: int) -> bytearray:
    """``n_bytes`` of non-zero, page-faulted data (a repeated random 64 KiB block)."""
    block = os.urandom(1 << 16)
    reps, rest = divmod(n_bytes, len(block))
    return bytearray(block) * reps + bytearray(block[:rest])


def _tune(sock: socket.socket, buf_bytes: int) -> None:
    """Set the kernel send and receive buffer sizes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)


def _recv_exact(sock: socket.socket, view: memoryview, chunk: int) -> None:
    """Fill ``view`` from ``sock`` with ``recv_into`` calls of up to ``chunk`` bytes."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(chunk, n - got))
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


def _serve_send(conn: socket.socket, src: memoryview, dst: memoryview, chunk: int) -> None:
    """Server side of the recv test: wait for the go byte, then send all of ``src``."""
    del dst, chunk
    conn.recv(1)
    conn.sendall(src)


def _serve_recv(conn: socket.socket, src: memoryview, dst: memoryview, chunk: int) -> None:
    """Server side of the send test: receive into ``dst``, then acknowledge with one byte."""
    del src
    _recv_exact(conn, dst, chunk)
    conn.sendall(b"\x01")


def _client_recv(sock: socket.socket, src: memoryview, dst: memoryview, chunk: int) -> float:
    """Client side of the recv test: seconds from the go byte to the last byte received."""
    del src
    t0 = time.perf_counter()
    sock.sendall(b"\x01")
    _recv_exact(sock, dst, chunk)
    return time.perf_counter() - t0


def _client_send(sock: socket.socket, src: memoryview, dst: memoryview, chunk: int) -> float:
    """Client side of the send test: seconds from the first byte sent to the server's ack."""
    del dst, chunk
    t0 = time.perf_counter()
    sock.sendall(src)
    if sock.recv(1) != b"\x01":
        raise ConnectionError("no acknowledgement from the receiving side")
    return time.perf_counter() - t0


ServerFn = Callable[[socket.socket, memoryview, memoryview, int], None]
ClientFn = Callable[[socket.socket, memoryview, memoryview, int], float]


def _one_transfer(
    server_fn: ServerFn,
    client_fn: ClientFn,
    src: memoryview,
    dst: memoryview,
    buf_bytes: int,
    chunk: int,
) -> float:
    """One connection: ``server_fn`` in a thread, ``client_fn`` here; the client's seconds."""
    errors: list[BaseException] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        _tune(listener, buf_bytes)  # accepted sockets inherit the sizes
        listener.bind((HOST, 0))
        listener.listen(1)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                with conn:
                    server_fn(conn, src, dst, chunk)
            except BaseException as e:  # reported to the caller below
                errors.append(e)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            _tune(sock, buf_bytes)
            sock.connect(listener.getsockname())
            seconds = client_fn(sock, src, dst, chunk)
        thread.join()
    if errors:
        raise errors[0]
    return seconds


def measure_raw_socket(
    total_bytes: int,
    repeats: int = 3,
    sock_buf_bytes: int = 4 << 20,
    recv_chunk_bytes: int = 4 << 20,
) -> dict[str, Any]:
    """The loopback TCP limit for moving ``total_bytes`` in one stream, both directions.

    recv: a server thread ``sendall``s a preallocated buffer and the client ``recv_into``s
    a preallocated bytearray (client-measured, from its go byte to the last byte). send:
    the client ``sendall``s and the server thread receives, then acknowledges with one byte
    (client-measured, to the ack). Fresh connection per run; GB/s from the median run.
    ``intact`` says whether the received bytes equalled the sent ones in every run.
    """
    if total_bytes <= 0 or repeats <= 0:
        raise ValueError("total_bytes and repeats must be positive")
    src_buf = _pattern_buffer(total_bytes)
    dst_buf = bytearray(b"\x00") * total_bytes  # written, so its pages are faulted in
    src, dst = memoryview(src_buf), memoryview(dst_buf)
    runs: dict[str, list[float]] = {"recv": [], "send": []}
    intact = True
    try:
        for _ in range(repeats):
            for name, server_fn, client_fn in (
                ("recv", _serve_send, _client_recv),
                ("send", _serve_recv, _client_send),
            ):
                runs[name].append(
                    _one_transfer(server_fn, client_fn, src, dst, sock_buf_bytes, recv_chunk_bytes)
                )
                intact = intact and dst_buf == src_buf
    finally:
        src.release()
        dst.release()
    return {
        "recv_gbps": _gbps(total_bytes, statistics.median(runs["recv"])),
        "send_gbps": _gbps(total_bytes, statistics.median(runs["send"])),
        "recv_runs_s": runs["recv"],
        "send_runs_s": runs["send"],
        "intact": intact,
        "total_bytes": total_bytes,
        "sock_buf_bytes": sock_buf_bytes,
        "recv_chunk_bytes": recv_chunk_bytes,
        "repeats": repeats,
    }


# --------------------------------------------------------------------------- demo


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-chunks", type=int, default=32, help="256-token chunks (32 = 8K tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-lmcache", action="store_true", help="only the raw-socket limit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Measure both baselines for ``--n-chunks`` SmolLM2-135M chunks and print them."""
    args = _parse_args(argv)
    total = CHUNK_BYTES * args.n_chunks
    print(
        f"payload: {args.n_chunks} x {CHUNK_BYTES:,} B = {total / 1e9:.3f} GB, "
        f"repeats={args.repeats}",
        flush=True,
    )
    results: dict[str, Any] = {"raw_socket": measure_raw_socket(total, args.repeats)}
    raw = results["raw_socket"]
    print(
        f"raw socket : recv {raw['recv_gbps']:.2f} GB/s, send {raw['send_gbps']:.2f} GB/s, "
        f"intact={raw['intact']}",
        flush=True,
    )
    if not args.skip_lmcache:
        results["lmcache"] = measure_lmcache(CHUNK_BYTES, args.n_chunks, args.repeats)
        lmc = results["lmcache"]
        print(
            f"lmcache    : put {lmc['put_gbps']:.2f} GB/s, get {lmc['get_gbps']:.2f} GB/s, "
            f"bitwise_equal={lmc['bitwise_equal']}",
            flush=True,
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
