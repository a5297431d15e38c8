"""The embedded Redis always asks for a password (loopback included), keeps it off its
command line, and the state file that carries its URL is readable by its owner only.
Real redis-server processes, no mocks."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import redis

from cluster.redis_server import RedisServer, write_private
from cluster.serve import Deployment, ServeConfig, state_file


@pytest.fixture
def server(tmp_path):
    """A RedisServer started as serve.py starts one on this machine: no password given."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def assert_needs_the_password(server: RedisServer) -> None:
    with pytest.raises(redis.AuthenticationError):  # NOAUTH, even on loopback
        redis.Redis(server.host, server.port, socket_timeout=5).ping()
    assert redis.Redis.from_url(server.url, socket_timeout=5).ping()


def test_loopback_redis_without_a_given_password_still_requires_one(server):
    assert server.url.startswith(f"redis://:{server.password}@127.0.0.1:{server.port}/")
    assert len(server.password) >= 32
    assert_needs_the_password(server)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(server.host, server.port, password="wrong", socket_timeout=5).ping()


def test_the_password_is_in_a_0600_config_file_not_on_the_command_line(server):
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()  # what `ps` shows
    assert server.password.encode() not in cmdline
    assert not any(server.password in str(arg) for arg in server.process.args)  # as started
    config = server.directory / "redis.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert f"requirepass {server.password}" in config.read_text()
    assert stat.S_IMODE(server.directory.stat().st_mode) == 0o700
    client = redis.Redis.from_url(server.url)
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert client.config_get("appendonly") == {"appendonly": "yes"}  # persistence kept
    assert client.config_get("appendfsync") == {"appendfsync": "always"}  # before replying


def test_restart_keeps_the_password_and_the_data(server):
    url = server.url
    redis.Redis.from_url(url).set("vc:probe", "kept")
    server.restart()
    assert server.url == url
    assert_needs_the_password(server)
    assert redis.Redis.from_url(url).get("vc:probe") == b"kept"  # the append-only file


def test_a_given_password_is_used_and_must_be_url_and_config_safe(tmp_path):
    server = RedisServer(tmp_path / "given", password="s3cret-given_pw").start()
    try:
        assert server.url == f"redis://:s3cret-given_pw@127.0.0.1:{server.port}/0"
        assert_needs_the_password(server)
    finally:
        server.stop()
    for bad in ("", "two words", "a\nmodule load /tmp/x.so", "p@ss"):
        with pytest.raises(ValueError, match="password"):
            RedisServer(tmp_path / "bad", password=bad)


def test_private_files_are_never_readable_by_others(tmp_path):
    old_umask = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        path = tmp_path / "secret"
        path.write_text("old")
        path.chmod(0o644)
        reader = path.open()  # someone who opened the old, world-readable file ...
        write_private(path, "new secret")
        assert reader.read() == "old"  # ... never reads what replaced it
        reader.close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "new secret"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]  # no partial file left


def test_the_state_file_with_the_redis_url_is_private_from_its_first_byte(
    tmp_path, monkeypatch, server
):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path / "home"))
    state_file().parent.mkdir(parents=True)
    state_file().write_text("{}")
    state_file().chmod(0o644)  # left world-readable by someone
    reader = state_file().open()
    deployment = Deployment(ServeConfig(redis_url=server.url, state_dir=tmp_path / "state"))
    deployment._write_state()
    assert server.password not in reader.read()
    reader.close()
    assert stat.S_IMODE(state_file().stat().st_mode) == 0o600
    assert json.loads(state_file().read_text())["redis_url"] == server.url
