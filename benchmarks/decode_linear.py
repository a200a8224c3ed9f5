"""Benchmark of the decode-step projections: :func:`ppo_core_decode.decode_linear.decode_linear` against cuBLAS
(``F.linear``) and the unfused element-wise kernels the engines run around it, in the same run.

Prints ONE JSON object. Shapes: the projections of a Llama-3.2-1B-shaped layer at ``--rows`` rows (bf16): q/k/v,
o, gate/up, down and the output layer. Every timing replays a CUDA graph of ``calls`` launches, as a decode step
does (no launch overhead, the gaps between kernels included), and cycles over enough copies of the weights that
each call reads its weight from HBM rather than from the 50 MB L2 cache, as in a decode step. Per shape:

- ``cublas_us``: ``F.linear``; ``ours_us``: ``decode_linear`` with its default launch shape; ``sweep``: other
  launch shapes (``best_us`` and its config);
- fused forms against the unfused kernels the engines launch otherwise: ``o`` and ``down`` with the residual add
  in the epilogue (against ``F.linear`` and an add), ``qkv`` with the norm's row scale (against
  ``add_rms_norm_as_model`` then ``F.linear``), ``gate_up`` with the norm's row scale and SwiGLU (against
  ``add_rms_norm_as_model``, ``F.linear``, ``silu_mul_as_model``);
- ``weight_read_us``: the weight's bytes over the copy bandwidth measured in this run.

``--chain``: a decode step's four products in a 16-layer chain (PDL modes); ``--head``: the vocabulary product's
launch shapes (``HEAD_SHAPES``) against its default.

Usage: ``python benchmarks/decode_linear.py [--rows 64] [--no-sweep | --wide-sweep | --chain | --head]
[--out FILE]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core_decode.decode_linear import DecodeLinearConfig, _default_config, decode_linear
from ppo_core_decode.eager_rounding import add_rms_norm_as_model, silu_mul_as_model

SHAPES = {  # name: (N, K)
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}
EPS = 1e-5


def _graph_us(fn, weights: list[torch.Tensor], calls: int = 40, repeats: int = 15) -> float:
    """Median microseconds per call of ``fn(weight)`` replayed in a CUDA graph, cycling over ``weights``."""
    fn(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return round(times[len(times) // 2], 2)


def _copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _graph_us(lambda _: dst.copy_(src), [src], calls=10)
    return 2 * src.numel() / (us * 1e-6)


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, -(-200 * 2**20 // (n * k * 2)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) / k**0.5 for _ in range(copies)
    ]


def _sweep(x, weights, default: DecodeLinearConfig, wide: bool = False, **kw) -> dict:
    n, k = weights[0].shape
    width = n // 2 if kw.get("swiglu") else n
    results = []
    shapes = itertools.product(
        (16, 32, 64, 128), (1, 2, 4, 8), (3, 4), (4, 8) if wide else (4,), (128, 256) if wide else (128,)
    )
    for block_n, split, stages, warps, block_k in shapes:
        programs = -(-width // block_n) * split
        if not 64 <= programs <= 8192 or k // split < 2 * block_k:
            continue
        cfg = DecodeLinearConfig(
            block_n=block_n, block_k=block_k, split_k=split, num_stages=stages, num_warps=warps
        )
        if cfg == default:
            continue
        try:
            us = _graph_us(lambda w, c=cfg: decode_linear(x, w, config=c, **kw), weights)
        except Exception as exc:  # a launch shape that does not compile is reported
            results.append({"config": dataclass_dict(cfg), "error": type(exc).__name__})
            continue
        results.append({"config": dataclass_dict(cfg), "us": us})
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {
        "best_us": best["us"] if best else None,
        "best_config": best["config"] if best else None,
        "all": results,
    }


def dataclass_dict(cfg: DecodeLinearConfig) -> dict:
    return {f: getattr(cfg, f) for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages")}


def _shape_report(
    name: str, n: int, k: int, m: int, bandwidth: float, gen, *, sweep: bool, wide: bool = False
) -> dict:
    weights = _weights(n, k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    width = n // 2 if name == "gate_up" else n
    residual = torch.randn(m, width, device="cuda", generator=gen).to(torch.bfloat16)
    delta = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    sumsq = x.float().square().sum(-1)[None]
    default = _default_config(n, k, False, x.device)
    entry = {
        "weight_read_us": round(n * k * 2 / bandwidth * 1e6, 2),
        "cublas_us": _graph_us(lambda w: F.linear(x, w), weights),
        "ours_us": _graph_us(lambda w: decode_linear(x, w), weights),
        "default_config": dataclass_dict(default),
    }
    if sweep:
        entry["sweep"] = _sweep(x, weights, default, wide)
    if name in ("o", "down"):  # the residual add after the product (and the next norm's statistics)
        entry["unfused_add_us"] = _graph_us(lambda w: residual + F.linear(x, w), weights)
        entry["fused_residual_us"] = _graph_us(lambda w: decode_linear(x, w, residual=residual), weights)
    if name == "qkv":  # the norm before the product: the engines' add + norm kernel, or the row scale
        entry["unfused_add_norm_us"] = _graph_us(
            lambda w: F.linear(add_rms_norm_as_model(x, delta, norm_w, EPS)[1], w), weights
        )
        entry["fused_norm_us"] = _graph_us(lambda w: decode_linear(x, w, sumsq=sumsq, eps=EPS), weights)
    if name == "gate_up":

        def unfused(w):
            gate, up = F.linear(add_rms_norm_as_model(x, delta, norm_w, EPS)[1], w).chunk(2, dim=-1)
            return silu_mul_as_model(gate, up)

        entry["unfused_add_norm_swiglu_us"] = _graph_us(unfused, weights)
        fused_default = _default_config(n // 2, k, True, x.device)
        entry["fused_norm_swiglu_us"] = _graph_us(
            lambda w: decode_linear(x, w, sumsq=sumsq, eps=EPS, swiglu=True), weights
        )
        entry["fused_default_config"] = dataclass_dict(fused_default)
        if sweep:
            entry["fused_sweep"] = _sweep(x, weights, fused_default, wide, sumsq=sumsq, eps=EPS, swiglu=True)
    return entry


def _chain_report(m: int, gen, layers: int = 16) -> dict:
    """A decode step's products without attention: ``layers`` layers of q/k/v (+ norm), o (+ residual), gate/up
    (+ norm, SwiGLU), down (+ residual) in one CUDA graph, without and with PDL; us per layer and the largest
    difference of the result from the first variant's (PDL changes no arithmetic: 0)."""
    import os

    d, f = SHAPES["o"][0], SHAPES["down"][1]
    weights = [
        tuple(
            (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            for n, k in (SHAPES["qkv"], SHAPES["o"], SHAPES["gate_up"], (d, f))
        )
        for _ in range(layers)
    ]
    h0 = torch.randn(m, d, device="cuda", generator=gen).to(torch.bfloat16)

    def step(_):
        h = h0
        sumsq = h.float().square().sum(-1)[None]
        for qkv, o, gate_up, down in weights:
            y, _, _ = decode_linear(h, qkv, sumsq=sumsq, eps=EPS)
            h, sumsq, _ = decode_linear(y[:, :d], o, residual=h)
            act, _, _ = decode_linear(h, gate_up, sumsq=sumsq, eps=EPS, swiglu=True)
            h, sumsq, _ = decode_linear(act, down, residual=h)
        return h

    out: dict = {"weight_mb_per_layer": round(sum(w.numel() * 2 for w in weights[0]) / 1e6, 1)}
    first = None
    for pdl in ("0", "1"):
        os.environ["PPO_CORE_PDL"] = pdl
        result = step(None).float()
        first = result if first is None else first
        out[f"pdl{pdl}"] = {
            "us_per_layer": round(_graph_us(step, [None], calls=1, repeats=30) / layers, 2),
            "max_diff": float((result - first).abs().max()),
        }
    os.environ.pop("PPO_CORE_PDL", None)
    return out


HEAD_SHAPES = (  # (block_n, block_k, num_stages, num_warps, tiles_per_program) of the vocabulary product
    (256, 64, 4, 4, 0),  # the grid launch's default before the persistent launch
    (128, 128, 3, 4, 0),
    (128, 64, 8, 4, 0),
    (128, 128, 4, 4, 8),
    (128, 128, 3, 4, 8),
    (128, 128, 4, 8, 8),
    (128, 128, 4, 4, 10),
    (128, 64, 6, 4, 8),
    (128, 64, 8, 4, 8),
    (256, 64, 4, 8, 4),
    (64, 128, 4, 4, 16),
)


def _head_report(m: int, gen) -> dict:
    """The output layer's product (``[128256, 2048]``, with the final norm's row scale in its epilogue, as the
    engines run it) at its default launch shape and the shapes of :data:`HEAD_SHAPES`: us per call and the largest
    difference from the default's result (the launch shape changes no arithmetic: 0)."""
    n, k = SHAPES["lm_head"]
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    weights = [
        (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16) for _ in range(2)
    ]
    sumsq = x.float().square().sum(-1)[None]
    default = _default_config(n, k, False, x.device)
    want = decode_linear(x, weights[0], sumsq=sumsq, eps=EPS).y
    out: dict = {
        "default_config": dataclass_dict(default),
        "default_us": _graph_us(lambda w: decode_linear(x, w, sumsq=sumsq, eps=EPS), weights, calls=16),
    }
    for block_n, block_k, stages, warps, tiles in HEAD_SHAPES:
        cfg = DecodeLinearConfig(
            block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps, tiles_per_program=tiles
        )
        key = f"bn{block_n}_bk{block_k}_st{stages}_w{warps}" + (f"_persistent{tiles}" if tiles else "")
        try:
            got = decode_linear(x, weights[0], sumsq=sumsq, eps=EPS, config=cfg).y
            us = _graph_us(
                lambda w, c=cfg: decode_linear(x, w, sumsq=sumsq, eps=EPS, config=c), weights, calls=16
            )
        except Exception as exc:  # a launch shape that does not fit is reported
            out[key] = {"error": type(exc).__name__}
            continue
        out[key] = {"us": us, "max_diff": float((got.float() - want.float()).abs().max())}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--wide-sweep", action="store_true", help="also 8 warps and 256-column K blocks (slow)")
    ap.add_argument("--chain", action="store_true", help="only the chain of a step's products (PDL modes)")
    ap.add_argument("--head", action="store_true", help="only the vocabulary product's launch shapes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_linear.py needs a CUDA device")
    m = args.rows
    bandwidth = _copy_bandwidth()
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "rows": m,
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2),
    }
    gen = torch.Generator(device="cuda").manual_seed(1)
    if args.chain or args.head:
        if args.chain:
            result["chain"] = _chain_report(m, gen)
        if args.head:
            result["head"] = _head_report(m, gen)
        return emit(result, args.out)
    for name, (n, k) in SHAPES.items():
        result[name] = _shape_report(
            name, n, k, m, bandwidth, gen, sweep=not args.no_sweep, wide=args.wide_sweep
        )
        torch.cuda.empty_cache()
    return emit(result, args.out)


if __name__ == "__main__":
    main()
