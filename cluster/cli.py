"""The `vericache` command line.

Every subcommand parses its flags into a typed request, validates it, and runs it. Bad
arguments print one line `vericache: error: ...` and exit with status 2; runtime failures
print one line and exit with status 1; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from decoder.errors import ExactModeUnsupported, ModelLoadError

GENERATE_MODES = ("full",)
"""Decoding modes of `vericache generate`; `full` is full-KV decoding (the reference)."""


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class GenerateArgs:
    """A validated `vericache generate` invocation."""

    prompt: str
    max_new_tokens: int
    mode: str
    model: str | None
    runner: str
    chat: bool
    json: bool
    threads: int | None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vericache", description="Lossless decoding with remote prefix KV.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    gen.add_argument("--mode", default="full", help=f"decoding mode: {', '.join(GENERATE_MODES)}")
    gen.add_argument("--model", help="a local Hugging Face Llama-family folder "
                     "(default: the built-in SmolLM2-135M-Instruct)")
    gen.add_argument("--runner", choices=("exact", "fast"), default="exact",
                     help="exact (bitwise reproducible, the default) or fast kernels")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(run=run_generate, parse=parse_generate)

    demo = sub.add_parser("demo", help="run the demo on the built-in model")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(run=run_demo, parse=lambda ns: ns)
    return parser


def parse_generate(ns: argparse.Namespace) -> GenerateArgs:
    prompt = ns.prompt if ns.prompt_file is None else _read_prompt_file(ns.prompt_file)
    if not prompt:
        raise UsageError("the prompt is empty")
    if ns.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    if ns.mode not in GENERATE_MODES:
        raise UsageError(f"--mode {ns.mode!r} is unknown; choose from: {', '.join(GENERATE_MODES)}")
    if ns.threads is not None and ns.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {ns.threads}")
    if ns.model is not None and not Path(ns.model).is_dir():
        raise UsageError(f"--model {ns.model}: not a directory")
    return GenerateArgs(prompt=prompt, max_new_tokens=ns.max_new_tokens, mode=ns.mode,
                        model=ns.model, runner=ns.runner, chat=ns.chat, json=ns.json,
                        threads=ns.threads)


def _read_prompt_file(path: Path) -> str:
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


def run_generate(args: GenerateArgs) -> int:
    from decoder.config import RunnerConfig
    from decoder.generate import generate_full
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model(args.model)
    prompt_ids = model.encode(args.prompt, chat=args.chat)
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + args.max_new_tokens > limit:
        raise UsageError(f"prompt ({len(prompt_ids)} tokens) plus --max-new-tokens "
                         f"({args.max_new_tokens}) exceeds the model's context of {limit}")
    runner = ModelRunner(model.config, model.weights, RunnerConfig(threads=args.threads))
    result = generate_full(runner, [prompt_ids], max_new_tokens=args.max_new_tokens,
                           eos_token_ids=model.eos_token_ids, mode=args.runner)[0]
    text = model.decode(result.tokens)
    stats = {"model": model.name, "runner": args.runner, "stop_reason": result.stop_reason,
             **result.stats}
    if args.json:
        print(json.dumps({"mode": args.mode, "tokens": result.tokens, "text": text,
                          "stats": stats}))
    else:
        print(text)
        print(_stats_line(stats), file=sys.stderr)
    return 0


def _stats_line(stats: dict) -> str:
    return (f"[{stats['generated_tokens']} tokens, {stats['tokens_per_s']} tok/s, "
            f"prefill {stats['prefill_s']}s, stop: {stats['stop_reason']}]")


DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def run_demo(ns: argparse.Namespace) -> int:
    """For now: one local full-KV generation on the built-in model (grows into the service demo)."""
    print(f"vericache demo: full-KV exact decoding on the built-in model\nprompt: {DEMO_PROMPT}\n")
    args = GenerateArgs(prompt=DEMO_PROMPT, max_new_tokens=ns.max_new_tokens, mode="full",
                        model=None, runner="exact", chat=True, json=False, threads=None)
    return run_generate(args)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        args = ns.parse(ns)
        return ns.run(args)
    except UsageError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except ModelLoadError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except ExactModeUnsupported as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vericache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
