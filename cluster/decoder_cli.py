"""Decoder subcommands of `vericache`: `publish`, and `generate --endpoint` (remote)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from cluster import tls_cli
from cluster.cli_common import UsageError, parse_compressor, read_prompt_file, stats_line
from cluster.secret_flags import add_secret


def add_commands(sub) -> None:
    pub = sub.add_parser(
        "publish", help="prefill a prefix once and store its KV and compressed artifacts"
    )
    source = pub.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, help="the prefix text, from a UTF-8 file")
    source.add_argument("--text", help="the prefix text")
    add_secret(pub, "token", "tenant token")
    pub.add_argument("--shared", default="", metavar="NAMESPACE", help="a shared namespace")
    pub.add_argument(
        "--compressor",
        action="append",
        default=[],
        metavar="SPEC",
        help="store a compressed artifact for this spec (repeatable)",
    )
    pub.add_argument("--chat", action="store_true", help="wrap the text in the chat template")
    pub.add_argument("--endpoint", help="decoder host:port (default: the local service's)")
    pub.add_argument("--json", action="store_true")
    tls_cli.add_client_flags(pub)
    pub.set_defaults(parse=parse_publish, run=run_publish)


def token_of(ns, usage_error) -> str:
    token = ns.token or os.environ.get("VERICACHE_TOKEN")
    if not token:
        raise usage_error("--token is required: set $VERICACHE_TOKEN or use --token-file")
    return token


def default_endpoint(usage_error, tls) -> str:
    """The local service's first decoder; a usage error when there is none, or when it
    serves TLS and `tls` (the client's) is None."""
    from cluster.state import read_state

    state = read_state()
    decoders = state.get("decoders") or []
    if not decoders:
        raise usage_error("the local service runs no decoder: pass --endpoint HOST:PORT")
    if state.get("tls", "off") != "off" and tls is None:
        raise usage_error(
            f"the local service serves {state['tls']}: pass --tls-ca (and --tls-cert, "
            "--tls-key under mtls) or set VERICACHE_TLS_CA (VERICACHE_TLS_CERT, _KEY)"
        )
    return decoders[0]


def parse_publish(ns: argparse.Namespace) -> argparse.Namespace:
    ns.token = token_of(ns, UsageError)
    ns.text = ns.text if ns.file is None else read_prompt_file(ns.file)
    if not ns.text:
        raise UsageError("the prefix text is empty")
    ns.compressor = [parse_compressor(spec) for spec in ns.compressor]
    ns.tls = tls_cli.client_tls(ns)
    ns.endpoint = ns.endpoint or default_endpoint(UsageError, ns.tls)
    return ns


def run_publish(ns: argparse.Namespace) -> int:
    from decoder.service.client import DecoderClient

    what = ns.file.name if ns.file is not None else f"{len(ns.text)} characters"
    with DecoderClient(ns.endpoint, ns.token, tls=ns.tls) as client:
        reply = _with_progress(
            f"publishing {what}",
            lambda: client.publish(
                text=ns.text, chat=ns.chat, namespace=ns.shared, compressors=ns.compressor
            ),
        )
    result = {
        "tokens": reply.tokens,
        "stored_bytes": reply.stored_bytes,
        "artifacts": list(reply.artifacts),
        "namespace": ns.shared,
        "prefill_s": round(reply.prefill_s, 3),
    }
    if ns.json:
        print(json.dumps(result))
    else:
        where = f"shared namespace {ns.shared}" if ns.shared else "your private namespace"
        print(
            f"published {reply.tokens} tokens into {where}: {reply.stored_bytes} bytes stored, "
            f"artifacts: {', '.join(reply.artifacts) or 'none'} (prefill {reply.prefill_s:.1f}s)"
        )
    return 0


def _with_progress(desc: str, call):
    """`call()` (one Publish RPC) under a progress bar on stderr that shows the time it has
    taken, then the tokens prefilled and the bytes stored. Publish is a unary RPC, so the
    client sees no finer progress than that. Without a bar (stderr not a terminal) the
    call simply runs here."""
    from decoder.progress import progress

    bar = progress(desc=desc, total=1, unit="doc")
    if bar.disable:
        bar.close()
        return call()
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["reply"] = call()
        except BaseException as error:  # raised again in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    with bar:
        while worker.is_alive():
            worker.join(0.5)
            bar.refresh()  # the elapsed time
        if "error" in outcome:
            raise outcome["error"]
        reply = outcome["reply"]
        bar.set_postfix_str(
            f"{reply.tokens} tokens prefilled, {reply.stored_bytes / 2**20:.1f} MiB stored"
        )
        bar.update(1)
    return reply


def run_remote_generate(args) -> int:
    """`vericache generate --endpoint`: the same flags and JSON as in-process mode."""
    from decoder.service.client import DecoderClient

    with DecoderClient(args.endpoint, args.token, tls=args.tls) as client:
        stream = client.stream(
            text=args.prompt,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            mode=args.mode,
            compressor=args.compressor if args.mode != "full" else "",
            horizon=args.horizon,
            ngram=args.ngram,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            namespace=args.namespace,
            reply=(reply := _reply()),
        )
        for piece in stream:
            if not args.json:
                print(piece.text, end="", flush=True)
    if args.json:
        out = {"mode": args.mode, "tokens": reply.tokens, "text": reply.text, "stats": reply.stats}
        print(json.dumps(out))
    else:
        print()
        print(stats_line(reply.stats), file=sys.stderr)
    return 0


def _reply():
    from decoder.service.client import GenerateReply

    return GenerateReply()
