"""Benchmark of rollout (sampling responses) on one GPU: ppo-core's KV-cached, graph-captured engines against
Hugging Face ``generate`` and full recomputation, in the same run.

Prints ONE JSON object. The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads, 8 key/value groups,
SwiGLU 8192, vocabulary 128256, tied embeddings; 1.24 B parameters), random weights, bf16. Each case samples
``new`` tokens for ``batch`` prompts of ``prompt`` tokens at temperature 1 (top-p 1, no top-k), without EOS so that
every row produces every token, except the mixed case, where EOS is forced after ``eos_after`` tokens in half of
the rows (``step_hook``) and the other half runs to the end. Reported per method: new tokens per second (tokens
actually produced over the wall time of a whole call: prefill + decode), the median of ``repeats`` calls after a
warm-up call (compilation, graph capture), and the peak GPU memory of a call.

- ``ours_hf``: :class:`ppo_core_decode.hf.HFRolloutEngine` on ``transformers``' ``LlamaForCausalLM`` with its
  defaults (the fused Llama-family path; decode steps through
  :func:`ppo_core_decode.decode_linear.decode_linear`, norms and SwiGLU fused into the products);
- ``ours_hf_unfused``: the same with ``fused_decode=False`` (cuBLAS products, the element-wise steps as kernels
  of their own);
- ``ours_megatron``: :class:`ppo_core.workers.megatron.rollout.MegatronRolloutEngine` on a megatron-core
  ``GPTModel`` of the same shape (SDPA attention, fused kernels) with its defaults (its own forward, decode steps
  through ``decode_linear``); ``ours_megatron_unfused``: ``fused_decode=False``; and
  ``ours_megatron_gpt_forward``: the same engine through megatron's ``GPTModel.forward`` (``own_forward=False``);
- ``hf_generate_static`` / ``hf_generate_dynamic``: ``model.generate(..., do_sample=True)`` with
  ``cache_implementation="static"`` (which ``transformers`` compiles) and the default dynamic cache;
- ``recompute``: the full sequence recomputed for every new token (``use_cache=False``), timed on ``recompute_new``
  tokens only (it is slow) and reported per token;
- ``bandwidth_bound``: new tokens/s if each decode step only read every weight once, from a device-to-device copy
  measured in the same run (bytes read + written over time).

Also checks exactness in bf16 (``exactness``): greedy tokens of the cached engines against full recomputation for
``exact_new`` tokens (rows identical, and for each differing row the gap between the two competing logits at the
first difference), and ``rollout_log_probs`` against one forward over the finished sequences; for the HF engine also
with the model's own modules through the cache (``hf_model_modules``) and with cuBLAS's split-K partial sums kept in
fp32 (``hf_fp32_split_k``), to tell where the differences come from; and the engine with batch-invariant numerics
(``ours_hf_batch_invariant``, ``exactness:hf_batch_invariant``, and the same for megatron: the reference is a full
recomputation through the same functions, the engines' ``recompute_logits``).

Usage: ``python benchmarks/rollout.py [--repeats 3] [--cases b64,b256,mixed] [--out FILE]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._hf import hf_generate_kwargs
from benchmarks._meta import emit

# the Llama-3.2-1B shape of the actor-update benchmark
from benchmarks.actor_update import MODEL, hf_llama

CASES = {
    "b64": {"batch": 64, "prompt": 256, "new": 128},
    "b256": {"batch": 256, "prompt": 256, "new": 128},
    "mixed": {"batch": 64, "prompt": 256, "new": 128, "eos_after": 16},
}
EOS = 7


def _hf_model() -> Any:
    """The actor benchmark's Llama (with its KV cache on, for Hugging Face's own ``generate``), in eval mode."""
    return hf_llama(use_cache=True).eval()


def _megatron_model() -> Any:
    from ppo_core.workers.megatron import MegatronModelConfig, ParallelConfig, init_megatron_parallel
    from ppo_core.workers.megatron.model import build_gpt_model

    init_megatron_parallel(ParallelConfig(), rank=0, world_size=1, device=torch.device("cuda", 0))
    cfg = MegatronModelConfig(**MODEL)
    return build_gpt_model(cfg, ParallelConfig()).eval(), cfg


def _prompts(batch: int, prompt: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1000 + prompt)
    ids = torch.randint(8, vocab, (batch, prompt), generator=g)
    return ids.cuda(), torch.ones(batch, prompt, dtype=torch.long, device="cuda")


def _eos_hook(batch: int, after: int):
    """Force EOS at token ``after`` in the first half of the rows (a device-only operation, graph-safe)."""
    rows = torch.zeros(batch, 1, dtype=torch.bool, device="cuda")
    rows[: batch // 2] = True

    def hook(t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        force = rows & (t == after)
        boost = torch.zeros_like(logits)
        boost[:, EOS] = 1e4
        return torch.where(force, logits + boost, logits)

    return hook


def _timed(call, repeats: int) -> tuple[list[float], Any]:
    out = call()  # warm-up: compilation, graph capture
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, out


def _report(times: list[float], tokens: int, extra: dict | None = None) -> dict:
    med = statistics.median(times)
    return {
        "new_tokens": tokens,
        "s_median": round(med, 4),
        "s_all": [round(t, 4) for t in times],
        "new_tokens_per_s": round(tokens / med, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        **(extra or {}),
    }


def _engine_case(engine: Any, case: dict, repeats: int) -> dict:
    from ppo_core.rollout import SamplingConfig
    from ppo_core.rollout.sampling import sample_tokens  # noqa: F401 (compiled on first use)

    b, p, r = case["batch"], case["prompt"], case["new"]
    ids, mask = _prompts(b, p, MODEL["vocab_size"])
    eos = EOS if "eos_after" in case else None
    cfg = SamplingConfig(max_new_tokens=r, temperature=1.0, eos_token_id=eos)
    hook = _eos_hook(b, case["eos_after"]) if eos is not None else None
    gen = torch.Generator(device="cuda").manual_seed(0)

    def call():
        return engine.generate(ids, mask, cfg, generator=gen, step_hook=hook)

    times, out = _timed(call, repeats)
    tokens = int(out["response_mask"].sum())
    s = engine.stats
    return _report(
        times,
        tokens,
        {
            "prefill_s": round(s.prefill_s, 4),
            "decode_s": round(s.decode_s, 4),
            "decode_steps": s.decode_steps,
            "decode_ms_per_step": round(1e3 * s.decode_s / max(s.decode_steps, 1), 3),
            "kv_cache_gib": round(s.cache_bytes / 2**30, 3),
            "graphs_captured": s.graphs_captured,
            "graphs_reused": s.graphs_reused,
            "cuda_graphs": s.cuda_graphs,
        },
    )


def _hf_generate_case(model: Any, case: dict, repeats: int, static: bool) -> dict:
    b, p, r = case["batch"], case["prompt"], case["new"]
    ids, mask = _prompts(b, p, MODEL["vocab_size"])
    kwargs = hf_generate_kwargs(r, static=static)

    def call():
        return model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    times, out = _timed(call, repeats)
    return _report(times, b * (out.shape[1] - p))


def _recompute_case(model: Any, case: dict, new: int) -> dict:
    from ppo_core.rollout import SamplingConfig, generate

    b, p = case["batch"], case["prompt"]
    ids, mask = _prompts(b, p, MODEL["vocab_size"])
    cfg = SamplingConfig(max_new_tokens=new, temperature=1.0, use_cache=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    times, _ = _timed(lambda: generate(model, ids, mask, cfg, generator=gen), 1)
    return _report(times, b * new, {"note": f"timed on {new} new tokens per row"})


def _bandwidth(weight_bytes: int, batch: int) -> dict:
    n = 2 * 1024**3 // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    bw = 2 * src.numel() * src.element_size() / seconds
    step = weight_bytes / bw
    return {
        "copy_tb_per_s": round(bw / 1e12, 3),
        "weight_gib": round(weight_bytes / 2**30, 3),
        "weights_read_ms": round(step * 1e3, 3),
        "new_tokens_per_s_at_batch": {str(batch): round(batch / step, 1)},
    }


def _greedy_recompute(last_logits, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[B, new]`` greedy tokens, the whole sequence recomputed for each (``last_logits(seq, mask) -> [B, V]``)."""
    seq, seq_mask, tokens = ids, mask, []
    for _ in range(new):
        tok = last_logits(seq, seq_mask).float().argmax(-1)
        tokens.append(tok)
        seq = torch.cat([seq, tok[:, None]], 1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(tok[:, None])], 1)
    return torch.stack(tokens, 1)


def _exactness(model: Any, engine: Any, forward_logits, new: int, last_logits=None) -> dict:
    """Greedy cached tokens vs full recomputation (bf16), and rollout log-probs vs one forward.

    The recomputation is ``last_logits(seq, mask) -> [B, V]`` (by default the last position of ``forward_logits``,
    the model's own forward); the log-probs are checked against ``forward_logits``.

    ``reference_rows_identical_in_halves``: the recomputation against itself run on the same rows in two batches of
    32 (other GEMM shapes, so other bf16 roundings): how many rows a bf16 random-weights model keeps identical
    when only the kernels' reduction order changes, the yardstick for ``rows_identical``.
    """
    from ppo_core.rollout import SamplingConfig

    last = last_logits or (lambda seq, seq_mask: forward_logits(seq, seq_mask)[:, -1])
    b, p = 64, 256
    ids, mask = _prompts(b, p, MODEL["vocab_size"])
    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=new, temperature=0.0))
    gaps = []
    with torch.no_grad():
        ref = _greedy_recompute(last, ids, mask, new)
        halves = torch.cat(
            [_greedy_recompute(last, ids[rows], mask[rows], new) for rows in (slice(0, 32), slice(32, 64))]
        )
        differ = (ref != out["responses"]).any(1)
        # for each differing row: the recomputed logit gap between the two tokens at the first difference
        for row in differ.nonzero().flatten().tolist():
            t = int((ref[row] != out["responses"][row]).nonzero()[0])
            prefix = torch.cat([ids[row], ref[row, :t]])[None]
            logits = last(prefix, torch.ones_like(prefix))[0].float()
            gaps.append(float(logits[ref[row, t]] - logits[out["responses"][row, t]]))
        full = forward_logits(out["input_ids"], out["attention_mask"])[:, p - 1 : -1].float()
        lp = full.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    diff = (lp - out["rollout_log_probs"]).abs()
    return {
        "rows": b,
        "new_tokens": new,
        "rows_identical": int((~differ).sum()),
        "reference_rows_identical_in_halves": int((halves == ref).all(1).sum()),
        "first_difference_logit_gaps": [round(g, 4) for g in gaps],
        "rollout_log_probs_max_abs_diff": round(float(diff.max()), 5),
        "rollout_log_probs_mean_abs_diff": round(float(diff.mean()), 6),
    }


def _fp32_split_k(run):
    """``run()`` with cuBLAS told not to reduce split-K partial sums in bf16 (restored afterwards)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return run()
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def _bench_hf(cases: dict, args: argparse.Namespace, result: dict, attempt) -> None:
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf_model()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result["bandwidth_bound"] = _bandwidth(weight_bytes, 64)
    engine = HFRolloutEngine(model)
    for case in cases:
        attempt(f"ours_hf:{case}", lambda c=cases[case]: _engine_case(engine, c, args.repeats))
    unfused = HFRolloutEngine(model, fused_decode=False)
    for case in cases:
        attempt(f"ours_hf_unfused:{case}", lambda c=cases[case]: _engine_case(unfused, c, args.repeats))

    def hf_logits(seq: torch.Tensor, seq_mask: torch.Tensor) -> torch.Tensor:
        pos = (seq_mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=seq, attention_mask=seq_mask, position_ids=pos).logits

    attempt("exactness:hf", lambda: _exactness(model, engine, hf_logits, args.exact_new))
    attempt("exactness:hf_unfused", lambda: _exactness(model, unfused, hf_logits, args.exact_new))
    # where the bf16 differences come from: the model's own modules through the cache (its element-wise roundings,
    # our attention and decode-sized GEMMs), and split-K GEMM partial sums kept in fp32 by cuBLAS
    modules = HFRolloutEngine(model, fast_path=False)
    attempt("exactness:hf_model_modules", lambda: _exactness(model, modules, hf_logits, args.exact_new))
    attempt(
        "exactness:hf_fp32_split_k",
        lambda: _fp32_split_k(lambda: _exactness(model, unfused, hf_logits, args.exact_new)),
    )
    # batch-invariant numerics: the cached engine against a full recomputation through the same functions
    invariant = HFRolloutEngine(model, batch_invariant=True)
    attempt("ours_hf_batch_invariant:b64", lambda: _engine_case(invariant, CASES["b64"], args.repeats))
    attempt(
        "exactness:hf_batch_invariant",
        lambda: _exactness(
            model, invariant, hf_logits, args.exact_new, last_logits=invariant.recompute_logits
        ),
    )
    if args.exact_fp32:
        # the same model in fp32: differences left by the engines' numerics alone are much smaller than in bf16
        model32 = model.float()
        engine32 = HFRolloutEngine(model32)
        attempt("exactness:hf_fp32", lambda: _exactness(model32, engine32, hf_logits, args.exact_new))
        model.to(torch.bfloat16)
    attempt("hf_static:b64", lambda: _hf_generate_case(model, CASES["b64"], 2, static=True))
    attempt("hf_dynamic:b64", lambda: _hf_generate_case(model, CASES["b64"], 1, static=False))
    attempt("recompute:b64", lambda: _recompute_case(model, CASES["b64"], args.recompute_new))


def _bench_megatron(cases: dict, args: argparse.Namespace, attempt) -> None:
    from ppo_core.workers.megatron.engine import megatron_attention_mask, position_ids
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    model, cfg = _megatron_model()
    engine = MegatronRolloutEngine(model, cfg)
    for case in cases:
        attempt(f"ours_megatron:{case}", lambda c=cases[case]: _engine_case(engine, c, args.repeats))

    def meg_logits(seq: torch.Tensor, seq_mask: torch.Tensor) -> torch.Tensor:
        return model(seq, position_ids(seq_mask), megatron_attention_mask(seq_mask))[..., : cfg.vocab_size]

    attempt("exactness:megatron", lambda: _exactness(model, engine, meg_logits, args.exact_new))
    unfused = MegatronRolloutEngine(model, cfg, fused_decode=False)
    for case in cases:
        attempt(f"ours_megatron_unfused:{case}", lambda c=cases[case]: _engine_case(unfused, c, args.repeats))
    attempt("exactness:megatron_unfused", lambda: _exactness(model, unfused, meg_logits, args.exact_new))
    # the engine's former path, megatron's GPTModel.forward through the cache: the reference of its own forward
    gpt_forward = MegatronRolloutEngine(model, cfg, own_forward=False)
    attempt("ours_megatron_gpt_forward:b64", lambda: _engine_case(gpt_forward, CASES["b64"], args.repeats))
    attempt(
        "exactness:megatron_gpt_forward", lambda: _exactness(model, gpt_forward, meg_logits, args.exact_new)
    )
    invariant = MegatronRolloutEngine(model, cfg, batch_invariant=True)
    attempt("ours_megatron_batch_invariant:b64", lambda: _engine_case(invariant, CASES["b64"], args.repeats))
    attempt(
        "exactness:megatron_batch_invariant",
        lambda: _exactness(
            model, invariant, meg_logits, args.exact_new, last_logits=invariant.recompute_logits
        ),
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="b64,b256,mixed")
    ap.add_argument("--recompute-new", type=int, default=8)
    ap.add_argument("--exact-new", type=int, default=32)
    ap.add_argument("--exact-fp32", action="store_true", help="also check exactness with the model in fp32")
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated methods or entries to skip (hf_static, megatron, exactness:hf, ...)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rollout.py needs a CUDA device")
    skip = set(filter(None, args.skip.split(",")))
    cases = {name: CASES[name] for name in args.cases.split(",")}
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": MODEL,
        "cases": cases,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
    }

    def attempt(name: str, fn) -> None:
        if name.split(":")[0] in skip or name in skip:
            return
        try:
            result.setdefault(name.split(":")[0], {})[name.split(":")[1]] = fn()
        except Exception as exc:  # a failed method is reported, the others still run
            result.setdefault(name.split(":")[0], {})[name.split(":")[1]] = {
                "error": f"{type(exc).__name__}: {exc}"
            }
        gc.collect()
        torch.cuda.empty_cache()
        if args.out:  # what has run so far, in case a later method does not finish
            emit(result, args.out, quiet=True)

    from transformers import __version__ as tf_version

    result["transformers"] = tf_version
    _bench_hf(cases, args, result, attempt)
    gc.collect()
    torch.cuda.empty_cache()
    if "megatron" not in skip:
        _bench_megatron(cases, args, attempt)

    summary = {}
    for method in (
        "ours_hf",
        "ours_hf_unfused",
        "ours_hf_batch_invariant",
        "ours_megatron",
        "ours_megatron_unfused",
        "ours_megatron_batch_invariant",
        "hf_static",
        "hf_dynamic",
        "recompute",
    ):
        for case, rep in result.get(method, {}).items():
            if isinstance(rep, dict) and "new_tokens_per_s" in rep:
                summary[f"{method}:{case}"] = rep["new_tokens_per_s"]
    result["summary_new_tokens_per_s"] = summary
    static = result.get("hf_static", {}).get("b64", {}).get("new_tokens_per_s")
    for method in ("ours_hf", "ours_hf_unfused", "ours_megatron", "ours_megatron_unfused"):
        ours = result.get(method, {}).get("b64", {}).get("new_tokens_per_s")
        if ours and static:
            result[f"{method}_over_hf_static_b64"] = round(ours / static, 2)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
