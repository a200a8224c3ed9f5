"""Benchmark of PPO actor updates on megatron-core (ours) against Hugging Face, one GPU: dense rows, realistic
mixed lengths (padded vs padding-free), and a small model at the real job's shape.

Prints ONE JSON object. Every update is ``MegatronActorWorker.update_actor`` (megatron-core GPTModel, SDPA core
attention, vocab-parallel log-probs, megatron DDP with fp32 gradient buffers and its mixed-precision optimizer:
fp32 master weights, fused AdamW): one mini-batch and one optimiser step per call, the ``vanilla`` clipped policy
loss, token-mean, no entropy bonus (so no entropy is computed, by either side). bf16 throughout. Cases
(``--cases``):

- ``dense``: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 key/value groups, SwiGLU 8192, vocabulary
  128256, tied embeddings; 1.24 B parameters) on ``batch`` rows of ``seq`` tokens, no padding at all (``ours``;
  ``--unfused`` / ``--distributed-optimizer`` / ``--local`` add variants), and ``hf``: ``transformers``'
  ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, bf16 weights, fused ``torch.optim.AdamW``, all logits
  computed) with the same loss.
- ``realistic``: the same model on 64 responses per step, prompts uniform in 64..512 tokens (left-padded),
  responses uniform in 32..2048 (right-padded), seeded: a padded ``[64, 2560]`` batch about half valid.
  ``ours_padded``: padded rows, micro-batches of ``--micro`` rows (the issue's measurement); ``ours_packed``:
  padding-free micro-batches (each micro-batch's valid tokens packed into one sequence, per-row causal attention
  with the ``auto`` packed kernel) of at most ``--max-tokens`` valid tokens (Karmarkar-Karp balanced);
  ``ours_packed_flex`` (with ``--flex``): the same with FlexAttention (``ours_packed_sdpa``, one SDPA call per row,
  only if ``ours_packed`` failed); ``hf_padded``: the Hugging Face loop on
  padded micro-batches of ``--micro`` rows, gradients accumulated over the step. The two ``ours`` variants run on
  one worker (its engine's ``packed`` switch and micro-batch settings changed between them), so they share weights
  and compiled kernels.
- ``qwen``: a Qwen2.5-0.5B-shaped actor (hidden 896, 24 layers, 14 heads, 2 key/value groups, SwiGLU 4864,
  vocabulary 151936, qkv bias, tied embeddings) on 64 rows of 256 prompt + 256 response tokens:
  ``rows8_padded`` (micro-batches of 8 rows, the configuration measured at about 11% MFU), ``rows8_packed`` (same
  micro-batches, padding-free) and ``budget<N>_packed`` (padding-free micro-batches of at most ``N`` tokens, for
  each ``N`` of ``--qwen-max-tokens``).

Reported per variant: step time (median and minimum of ``--steps`` after ``--warmup``), ``tokens_per_s`` counted on
*valid* tokens, ``mfu`` = ``6 N valid_tokens / time / 989e12`` with ``N`` the parameters that do matrix work per
token (the tied embedding counted once, as the output layer; the issue's convention), ``mfu_with_attention``
adding the causal attention FLOPs each row actually needs (``6 L D len^2`` per row: forward + backward, half the
``len x len`` scores; padding tokens are never counted), and the peak GPU memory. A variant that fails reports
``{"error": ...}`` and the others still run. Ratios: ``packed_vs_padded``, ``packed_vs_hf`` and
``packed_vs_dense`` (realistic packed tokens/s over the dense case's; the issue's targets are >= 1.8 and within
10%), and the Qwen case's best ``budget<N>_packed`` MFU (``best_budget_mfu``; target >= 0.30).

Measured before this benchmark had the realistic and Qwen cases (one H200, torch 2.11, transformers 5.17,
megatron-core 0.16.1, dense 4 x 2048, prompt 512, median of 15 steps; ``results_h200_actor_update.json`` at e3baa8f): ours
141 ms/step, 58.0k tokens/s, MFU 0.435 (0.458 with attention), 34 GiB; HF 196 ms, 41.9k tokens/s, MFU 0.314.

Usage: ``python benchmarks/actor_update.py [--cases dense,realistic,qwen] [--steps 3] [--warmup 1]
[--max-tokens 16384] [--flex] [--out FILE]`` (CUDA only; about 3-4 minutes on one H200 with the defaults).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit

PEAK_FLOPS = 989e12
MODEL = {
    "num_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "ffn_hidden_size": 8192,
    "vocab_size": 128256,
    "rotary_base": 500000.0,
    "norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
QWEN_05B = {
    "num_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_query_groups": 2,
    "ffn_hidden_size": 4864,
    "vocab_size": 151936,
    "rotary_base": 1000000.0,
    "norm_epsilon": 1e-6,
    "qkv_bias": True,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
REALISTIC = {"rows": 64, "prompt": (64, 512), "response": (32, 2048), "seed": 0}
QWEN_ROWS, QWEN_PROMPT, QWEN_RESPONSE = 64, 256, 256


# ----- batches ------------------------------------------------------------------------------------------------
def _update_batch(ids: torch.Tensor, mask: torch.Tensor, prompt: int, g: torch.Generator):
    """The ``update_actor`` keys of left-padded prompts and right-padded responses (``ids``/``mask [B, P + R]``)."""
    from tensordict import TensorDict

    rows, r = ids.shape[0], ids.shape[1] - prompt
    response_mask = mask[:, prompt:].long()
    return TensorDict(
        {
            "input_ids": ids * mask,
            "attention_mask": mask.long(),
            "responses": ids[:, prompt:] * response_mask,
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(rows, r, generator=g) * 10,
            "advantages": torch.randn(rows, r, generator=g),
        },
        batch_size=[rows],
    ).to("cuda")


def _dense_batch(batch: int, seq: int, prompt: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return _update_batch(ids, torch.ones(batch, seq, dtype=torch.long), prompt, g)


def _mixed_batch(vocab: int, rows: int, prompt: tuple[int, int], response: tuple[int, int], seed: int):
    """Prompts and responses of uniformly drawn lengths, padded to ``[rows, max_prompt + max_response]``."""
    g = torch.Generator().manual_seed(seed)
    p_width, r_width = prompt[1], response[1]
    p_len = torch.randint(prompt[0], prompt[1] + 1, (rows,), generator=g)
    r_len = torch.randint(response[0], response[1] + 1, (rows,), generator=g)
    ids = torch.randint(0, vocab, (rows, p_width + r_width), generator=g)
    cols = torch.arange(p_width + r_width)
    mask = (cols >= p_width - p_len[:, None]) & (cols < p_width + r_len[:, None])
    return _update_batch(ids, mask, p_width, g)


# ----- measurement --------------------------------------------------------------------------------------------
def _time(step: Callable[[], None], steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _profile(step: Callable[[], None], path: str) -> None:
    """Write the 40 most expensive CUDA ops of two steps (self time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    Path(path).write_text(table)


def _n_params(model: dict) -> int:
    """Parameters doing matrix work per token: the body plus the output layer (a tied embedding counted once)."""
    from ppo_core.workers.megatron import MegatronModelConfig

    cfg = MegatronModelConfig(**model)
    return cfg.num_parameters(include_embedding=False) + cfg.vocab_size * cfg.hidden_size


def _summary(times: list[float], batch: Any, model: dict) -> dict:
    """Step times, valid tokens/s and MFU of the FLOPs the valid tokens need (see the module docstring)."""
    lengths = batch["attention_mask"].sum(-1).double()
    tokens = float(lengths.sum())
    attention = 6 * model["num_layers"] * model["hidden_size"] * float((lengths**2).sum())
    med = statistics.median(times)
    dense = 6 * _n_params(model) * tokens
    return {
        "step_ms_median": round(med * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_s": round(tokens / med, 1),
        "mfu": round(dense / med / PEAK_FLOPS, 4),
        "mfu_with_attention": round((dense + attention) / med / PEAK_FLOPS, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def _fail_soft(result: dict, name: str, run: Callable[[], dict]) -> None:
    """``result[name] = run()``, or the error (the other variants still run)."""
    try:
        torch.cuda.reset_peak_memory_stats()
        result[name] = run()
    except Exception as exc:
        result[name] = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc(limit=-3)}
    gc.collect()
    torch.cuda.empty_cache()


def _ratio(result: dict, a: str, b: str) -> float | None:
    x, y = result.get(a, {}).get("tokens_per_s"), result.get(b, {}).get("tokens_per_s")
    return round(x / y, 3) if x and y else None


# ----- ours ---------------------------------------------------------------------------------------------------
def _actor(model: dict, rows: int, **config: Any):
    from ppo_core.workers.base import worker_context
    from ppo_core.workers.megatron import MegatronActorWorker

    cfg = {
        "model": model,
        "ppo_mini_batch_size": rows,
        "use_reference": False,
        "optim": {"lr": 1e-6, "weight_decay": 0.0, "grad_clip": 1.0},
        "policy_loss": {"loss_mode": "vanilla", "loss_agg_mode": "token-mean"},
        **config,
    }
    with worker_context(rank=0, world_size=1):
        return MegatronActorWorker(cfg)


def _configure(actor: Any, *, packed: bool, micro_rows: int | None, max_tokens: int | None) -> None:
    """Switch a built worker between padded and packed micro-batches (what its config fields would choose)."""
    actor.engine.packed = packed
    actor.config.micro_batch_size = micro_rows
    actor.config.ppo_max_token_len_per_gpu = max_tokens


def _set_packed_attention(actor: Any, backend: str) -> None:
    from ppo_core.workers.megatron.model import SDPACoreAttention

    for module in actor.engine.module.modules():
        if isinstance(module, SDPACoreAttention):
            module.packed_attention = backend


def _timed_update(
    actor: Any, batch: Any, model: dict, args: argparse.Namespace, profile: str | None = None
) -> dict:
    last: dict = {}

    def step() -> None:
        last.update(actor.update_actor(batch))

    times = _time(step, args.steps, args.warmup)
    out = {**_summary(times, batch, model), "last_metrics": last}
    if profile:
        _profile(step, profile)
    return out


def _variants_on_one_actor(
    result: dict, model: dict, batch: Any, variants: list[tuple], args: argparse.Namespace
) -> None:
    """Time ``update_actor`` on one worker for each ``(name, packed, micro_rows, max_tokens, packed_attention)``
    (fail-soft each), switching its micro-batching between them; the worker is closed afterwards."""
    actor = None
    try:
        actor = _actor(model, int(batch.batch_size[0]), micro_batch_size=variants[0][2] or None)
        for name, packed, micro, budget, backend in variants:

            def run(
                packed: bool = packed,
                micro: int | None = micro,
                budget: int | None = budget,
                backend: str = backend,
            ) -> dict:
                _configure(actor, packed=packed, micro_rows=micro, max_tokens=budget)
                _set_packed_attention(actor, backend)
                return _timed_update(actor, batch, model, args)

            _fail_soft(result, name, run)
    except Exception as exc:  # building the worker failed: say so for every variant
        for name, *_ in variants:
            result.setdefault(name, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        if actor is not None:
            actor.close()
        gc.collect()
        torch.cuda.empty_cache()


def bench_dense_ours(
    args: argparse.Namespace, attention: str, distributed_optimizer: bool, fused: bool
) -> dict:
    model = {**MODEL, "attention": attention, "fused_kernels": fused}
    actor = _actor(
        model, args.batch, micro_batch_size=args.batch, use_distributed_optimizer=distributed_optimizer
    )
    try:
        batch = _dense_batch(args.batch, args.seq, args.prompt, MODEL["vocab_size"])
        profile = args.profile if attention == "sdpa" and not distributed_optimizer and fused else None
        return _timed_update(actor, batch, MODEL, args, profile)
    finally:
        actor.close()


# ----- Hugging Face -------------------------------------------------------------------------------------------
def hf_llama(*, use_cache: bool = False) -> Any:
    """A random-init Hugging Face ``LlamaForCausalLM`` of the benchmark's shape, bf16, on the GPU (train mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=MODEL["vocab_size"],
        hidden_size=MODEL["hidden_size"],
        intermediate_size=MODEL["ffn_hidden_size"],
        num_hidden_layers=MODEL["num_layers"],
        num_attention_heads=MODEL["num_attention_heads"],
        num_key_value_heads=MODEL["num_query_groups"],
        rope_theta=MODEL["rotary_base"],
        rms_norm_eps=MODEL["norm_epsilon"],
        tie_word_embeddings=True,
        max_position_embeddings=MODEL["max_position_embeddings"],
        attn_implementation="sdpa",
        use_cache=use_cache,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(hf_cfg).to(dtype=torch.bfloat16).train()


def bench_hf(args: argparse.Namespace, batch: Any, micro_rows: int) -> dict:
    """The Hugging Face loop: padded micro-batches of ``micro_rows``, the loss with the step's global token count
    (so the accumulated gradient is the step's), one fused AdamW step."""
    from ppo_core.logprobs import logprobs_from_logits
    from ppo_core.losses import PolicyLossConfig, compute_policy_loss
    from ppo_core.models.hf import positions_from_mask

    model = hf_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
    loss_cfg = PolicyLossConfig(loss_mode="vanilla", loss_agg_mode="token-mean")
    r = batch["responses"].shape[1]
    rows = int(batch.batch_size[0])
    agg = {
        "dp_size": 1,
        "batch_num_tokens": batch["response_mask"].sum().double(),
        "global_batch_size": torch.tensor(float(rows), dtype=torch.float64, device="cuda"),
    }
    last: dict = {}

    def step() -> None:
        total = torch.zeros((), device="cuda")
        for start in range(0, rows, micro_rows):
            mb = batch[start : start + micro_rows]
            mask = mb["attention_mask"]
            logits = model(
                input_ids=mb["input_ids"], attention_mask=mask, position_ids=positions_from_mask(mask)
            ).logits[:, -r - 1 : -1]
            log_prob = logprobs_from_logits(logits, mb["responses"])
            loss, _ = compute_policy_loss(
                mb["old_log_probs"], log_prob, mb["advantages"], mb["response_mask"], config=loss_cfg, **agg
            )
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last.update({"pg_loss": float(total), "grad_norm": float(norm)})

    times = _time(step, args.steps, args.warmup)
    return {**_summary(times, batch, MODEL), "last_metrics": last}


# ----- cases --------------------------------------------------------------------------------------------------
def case_dense(args: argparse.Namespace) -> dict:
    result: dict = {"shape": {"batch": args.batch, "seq": args.seq, "prompt": args.prompt}}
    variants = [("ours", "sdpa", False, True)]
    if args.unfused:
        variants.append(("ours_unfused_kernels", "sdpa", False, False))
    if args.distributed_optimizer:
        variants.append(("ours_distributed_optimizer", "sdpa", True, True))
    if args.local:
        variants.append(("ours_local_attention", "local", False, True))
    for name, attention, dist_opt, fused in variants:
        _fail_soft(result, name, lambda a=attention, d=dist_opt, f=fused: bench_dense_ours(args, a, d, f))
    if not args.skip_hf:
        batch = _dense_batch(args.batch, args.seq, args.prompt, MODEL["vocab_size"])
        _fail_soft(result, "hf", lambda: bench_hf(args, batch, args.batch))
    result["speedup_vs_hf"] = _ratio(result, "ours", "hf")
    return result


def case_realistic(args: argparse.Namespace) -> dict:
    batch = _mixed_batch(MODEL["vocab_size"], **REALISTIC)
    valid = int(batch["attention_mask"].sum())
    result: dict = {
        "shape": {**REALISTIC, "padded": list(batch["input_ids"].shape), "valid_tokens": valid},
        "valid_fraction": round(valid / batch["input_ids"].numel(), 4),
        "micro_rows": args.micro,
        "max_tokens": args.max_tokens,
    }
    variants = [("ours_packed", True, None, args.max_tokens, "auto")]
    if args.flex:
        variants.append(("ours_packed_flex", True, None, args.max_tokens, "flex"))
    variants.append(("ours_padded", False, args.micro, None, "auto"))
    _variants_on_one_actor(result, MODEL, batch, variants, args)
    if "error" in result.get("ours_packed", {}):  # still measure packing, with the per-row SDPA attention
        _variants_on_one_actor(
            result, MODEL, batch, [("ours_packed_sdpa", True, None, args.max_tokens, "sdpa")], args
        )
    if not args.skip_hf:
        _fail_soft(result, "hf_padded", lambda: bench_hf(args, batch, args.micro))
    result["packed_vs_padded"] = _ratio(result, "ours_packed", "ours_padded")
    result["packed_vs_hf"] = _ratio(result, "ours_packed", "hf_padded")
    return result


def case_qwen(args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    seq = QWEN_PROMPT + QWEN_RESPONSE
    ids = torch.randint(0, QWEN_05B["vocab_size"], (QWEN_ROWS, seq), generator=g)
    batch = _update_batch(ids, torch.ones(QWEN_ROWS, seq, dtype=torch.long), QWEN_PROMPT, g)
    result: dict = {
        "shape": {**QWEN_05B, "rows": QWEN_ROWS, "prompt": QWEN_PROMPT, "response": QWEN_RESPONSE},
        "params": _n_params(QWEN_05B),
        "max_tokens": args.qwen_max_tokens,
    }
    variants = [
        ("rows8_padded", False, 8, None, "auto"),
        ("rows8_packed", True, 8, None, "auto"),
        *((f"budget{n}_packed", True, None, n, "auto") for n in args.qwen_max_tokens),
    ]
    _variants_on_one_actor(result, QWEN_05B, batch, variants, args)
    budgets = [
        f"budget{n}_packed" for n in args.qwen_max_tokens if "mfu" in result.get(f"budget{n}_packed", {})
    ]
    if budgets:
        best = max(budgets, key=lambda name: result[name]["mfu"])
        result["best_budget"] = best
        result["best_budget_mfu"] = result[best]["mfu"]
        result["best_budget_vs_rows8_padded"] = _ratio(result, best, "rows8_padded")
    return result


CASES = {"dense": case_dense, "realistic": case_realistic, "qwen": case_qwen}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="dense,realistic,qwen", help=f"comma-separated, of {sorted(CASES)}")
    p.add_argument("--batch", type=int, default=4, help="dense: rows")
    p.add_argument("--seq", type=int, default=2048, help="dense: tokens per row")
    p.add_argument("--prompt", type=int, default=512, help="dense: prompt tokens per row")
    p.add_argument(
        "--micro", type=int, default=4, help="realistic: rows per padded micro-batch (ours and HF)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=16384, help="realistic: valid tokens per packed micro-batch"
    )
    p.add_argument(
        "--qwen-max-tokens",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[16384, 32768],
        help="qwen: comma-separated token budgets of packed micro-batches, one variant each",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--flex", action="store_true", help="realistic: also time FlexAttention for packed attention"
    )
    p.add_argument("--local", action="store_true", help="dense: also time megatron's unfused local attention")
    p.add_argument(
        "--distributed-optimizer", action="store_true", help="dense: also time the distributed optimizer"
    )
    p.add_argument("--unfused", action="store_true", help="dense: also time fused_kernels=False")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", default=None, help="dense: write a CUDA op profile of ours to this file")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/actor_update.py needs a CUDA device")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown --cases {unknown}; choose from {sorted(CASES)}")
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": {**MODEL, "params": _n_params(MODEL)},
        "peak_tflops": PEAK_FLOPS / 1e12,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    for name in cases:
        t0 = time.perf_counter()
        try:
            result[name] = CASES[name](args)
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc(limit=-3)}
        result[name]["case_wall_s"] = round(time.perf_counter() - t0, 1)
    dense = result.get("dense", {}).get("ours", {}).get("tokens_per_s")
    packed = result.get("realistic", {}).get("ours_packed", {}).get("tokens_per_s")
    if dense and packed:
        result["realistic"]["packed_vs_dense"] = round(packed / dense, 3)
    return emit(result, args.out)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
