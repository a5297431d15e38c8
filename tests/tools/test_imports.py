"""tools.lint.imports: every import counts (except under TYPE_CHECKING); circles and layer
rules are reported one line each, with exit status 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools.lint import imports

REPO = Path(__file__).resolve().parents[2]


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` (path -> source) under root, with __init__.py in every package."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                (root / parent / "__init__.py").touch()
        path.write_text(source)
    return root


def test_a_clean_tree_has_no_findings(tmp_path):
    tree(tmp_path, {"decoder/a.py": "import decoder.b\n", "decoder/b.py": "import os\n"})
    assert imports.findings(tmp_path) == []
    assert imports.main([str(tmp_path)]) == 0


def test_a_lazy_import_closes_a_circle(tmp_path, capsys):
    tree(
        tmp_path,
        {
            "cluster/cli.py": "from cluster import decoder_cli\n",
            "cluster/decoder_cli.py": "def f():\n    from cluster.cli import UsageError\n",
        },
    )
    assert imports.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        "circle: cluster.cli -> cluster.decoder_cli -> cluster.cli\n"
    )


def test_import_module_and_relative_imports_count(tmp_path):
    tree(
        tmp_path,
        {
            "decoder/x/a.py": "from . import b\n",
            "decoder/x/b.py": "from ..y import c\n",
            "decoder/y/c.py": "import importlib\nimportlib.import_module('decoder.x.a')\n",
        },
    )
    assert imports.findings(tmp_path) == [
        "circle: decoder.x.a -> decoder.x.b -> decoder.y.c -> decoder.x.a"
    ]


def test_from_import_of_a_name_is_an_import_of_its_module(tmp_path):
    tree(
        tmp_path,
        {
            "decoder/__init__.py": "from decoder.a import thing\n",
            "decoder/a.py": "from decoder import b\nthing = 1\n",
            "decoder/b.py": "from decoder import thing\n",
        },
    )
    # decoder.b imports the package decoder (thing is no module), which imports decoder.a.
    assert imports.findings(tmp_path) == ["circle: decoder -> decoder.a -> decoder.b -> decoder"]


def test_type_checking_imports_are_exempt(tmp_path):
    tree(
        tmp_path,
        {
            "decoder/a.py": "import decoder.b\n",
            "decoder/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    import decoder.a\nelse:\n    import os\n"
            ),
        },
    )
    assert imports.findings(tmp_path) == []


def test_the_else_of_type_checking_counts(tmp_path):
    tree(
        tmp_path,
        {
            "decoder/a.py": "import decoder.b\n",
            "decoder/b.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n"
            "    import decoder.a\n",
        },
    )
    assert imports.findings(tmp_path) == ["circle: decoder.a -> decoder.b -> decoder.a"]


def test_layer_rules(tmp_path):
    tree(
        tmp_path,
        {
            "prefix_store/client/sdk.py": "def f():\n    from prefix_store import shard\n",
            "prefix_store/shard.py": "",
            "prefix_store/tiers/disk.py": "",
            "rpc/server.py": "",
            "prefix_store/client/net.py": "import rpc.server\n",
            "decoder/store.py": "from prefix_store.tiers.disk import Disk\n",
            "decoder/service/server.py": "",
            "decoder/service/client.py": "from decoder.service import server\n",
        },
    )
    assert imports.findings(tmp_path) == [
        "layer: decoder/service/client.py:1: decoder.service.client imports "
        "decoder.service.server (decoder.service.client* must not import decoder.service.server*)",
        "layer: decoder/store.py:1: decoder.store imports prefix_store.tiers.disk "
        "(decoder* must not import prefix_store.tiers*)",
        "layer: prefix_store/client/net.py:1: prefix_store.client.net imports rpc.server "
        "(prefix_store.client* must not import rpc*)",
        "layer: prefix_store/client/sdk.py:2: prefix_store.client.sdk imports prefix_store.shard "
        "(prefix_store.client* must not import prefix_store.shard*)",
    ]


def test_the_real_tree_has_no_circle():
    circles = [line for line in imports.findings(REPO) if line.startswith("circle:")]
    assert circles == []


def test_it_runs_as_a_module(tmp_path):
    tree(tmp_path, {"cluster/a.py": "import cluster.b\n", "cluster/b.py": "import cluster.a\n"})
    run = subprocess.run(
        [sys.executable, "-m", "tools.lint.imports", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (run.returncode, run.stdout) == (1, "circle: cluster.a -> cluster.b -> cluster.a\n")
