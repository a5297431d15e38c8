"""`make gpu-check`: the exact-mode GPU kernels (numerics/gpu) on one CUDA device.

What it checks today, each as a section of the JSON (written after every section, so a run
cut short still reports what it measured) and of the table printed last:

- `identity`: a row's bits alone and inside calls of M rows (the linear layer at the 8B
  shape's o_proj and down_proj widths, RMSNorm, RoPE), and an attention row alone, inside a batch
  of query rows, and inside verify passes of every length up to 33 consecutive positions;
  each also against a float64 reference (relative error of the whole output);
- `cost`: each exact kernel against the stock path (cuBLAS `F.linear`, flash SDPA) on the
  8B shape at batch 1 and 16, medians of `triton.testing.do_bench`.

Not yet: token identity and speed of whole models, which wait for the runner's CUDA path.

It needs a stock CUDA PyTorch, Triton and numpy: no `make install`, Ray, Redis or gRPC
(`PYTHONPATH=. python bench/gpu_check.py`). `--smoke` runs the same checks at tiny shapes
on CPU under Triton's interpreter (no timing), as `make test` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # the interpreter is chosen when the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from numerics.gpu import Tiles, kernel_id, kernels  # noqa: E402

SHAPES = {
    # the 8B shape: hidden 4096, 32 query heads over 8 kv heads of 128, MLP 14336
    "full": {
        "hidden": 4096, "mlp": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "rows": (1, 3, 64, 2048), "contexts": (8192, 32768), "batches": (1, 16),
        "verify": 33, "chunk": 256, "tiles": Tiles(),
    },
    # tiny, for the interpreter: several tiles and key chunks in every direction
    "smoke": {
        "hidden": 48, "mlp": 72, "heads": 4, "kv_heads": 2, "head_dim": 24,
        "rows": (1, 3, 17), "contexts": (70,), "batches": (1, 3),
        "verify": 5, "chunk": 16, "tiles": Tiles(block_m=16, block_n=16, block_k=16),
    },
}  # fmt: skip


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖, against a float64 reference (NaN never passes)."""
    err = torch.linalg.vector_norm(got.double() - ref) / torch.linalg.vector_norm(ref)
    return float("inf") if not torch.isfinite(err) else float(err)


def randn(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def edge_rows(m: int) -> list[int]:
    """The rows of a call of `m` checked against themselves alone: the first three, the last."""
    return sorted({0, 1, 2, m - 1} & set(range(m)))


def identity_row(kernel: str, got: torch.Tensor, alone, rows, ref) -> dict:
    """One identity check: whether each of `rows` of `got` is the bits `alone(i)` gives for
    it computed alone, and `got`'s error against the float64 `ref` (None: not computed)."""
    return {
        "kernel": kernel,
        "rows": got.shape[0],
        "identical": all(torch.equal(got[i : i + 1], alone(i)) for i in rows),
        "rel_error": None if ref is None else rel_error(got, ref),
    }


def linear_identity(s: dict, device: str, dtype: torch.dtype) -> list[dict]:
    """o_proj-like (hidden -> hidden) and down_proj-like (mlp -> hidden) layers: every row
    of a call of M rows against the same rows computed one at a time."""
    out = []
    for name, k in (("o_proj", s["hidden"]), ("down_proj", s["mlp"])):
        w = randn(s["hidden"], k, device=device, dtype=dtype, scale=k**-0.5)
        x = randn(max(s["rows"]), k, device=device, dtype=dtype)
        for m in s["rows"]:
            got = kernels.linear(x[:m], w, s["tiles"])
            alone = lambda i, x=x, w=w: kernels.linear(x[i : i + 1], w, s["tiles"])  # noqa: E731
            ref = x[:m].double() @ w.double().T
            out.append(identity_row(f"linear {name}", got, alone, edge_rows(m), ref))
    return out


def norm_identity(s: dict, device: str, dtype: torch.dtype) -> list[dict]:
    x = randn(max(s["rows"]), s["hidden"], device=device, dtype=dtype)
    g = randn(s["hidden"], device=device, dtype=dtype)
    out = []
    for m in s["rows"]:
        got = kernels.rms_norm(x[:m], g, 1e-5)
        xd = x[:m].double()
        ref = g.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
        alone = lambda i: kernels.rms_norm(x[i : i + 1], g, 1e-5)  # noqa: E731
        out.append(identity_row("rms_norm", got, alone, edge_rows(m), ref))
    return out


def rope_identity(s: dict, device: str, dtype: torch.dtype) -> list[dict]:
    """Each token's rotation alone and inside calls of M tokens."""
    n, h, d = max(s["rows"]), s["heads"], s["head_dim"]
    x = randn(n, h, d, device=device, dtype=dtype)
    angles = torch.arange(n, device=device)[:, None] * torch.rand(d // 2, device=device)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    out = []
    for m in s["rows"]:
        got = kernels.rope(x[:m], cos[:m], sin[:m])
        xd, cd, sd = x[:m].double(), cos[:m, None].double(), sin[:m, None].double()
        ref = xd * cd + torch.cat([-xd[..., d // 2 :], xd[..., : d // 2]], -1) * sd
        alone = lambda i: kernels.rope(x[i : i + 1], cos[i : i + 1], sin[i : i + 1])  # noqa: E731
        out.append(identity_row("rope", got, alone, edge_rows(m), ref))
    return out


def attention_reference(q, k, v, positions, scale) -> torch.Tensor:
    group = q.shape[1] // k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for row, pos in enumerate(positions.tolist()):
        keys = k[:, : pos + 1].double().repeat_interleave(group, 0)  # [H, pos+1, D]
        vals = v[:, : pos + 1].double().repeat_interleave(group, 0)
        weights = torch.softmax(torch.einsum("hd,htd->ht", q[row].double() * scale, keys), -1)
        out[row] = torch.einsum("ht,htd->hd", weights, vals)
    return out


def attention_identity(s: dict, device: str, dtype: torch.dtype) -> list[dict]:
    """Verify passes of 1 to `verify` consecutive positions ending at the context's end, and
    a batch of rows at spread positions: each row against itself alone over only the keys
    up to its position."""
    context = s["contexts"][0]
    h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
    scale, chunk = d**-0.5, s["chunk"]
    k = randn(kvh, context, d, device=device, dtype=dtype)
    v = randn(kvh, context, d, device=device, dtype=dtype)
    cases = [("verify pass", list(range(context - n, context))) for n in range(1, s["verify"] + 1)]
    cases.append(("spread rows", [0, chunk - 1, chunk, context // 2, context - 1]))
    out = []
    for kind, positions in cases:
        pos = torch.tensor(positions, device=device)
        q = randn(len(positions), h, d, device=device, dtype=dtype)
        got = kernels.attention(q, k, v, pos, scale, key_chunk=chunk)

        def alone(i: int, q=q, pos=pos, positions=positions) -> torch.Tensor:  # keys up to its own
            one, cut = slice(i, i + 1), slice(0, positions[i] + 1)
            return kernels.attention(q[one], k[:, cut], v[:, cut], pos[one], scale, key_chunk=chunk)

        referenced = kind == "spread rows" or len(positions) <= 2  # float64 on the host is slow
        ref = attention_reference(q, k, v, pos, scale) if referenced else None
        out.append(
            identity_row(f"attention {kind}", got, alone, range(min(4, len(positions))), ref)
        )
    return out


def timing(op: str, batch: int, context: int | None, exact: float, stock: float) -> dict:
    return {
        "op": op,
        "batch": batch,
        "context": context,
        "exact_ms": exact,
        "stock_ms": stock,
        "ratio": exact / stock,
    }


def bench_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cost(s: dict, device: str, dtype: torch.dtype) -> list[dict]:
    """Exact kernels against the stock path: the linear layers and one attention step
    (one query row per sequence) at each batch and context."""
    import torch.nn.functional as F

    out = []
    for batch in s["batches"]:
        for name, k in (("o_proj", s["hidden"]), ("down_proj", s["mlp"])):
            w = randn(s["hidden"], k, device=device, dtype=dtype, scale=k**-0.5)
            x = randn(batch, k, device=device, dtype=dtype)
            exact = bench_ms(lambda x=x, w=w: kernels.linear(x, w, s["tiles"]))
            stock = bench_ms(lambda x=x, w=w: F.linear(x, w))
            out.append(timing(f"linear {name}", batch, None, exact, stock))
        for context in s["contexts"]:
            h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
            k = randn(kvh, context, d, device=device, dtype=dtype)
            v = randn(kvh, context, d, device=device, dtype=dtype)
            q = randn(1, h, d, device=device, dtype=dtype)
            pos = torch.tensor([context - 1], device=device)

            def exact_step(q=q, k=k, v=v, pos=pos, batch=batch, scale=d**-0.5):
                for _ in range(batch):  # one sequence per call: each has its own keys
                    kernels.attention(q, k, v, pos, scale, key_chunk=s["chunk"])

            qs = q.view(1, h, 1, d).expand(batch, h, 1, d).contiguous()
            ks = k.unsqueeze(0).expand(batch, kvh, context, d).contiguous()
            vs = v.unsqueeze(0).expand(batch, kvh, context, d).contiguous()

            def stock_step(qs=qs, ks=ks, vs=vs):
                F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

            exact, stock = bench_ms(exact_step), bench_ms(stock_step)
            out.append(timing("attention step", batch, context, exact, stock))
            del ks, vs
    return out


def table(report: dict) -> str:
    lines = [
        f"device: {report['device']}; torch {report['torch']}, triton {report['triton']}; "
        f"kernels {report['kernel_id']}",
        "",
        "| kernel | rows | identical | rel. error vs float64 |",
        "|---|---|---|---|",
    ]
    for r in report.get("identity", []):
        err = "-" if r["rel_error"] is None else f"{r['rel_error']:.2e}"
        lines.append(f"| {r['kernel']} | {r['rows']} | {r['identical']} | {err} |")
    if report.get("cost"):
        lines += ["", "| op | batch | context | exact ms | stock ms | exact / stock |"]
        lines.append("|---|---|---|---|---|---|")
        for r in report["cost"]:
            context = r["context"] or "-"
            times = f"{r['exact_ms']:.3f} | {r['stock_ms']:.3f} | {r['ratio']:.2f}x"
            lines.append(f"| {r['op']} | {r['batch']} | {context} | {times} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU under Triton's interpreter"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    args = parser.parse_args(argv)
    if not args.smoke and not CUDA:
        print("gpu-check: no CUDA device here (use --smoke for the CPU check)", file=sys.stderr)
        return 2
    s = SHAPES["smoke" if args.smoke else "full"]
    device, dtype = ("cuda", torch.bfloat16) if CUDA and not args.smoke else ("cpu", torch.float32)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "kernel_id": kernel_id(s["tiles"]),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    checks = (linear_identity, norm_identity, rope_identity, attention_identity)
    sections = [("identity", checks)]
    if device == "cuda":
        sections.append(("cost", (cost,)))
    for name, checks in sections:
        report[name] = [row for check in checks for row in check(s, device, dtype)]
        args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"\nwrote {args.out}")
    return 0 if all(r["identical"] for r in report["identity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
