"""Benchmark of a decode step's draw: :func:`ppo_core_decode.fused_sampling.fused_sample_record` at ``B`` rows of a
``V``-entry vocabulary (bf16 logits), as the decoder runs it, against references in the same run.

Prints ONE JSON object, microseconds per draw (the median of 20 replays of a CUDA graph of 20 draws, cycling over
4 logits tensors so that each draw reads its logits from HBM):

- ``in_kernel``: temperature 1 with the randomness made in the kernel (the decoder's rule);
- ``greedy``: temperature 0 (the same two launches without randomness: the floor of the rule);
- ``tensor_noise``: temperature 1 from a ``[B, V]`` noise tensor the caller filled (Gumbel-max, what
  ``sample_tokens`` draws on CUDA), the noise's fill not timed;
- with ``--sweep``: the in-kernel draw for other block sizes and warp counts (``bv<BLOCK_V>_bw<first kernel's
  warps>_cw<second kernel's warps>``).

The script calls only the public signatures of ``fused_sample_record`` and ``fused_sample``, so it also times a
previous release's draws when run against that tree (``PYTHONPATH``).

Usage: ``python benchmarks/sampling.py [--rows 64] [--vocab 128256] [--sweep] [--out FILE]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks.decode_linear import _graph_us
from ppo_core_decode import fused_sampling

CALLS, REPEATS = 20, 20


def _record_us(logits: list[torch.Tensor], temperature: float) -> float:
    rows = logits[0].shape[0]
    device = logits[0].device
    width = (
        1024  # every step of the timed replays writes its column (a step past the buffer would write none)
    )
    buffers = {
        "responses": torch.zeros(rows, width, dtype=torch.long, device=device),
        "response_mask": torch.zeros(rows, width, dtype=torch.bool, device=device),
        "log_probs": torch.zeros(rows, width, device=device),
        "done": torch.zeros(rows, dtype=torch.bool, device=device),
        "last_tok": torch.zeros(rows, dtype=torch.long, device=device),
        "last_valid": torch.zeros(rows, dtype=torch.bool, device=device),
    }
    seed = torch.tensor(5, device=device)
    step = torch.zeros((), dtype=torch.long, device=device)

    def record(step_logits: torch.Tensor) -> None:
        fused_sampling.fused_sample_record(
            step_logits,
            temperature,
            step=step,
            eos_token_id=None,
            pad_token_id=0,
            seed=seed if temperature > 0 else None,
            **buffers,
        )

    return _graph_us(record, logits, calls=CALLS, repeats=REPEATS)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--out", default=None, help="also write the JSON (with commit, date, device) to this file"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/sampling.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.rows, args.vocab)
    logits = [(3 * torch.randn(*shape, device="cuda", generator=gen)).bfloat16() for _ in range(4)]
    noise = torch.rand(*shape, device="cuda", generator=gen)
    result: dict = {"device": torch.cuda.get_device_name(), "rows": args.rows, "vocab": args.vocab}
    result["in_kernel"] = _record_us(logits, 1.0)
    result["greedy"] = _record_us(logits, 0.0)

    result["tensor_noise"] = _graph_us(
        lambda step_logits: fused_sampling.fused_sample(step_logits, noise, 1.0),
        logits,
        calls=CALLS,
        repeats=REPEATS,
    )
    if args.sweep and hasattr(fused_sampling, "_COMBINE_WARPS"):
        saved = fused_sampling.BLOCK_V, fused_sampling._BLOCK_WARPS, fused_sampling._COMBINE_WARPS
        sweep = {}
        for block, warps, combine in itertools.product((4096, 2048, 1024), (8, 4), (4, 8, 16)):
            fused_sampling.BLOCK_V, fused_sampling._BLOCK_WARPS = block, warps
            fused_sampling._COMBINE_WARPS = {False: 1, True: combine}
            sweep[f"bv{block}_bw{warps}_cw{combine}"] = _record_us(logits, 1.0)
        fused_sampling.BLOCK_V, fused_sampling._BLOCK_WARPS, fused_sampling._COMBINE_WARPS = saved
        result["sweep"] = sweep
    return emit(result, args.out)


if __name__ == "__main__":
    main()
