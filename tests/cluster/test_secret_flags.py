"""Secrets reach `vericache` from the environment or a file; the command line still works,
with a warning that names both (other local users see command lines)."""

from __future__ import annotations

import pytest

from cluster.cli import main


@pytest.fixture
def tenants(metadata, redis_server, capsys, tmp_path):
    """A fresh Redis database with one tenant, added with the URL from a file."""
    argv = ["tenant", "add", "secret-flags", "--redis-url-file"]
    assert main([*argv, str(url_file(redis_server, tmp_path / "url"))]) == 0
    capsys.readouterr()


def url_file(redis_server, path):
    path.write_text(redis_server.url + "\n")
    path.chmod(0o600)
    return path


def test_a_secret_on_the_command_line_works_with_a_warning(redis_server, tenants, capsys):
    assert main(["tenant", "list", "--redis-url", redis_server.url]) == 0
    out, err = capsys.readouterr()
    assert "secret-flags" in out
    assert "--redis-url on the command line is visible to every local user" in err
    assert "$VERICACHE_REDIS_URL" in err and "--redis-url-file" in err
    assert redis_server.password not in err


def test_from_a_file_or_the_environment_there_is_no_warning(
    redis_server, tenants, capsys, monkeypatch, tmp_path
):
    assert (
        main(["tenant", "list", "--redis-url-file", str(url_file(redis_server, tmp_path / "u"))])
        == 0
    )
    out, err = capsys.readouterr()
    assert "secret-flags" in out and err == ""
    monkeypatch.setenv("VERICACHE_REDIS_URL", redis_server.url)
    assert main(["tenant", "list"]) == 0
    out, err = capsys.readouterr()
    assert "secret-flags" in out and err == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tenant", "list", "--redis-url-file", "/nonexistent/url"], "cannot read"),
        (["status", "--redis-url-file", "EMPTY"], "is empty"),
        (["publish", "--text", "x", "--token-file", "EMPTY"], "is empty"),
    ],
)
def test_an_unusable_secret_file_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    argv = [str(empty) if arg == "EMPTY" else arg for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0


def test_a_secret_and_its_file_together_are_refused(redis_server, capsys, tmp_path):
    argv = ["tenant", "list", "--redis-url-file", str(url_file(redis_server, tmp_path / "u"))]
    assert main([*argv, "--redis-url", "redis://x"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
