"""Where the time of a decode step goes (development aid for ``benchmarks/rollout.py``; CUDA only).

Prints one JSON object: decode ms/step of the Hugging Face engine at B = 64 for variants (eager, graphs, graphs
over a ``torch.compile``'d forward), per-kernel CUDA time of the graphed step (``torch.profiler``), and the
time of each GEMM shape of a decode step alone; with ``--megatron`` the megatron engine's own forward (its profile)
and its ``GPTModel.forward`` path (``megatron_gpt_forward_graphs``); with ``--unfused`` the HF engine with
``fused_decode=False`` (its step and profile); ``--timeline`` the kernels of one decode step in order (both HF
engines and the megatron engine); ``--prefill`` the kernels of the prefill; ``--attention-sweep`` the launch shapes
of the one-launch attention; ``--host-gaps`` where a whole ``generate`` call's time goes outside its prefill and
decode (both engines): the call's host marks, and the GPU's idle gaps longer than 15 us with the CPU operations
that ran in them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks.rollout import MODEL, _hf_model, _prompts


def _ms_per_step(engine, ids, mask, cfg, gen) -> dict:
    engine.generate(ids, mask, cfg, generator=gen)
    runs = []
    for _ in range(3):
        engine.generate(ids, mask, cfg, generator=gen)
        s = engine.stats
        runs.append(1e3 * s.decode_s / max(s.decode_steps, 1))
    return {"decode_ms_per_step": round(sorted(runs)[1], 3), "prefill_s": round(engine.stats.prefill_s, 4)}


def _profile_top(engine, ids, mask, cfg, gen) -> list[str]:
    """The 30 CUDA kernels of one ``generate`` call that take the most time (``torch.profiler`` table lines)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, mask, cfg, generator=gen)
        torch.cuda.synchronize()
    return (
        prof.key_averages()
        .table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        .splitlines()
    )


def _trace_events(prof) -> list[dict]:
    """The events of a finished ``torch.profiler`` session, as its Chrome trace lists them."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def _timeline(engine, ids, mask, cfg, gen) -> dict:
    """The kernels of one decode step in the middle of a ``generate`` call, in launch order: name, duration and the
    idle time before each (us), with the step's busy and idle totals and what each kernel name adds to the step's
    span (from ``torch.profiler``'s trace)."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(ids, mask, cfg, generator=gen)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, mask, cfg, generator=gen)
        torch.cuda.synchronize()
    events = _trace_events(prof)
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: float(e["ts"])
    )
    # a step ends with the sampling combine kernel (which records the token); take the kernels after the middle step's record up to the next one's
    ends = [i for i, e in enumerate(kernels) if "_sample_combine" in e["name"]]
    if len(ends) < 4:
        return {
            "error": f"found {len(ends)} combine kernels; names: {sorted({e['name'][:40] for e in kernels})[:40]}"
        }
    lo, hi = ends[len(ends) // 2], ends[len(ends) // 2 + 1]
    step, rows, prev_end = kernels[lo + 1 : hi + 1], [], float(kernels[lo]["ts"]) + float(kernels[lo]["dur"])
    busy = idle = 0.0
    for e in step:
        ts, dur = float(e["ts"]), float(e["dur"])
        gap = ts - prev_end
        rows.append([e["name"][:60], round(dur, 2), round(gap, 2)])
        busy, idle, prev_end = busy + dur, idle + max(gap, 0.0), max(prev_end, ts + dur)
    by_name: dict = {}
    for name, dur, gap in rows:
        entry = by_name.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += dur
        entry[2] += gap
    # under PDL the durations overlap; a kernel's duration plus the gap before it (negative: it started before the
    # previous one ended) is what it adds to the step's span: where the kernels end in launch order, as a step's do,
    # these sum to span_us
    span_by_name = {name: round(v[1] + v[2], 1) for name, v in by_name.items()}
    return {
        "kernels": len(rows),
        "busy_us": round(busy, 1),
        "idle_us": round(idle, 1),
        "span_us": round(prev_end - float(kernels[lo]["ts"]) - float(kernels[lo]["dur"]), 1),
        "by_name": {
            k: [v[0], round(v[1], 1), round(v[2], 1)]
            for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])
        },
        "span_by_name": span_by_name,
        "in_order": rows,
    }


def _host_gaps(engine, ids, mask, cfg, gen) -> dict:
    """One ``generate`` call: wall, prefill and decode times (no profiler), then under ``torch.profiler`` the GPU's
    idle gaps (> 15 us) between kernels, the largest 25 with the CPU operations that overlap each."""
    for _ in range(2):
        engine.generate(ids, mask, cfg, generator=gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(ids, mask, cfg, generator=gen)
    torch.cuda.synchronize()
    stats = engine.stats
    res = {
        "wall_ms": round((time.perf_counter() - t0) * 1e3, 2),
        "prefill_ms": round(stats.prefill_s * 1e3, 2),
        "decode_ms": round(stats.decode_s * 1e3, 2),
    }
    res["outside_ms"] = round(res["wall_ms"] - res["prefill_ms"] - res["decode_ms"], 2)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.generate(ids, mask, cfg, generator=gen)
        torch.cuda.synchronize()
    events = _trace_events(prof)
    kernels = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    cpu = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "cpu_op"]
    start = min(c[0] for c in cpu)
    gaps, end = [], kernels[0][1]
    for a, b, name in kernels[1:]:
        if a - end > 15:
            inside: dict[str, float] = {}
            for c0, c1, op in cpu:
                if c0 < a and c1 > end:
                    inside[op] = inside.get(op, 0.0) + min(c1, a) - max(c0, end)
            top = sorted(inside.items(), key=lambda x: -x[1])[:6]
            gaps.append(
                {
                    "at_ms": round((end - start) / 1e3, 3),
                    "gap_us": round(a - end, 1),
                    "next_kernel": name[:50],
                    "cpu": [(op[:60], round(us, 1)) for op, us in top],
                }
            )
        end = max(end, b)
    res["profiled_gaps_total_ms"] = round(sum(g["gap_us"] for g in gaps) / 1e3, 3)
    res["largest_gaps"] = sorted(gaps, key=lambda g: -g["gap_us"])[:25]
    return res


def _fused_attention_sweep(
    b: int = 64, filled: int = 320, length: int = 384, layers: int = 8, splits=(1, 2)
) -> dict:
    """The one-launch rotation + cache write + attention of a decode step at ``filled`` slots, reading each layer's
    cache from HBM (``layers`` caches cycled, more than the L2 holds), over launch shapes (slot blocks, warps,
    stages) and splits of the slots: us per call and the cache bandwidth it reaches (``default_split``: the
    split the kernel chooses)."""
    from ppo_core_decode.decode_rotary_attention import default_split, rotate_write_attend_triton

    h, g, d = 32, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    caches = [(rand(b, g, length, d), rand(b, g, length, d)) for _ in range(layers)]
    q, k, v = rand(b, h, 1, d), rand(b, g, 1, d), rand(b, g, 1, d)
    cos, sin = rand(b, d), rand(b, d)
    slot = torch.tensor(filled - 1, device="cuda")
    bias = torch.zeros(b, 1, 1, length, device="cuda", dtype=torch.bfloat16)
    read_bytes = 2 * b * g * filled * d * 2
    out = {
        "read_us_at_4.2tb": round(read_bytes / 4.2e6, 2),
        "default_split": default_split(b * g, length, 64, torch.device("cuda")),
    }
    shapes = ((64, 4, 3), (64, 4, 2), (64, 4, 1), (128, 4, 2), (128, 8, 2), (32, 4, 2), (64, 2, 2))
    for (block_l, warps, stages), split in itertools.product(shapes, splits):
        i = iter(range(10**9))

        def call(block_l=block_l, warps=warps, stages=stages, split=split, i=i):
            keys, values = caches[next(i) % layers]
            return rotate_write_attend_triton(
                q,
                k,
                v,
                cos,
                sin,
                keys,
                values,
                slot,
                bias,
                model_rounding=True,
                block_l=block_l,
                num_warps=warps,
                num_stages=stages,
                split=split,
            )

        name = f"l{block_l}_w{warps}_s{stages}_split{split}"
        try:
            us = _graph_us(call, warmup=2, calls=2 * layers)
            out[name] = {"us": round(us, 2), "tb_s": round(read_bytes / us / 1e6, 2)}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def _graph_us(fn, *, warmup: int, calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call of ``fn``: ``calls`` calls captured in one CUDA graph, replayed ``replays`` times after
    one warm replay (no launch overhead in the time)."""
    for _ in range(warmup):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (calls * replays) * 1e6


def _gemm_times(b: int) -> dict:
    d, f, kv, v = MODEL["hidden_size"], MODEL["ffn_hidden_size"], 512, MODEL["vocab_size"]
    shapes = {
        "qkv": (d + 2 * kv, d),
        "q": (d, d),
        "kv": (kv, d),
        "o": (d, d),
        "gate_up": (2 * f, d),
        "gate": (f, d),
        "down": (d, f),
        "lm_head": (v, d),
    }
    out = {}
    x = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xin = x if k == d else torch.randn(b, k, device="cuda", dtype=torch.bfloat16)
        us = _graph_us(lambda xin=xin, w=w: torch.nn.functional.linear(xin, w), warmup=5)
        out[name] = {"us": round(us, 2), "tb_per_s": round(n * k * 2 / us / 1e6, 3)}
    return out


def _attn_times(b: int, kv_len: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ppo_core_decode.decode_attention import decode_attention_sdpa, decode_attention_triton

    q = torch.randn(b, 32, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 8, kv_len + 128, 64, device="cuda", dtype=torch.bfloat16)[:, :, :kv_len]
    v = torch.randn_like(k)
    bias = torch.zeros(b, 1, 1, kv_len, device="cuda", dtype=torch.bfloat16)
    bias[:, :, :, : kv_len // 4] = float("-inf")
    ref = decode_attention_sdpa(q.float(), k.float(), v.float(), bias.float())
    variants = {
        "triton": lambda: decode_attention_triton(q, k, v, bias),
        "triton_l128": lambda: decode_attention_triton(q, k, v, bias, block_l=128),
        "triton_w2": lambda: decode_attention_triton(q, k, v, bias, num_warps=2),
        "sdpa_default": lambda: decode_attention_sdpa(q, k, v, bias),
    }
    for name, backend in (
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("sdpa_math", SDPBackend.MATH),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
    ):

        def run(backend=backend):
            with sdpa_kernel(backend):
                return decode_attention_sdpa(q, k, v, bias)

        variants[name] = run
    out = {"read_us_at_4tb": round(2 * k.numel() * 2 / 4.2e6, 2)}
    for name, fn in variants.items():
        try:
            err = float((fn().float() - ref).abs().max())
            out[name] = {"us": round(_graph_us(fn, warmup=3), 2), "max_err": round(err, 4)}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--megatron", action="store_true")
    ap.add_argument("--unfused", action="store_true", help="also HFRolloutEngine(fused_decode=False)")
    ap.add_argument("--prefill", action="store_true", help="only the kernels of the HF engine's prefill")
    ap.add_argument(
        "--attention-sweep", action="store_true", help="only the one-launch attention's launch shapes"
    )
    ap.add_argument(
        "--host-gaps",
        action="store_true",
        help="only the GPU's idle gaps in one generate call (both engines)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="only the kernels of one decode step of each engine, in order",
    )
    args = ap.parse_args()
    from ppo_core.rollout import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine

    result: dict = {}

    def save() -> None:
        if args.out:
            emit(result, args.out, quiet=True)

    if args.prefill:
        model = _hf_model()
        ids, mask = _prompts(64, 256, MODEL["vocab_size"])
        one = SamplingConfig(max_new_tokens=1, temperature=1.0)
        gen = torch.Generator(device="cuda").manual_seed(0)
        engine = HFRolloutEngine(model)
        engine.generate(ids, mask, one, generator=gen)
        result["prefill_s"] = _ms_per_step(engine, ids, mask, one, gen)["prefill_s"]
        result["prefill_profile_top"] = _profile_top(engine, ids, mask, one, gen)
        emit(result, args.out)
        return
    if args.attention_sweep:
        result["fused_attention_b64"] = _fused_attention_sweep(64)
        result["fused_attention_b256"] = _fused_attention_sweep(256, layers=2, splits=(1, 2))
        emit(result, args.out)
        return
    if args.host_gaps:
        from benchmarks.rollout import _megatron_model
        from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

        ids, mask = _prompts(64, 256, MODEL["vocab_size"])
        cfg = SamplingConfig(max_new_tokens=128, temperature=1.0)
        gen = torch.Generator(device="cuda").manual_seed(0)
        model = _hf_model()
        result["hf"] = _host_gaps(HFRolloutEngine(model), ids, mask, cfg, gen)
        save()
        del model
        torch.cuda.empty_cache()
        megatron, megatron_cfg = _megatron_model()
        result["megatron"] = _host_gaps(MegatronRolloutEngine(megatron, megatron_cfg), ids, mask, cfg, gen)
        emit(result, args.out)
        return
    if args.timeline:
        model = _hf_model()
        ids, mask = _prompts(64, 256, MODEL["vocab_size"])
        cfg = SamplingConfig(max_new_tokens=128, temperature=1.0)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for name, kw in (("hf", {}), ("hf_unfused", {"fused_decode": False})):
            engine = HFRolloutEngine(model, **kw)
            result[name] = _ms_per_step(engine, ids, mask, cfg, gen)
            result[name]["timeline"] = _timeline(engine, ids, mask, cfg, gen)
            save()
        del model, engine
        torch.cuda.empty_cache()
        from benchmarks.rollout import _megatron_model
        from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

        megatron, megatron_cfg = _megatron_model()
        engine = MegatronRolloutEngine(megatron, megatron_cfg)
        result["megatron"] = _ms_per_step(engine, ids, mask, cfg, gen)
        result["megatron"]["timeline"] = _timeline(engine, ids, mask, cfg, gen)
        emit(result, args.out)
        return
    result["attention_b64_l384"] = _attn_times(64, 384)
    result["attention_b256_l384"] = _attn_times(256, 384)
    save()
    model = _hf_model()
    ids, mask = _prompts(64, 256, MODEL["vocab_size"])
    cfg = SamplingConfig(max_new_tokens=128, temperature=1.0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    engine = HFRolloutEngine(model)
    result["graphs"] = _ms_per_step(engine, ids, mask, cfg, gen)
    save()
    import os

    os.environ["PPO_CORE_DECODE_ATTENTION"] = "sdpa"
    result["graphs_sdpa_attention"] = _ms_per_step(HFRolloutEngine(model), ids, mask, cfg, gen)
    del os.environ["PPO_CORE_DECODE_ATTENTION"]
    ids256, mask256 = _prompts(256, 256, MODEL["vocab_size"])
    result["graphs_b256"] = _ms_per_step(engine, ids256, mask256, cfg, gen)

    result["profile_top"] = _profile_top(engine, ids, mask, cfg, gen)
    save()
    if args.unfused:
        unfused = HFRolloutEngine(model, fused_decode=False)
        result["unfused_graphs"] = _ms_per_step(unfused, ids, mask, cfg, gen)
        result["unfused_profile_top"] = _profile_top(unfused, ids, mask, cfg, gen)
        save()
    if args.compile:
        t0 = time.perf_counter()
        compiled = HFRolloutEngine(model)
        compiled.decoder.forward = torch.compile(compiled.decoder.forward, dynamic=False)
        compiled.generate(ids, mask, cfg, generator=gen)
        result["compile_s"] = round(time.perf_counter() - t0, 1)
        result["graphs_compiled_forward"] = _ms_per_step(compiled, ids, mask, cfg, gen)
    if args.megatron:
        del model, engine
        from benchmarks.rollout import _megatron_model
        from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

        mmodel, mcfg = _megatron_model()
        mengine = MegatronRolloutEngine(mmodel, mcfg)
        result["megatron_graphs"] = _ms_per_step(mengine, ids, mask, cfg, gen)
        result["megatron_profile_top"] = _profile_top(mengine, ids, mask, cfg, gen)
        # the former path (GPTModel.forward through the cache) against the engine's own forward, in the same run
        gpt_forward = MegatronRolloutEngine(mmodel, mcfg, own_forward=False)
        result["megatron_gpt_forward_graphs"] = _ms_per_step(gpt_forward, ids, mask, cfg, gen)
    emit(result, args.out)


if __name__ == "__main__":
    main()
