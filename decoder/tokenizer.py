"""A model's tokenizer, read from its Hugging Face folder without importing `transformers`.

`transformers`' `AutoTokenizer` costs about 2.5 CPU-seconds of imports in every process that
loads a model (each decoder, router and CLI run), for what `tokenizer.json` alone defines:
a fast tokenizer is the `tokenizers` library running that file. `Tokenizer` runs it the
same way, with the special tokens of `tokenizer_config.json`. Chat templates are rendered
by `transformers`' own renderer (its jinja2 sandbox and input hardening), imported at the
first chat conversation only, and the result is tokenized without special tokens, as
`apply_chat_template` does.

`Tokenizer` serves only folders where `tokenizer.json` says it all: `tokenizer_config.json`
names a generic tokenizer class, every special token it names is a special token of
`tokenizer.json`, and nothing else changes the backend (BOS/EOS insertion flags that
rewrite the post-processor, more special tokens, `added_tokens_decoder`, clean-up of spaces
in decoding, an older `special_tokens_map.json`). `load_tokenizer` gives any other folder
to `AutoTokenizer`.
tests/decoder/test_tokenizer.py checks this class against `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from decoder.errors import ModelLoadError

PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""`tokenizer_class` values whose fast tokenizer is `tokenizer.json` run as it is."""
REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "added_tokens_decoder",
                  "additional_special_tokens", "extra_special_tokens")  # fmt: skip
"""`tokenizer_config.json` keys with which `transformers` changes the backend it loads."""
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")  # fmt: skip


class Tokenizer:
    """`tokenizer.json` run by the `tokenizers` library, with the folder's special tokens and
    chat template. The methods used here mirror `transformers`' fast tokenizers."""

    def __init__(self, folder: Path, config: dict[str, Any], backend) -> None:
        self._backend = backend
        self.special_tokens_map = _named_specials(config)
        self.chat_template = _chat_template(folder, config)
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if eos is None else self._backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def special_token_texts(self) -> list[str]:
        """The texts of the special (control) tokens, as `transformers`' `all_special_tokens`
        plus every added token marked special."""
        added = self._backend.get_added_tokens_decoder().values()
        named = set(self.special_tokens_map.values())
        return sorted({t.content for t in added if t.special} | named)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, **_: Any
    ) -> list[int]:
        """Token ids of `messages` through the chat template (no special tokens added
        around the rendered text: the template writes its own)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ModelLoadError("this tokenizer has no chat template")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, _ = render_jinja_template(
            conversations=[chat],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
        return self.encode(rendered[0], add_special_tokens=False)


def load_tokenizer(folder: Path):
    """The folder's tokenizer: a `Tokenizer` where `tokenizer.json` defines it all, else
    `transformers`' `AutoTokenizer` (see the module docstring)."""
    if not (folder / "tokenizer.json").exists():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    config = _tokenizer_config(folder)
    if _plain(folder, config):
        backend = _backend(folder)
        if _specials_are_special(backend, config):
            return Tokenizer(folder, config, backend)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _backend(folder: Path):
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(folder / "tokenizer.json"))


def _plain(folder: Path, config: dict[str, Any]) -> bool:
    """Whether nothing in the folder but `tokenizer.json` shapes the tokenizer."""
    return (
        config.get("tokenizer_class") in PLAIN_CLASSES
        and not any(key in config for key in REWRITING_KEYS)
        and not config.get("clean_up_tokenization_spaces")
        and not (folder / "special_tokens_map.json").exists()
    )


def _specials_are_special(backend, config: dict[str, Any]) -> bool:
    """Whether every special token the config names is a special token of the backend
    (`transformers` would otherwise register it as one: skipped in decoding, never split)."""
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    return all(token in special for token in _named_specials(config).values())


def _named_specials(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens `tokenizer_config.json` names (`bos_token`: "<s>", ...)."""
    return {name: _content(config[name]) for name in SPECIAL_NAMES if config.get(name) is not None}


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return config


def _content(token: Any) -> str:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja`, else the config's template (a string, or named ones: "default")."""
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
