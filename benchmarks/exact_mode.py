"""Exact on-policy mode's cost: the torch actor's GRPO step with ``exact_log_probs`` (and the batch-invariant rollout
it needs) against the fast mode, same model, prompts and settings, one GPU, as one JSON object.

Each mode gets a fresh :class:`~ppo_core.workers.torch.TorchActorWorker` on the same randomly initialised model
(``--shape``: the SmolLM2-135M shape of the real-model job, or Qwen2.5-0.5B's) and runs ``--warmup`` + ``--steps``
steps of: ``generate_sequences`` (``--prompts x --n`` rows, prompts of ``--prompt-tokens / 2`` to
``--prompt-tokens`` random tokens, left-padded; no EOS, so every response has ``--response-tokens`` tokens),
``compute_log_prob``, ``compute_ref_log_prob`` and ``update_actor`` (seeded standard-normal advantages, KL loss,
token-budget micro-batches, two optimiser steps) — the worker settings of ``examples/configs/smollm2_grpo.yaml``,
its token budgets included (``--ppo-max-tokens`` 16384 a training micro-batch, ``--forward-max-tokens`` 32768 a
log-prob forward: the fp32 logits of a 65,536-token micro-batch over SmolLM2's 49,152-token vocabulary alone are
12.9 GB before their gradients; budgets of 65,536 / 131,072 did not fit one 80 GB GPU at the default 64 x 8 rows).
The fast mode is the default rollout (fused decode kernels, CUDA graphs) and training forward; the exact mode sets
``rollout.batch_invariant`` and ``exact_log_probs``.

Reported per mode (medians over the measured steps): ``rollout_s``, ``rollout_tokens_per_s`` (response tokens
over ``rollout_s``), ``old_log_prob_s``, ``ref_log_prob_s``, ``update_s``, ``step_s`` (their sum), the peak GPU
memory, and per step ``rollout_probs_diff_max`` (``training/rollout_probs_diff_max``: exactly 0 in exact mode) and
``ppo_kl`` (``actor/ppo_kl``); ``ratios``: exact over fast (``step_s``, ``rollout_s``, ``rollout_tokens_per_s``;
the issue's aim is ``step_s`` at most 1.5).

Usage (CUDA; no network needed)::

    python benchmarks/exact_mode.py                                    # SmolLM2-135M shape, fp32, 64 x 8 rows
    python benchmarks/exact_mode.py --prompts 16 --steps 2 --out benchmarks/results/exact_mode.json
    python benchmarks/exact_mode.py --shape qwen2.5-0.5b --dtype bfloat16 --n 1 --prompt-tokens 256 \\
        --response-tokens 256 --out benchmarks/results/exact_mode_qwen.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core_cli.shapes import SHAPES as SHAPES_QWEN

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (  # a smoke run on the CPU (--device cpu; the test of this script)
        "qwen2",
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "max_position_embeddings": 256,
        },
    ),
    "smollm2-135m": (
        "llama",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "rope_theta": 1e5,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-0.5b": ("qwen2", SHAPES_QWEN["qwen2.5-0.5b"]),
}
"""The published configurations' shapes (random weights cost the same per step as trained ones)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="fast,exact")
    p.add_argument(
        "--ppo-max-tokens",
        type=int,
        default=16384,
        help="actor.worker.ppo_max_token_len_per_gpu: tokens a training micro-batch (the real job's)",
    )
    p.add_argument(
        "--forward-max-tokens",
        type=int,
        default=32768,
        help="actor.worker.forward_max_token_len_per_gpu: tokens a log-prob forward (the real job's)",
    )
    p.add_argument("--device", default="cuda", help="cuda (what the numbers are for) or cpu (a smoke run)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def make_model(shape: str, dtype: str) -> torch.nn.Module:
    """The shape's causal LM, randomly initialised from a fixed seed, wrapped for the torch workers."""
    import transformers

    from ppo_core.models import HFCausalLM

    kind, sizes = SHAPES[shape]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**sizes))
    return HFCausalLM(model.to(getattr(torch, dtype)))


def worker_config(args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    rows = args.prompts * args.n
    return {
        "device": args.device,
        "seed": 0,
        "ppo_mini_batch_size": max(1, rows // 2),
        "use_kl_loss": True,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl",
        "ppo_max_token_len_per_gpu": args.ppo_max_tokens,
        "forward_max_token_len_per_gpu": args.forward_max_tokens,
        "optim": {"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0},
        "rollout": {
            "max_new_tokens": args.response_tokens,
            "temperature": args.temperature,
            "eos_token_id": None,
            "batch_invariant": exact,
        },
        "policy_loss": {"loss_mode": "vanilla", "clip_ratio": 0.2, "loss_agg_mode": "token-mean"},
        "exact_log_probs": exact,
    }


def prompts(args: argparse.Namespace, vocab: int, step: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(1000 + step)
    width = args.prompt_tokens
    lengths = torch.randint(width // 2, width + 1, (args.prompts,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(1, vocab, (args.prompts, width), generator=g) * mask
    batch = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[args.prompts])
    return batch.repeat_interleave(args.n, dim=0) if args.n > 1 else batch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *a: Any) -> tuple[Any, float]:
    _sync()
    start = time.perf_counter()
    out = fn(*a)
    _sync()
    return out, time.perf_counter() - start


def run_mode(args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    from ppo_core.metrics import rollout_probs_diff_metrics
    from ppo_core.workers.torch import TorchActorWorker

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    actor = TorchActorWorker(
        functools.partial(make_model, args.shape, args.dtype), worker_config(args, exact)
    )
    vocab = SHAPES[args.shape][1]["vocab_size"]
    spans: dict[str, list[float]] = {k: [] for k in ("rollout", "old_log_prob", "ref_log_prob", "update")}
    diffs, kls, tokens = [], [], []
    for step in range(args.warmup + args.steps):
        batch, t_gen = timed(actor.generate_sequences, prompts(args, vocab, step))
        old, t_old = timed(actor.compute_log_prob, batch)
        batch.update(old)
        ref, t_ref = timed(actor.compute_ref_log_prob, batch)
        batch.update(ref)
        g = torch.Generator().manual_seed(step)
        batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
        metrics, t_upd = timed(actor.update_actor, batch)
        diff = rollout_probs_diff_metrics(
            batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"]
        )["training/rollout_probs_diff_max"]
        diffs.append(diff)
        kls.append(metrics.get("actor/ppo_kl"))
        if step >= args.warmup:
            for key, value in zip(spans, (t_gen, t_old, t_ref, t_upd), strict=True):
                spans[key].append(value)
            tokens.append(int(batch["response_mask"].sum()))
    result = {f"{k}_s": statistics.median(v) for k, v in spans.items()}
    result["step_s"] = sum(result[f"{k}_s"] for k in spans)
    result["rollout_tokens_per_s"] = statistics.median(tokens) / result["rollout_s"]
    result["rollout_probs_diff_max"] = diffs
    result["ppo_kl"] = kls
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    actor.close()
    del actor
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/exact_mode.py needs a CUDA device (or --device cpu for a smoke run)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows_per_step": args.prompts * args.n,
    }
    for mode in modes:
        try:
            result[mode] = run_mode(args, exact=mode == "exact")
        except Exception as err:  # report the other mode whatever happens to this one
            result[mode] = {"error": f"{type(err).__name__}: {err}"}
        emit(result, args.out, quiet=True)
    fast, exact = result.get("fast", {}), result.get("exact", {})
    if "step_s" in fast and "step_s" in exact:
        result["ratios"] = {
            key: exact[key] / fast[key] for key in ("step_s", "rollout_s", "rollout_tokens_per_s", "update_s")
        }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
