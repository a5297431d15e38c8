"""The CLI imports Ray, gRPC, Redis, torch and transformers only in the commands that use
them: `vericache --help` imports none of them, an in-process generate (every mode) only
torch, and the tenant commands only Redis."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("ray", "grpc", "redis", "transformers", "torch", "lmcache", "prometheus_client")


def imported_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cli_and_its_help_import_nothing_heavy():
    assert imported_after("import cluster.cli") == []
    help_code = (
        "from cluster.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0"
    )
    assert imported_after(help_code) == []


def test_an_in_process_generate_needs_no_ray_grpc_or_redis():
    for mode in ("full", "vericache"):
        code = (
            "import contextlib, io\nfrom cluster.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['generate', '--prompt', 'def f(n):', '--max-new-tokens', '2', "
            f"'--mode', '{mode}']) == 0"
        )
        assert set(imported_after(code)) == {"torch"}, mode


def test_tenant_commands_need_only_redis(redis_server):
    """What operators script (`tenant add`, `tenant list`) starts in a fraction of a second:
    no Ray, no model runtime."""
    for command in (
        ["tenant", "add", "lazy-imports"],
        ["tenant", "list"],
        ["tenant", "remove", "lazy-imports"],
    ):
        code = (
            "import contextlib, io\nfrom cluster.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main({command + ['--redis-url', redis_server.url]!r}) == 0"
        )
        assert imported_after(code) == ["redis"], command


def test_processes_that_handle_no_tensors_import_no_torch():
    """The router, the LMCache gateway, the store SDK and the deployment driver (`vericache
    serve`, `status`, `stop`) start without the model runtime: about 2.5 CPU-seconds and
    200 MB less per process. Shards and decoders load it where they use it."""
    for module in (
        "cluster.router_actor",
        "cluster.gateway_actor",
        "cluster.serve",
        "prefix_store.client",
        "decoder.service.client",
    ):
        assert "torch" not in imported_after(f"import {module}"), module
