"""The tokenizer read without `transformers`: token for token and character for character
what `transformers`' `AutoTokenizer` gives for the same folder, chat templates included."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys

import pytest

from decoder.errors import ModelLoadError
from decoder.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "",
    " ",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "Unicode: naïve café, 日本語, emoji 🙂, Ω≈ç√",
    "<|im_start|>user\ncontrol tokens written in the text<|im_end|>",
    "<|endoftext|> unknown-ish <unk> [MASK]",
    inspect.getsource(inspect)[:6000],
    "x" * 3000,
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, with <|im_end|> in it."},
    ],
    [{"role": "user", "content": "Ünïcode 🙂", "name": None}],
]


@pytest.fixture(scope="module")
def pair(builtin_model):
    from transformers import AutoTokenizer

    ours = load_tokenizer(builtin_model.path)
    assert isinstance(ours, Tokenizer)
    return ours, AutoTokenizer.from_pretrained(str(builtin_model.path))


@pytest.mark.parametrize("special", [True, False])
def test_encode_equals_transformers(pair, special):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(
            text, add_special_tokens=special
        ), text[:40]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(pair, skip):
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )
    mixed = [1, 2, 0, 9690, 198, 2683, 2, 2, 49151]
    assert ours.decode(mixed, skip_special_tokens=skip) == theirs.decode(
        mixed, skip_special_tokens=skip
    )


@pytest.mark.parametrize("reply", [True, False])
def test_chat_template_equals_transformers(pair, reply):
    ours, theirs = pair
    for chat in CHATS:
        want = theirs.apply_chat_template(chat, add_generation_prompt=reply, tokenize=True)
        if hasattr(want, "keys"):
            want = want["input_ids"]
        assert ours.apply_chat_template(chat, add_generation_prompt=reply) == list(want)


def test_special_tokens_vocab_and_eos_equal_transformers(pair):
    ours, theirs = pair
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.get_vocab() == theirs.get_vocab()
    for name, token in ours.special_tokens_map.items():
        assert getattr(theirs, name) == token


def test_loading_a_model_does_not_import_transformers(builtin_model):
    """Encoding and decoding need only `tokenizers` (what a decoder or router pays at start)."""
    code = (
        "import sys; from decoder.loader import load_model; m = load_model(); "
        "m.decode(m.encode('hello')); from decoder.router.server import load_tokenizer; "
        "load_tokenizer(None).encode('x'); print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def edited(builtin_model, tmp_path, **changes):
    """A copy of the built-in tokenizer files with `changes` to its config (None: removed)."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(builtin_model.path / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer_class": "LlamaTokenizer"},
        {"tokenizer_class": None},  # transformers would pick a class from config.json
        {"add_bos_token": True},
        {"clean_up_tokenization_spaces": True},
        {"additional_special_tokens": ["<|endoftext|>"]},
        {"unk_token": "hello"},  # named special, but an ordinary token in tokenizer.json
        {"special_tokens_map.json": True},
    ],
    ids=lambda changes: next(iter(changes)),
)
def test_a_folder_that_needs_more_than_tokenizer_json_gets_transformers(
    builtin_model, tmp_path, changes
):
    from transformers import AutoTokenizer

    older = changes.pop("special_tokens_map.json", False)
    folder = edited(builtin_model, tmp_path, **changes)
    if older:
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = load_tokenizer(folder)
    assert not isinstance(tokenizer, Tokenizer)
    reference = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS[:8]:
        assert tokenizer.encode(text) == reference.encode(text)


def test_named_chat_templates_and_a_missing_one(builtin_model, tmp_path):
    template = (builtin_model.path / "chat_template.jinja").read_text()
    folder = edited(
        builtin_model, tmp_path, chat_template=[{"name": "default", "template": template}]
    )
    (folder / "chat_template.jinja").unlink()
    tokenizer = load_tokenizer(folder)
    chat = CHATS[1]
    assert tokenizer.apply_chat_template(chat) == load_tokenizer(
        builtin_model.path
    ).apply_chat_template(chat)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template(chat)


def test_a_broken_tokenizer_config_is_a_load_error(builtin_model, tmp_path):
    folder = edited(builtin_model, tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(folder)
