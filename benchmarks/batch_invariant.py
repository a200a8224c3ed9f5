"""Batch-invariant products: :func:`~ppo_core_decode.batch_invariant.invariant_linear`'s Triton GEMM against the
chunked cuBLAS path it replaced (:func:`~ppo_core_decode.batch_invariant.linear_chunked`, one fixed 64-row product
per chunk) and against plain ``F.linear`` (cuBLAS choosing per shape: fast, not batch-invariant), as one JSON object.

These products are most of exact mode's training forward (``actor.worker.exact_log_probs``: every micro-batch runs
the batch-invariant model once more) and of the batch-invariant rollout's decode steps. For each model shape's
projections (the fused q/k/v product, the output projection, the fused gate/up product, the down projection, the
vocabulary head) and each row count ``M`` (a decode step of ``B`` rows, a prefill micro-batch of many), the median
time of ``--repeats`` calls after a warm-up, and the TFLOP/s it reaches; ``path``: which of the two
``invariant_linear`` runs for that weight; ``forward_ms``: one forward's products (every layer's and the head) per
method, and with ``invariant_linear``'s choices. ``bits``: whether each method gives row
``i`` of an ``M``-row product the same bits as the row alone and as the first 64 rows (the property exact mode
needs); ``F.linear`` is reported, not required, to have it.

Usage: ``python benchmarks/batch_invariant.py [--shapes smollm2-135m:float32,qwen2.5-0.5b:bfloat16] [--rows
512,9472] [--out FILE]`` (CUDA); ``--tiny`` runs a seconds-long smoke of the same code on the CPU (the chunked
path and ``F.linear`` only, unless ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks._timing import median_ms
from ppo_core_decode import batch_invariant as bi

SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "smollm2-135m": {  # hidden 576, 9 query / 3 key-value heads of 64, SwiGLU 1536, vocabulary 49152
        "qkv": (576, 960),
        "o": (576, 576),
        "gate_up": (576, 3072),
        "down": (1536, 576),
        "head": (576, 49152),
    },
    "qwen2.5-0.5b": {  # hidden 896, 14 query / 2 key-value heads of 64, SwiGLU 4864, vocabulary 151936
        "qkv": (896, 1152),
        "o": (896, 896),
        "gate_up": (896, 9728),
        "down": (4864, 896),
        "head": (896, 151936),
    },
    "tiny": {"qkv": (32, 48), "down": (48, 32), "head": (32, 64)},
}
"""Per model shape, each projection's ``(K, N)``."""

LAYERS = {"smollm2-135m": 30, "qwen2.5-0.5b": 24, "tiny": 2}
"""Decoder layers per model shape: a forward runs every projection but the head once a layer."""


def forward_totals(cases: dict[str, dict[str, Any]], layers: int, rows: list[int]) -> dict[str, float]:
    """Milliseconds of one forward's products per method and row count: ``layers`` x the layer projections' sum,
    plus the head once (``head``); ``invariant_linear:<M>_ms`` takes, per projection, the path
    :func:`~ppo_core_decode.batch_invariant.invariant_linear` chooses (``path``)."""
    totals: dict[str, float] = {}
    for m in rows:
        here = {name.split(":")[0]: case for name, case in cases.items() if name.endswith(f":{m}")}
        for method in ("triton", "chunked", "f_linear", "invariant_linear"):
            total, complete = 0.0, True
            for proj, case in here.items():
                pick = case.get("path") if method == "invariant_linear" else method
                if pick not in case:
                    complete = False
                    break
                total += case[pick]["ms"] * (1 if proj == "head" else layers)
            if complete and here:
                totals[f"{method}:{m}_ms"] = round(total, 3)
    return totals


def _rows_alike(fn, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Row ``i`` of ``fn(x)`` against ``fn`` of the row alone (``i`` the last row) and of the first 64 rows."""
    full = fn(x, w)
    last = x.shape[0] - 1
    alone = torch.equal(fn(x[last:], w)[0], full[last])
    head = torch.equal(fn(x[:64], w), full[:64])
    return bool(alone and head)


def run_case(
    k: int, n: int, m: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> dict[str, Any]:
    """One projection at ``m`` rows: time, TFLOP/s and batch invariance of each method."""
    g = torch.Generator(device="cpu").manual_seed(m * 31 + n)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device=device, dtype=dtype)
    methods = {"chunked": bi.linear_chunked, "f_linear": F.linear}
    if bi._triton_linear_runs(x):
        methods = {"triton": lambda a, b: bi._linear_triton(a, b, None), **methods}
    out: dict[str, Any] = {
        "k": k,
        "n": n,
        "m": m,
        "gflop": round(2 * m * n * k / 1e9, 3),
        "path": bi.linear_path(x, w),  # what invariant_linear runs
    }
    for name, fn in methods.items():
        seconds = median_ms(lambda fn=fn: fn(x, w), device, repeats, warmup=1) / 1e3
        out[name] = {
            "ms": round(seconds * 1e3, 4),
            "tflops": round(2 * m * n * k / seconds / 1e12, 2),
            "bits": _rows_alike(fn, x, w),
        }
    if "triton" in out:
        out["triton_over_chunked"] = round(out["chunked"]["ms"] / out["triton"]["ms"], 2)
        out["triton_vs_f_linear"] = round(out["f_linear"]["ms"] / out["triton"]["ms"], 2)
        out["triton_equals_chunked_within"] = float(
            (bi.invariant_linear(x, w).double() - bi.linear_chunked(x, w).double()).abs().max()
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m:float32,qwen2.5-0.5b:bfloat16")
    ap.add_argument("--rows", default="512,9472", help="comma-separated row counts M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: tiny shapes, few rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.shapes, args.rows, args.repeats = "tiny:float32", "70", 1
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/batch_invariant.py needs a CUDA device (or --tiny)")
        device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    result: dict[str, Any] = {"benchmark": "benchmarks/batch_invariant.py", "rows": rows, "shapes": {}}
    for spec in args.shapes.split(","):
        shape, dtype_name = spec.split(":")
        dtype = getattr(torch, dtype_name)
        per = result["shapes"].setdefault(f"{shape}:{dtype_name}", {})
        for proj, (k, n) in SHAPES[shape].items():
            for m in rows:
                per[f"{proj}:{m}"] = run_case(k, n, m, dtype, device, args.repeats)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        per["forward_ms"] = forward_totals(per, LAYERS[shape], rows)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
