"""Batch operations on a PPO-shaped batch with non-tensor fields, against tensordict's ``clone`` forms; prints JSON.

The batch: ``B`` rows of ``T`` tokens (``input_ids``, ``attention_mask``, ``response_mask``, ``old_log_probs``,
``advantages``) and three non-tensor fields (a ``uid`` string, a ``data_source`` string, a ``ground_truth`` dict per
row), as the trainer holds it. Timed (median ms over ``--repeats`` interleaved rounds, this machine's CPU):

- ``split_for_dp``: four data-parallel shards, each a compact independent copy (ours: integer-tensor indexing,
  ``ppo_core.batch._td._slice``), against ``batch[start:stop].clone()`` per shard (the former form);
- ``concat_one``: ``concat([batch])``, a deep copy (ours: ``_copy``), against ``batch.clone()``;
- ``shallow_copy``: the copy the trainer's steps make before setting a key (ours: ``_shallow_copy``), against
  ``batch.clone(False)``.

Usage: ``python benchmarks/batch_ops.py [--batch 1024] [--seqlen 512] [--repeats 9] [--out FILE]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core.batch import concat, split_for_dp
from ppo_core.batch._td import _shallow_copy


def _batch(b: int, t: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "input_ids": torch.randint(0, 1000, (b, t), generator=gen),
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "response_mask": torch.ones(b, t // 2, dtype=torch.bool),
            "old_log_probs": torch.randn(b, t // 2, generator=gen),
            "advantages": torch.randn(b, t // 2, generator=gen),
            "uid": NonTensorStack(*[f"7:{i // 8}" for i in range(b)]),
            "data_source": NonTensorStack(*["digits"] * b),
            "ground_truth": NonTensorStack(*[{"answer": str(i % 19), "id": i} for i in range(b)]),
        },
        batch_size=[b],
    )


def _former_split(batch: TensorDict, n: int) -> list[TensorDict]:
    size = int(batch.batch_size[0])
    step = size // n
    return [batch[i * step : (i + 1) * step].clone() for i in range(n)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--out", default=None, help="also write the JSON (with commit, date, device) to this file"
    )
    args = ap.parse_args(argv)
    batch = _batch(args.batch, args.seqlen)
    pairs = {
        "split_for_dp": (lambda: split_for_dp(batch, 4)[0], lambda: _former_split(batch, 4)),
        "concat_one": (lambda: concat([batch]), lambda: batch.clone()),
        "shallow_copy": (lambda: _shallow_copy(batch), lambda: batch.clone(False)),
    }
    times: dict[str, list[float]] = {f"{n}:{side}": [] for n in pairs for side in ("ours", "clone")}
    for ours, former in pairs.values():  # warm-up, and both give the same rows
        got, want = ours(), former()
        got, want = (x if isinstance(x, list) else [x] for x in (got, want))
        for g, w in zip(got, want, strict=True):
            assert g["ground_truth"].tolist() == w["ground_truth"].tolist()
            assert torch.equal(g["input_ids"], w["input_ids"])
    for _ in range(args.repeats):
        for name, (ours, former) in pairs.items():
            for side, fn in (("ours", ours), ("clone", former)):
                t0 = time.perf_counter()
                fn()
                times[f"{name}:{side}"].append((time.perf_counter() - t0) * 1e3)
    result: dict = {
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "batch": args.batch,
        "seqlen": args.seqlen,
    }
    for name in pairs:
        ours, former = (statistics.median(times[f"{name}:{side}"]) for side in ("ours", "clone"))
        result[name] = {
            "ours_ms": round(ours, 3),
            "clone_ms": round(former, 3),
            "speedup": round(former / ours, 1),
        }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
