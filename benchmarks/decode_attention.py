"""The one-launch decode attention (rotation + cache write + attention,
:func:`ppo_core_decode.decode_rotary_attention.rotate_write_attend_triton`) against PyTorch's own attention over the
same cached slots, at the decode shapes of the models the rollout benchmarks use, and its tiling sweep.

Per shape (``B`` rows of ``G`` key-value heads of width ``d``, ``H`` query heads, the new token at slot ``slot`` of a
cache of ``L`` slots):

- ``ours_default``: the kernel with its defaults (``block_l``:
  :func:`~ppo_core_decode.decode_attention.default_block_l`), in microseconds a call and the cache bytes it reads
  (the keys and values of the ``slot + 1`` attended slots) over that time, TB/s;
- ``sweep``: the same for each ``block_l`` x ``num_stages`` (four warps, unsplit): where the default stands;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True)`` over the same slots (the
  backend PyTorch picks; it neither rotates nor writes the cache, so it does less than ours);
- ``copy_keys``: a device copy of the attended keys (read + write), the memory's speed at this size.

Every time is the median of CUDA-graph replays of 20 back-to-back calls (no launch overhead from the host), divided
by 20. The first call's output is checked against the two-launch path's
(:func:`~ppo_core_decode.decode_rotary.rotate_and_write_triton` then
:func:`~ppo_core_decode.decode_attention.decode_attention_triton`): equal bits over the same blocks.

Usage: ``python benchmarks/decode_attention.py [--shapes qwen3,llama] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks._timing import CALLS_PER_GRAPH, graph_us
from benchmarks.rollout_families import FAMILIES


def attention_shape(family: str) -> tuple[int, int, int]:
    """``(H, G, d)`` of a family of ``benchmarks/rollout_families.py``: query heads, key-value heads, head width."""
    config = FAMILIES[family][1]
    heads = config["num_attention_heads"]
    return heads, config["num_key_value_heads"], config.get("head_dim", config["hidden_size"] // heads)


SHAPES = {name: attention_shape(name) for name in ("qwen3", "llama")}
"""Qwen3-0.6B's attention and Llama-3.2-1B's, as the rollout benchmark builds them."""


def shape_entry(name: str, batch: int, length: int, slot: int) -> dict[str, Any]:
    from ppo_core_decode.decode_attention import decode_attention_triton, default_block_l
    from ppo_core_decode.decode_rotary import rotate_and_write_triton
    from ppo_core_decode.decode_rotary_attention import rotate_write_attend_triton

    h, g, d = SHAPES[name]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    q, k, v = randn(batch, h, 1, d), randn(batch, g, 1, d), randn(batch, g, 1, d)
    cos, sin = randn(batch, d), randn(batch, d)
    keys, values = randn(batch, g, length, d), randn(batch, g, length, d)
    bias = torch.zeros(batch, 1, 1, length, device=dev)
    index = torch.tensor(slot, device=dev)
    nbytes = batch * g * (slot + 1) * d * 2 * keys.element_size()

    def ours(**tiling: Any) -> torch.Tensor:
        return rotate_write_attend_triton(
            q, k, v, cos, sin, keys, values, index, bias, model_rounding=True, split=1, **tiling
        )

    def rate(us: float, moved: int = nbytes) -> dict[str, float]:
        return {"us": round(us, 2), "tb_per_s": round(moved / us / 1e6, 3)}

    written_k, written_v = keys.clone(), values.clone()
    rotated = rotate_and_write_triton(q, k, v, cos, sin, written_k, written_v, index, model_rounding=True)
    two = decode_attention_triton(rotated, written_k, written_v, bias, filled=index + 1)
    entry: dict[str, Any] = {
        "H": h,
        "G": g,
        "d": d,
        "batch": batch,
        "cache_slots": length,
        "attended_slots": slot + 1,
        "cache_mb_read": round(nbytes / 1e6, 1),
        "default_block_l": default_block_l(d),
        "equals_two_launches": bool(torch.equal(ours(), two)),
        "ours_default": rate(graph_us(ours)),
    }
    sweep = {}
    for block_l in (16, 32, 64, 128):
        for stages in (2, 3, 4):
            tiled = functools.partial(ours, block_l=block_l, num_stages=stages)
            sweep[f"block_l={block_l},stages={stages}"] = rate(graph_us(tiled))
    entry["sweep"] = sweep
    entry["sweep_best"] = min(sweep, key=lambda c: sweep[c]["us"])
    attended_k, attended_v = keys[:, :, : slot + 1], values[:, :, : slot + 1]
    entry["sdpa"] = rate(
        graph_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q, attended_k, attended_v, enable_gqa=True
            )
        )
    )
    src = attended_k.contiguous()
    dst = torch.empty_like(src)
    entry["copy_keys"] = rate(graph_us(lambda: dst.copy_(src)), 2 * src.numel() * src.element_size())
    entry["ours_over_sdpa_time"] = round(entry["ours_default"]["us"] / entry["sdpa"]["us"], 3)
    return entry


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache", type=int, default=384, help="cache slots (prompt 256 + 128 new)")
    ap.add_argument("--slot", type=int, default=320, help="the new token's slot (mid-decode)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py needs CUDA")
    result: dict[str, Any] = {"dtype": "bfloat16", "calls_per_graph": CALLS_PER_GRAPH}
    for name in args.shapes.split(","):
        result[name] = shape_entry(name, args.batch, args.cache, args.slot)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
