"""tools.lint.duplicates: six consecutive normalized lines in two places are a finding."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools.lint import duplicates

REPO = Path(__file__).resolve().parents[2]

BLOCK = """\
def total(items):
    count = 0
    for item in items:
        if item.size > 0:
            count += item.size
    log.info("total %d", count)
    return count
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_a_block_in_two_files_is_reported_once(tmp_path, capsys):
    write(tmp_path, {"decoder/a.py": "x = 1\n\n" + BLOCK, "cluster/b.py": BLOCK})
    assert duplicates.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        "duplicate: cluster/b.py:1-7 and decoder/a.py:3-9 (7 lines)\n"
    )


def test_comments_docstrings_blank_lines_and_indentation_do_not_hide_it(tmp_path):
    other = 'class Holder:\n    """A docstring."""\n\n' + "".join(
        f"    {line}  # a comment\n" if line else "\n" for line in BLOCK.splitlines()
    )
    write(tmp_path, {"decoder/a.py": BLOCK, "prefix_store/b.py": other})
    assert duplicates.findings(tmp_path) == [
        "duplicate: decoder/a.py:1-7 and prefix_store/b.py:4-10 (7 lines)"
    ]


def test_two_places_in_one_file(tmp_path):
    write(tmp_path, {"cluster/a.py": BLOCK + "\n\n" + BLOCK.replace("def total", "def other")})
    assert duplicates.findings(tmp_path) == [
        "duplicate: cluster/a.py:2-7 and cluster/a.py:11-16 (6 lines)"
    ]


def test_five_lines_are_not_a_finding(tmp_path):
    five = textwrap.dedent("\n".join(BLOCK.splitlines()[1:6]) + "\n")
    write(tmp_path, {"decoder/a.py": five, "decoder/b.py": five})
    assert duplicates.findings(tmp_path) == []


def test_argparse_calls_and_imports_are_exempt(tmp_path):
    parser = (
        "import argparse\nimport json\nimport os\nimport sys\nfrom pathlib import Path\n"
        "from typing import Any\n"
        "def build(sub):\n"
        "    p = sub.add_parser('serve', help='serve')\n"
        "    p.add_argument('--port', type=int, default=50051,\n"
        "                   help='the port')\n"
        "    p.add_argument('--host', default='127.0.0.1')\n"
        "    p.add_argument('--state-dir', type=Path)\n"
        "    p.add_argument('--json', action='store_true')\n"
        "    return p\n"
    )
    write(tmp_path, {"cluster/a.py": parser, "cluster/b.py": parser})
    assert duplicates.findings(tmp_path) == []


def test_messages_differ_so_no_finding(tmp_path):
    write(tmp_path, {"decoder/a.py": BLOCK, "decoder/b.py": BLOCK.replace("total %d", "sum %d")})
    assert duplicates.findings(tmp_path) == []


def test_code_outside_the_product_packages_is_not_compared(tmp_path):
    write(tmp_path, {"decoder/a.py": BLOCK, "proto/gen/b.py": BLOCK, "tests/c.py": BLOCK})
    assert duplicates.findings(tmp_path) == []


def test_the_real_tree_has_no_duplicate_in_cluster():
    assert [line for line in duplicates.findings(REPO) if "cluster/" in line] == []
