"""The `vericache` command line: JSON output and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main
from decoder.sampling import SamplingParams
from tests.references import full_kv_tokens


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_matches_in_process_full_decoding(builtin_model, builtin_runner):
    proc = run_cli("generate", "--prompt", "def square(x):", "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"mode", "tokens", "text", "stats"}
    assert out["mode"] == "full"
    expected = full_kv_tokens(
        builtin_runner, builtin_model, builtin_model.encode("def square(x):"), 12
    )
    assert out["tokens"] == expected
    assert out["text"] == builtin_model.decode(expected)
    stats = out["stats"]
    assert stats["generated_tokens"] == len(out["tokens"]) <= 12
    assert stats["prompt_tokens"] == len(builtin_model.encode("def square(x):"))
    assert stats["stop_reason"] in ("eos", "length")
    assert stats["tokens_per_s"] > 0


def test_vericache_json_equals_full_with_seeded_sampling(tmp_path, builtin_model, builtin_runner):
    """The full-KV reference is in-process (the CLI's own full mode is checked against it
    above); the CLI's vericache run must equal it token for token."""
    text = Path(__file__).read_text(encoding="utf-8")[:2500]
    prompt = tmp_path / "code.py"
    prompt.write_text(text, encoding="utf-8")
    common = [
        "--prompt-file",
        str(prompt),
        "--max-new-tokens",
        "24",
        "--json",
        "--temperature",
        "0.7",
        "--top-k",
        "40",
        "--seed",
        "11",
    ]
    sampling = SamplingParams(temperature=0.7, top_k=40, seed=11)
    want = full_kv_tokens(builtin_runner, builtin_model, builtin_model.encode(text), 24, sampling)
    outputs = {}
    for mode in ("vericache", "lossy"):
        proc = run_cli(
            "generate",
            "--mode",
            mode,
            "--compressor",
            "snapkv:budget=0.25+kivi:bits=4",
            "--horizon",
            "6",
            *common,
        )
        assert proc.returncode == 0, proc.stderr
        outputs[mode] = json.loads(proc.stdout)
    assert outputs["vericache"]["tokens"] == want
    assert outputs["vericache"]["text"] == builtin_model.decode(want)
    stats = outputs["vericache"]["stats"]
    assert stats["mode"] == "vericache" and stats["seed"] == 11
    assert stats["compressor"] == (
        "snapkv:budget=0.25,window=32,kernel=7+kivi:bits=4,residual=128,group=32"
    )
    for key in (
        "verifications",
        "drafted",
        "accepted_per_verification",
        "compressed_bytes",
        "full_bytes",
        "peak_staging_bytes",
        "tokens_per_s",
    ):
        assert key in stats, key
    assert stats["drafted"] <= 6 * stats["verifications"]
    assert 0 < stats["compressed_bytes"] < stats["full_bytes"]
    # In-process the budget is unlimited: the prefix's full KV stays resident (no staging).
    assert stats["resident_prefix"] and stats["peak_staging_bytes"] == 0
    assert outputs["lossy"]["stats"]["mode"] == "lossy"
    assert len(outputs["lossy"]["tokens"]) == 24


def test_ngram_guesses_change_no_token(tmp_path, builtin_model, builtin_runner):
    """`--ngram` in full mode (guesses verified by the exact pass) and in vericache mode
    (checked by the drafter, then verified): the full-KV tokens (in-process), with guesses
    taken."""
    text = Path(__file__).read_text(encoding="utf-8")[:2000]
    prompt = tmp_path / "code.py"
    prompt.write_text(text, encoding="utf-8")
    common = ["--prompt-file", str(prompt), "--max-new-tokens", "32", "--json"]
    want = full_kv_tokens(builtin_runner, builtin_model, builtin_model.encode(text), 32)
    for mode in ("full", "vericache"):
        proc = run_cli("generate", "--mode", mode, "--ngram", "6", *common)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["tokens"] == want, mode
        assert out["stats"]["ngram_proposed"] >= out["stats"]["ngram_accepted"] >= 0


def test_generate_from_file_with_chat_template_stops_on_eos(tmp_path, builtin_model):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Say hi.", encoding="utf-8")
    proc = run_cli(
        "generate", "--prompt-file", str(prompt), "--chat", "--max-new-tokens", "40", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["stop_reason"] == "eos"
    assert out["tokens"][-1] in builtin_model.eos_token_ids


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate"], "one of the arguments --prompt --prompt-file is required"),
        (["generate", "--prompt-file", "/nope"], "--prompt-file /nope: no such file"),
        (
            ["generate", "--prompt", "x", "--mode", "bogus"],
            "--mode 'bogus' is unknown; choose from: full, lossy, vericache",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "vericache", "--compressor", "zip"],
            "--compressor: unknown compressor 'zip'; allowed: streamingllm, snapkv, h2o",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "lossy", "--compressor", "kivi:bits=3"],
            "--compressor: kivi: bits='3': must be one of 2, 4, 8",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "vericache", "--horizon", "many"],
            "--horizon must be 'auto' or an integer >= 0, got 'many'",
        ),
        (["generate", "--prompt", "x", "--horizon", "-2"], "--horizon must be 'auto'"),
        (["generate", "--prompt", "x", "--ngram", "33"], "--ngram must be in [0, 32], got 33"),
        (
            ["generate", "--prompt", "x", "--ngram", "4", "--runner", "fast"],
            "--ngram needs the exact runner",
        ),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--top-k", "-5"], "--top-k must be >= 0"),
        (
            ["generate", "--prompt", "x", "--mode", "vericache", "--runner", "fast"],
            "--runner fast applies to --mode full only",
        ),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
        (["generate", "--prompt", "x", "--max-new-tokens", "ten"], "invalid int value: 'ten'"),
        (["generate", "--prompt", "x", "--threads", "0"], "--threads must be >= 1"),
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt", "x", "--prompt-file", "f"], "not allowed with argument"),
        (["generate", "--prompt", "x", "--model", "/nope"], "--model /nope: not a directory"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vericache: error: "), err
    assert message in err


def test_bad_prompt_files(tmp_path, capsys):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00\x80")
    assert main(["generate", "--prompt-file", str(binary)]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_refused(capsys):
    assert main(["generate", "--prompt", "word " * 9000, "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 8192" in err and err.count("\n") == 1


def test_errors_from_the_installed_script_have_no_traceback():
    script = str(Path(sys.executable).parent / "vericache")
    proc = subprocess.run(
        [script, "generate", "--prompt", "x", "--max-new-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "vericache: error: --max-new-tokens must be >= 1, got 0"
