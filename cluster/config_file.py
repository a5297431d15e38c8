"""A command's flags from a YAML file and `VERICACHE_*` environment variables.

`vericache serve --config FILE.yaml` takes every flag from the file: its keys are the flag
names without the dashes in front (`memory-bytes: 4GiB`, `shards: 4`, `no-metrics: true`;
underscores are accepted for dashes). Each flag can also come from the environment as
`VERICACHE_<FLAG>` (`VERICACHE_MEMORY_BYTES=4GiB`; switches take 1/0, true/false, yes/no,
on/off), except the ones in `NOT_FROM_ENV`, whose variables mean the client side already.

Precedence: the command line, then the environment, then the file, then the defaults.
Values are converted and checked exactly as the same flag on the command line would be
(so the typed config built from them, `ServeConfig`, is the one source of truth); an
unknown key, a bad value or an unreadable file is a one-line error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

import yaml

ENV_PREFIX = "VERICACHE_"
NOT_FROM_ENV = frozenset({"tls-cert", "tls-key", "tls-client-ca", "config"})
"""Flags no environment variable sets: VERICACHE_TLS_CERT and VERICACHE_TLS_KEY are the
clients' certificate (`tls_cli`), never a server's."""
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A config file or variable that cannot be used as given."""


def apply(parser: argparse.ArgumentParser, path: Path | None, environ: Mapping[str, str]) -> None:
    """Make the file's and the environment's values the parser's defaults (so flags given
    on the command line still win)."""
    options = _options(parser)
    values = {}
    if path is not None:
        for key, value in _read(path).items():
            name = str(key).lstrip("-").replace("_", "-")
            if name not in options or name in ("config", "help"):
                raise ConfigError(
                    f"--config {path}: unknown key {key!r} (not a flag of this command)"
                )
            values.update(_value(options[name], name, value, f"--config {path}: {key}"))
    for name, action in options.items():
        variable = ENV_PREFIX + name.replace("-", "_").upper()
        if name not in NOT_FROM_ENV and variable in environ:
            values.update(_value(action, name, environ[variable], variable, from_text=True))
    parser.set_defaults(**values)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each long flag's name (no dashes in front) and its action."""
    return {
        option[2:]: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path}: cannot read it ({error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}: not YAML ({str(error).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(f"--config {path}: not YAML (nested too deeply)") from None
    except (ValueError, OverflowError) as error:  # e.g. "\UFFFFFFFF", past the last code point
        raise ConfigError(f"--config {path}: not YAML ({error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    return data


def _value(action: argparse.Action, name: str, value, where: str, from_text: bool = False):
    """{dest: value} as the flag would set it on the command line."""
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
        given = _switch(value, where, from_text)
        return {action.dest: action.const} if given else {}
    if isinstance(value, (dict, list)) or value is None:
        raise ConfigError(f"{where}: expected one value for --{name}")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: --{name} takes a value, not {str(value).lower()}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
            raise ConfigError(f"{where}: --{name}: {error}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: --{name} must be one of {choices}, got {value!r}")
    return {action.dest: value}


def _switch(value, where: str, from_text: bool) -> bool:
    if isinstance(value, bool) and not from_text:
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def config_path(argv: list[str]) -> Path | None:
    """The --config FILE of a command line (before it is parsed)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return None


def environment() -> Mapping[str, str]:
    return os.environ
