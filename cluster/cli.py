"""The `vericache` command line.

Every subcommand parses its flags into a typed request, validates it, and runs it. Bad
arguments print one line `vericache: error: ...` and exit with status 2; runtime failures
print one line and exit with status 1; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from cluster import decoder_cli, node_cli, store_cli, tls_cli
from cluster.cli_common import UsageError, parse_compressor, read_prompt_file, stats_line
from cluster.config_file import ConfigError
from cluster.paths import PRIVATE_UMASK
from cluster.secret_flags import add_secret, resolve_secrets
from decoder.errors import ExactModeUnsupported, ModelLoadError
from prefix_store.errors import InvalidArgument, NotFound, StoreError, Unauthenticated

if TYPE_CHECKING:
    from prefix_store.tls import TLSClientConfig

GENERATE_MODES = ("full", "lossy", "vericache")
"""Decoding modes of `vericache generate`: `full` is full-KV decoding (the reference),
`lossy` decodes with the compressed KV alone, `vericache` drafts with it and verifies."""

DEFAULT_COMPRESSOR = "snapkv:budget=0.125"


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
    compressor: str = DEFAULT_COMPRESSOR
    horizon: int | None = None
    """Drafted tokens per verification; None: automatic."""
    ngram: int | None = None
    """Prompt-lookup guesses per forward; None: off in-process, the worker's default with
    --endpoint."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    endpoint: str | None = None
    """A decoder's host:port: generate on the service instead of in this process."""
    token: str | None = None
    namespace: str = ""
    tls: TLSClientConfig | None = None
    """With --endpoint: TLS to the decoder (None: in the clear)."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vericache", description="Lossless decoding with remote prefix KV.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    gen.add_argument("--mode", default="full", help=f"decoding mode: {', '.join(GENERATE_MODES)}")
    gen.add_argument(
        "--model",
        help="a local Hugging Face Llama-family folder "
        "(default: the built-in SmolLM2-135M-Instruct)",
    )
    gen.add_argument(
        "--runner",
        choices=("exact", "fast"),
        default="exact",
        help="exact (bitwise reproducible, the default) or fast kernels",
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument(
        "--compressor",
        default=DEFAULT_COMPRESSOR,
        help="KV compressor spec for lossy/vericache, e.g. snapkv:budget=0.125, "
        "kivi:bits=2, snapkv:budget=0.25+kivi:bits=4 (default: %(default)s)",
    )
    gen.add_argument(
        "--horizon",
        default="auto",
        help="vericache: drafted tokens per verification, 'auto' or N >= 0",
    )
    gen.add_argument(
        "--ngram",
        type=int,
        help="prompt-lookup speculation: at most N guesses copied from the prompt and output "
        "checked per forward (0: off; default: off here, the decoder's default with "
        "--endpoint); the output does not change",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1]")
    gen.add_argument("--seed", type=int, help="sampling seed (same seed, same tokens)")
    gen.add_argument(
        "--endpoint", help="a decoder's host:port: generate on the service (remote prefix KV)"
    )
    add_secret(gen, "token", "with --endpoint: tenant token")
    gen.add_argument(
        "--namespace", default="", help="with --endpoint: shared namespace to look prefixes up in"
    )
    tls_cli.add_client_flags(gen)
    gen.set_defaults(run=run_generate, parse=parse_generate)

    demo = sub.add_parser(
        "demo", help="the service on this machine: 3 tenants, full vs lossy vs vericache"
    )
    demo.add_argument("--prefix-tokens", type=int, default=3000, help="shared document tokens")
    demo.add_argument("--requests", type=int, default=6, help="concurrent requests per mode")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--compressor", default=DEFAULT_COMPRESSOR)
    demo.add_argument(
        "--kv-budget",
        type=store_cli.parse_bytes,
        help="KV bytes per decoder (default: unlimited); the full-KV baseline needs room for "
        "the shared document's full KV",
    )
    demo.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each mode, interleaved; above 1 the table gives medians and ranges",
    )
    demo.add_argument("--out", type=Path, help="also write the table here as JSON")
    demo.set_defaults(run=run_demo, parse=lambda ns: ns)
    store_cli.add_commands(sub)
    decoder_cli.add_commands(sub)
    node_cli.add_commands(sub)
    tls_cli.add_commands(sub)
    return parser


def parse_generate(ns: argparse.Namespace) -> GenerateArgs:
    prompt = ns.prompt if ns.prompt_file is None else read_prompt_file(ns.prompt_file)
    if not prompt:
        raise UsageError("the prompt is empty")
    if ns.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    if ns.mode not in GENERATE_MODES:
        raise UsageError(f"--mode {ns.mode!r} is unknown; choose from: {', '.join(GENERATE_MODES)}")
    if ns.threads is not None and ns.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {ns.threads}")
    token = tls = None
    if ns.endpoint is not None:
        token = decoder_cli.token_of(ns, UsageError)
        tls = tls_cli.client_tls(ns)
        if ns.model is not None or ns.runner != "exact" or ns.threads is not None:
            raise UsageError("--model, --runner and --threads are the service's with --endpoint")
    elif ns.namespace or tls_cli.client_flags_given(ns):
        raise UsageError("--namespace and --tls-* apply with --endpoint only")
    if ns.model is not None and not Path(ns.model).is_dir():
        raise UsageError(f"--model {ns.model}: not a directory")
    if ns.runner == "fast" and ns.mode != "full":
        raise UsageError(
            f"--runner fast applies to --mode full only ({ns.mode} drafts with fast "
            "kernels and verifies with exact ones)"
        )
    _check_sampling(ns)
    if ns.ngram is not None and not 0 <= ns.ngram <= 32:
        raise UsageError(f"--ngram must be in [0, 32], got {ns.ngram}")
    if ns.ngram and ns.runner == "fast":
        raise UsageError("--ngram needs the exact runner (guesses are checked exactly)")
    compressor = parse_compressor(ns.compressor) if ns.mode != "full" else ns.compressor
    return GenerateArgs(
        prompt=prompt,
        max_new_tokens=ns.max_new_tokens,
        mode=ns.mode,
        model=ns.model,
        runner=ns.runner,
        chat=ns.chat,
        json=ns.json,
        threads=ns.threads,
        compressor=compressor,
        horizon=_parse_horizon(ns.horizon),
        ngram=ns.ngram,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        seed=ns.seed,
        endpoint=ns.endpoint,
        token=token,
        namespace=ns.namespace,
        tls=tls,
    )


def _parse_horizon(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"--horizon must be 'auto' or an integer >= 0, got {text!r}")
    return value


def _check_sampling(ns: argparse.Namespace) -> None:
    if not ns.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {ns.temperature}")
    if ns.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {ns.top_k}")
    if not 0 < ns.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {ns.top_p}")
    if ns.seed is not None and not 0 <= ns.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {ns.seed}")


def run_generate(args: GenerateArgs) -> int:
    if args.endpoint is not None:
        return decoder_cli.run_remote_generate(args)
    from decoder.config import RunnerConfig
    from decoder.generate import generate_full
    from decoder.loader import load_runner
    from decoder.sampling import SamplingParams

    config = RunnerConfig(threads=args.threads)
    model, runner = load_runner(
        args.model, config, draft=args.mode != "full" or args.runner == "fast"
    )
    prompt_ids = model.encode(args.prompt, chat=args.chat)
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + args.max_new_tokens > limit:
        raise UsageError(
            f"prompt ({len(prompt_ids)} tokens) plus --max-new-tokens "
            f"({args.max_new_tokens}) exceeds the model's context of {limit}"
        )
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.mode == "full" and not args.ngram:
        result = generate_full(
            runner,
            [prompt_ids],
            max_new_tokens=args.max_new_tokens,
            eos_token_ids=model.eos_token_ids,
            mode=args.runner,
            sampling=sampling,
        )[0]
    else:
        result = _generate_compressed(runner, model, prompt_ids, args, sampling)
    text = model.decode(result.tokens)
    stats = {
        "model": model.name,
        "runner": args.runner,
        "stop_reason": result.stop_reason,
        **result.stats,
        **_memory(runner, len(prompt_ids) + len(result.tokens), result.stats),
    }
    if args.json:
        print(
            json.dumps({"mode": args.mode, "tokens": result.tokens, "text": text, "stats": stats})
        )
    else:
        print(text)
        print(stats_line(stats), file=sys.stderr)
    return 0


def _generate_compressed(runner, model, prompt_ids, args: GenerateArgs, sampling):
    """lossy / vericache (and full with n-gram guesses) through the engine: the prompt minus
    its last token is the prefix held in memory."""
    import time

    from decoder.engine import Engine, EngineConfig, Request, split_prompt

    config = EngineConfig(
        mode=args.mode, compressor=args.compressor, horizon=args.horizon, ngram=args.ngram or 0
    )
    engine = Engine(runner, config, model.eos_token_ids)
    runner.ensure_exact_supported()
    t0 = time.perf_counter()
    prefix, suffix = split_prompt(runner, prompt_ids, max(1, engine.observe_window))
    prefix_s = time.perf_counter() - t0
    result = engine.run([Request(prefix, suffix, args.max_new_tokens, sampling)])[0]
    stats = result.stats
    stats["prefill_s"] = round(prefix_s + stats["prefill_s"], 4)
    total = stats["prefill_s"] + stats["compress_s"] + stats["decode_s"]
    stats["tokens_per_s"] = round(stats["generated_tokens"] / total, 3)
    stats["decode_tokens_per_s"] = round(stats["generated_tokens"] / stats["decode_s"], 3)
    return result


def _memory(runner, tokens: int, stats: dict) -> dict[str, int]:
    """What this process holds: weights (every form, once per storage), the request's KV
    (full KV of its tokens, plus the compressed copy), and its peak resident memory."""
    import resource

    kv = tokens * runner.config.kv_bytes_per_token + int(stats.get("compressed_bytes", 0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"weight_bytes": runner.weight_bytes, "kv_bytes": kv, "peak_rss_bytes": peak}


def run_demo(ns: argparse.Namespace) -> int:
    from cluster.demo import DemoConfig
    from cluster.demo import run_demo as demo

    if ns.prefix_tokens < 256 or min(ns.requests, ns.max_new_tokens, ns.repeats) < 1:
        raise UsageError(
            "--prefix-tokens must be >= 256, --requests, --max-new-tokens and --repeats >= 1"
        )
    compressor = parse_compressor(ns.compressor)
    return demo(
        DemoConfig(
            ns.prefix_tokens,
            ns.requests,
            ns.max_new_tokens,
            compressor,
            ns.kv_budget,
            repeats=ns.repeats,
            out=ns.out,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    os.umask(PRIVATE_UMASK)  # state, keys, tokens, blobs: the service user's alone
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        store_cli.apply_config(parser, argv)
        ns = parser.parse_args(argv)
        resolve_secrets(ns)
        args = ns.parse(ns)
        return ns.run(args)
    except (UsageError, ConfigError) as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except ModelLoadError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except ExactModeUnsupported as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 1
    except (InvalidArgument, NotFound, Unauthenticated, FileNotFoundError) as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except StoreError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vericache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
