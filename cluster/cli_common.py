"""What the CLI's command modules share: the usage error, argument checks on prompts and
compressors, and the stats line printed after a generation (`cluster.cli` and
`cluster.decoder_cli` both use them; neither imports the other for them)."""

from __future__ import annotations

from pathlib import Path

from decoder.errors import CompressorSpecError


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit status 2."""


def parse_compressor(spec: str) -> str:
    """The canonical spec of a --compressor value; UsageError when it is not one."""
    from decoder.compressors import parse_compressor as parse

    try:
        return parse(spec).spec
    except CompressorSpecError as e:
        raise UsageError(f"--compressor: {e}") from None


def read_prompt_file(path: Path) -> str:
    """The UTF-8 text of a --prompt-file (or --file); UsageError saying why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--prompt-file {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--prompt-file {path}: is a directory") from None
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"--prompt-file {path}: {e.strerror}") from None


def stats_line(stats: dict) -> str:
    """One bracketed line of a generation's stats, for stderr."""
    line = (
        f"[{stats['generated_tokens']} tokens, {stats['tokens_per_s']} tok/s, "
        f"prefill {stats['prefill_s']}s, stop: {stats['stop_reason']}"
    )
    if "compressed_bytes" in stats:
        line += (
            f", compressed {stats['compressed_bytes']} of {stats['full_bytes']} bytes "
            f"({stats['compression_ratio']}x)"
        )
    if "verifications" in stats:
        line += (
            f", {stats['verifications']} verifications, "
            f"{stats['accepted_per_verification']} accepted each"
        )
    return line + "]"
