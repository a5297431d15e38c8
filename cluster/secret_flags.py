"""Secret flags: every secret a command takes comes from the environment or a file.

A command line is visible to every local user (`ps`, /proc/PID/cmdline), so each secret
flag `--X` has a variable ($VERICACHE_X, its default) and a file form (`--X-file FILE`,
the file's first line). `--X` itself still works, with a warning naming both. The service
never passes a secret to a process it starts in that process's arguments."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefix_store.errors import InvalidArgument

VARIABLES = {
    "redis-url": "VERICACHE_REDIS_URL",
    "metrics-token": "VERICACHE_METRICS_TOKEN",
    "lmcache-token": "VERICACHE_LMCACHE_TOKEN",
    "token": "VERICACHE_TOKEN",
}
"""Each secret flag and the variable that gives it instead."""
MAX_SECRET_FILE = 64 << 10
"""Bytes of a secret file read (its first line is the secret)."""


class _OnCommandLine(argparse.Action):
    """Stores the value, warning that the command line shows it to every local user."""

    def __init__(self, *args, variable: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.variable = variable

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"vericache: warning: {option_string} on the command line is visible to every "
            f"local user; set ${self.variable} or use {option_string}-file FILE instead",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def read_secret(path: str) -> str:
    """The secret in file `path`: its first line, stripped. Errors name the file only."""
    try:
        with Path(path).expanduser().open("rb") as file:
            lines = file.read(MAX_SECRET_FILE).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.__class__.__name__
        raise InvalidArgument(f"cannot read secret file {path} ({reason})") from None
    if not lines or not lines[0].strip():
        raise InvalidArgument(f"secret file {path} is empty")
    return lines[0].strip()


def add_secret(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """`--FLAG` (warned; default $VERICACHE_FLAG) or `--FLAG-file FILE`, not both; read
    the file with `resolve_secrets` once parsed."""
    variable = VARIABLES[flag]
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        f"--{flag}",
        action=_OnCommandLine,
        variable=variable,
        default=os.environ.get(variable) or None,
        help=f"{help} (default: ${variable}; prefer it or --{flag}-file: other local users "
        "see command lines)",
    )
    group.add_argument(
        f"--{flag}-file", metavar="FILE", help=f"read --{flag} from FILE's first line"
    )


def resolve_secrets(ns: argparse.Namespace) -> None:
    """Each secret given as `--FLAG-file` read into its flag's place."""
    for flag in VARIABLES:
        dest = flag.replace("-", "_")
        path = getattr(ns, f"{dest}_file", None)
        if path:
            setattr(ns, dest, read_secret(path))
