"""`vericache serve --config FILE.yaml` and VERICACHE_* variables: the same typed config as
the same flags on the command line; precedence; one-line errors with exit status 2."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, main
from cluster.store_cli import apply_config, serve_config
from prefix_store.config import GiB

FLAGS = [
    "--shards", "3",
    "--memory-bytes", "1GiB",
    "--disk-bytes", "0",
    "--decoders", "2",
    "--kv-budget", "512MiB",
    "--compressor", "kivi:bits=2",
    "--ngram", "4",
    "--no-resident-prefixes",
    "--placement", "near",
    "--metrics-port", "9100",
    "--audit-rate", "0.01",
]  # fmt: skip
YAML = """\
shards: 3
memory-bytes: 1GiB
disk_bytes: 0           # underscores work too
decoders: 2
kv-budget: 512MiB
compressor: kivi:bits=2
ngram: 4
no-resident-prefixes: true
placement: near
metrics-port: 9100
audit-rate: 0.01
"""
ENV = {
    "VERICACHE_SHARDS": "3",
    "VERICACHE_MEMORY_BYTES": "1GiB",
    "VERICACHE_DISK_BYTES": "0",
    "VERICACHE_DECODERS": "2",
    "VERICACHE_KV_BUDGET": "512MiB",
    "VERICACHE_COMPRESSOR": "kivi:bits=2",
    "VERICACHE_NGRAM": "4",
    "VERICACHE_NO_RESIDENT_PREFIXES": "yes",
    "VERICACHE_PLACEMENT": "near",
    "VERICACHE_METRICS_PORT": "9100",
    "VERICACHE_AUDIT_RATE": "0.01",
}


def config_of(argv):
    parser = build_parser()
    argv = ["serve", *argv]
    apply_config(parser, argv)
    return serve_config(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path / "home"))


def test_a_config_file_equals_the_same_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(YAML)
    from_flags = config_of(FLAGS)
    assert from_flags.shards == 3 and from_flags.memory_bytes == GiB
    assert from_flags.resident_prefixes is False and from_flags.audit_rate == 0.01
    assert config_of(["--config", str(path)]) == from_flags
    assert config_of([f"--config={path}"]) == from_flags


def test_environment_variables_equal_the_same_flags(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    assert config_of([]) == config_of(FLAGS)


def test_the_command_line_wins_then_the_environment_then_the_file(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    path.write_text("shards: 3\nngram: 2\nplacement: pull\n")
    monkeypatch.setenv("VERICACHE_SHARDS", "4")
    monkeypatch.setenv("VERICACHE_NGRAM", "5")
    config = config_of(["--config", str(path), "--shards", "6"])
    assert (config.shards, config.ngram, config.placement) == (6, 5, "pull")


def test_client_tls_variables_never_configure_a_server(monkeypatch):
    monkeypatch.setenv("VERICACHE_TLS_CERT", "/nonexistent/client.pem")
    monkeypatch.setenv("VERICACHE_TLS_KEY", "/nonexistent/client-key.pem")
    assert config_of([]).tls is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("shards: 3\nshard: 4\n", "unknown key 'shard'"),
        ("memory-bytes: lots\n", "is not a size"),
        ("placement: sideways\n", "must be one of"),
        ("no-metrics: maybe\n", "expected true or false"),
        ("shards: [1, 2]\n", "expected one value"),
        ("- shards\n", "expected a mapping"),
        ("shards: 3\n  bad: [\n", "not YAML"),
        ("audit-rate: 2\n", "audit_rate"),
    ],
)
def test_a_bad_config_file_is_one_line_and_exit_status_2(tmp_path, capsys, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vericache: error: ") and message in err and err.count("\n") == 1


def test_a_missing_file_and_a_bad_variable_are_exit_status_2(tmp_path, capsys, monkeypatch):
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setenv("VERICACHE_SHARDS", "many")
    assert main(["serve"]) == 2
    assert "VERICACHE_SHARDS" in capsys.readouterr().err
