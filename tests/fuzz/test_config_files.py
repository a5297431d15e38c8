"""The operator's files: `vericache serve --config FILE.yaml` with VERICACHE_* variables
(`cluster.config_file`), and the state file a running service writes (`cluster.json`, read
by `vericache status`, `tenant ...`, `publish`: `cluster.state.read_state`). Clear errors:
what the CLI reports in one line with exit status 2 (ConfigError, UsageError,
InvalidArgument, FileNotFoundError), never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from cluster import cli, store_cli
from cluster.config_file import ConfigError
from cluster.secret_flags import resolve_secrets
from prefix_store.errors import InvalidArgument
from tests.fuzz.mutate import mutated, share

CLEAR = (ConfigError, cli.UsageError, InvalidArgument, FileNotFoundError)
"""What `cluster.cli.main` turns into "vericache: error: ..." and exit status 2."""


def serve_flags() -> dict:
    """serve's long flags and their actions (no file-reading ones: those read the paths
    the operator names)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {
        option[2:]: action
        for action in sub.choices["serve"]._actions
        for option in action.option_strings
        if option.startswith("--") and not option.endswith("-file") and "tls" not in option
    }


FLAGS = serve_flags()
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
VALUES = st.recursive(
    SCALARS | st.sampled_from(["4GiB", "0", "-1", "1e400", "nan", "yes", "auto", "1KiB"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=4,
)
KEYS = st.sampled_from(sorted(FLAGS)) | st.sampled_from(["help", "config", "--shards", "x_y"])
DOCUMENTS = st.dictionaries(KEYS, VALUES, max_size=4).map(
    lambda d: yaml.safe_dump(d, allow_unicode=True).encode()
)


def serve_config(tmp_path, document: bytes, environ: dict[str, str]):
    """serve's typed config from a --config file and the environment, as `main` builds it
    (without starting anything)."""
    path = tmp_path / "serve.yaml"
    path.write_bytes(document)
    argv = ["serve", "--config", str(path)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VERICACHE_")}
    with mock.patch.dict(os.environ, {**clean, **environ}, clear=True):
        parser = cli.build_parser()
        store_cli.apply_config(parser, argv)
        ns = parser.parse_args(argv)
        resolve_secrets(ns)
        return store_cli.serve_config(ns)


@share(0.5)
@given(mutated(DOCUMENTS, max_edits=2))
@example(b"[" * 1000)  # nested past what the YAML parser recurses: was RecursionError
@example(b"a: &a [*a, *a]\n")  # a recursive alias
@example(b"shards: !!python/object:os.system ls\n")  # a tag safe_load refuses
@example(b"\xff\xfe")
@example(b'a: "\\UFFFFFFFF"\n')  # an escape past what chr() takes: was OverflowError
@example(b'a: "\\U00110000"\n')  # past the last code point: was ValueError
def test_config_files(tmp_path, document):
    try:
        config = serve_config(tmp_path, document, {})
    except CLEAR:
        return
    assert config.shards >= 1


ENVIRON = st.dictionaries(
    st.sampled_from(sorted(FLAGS)).map(lambda f: "VERICACHE_" + f.replace("-", "_").upper()),
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0"), max_size=12),
    max_size=3,
)


@share(0.5)
@given(ENVIRON)
def test_config_variables(tmp_path, environ):
    with contextlib.suppress(*CLEAR):
        serve_config(tmp_path, b"", environ)


# ---- the state file --------------------------------------------------------------------

STATE = st.fixed_dictionaries(
    {
        "endpoints": st.lists(st.just("127.0.0.1:5000"), max_size=2),
        "decoders": st.lists(st.just("127.0.0.1:6000"), max_size=2),
        "routers": st.lists(st.just("127.0.0.1:7000"), max_size=2),
        "lmcache": st.sampled_from(["", "lm://127.0.0.1:65432"]),
        "redis_url": st.just("redis://:pw@127.0.0.1:6379"),
        "ray_address": st.just("embedded"),
        "detached": st.booleans(),
        "tls": st.sampled_from(["off", "tls", "mtls"]),
        "metrics": st.dictionaries(
            st.sampled_from(["shard-0", "decoder-0"]), st.just("http://127.0.0.1:9/m")
        ),
        "metrics_token": st.text(max_size=8),
        "started": st.floats(0, 2e9),
        "pid": st.integers(1, 2**22),
    }
)


def read_state_file(tmp_path, raw: bytes):
    from cluster.state import read_state

    (tmp_path / "cluster.json").write_bytes(raw)
    with mock.patch.dict(os.environ, {"VERICACHE_HOME": str(tmp_path)}):
        return read_state()


@given(STATE)
def test_state_files_round_trip(tmp_path, state):
    assert read_state_file(tmp_path, json.dumps(state, indent=2).encode()) == state


@given(st.data())
@example(None)
def test_state_file_mutations(tmp_path, data):
    if data is None:  # the explicit cases
        raws = [b"[]", b"null", b'{"decoders": "abc"}', b'{"metrics": []}', b"\xff", b"[" * 10**5]
    else:
        state = data.draw(STATE)
        for name in data.draw(st.lists(st.sampled_from(sorted(state)), max_size=2)):
            state[name] = data.draw(VALUES)
        raws = [data.draw(mutated(st.just(json.dumps(state).encode()), max_edits=2))]
    for raw in raws:
        check_state(tmp_path, raw)


def check_state(tmp_path, raw: bytes) -> None:
    """Read as a state of the types the service writes, or refused with ConfigError; and
    what the CLI takes from it is then of those types."""
    from cluster.decoder_cli import default_endpoint

    try:
        state = read_state_file(tmp_path, raw)
    except ConfigError:
        return
    with mock.patch.dict(os.environ, {"VERICACHE_HOME": str(tmp_path)}):
        try:
            endpoint = default_endpoint(cli.UsageError, object())
        except cli.UsageError:
            endpoint = ""
    assert isinstance(endpoint, str)
    for name in ("decoders", "endpoints", "routers"):
        assert all(isinstance(a, str) for a in state.get(name, []))
    assert all(isinstance(v, str) for v in state.get("metrics", {}).values())
    assert isinstance(state.get("redis_url", ""), str)
