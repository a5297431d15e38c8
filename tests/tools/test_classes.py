"""tools.lint.classes: a class over 300 lines or 20 methods is a finding, outside the
SDKs' public client classes."""

from __future__ import annotations

from pathlib import Path

from tools.lint import classes

REPO = Path(__file__).resolve().parents[2]


def class_with(methods: int, body_lines: int = 0) -> str:
    defs = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(methods))
    padding = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    return f"class Big:\n{padding}{defs}"


def write(root: Path, name: str, source: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return root


def test_twenty_one_methods_are_reported(tmp_path, capsys):
    write(tmp_path, "decoder/big.py", class_with(21))
    assert classes.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        "class: decoder/big.py:1 Big (63 lines, 21 methods; at most 300 and 20)\n"
    )


def test_twenty_methods_pass_and_so_does_code_outside_the_packages(tmp_path):
    write(tmp_path, "decoder/ok.py", class_with(20))
    write(tmp_path, "tests/big.py", class_with(30))
    assert classes.findings(tmp_path) == []


def test_three_hundred_and_one_lines_are_reported_nested_classes_too(tmp_path):
    nested = "class Outer:\n    " + class_with(1, body_lines=299).replace("\n", "\n    ")
    write(tmp_path, "prefix_store/long.py", nested)
    found = classes.findings(tmp_path)
    assert len(found) == 2 and "Outer" in found[0] and "Big" in found[1]


def test_the_sdk_client_classes_are_exempt_by_path_and_name(tmp_path):
    write(tmp_path, "prefix_store/client/sync.py", class_with(30).replace("Big", "StoreClient"))
    write(tmp_path, "prefix_store/client/other.py", class_with(30).replace("Big", "StoreClient"))
    found = classes.findings(tmp_path)
    assert len(found) == 1 and "prefix_store/client/other.py" in found[0]


def test_the_real_tree_has_no_class_over_the_bounds():
    assert classes.findings(REPO) == []
