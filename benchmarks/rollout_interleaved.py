"""Rollout engines compared in one process, their calls interleaved (CUDA only).

Whole-call rates of ``benchmarks/rollout.py`` vary by ~1% between processes (the prefill alone by 1-2 ms), more than
some changes worth measuring. This script builds the HF engine and the megatron engine with and without
``fold_norms`` on one GPU, warms each up, then calls them in rotating order (each position in the rotation in turn)
on ``benchmarks/rollout.py``'s B = 64 case and prints one JSON object: per engine the median call (new tokens/s from
it), the median prefill and decode ms/step, and every measured call's seconds.

    python benchmarks/rollout_interleaved.py --calls 14 --warmup 3 [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks.rollout import CASES, MODEL, _hf_model, _megatron_model, _prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=14, help="rotations (each calls every engine once)")
    ap.add_argument("--warmup", type=int, default=3, help="first rotations not measured")
    ap.add_argument(
        "--out", default=None, help="also write the JSON (with commit, date, device) to this file"
    )
    args = ap.parse_args()
    from ppo_core.rollout import SamplingConfig
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine
    from ppo_core_decode.hf import HFRolloutEngine

    megatron, cfg = _megatron_model()
    engines = {
        "hf": HFRolloutEngine(_hf_model()),
        "megatron_fold": MegatronRolloutEngine(megatron, cfg),
        "megatron_nofold": MegatronRolloutEngine(megatron, cfg, fold_norms=False),
    }
    case = CASES["b64"]
    ids, mask = _prompts(case["batch"], case["prompt"], MODEL["vocab_size"])
    sampling = SamplingConfig(max_new_tokens=case["new"], temperature=1.0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    names = list(engines)
    runs: dict[str, dict[str, list[float]]] = {n: {"s": [], "prefill_s": [], "decode_ms": []} for n in names}
    tokens = 0
    for rotation in range(args.calls):
        for name in names[rotation % len(names) :] + names[: rotation % len(names)]:
            engine = engines[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = engine.generate(ids, mask, sampling, generator=gen)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if rotation < args.warmup:
                continue
            tokens = int(out["response_mask"].sum())
            stats = engine.stats
            runs[name]["s"].append(seconds)
            runs[name]["prefill_s"].append(stats.prefill_s)
            runs[name]["decode_ms"].append(1e3 * stats.decode_s / max(stats.decode_steps, 1))
    result = {
        "device": torch.cuda.get_device_name(),
        "case": case,
        "calls_measured": args.calls - args.warmup,
    }
    for name, r in runs.items():
        median = statistics.median(r["s"])
        result[name] = {
            "median_s": round(median, 5),
            "new_tokens_per_s": round(tokens / median, 1),
            "median_prefill_ms": round(1e3 * statistics.median(r["prefill_s"]), 3),
            "median_decode_ms_per_step": round(statistics.median(r["decode_ms"]), 4),
            "s_all": [round(x, 5) for x in r["s"]],
        }
    emit(result, args.out, indent=None)


if __name__ == "__main__":
    main()
