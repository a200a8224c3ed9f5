"""Rollout speed per model family: the Hugging Face engine against Hugging Face's static-cache ``generate`` and the
weight-bandwidth bound, for the Llama, Qwen3 and GPT-NeoX shapes, in one process.

Prints ONE JSON object. Each family is a ``transformers`` causal LM built from its config (random weights, bf16,
eval mode, nothing downloaded):

- ``llama``: the Llama-3.2-1B shape of the other rollout benchmarks (1.24B parameters) -> the engine's fused
  Llama-family path;
- ``qwen3``: the Qwen3-0.6B shape (hidden 1024, 28 layers, 16 query / 8 key-value heads of 128, SwiGLU 3072,
  vocabulary 151936, tied embeddings; per-head RMSNorm of queries and keys) -> the fused path too;
- ``llama_as_qwen3``: a Llama of Qwen3-0.6B's dimensions (no q/k norms), our engine only: the fused path's rate
  on that shape, so that Qwen3's distance from its bound splits into its shape's (28 thin layers) and its q/k
  norms';
- ``neox``: the Pythia-1B shape of ``GPTNeoXForCausalLM`` (hidden 2048, 16 layers, 8 heads, GELU MLP 8192,
  vocabulary 50304, rotary on a quarter of each head, parallel residual) -> the generic path (the model's own
  ``forward``, its attention routed through the engine's KV cache); ``neox_compiled``, an experiment, our engine
  only: the same with the model's ``forward`` through ``torch.compile``, the cache's attention left out of the graphs
  (``graph_breaks`` lists dynamo's reasons): how much of the generic path's distance from a fused one is the
  model's eager element-wise kernels.

Per family, ``batch`` prompts of ``prompt`` random tokens, ``new`` tokens each at temperature 1 (top-p 1, no top-k,
no EOS: every row produces every token), the median of ``repeats`` calls after two untimed ones (compilation,
graph capture: :data:`WARMUP_CALLS`):

- ``ours``: :class:`ppo_core_decode.hf.HFRolloutEngine` with its defaults (``path`` says which path ran), new
  tokens/s over the whole call (prefill + decode) and over the decode steps alone (``decode_new_tokens_per_s``);
  the host's time queuing the prefill, capturing the first decode steps' graph and destroying the previous call's
  graphs (``host_prefill_s``, ``host_capture_s``, ``host_release_s``: where the first two outlast the device's
  prefill, ``prefill_s`` shows the rest; ``host_capture_s`` is 0 in a call that replayed the previous call's graphs,
  ``graphs_reused_per_call``);
- ``hf_static``: ``model.generate(..., do_sample=True, cache_implementation="static")`` (which ``transformers``
  compiles on CUDA);
- ``bound_new_tokens_per_s``: new tokens/s if each decode step only read every weight once (the weights' bytes over
  a device-to-device copy's bandwidth measured in the same run), and each rate as a percentage of it
  (``ours_pct_of_bound``, ``ours_decode_pct_of_bound``, ``hf_static_pct_of_bound``);
- ``bound_with_kv_new_tokens_per_s``: the same with the KV cache each step reads added to the weights
  (:func:`kv_bytes_per_decode_step`: at B = 64, P = 256 Qwen3-0.6B's cache, 28 layers of 8 key-value heads of 128,
  is read twice as many bytes a step as its weights, so the weights alone do not bound it), and the rates as
  percentages of it (``ours_pct_of_bound_with_kv``, ``ours_decode_pct_of_bound_with_kv``,
  ``hf_static_pct_of_bound_with_kv``); ``kv_gib_per_step``, the cache bytes of a step;
- ``ours_over_hf_static``; ``recompile_limit_hits``: the engine's compiled functions that fell back to eager during
  the family's calls (:func:`ppo_core.kernels.compiled.recompile_limit_hits`; empty when every one stayed compiled);
  ``warnings``: what ppo-core, dynamo and ``transformers``' generation logged at WARNING meanwhile (a decode step
  that could not be captured as a CUDA graph says so there).

Dynamo's caches are reset between families (``transformers`` compiles ``generate``'s forward through one code
object for every model, and dynamo keeps at most 8 graphs per code object).

Usage: ``python benchmarks/rollout_families.py [--families qwen3,llama,neox,llama_as_qwen3,neox_compiled]
[--repeats 3] [--out FILE]`` (CUDA); ``--add-kv-bound FILE [--out FILE]`` adds the KV-inclusive bound's fields
to a result written before they existed, from its own numbers (no GPU); ``--tiny`` runs a few-second smoke of the same code on the CPU (tiny shapes, B = 2, P = 8, 4 new tokens).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._hf import hf_generate_kwargs
from benchmarks._meta import emit

_QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
"""Qwen3-0.6B's dimensions (used by the Qwen3 family and by the Llama of the same shape)."""

# config kwargs of each family's ``transformers`` class (rotary settings left at their defaults: they do not change
# the work of a step)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        },
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        _QWEN3_06B,
    ),
    # Llama with Qwen3-0.6B's dimensions (no q/k norms): what the fused path gives that shape, so that Qwen3's
    # distance from its bound splits into the shape's (thin, deep layers) and the q/k norms'
    "llama_as_qwen3": (
        "LlamaForCausalLM",
        _QWEN3_06B,
    ),
    "neox": (
        "GPTNeoXForCausalLM",
        {
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 8,
            "hidden_act": "gelu",
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
            "max_position_embeddings": 2048,
        },
    ),
}
# an experiment: the generic path with the model's forward through torch.compile (our attention a graph break or a
# traced kernel, whatever dynamo makes of it): how much of the gap to a fused path the model's eager element-wise
# kernels are
FAMILIES["neox_compiled"] = FAMILIES["neox"]
COMPILED_FORWARD = {"neox_compiled"}
# --tiny: the same families shrunk to seconds on a CPU
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
TINY_HEADS = {
    "llama": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "llama_as_qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "neox": {},
    "neox_compiled": {},
}
NO_REFERENCE = {"llama_as_qwen3", "neox_compiled"}
"""Families measured with our engine only (a control of another family, not a comparison with Hugging Face)."""
WATCHED_LOGGERS = ("ppo_core", "ppo_core_decode", "torch._dynamo", "transformers.generation")


class _Warnings(logging.Handler):
    """Collects the warnings of :data:`WATCHED_LOGGERS` during a family's calls (a graph capture that failed, a
    compiled function that fell back to eager...), first lines only."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < 20:
            self.messages.append(f"{record.name}: {record.getMessage().splitlines()[0][:300]}")


def build(family: str, device: torch.device, dtype: torch.dtype, tiny: bool) -> torch.nn.Module:
    """The family's causal LM from its config, random weights (seed 0), in eval mode with its KV cache on (for
    ``generate``)."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    if tiny:
        kwargs = {**kwargs, **TINY, **TINY_HEADS[family]}
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**kwargs, use_cache=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).to(dtype=dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARMUP_CALLS = 2
"""Untimed calls before the timed ones. Our engine's first call decodes its first step eagerly and captures its
graph after it; from the second on, a call replays the previous call's graphs where the tensors they read are back
at their addresses (``graphs_reused_per_call``), else captures its first graph while the prefill runs, as a worker's
every later rollout does, and the compiled element-wise kernels of both kinds of call exist."""


def _timed(call, repeats: int, device: torch.device) -> tuple[list[float], Any, float]:
    """``repeats`` timed calls after :data:`WARMUP_CALLS` untimed ones; also the warm-up calls' seconds."""
    t0 = time.perf_counter()
    for _ in range(WARMUP_CALLS):
        out = call()
    _sync(device)
    warmup = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, out, warmup


def _report(times: list[float], tokens: int, warmup: float) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "new_tokens": tokens,
        "s_median": round(med, 4),
        "s_all": [round(t, 4) for t in times],
        "warmup_s": round(warmup, 2),
        "new_tokens_per_s": round(tokens / med, 1),
    }


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (bytes read + written over time)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each counted once (tied embeddings read once a step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Bytes of KV cache one token (one row's position) holds over the model: a key and a value of
    ``head_dim`` elements per key-value head per layer, ``2 * layers * kv_heads * head_dim * dtype_bytes``.

    Args:
        config: the model's ``transformers`` config (``num_key_value_heads`` defaults to ``num_attention_heads``,
            ``head_dim`` to ``hidden_size // num_attention_heads``, as in the models).
        dtype_bytes: bytes of one cached element (2 for bf16).
    """
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_decode_step(token_bytes: int, *, batch: int, prompt: int, new: int) -> float:
    """Mean bytes of KV cache one step of a call reads: ``batch`` rows, each reading its cached length, averaged
    over the call's ``new`` token steps, whose lengths are ``prompt, prompt + 1, ..., prompt + new - 1`` (mean
    ``prompt + (new - 1) / 2``).

    Args:
        token_bytes: one position's cache over all layers (:func:`kv_bytes_per_token`).
        batch: rows B; prompt: prompt tokens P of each row; new: tokens each row generates.
    """
    return token_bytes * batch * (prompt + (new - 1) / 2)


def add_bounds(
    entry: dict[str, Any], *, batch: int, bandwidth: float, weight_bytes: int, kv_bytes: float
) -> None:
    """Put into a family's ``entry`` both bounds (weights only; weights + ``kv_bytes`` a step) at ``bandwidth``
    bytes/s, and each measured rate (``ours``, its decode steps, ``hf_static``) as a percentage of each."""
    bounds = {"": batch * bandwidth / weight_bytes, "_with_kv": batch * bandwidth / (weight_bytes + kv_bytes)}
    entry["kv_gib_per_step"] = round(kv_bytes / 2**30, 3)
    for suffix, bound in bounds.items():
        entry[f"bound{suffix}_new_tokens_per_s"] = round(bound, 1)
    rates = {
        "ours": entry.get("ours", {}).get("new_tokens_per_s"),
        "ours_decode": entry.get("ours", {}).get("decode_new_tokens_per_s"),
        "hf_static": entry.get("hf_static", {}).get("new_tokens_per_s"),
    }
    for name, rate in rates.items():
        for suffix, bound in bounds.items():
            if rate:
                entry[f"{name}_pct_of_bound{suffix}"] = round(100 * rate / bound, 1)


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """Each family's headline numbers: its percentages of both bounds, ours over HF static, ours' rate."""
    keys = (
        "ours_pct_of_bound",
        "hf_static_pct_of_bound",
        "ours_pct_of_bound_with_kv",
        "hf_static_pct_of_bound_with_kv",
        "ours_over_hf_static",
    )
    return {
        name: {key: result[name].get(key) for key in keys}
        | {"ours_new_tokens_per_s": result[name].get("ours", {}).get("new_tokens_per_s")}
        for name in FAMILIES
        if name in result
    }


def add_kv_bound(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (this script's JSON) with the KV-inclusive bound's fields added to each family from its own
    numbers: the weight bytes from the family's config (built on the meta device), the copy bandwidth from its
    ``bound_new_tokens_per_s``, the cache bytes from ``case`` and ``dtype``."""
    case, dtype = result["case"], getattr(torch, result["dtype"])
    out = dict(result)
    for name in FAMILIES:
        if name not in result:
            continue
        model = build(name, torch.device("meta"), dtype, tiny=result.get("tiny", False))
        nbytes = weight_bytes(model)
        bandwidth = result[name]["bound_new_tokens_per_s"] * nbytes / case["batch"]
        kv = kv_bytes_per_decode_step(kv_bytes_per_token(model.config, dtype.itemsize), **case)
        entry = dict(result[name])
        add_bounds(entry, batch=case["batch"], bandwidth=bandwidth, weight_bytes=nbytes, kv_bytes=kv)
        out[name] = entry
    out["summary"] = _summary(out)
    note = "the KV-inclusive bound's fields added after the run from its own numbers (--add-kv-bound)"
    out["note"] = f"{result['note']}; {note}" if result.get("note") else note
    return out


def _prompts(batch: int, prompt: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1000 + prompt)
    ids = torch.randint(8, vocab, (batch, prompt), generator=g).to(device)
    return ids, torch.ones_like(ids)


def compile_forward(model: torch.nn.Module, backend: str) -> None:
    """Route ``model``'s calls through ``torch.compile(model.forward)`` with the engine's cached attention left out of
    the graphs (a graph break at each layer's attention: the cache's Triton attention runs as in the generic path,
    the model's element-wise work between attentions is compiled). Call it after building the engine (which
    registers its attention function) and run the engine under :func:`_room_for_layers`."""
    from transformers import AttentionInterface

    from ppo_core_decode import hf

    AttentionInterface.register(hf._ATTENTION_NAME, torch._dynamo.disable(hf._cached_attention))
    model.forward = torch.compile(model.forward, backend=backend)


def _room_for_layers() -> Any:
    """Dynamo's recompile limits raised for the block: room for one graph per layer between graph breaks."""
    return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024)


def _graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons so far (first line of each), most frequent first, at most 8."""
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        line = str(reason).splitlines()[0][:200]
        reasons[line] = reasons.get(line, 0) + n
    return dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8])


def ours(
    model: torch.nn.Module, case: dict[str, int], repeats: int, compile_backend: str | None = None
) -> dict[str, Any]:
    """The Hugging Face engine with its defaults (one engine, reused across calls as a worker does); with
    ``compile_backend`` the model's forward compiled first (:func:`compile_forward`)."""
    if compile_backend is None:
        return _ours(model, case, repeats)
    with _room_for_layers():
        report = _ours(model, case, repeats, after_build=lambda: compile_forward(model, compile_backend))
    report["graph_breaks"] = _graph_breaks()
    return report


def _ours(
    model: torch.nn.Module, case: dict[str, int], repeats: int, after_build: Any = None
) -> dict[str, Any]:
    from ppo_core.rollout import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine

    device = next(model.parameters()).device
    engine = HFRolloutEngine(model)
    if after_build is not None:
        after_build()
    ids, mask = _prompts(case["batch"], case["prompt"], model.config.vocab_size, device)
    cfg = SamplingConfig(max_new_tokens=case["new"], temperature=1.0)
    gen = torch.Generator(device=device).manual_seed(0)
    reused = []  # per call, warm-up calls first: how many of the previous call's graphs it replayed

    def call():
        out = engine.generate(ids, mask, cfg, generator=gen)
        reused.append(engine.stats.graphs_reused)
        return out

    times, out, warmup = _timed(call, repeats, device)
    s = engine.stats
    report = _report(times, int(out["response_mask"].sum()), warmup)
    report.update(
        path="fused" if engine.fast_path else "generic",
        prefill_s=round(s.prefill_s, 4),
        decode_s=round(s.decode_s, 4),
        decode_steps=s.decode_steps,
        decode_ms_per_step=round(1e3 * s.decode_s / max(s.decode_steps, 1), 3),
        decode_new_tokens_per_s=round(case["batch"] * s.decode_steps / max(s.decode_s, 1e-9), 1),
        cuda_graphs=s.cuda_graphs,
        graphs_captured=s.graphs_captured,
        graphs_reused_per_call=reused,
        host_prefill_s=round(s.host_prefill_s, 4),
        host_capture_s=round(s.host_capture_s, 4),
        host_release_s=round(s.host_release_s, 4),
    )
    engine.release()
    return report


def hf_static(model: torch.nn.Module, case: dict[str, int], repeats: int) -> dict[str, Any]:
    """``transformers``' ``generate`` with its static cache, sampling every token (no EOS)."""
    device = next(model.parameters()).device
    b, p, r = case["batch"], case["prompt"], case["new"]
    ids, mask = _prompts(b, p, model.config.vocab_size, device)
    kwargs = hf_generate_kwargs(r, static=True)
    times, out, warmup = _timed(
        lambda: model.generate(input_ids=ids, attention_mask=mask, **kwargs), repeats, device
    )
    return _report(times, b * (out.shape[1] - p), warmup)


def family(name: str, case: dict[str, int], args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """One family's entry (see the module docstring); a method that raises is reported as its error."""
    from ppo_core.kernels.compiled import recompile_limit_hits

    device = torch.device(args.device)
    torch._dynamo.reset()
    hits = len(recompile_limit_hits())
    dtype = getattr(torch, args.dtype)
    model = build(name, device, dtype, args.tiny)
    nbytes = weight_bytes(model)
    kv_bytes = kv_bytes_per_decode_step(kv_bytes_per_token(model.config, dtype.itemsize), **case)
    entry: dict[str, Any] = {
        "model": type(model).__name__,
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "weight_gib": round(nbytes / 2**30, 3),
    }
    warnings = _Warnings()
    for logger_name in WATCHED_LOGGERS:
        logging.getLogger(logger_name).addHandler(warnings)
    backend = "eager" if args.tiny else "inductor"  # a CPU smoke does not generate C++
    run_ours = functools.partial(ours, compile_backend=backend) if name in COMPILED_FORWARD else ours
    for method, run in (("ours", run_ours), ("hf_static", hf_static)):
        if method in args.skip or (method == "hf_static" and name in NO_REFERENCE):
            continue
        t0 = time.perf_counter()
        try:
            entry[method] = run(model, case, args.repeats)
        except Exception as exc:  # reported; the other methods and families still run
            entry[method] = {"error": f"{type(exc).__name__}: {exc}"}
        entry[method]["wall_s"] = round(time.perf_counter() - t0, 1)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_bounds(entry, batch=case["batch"], bandwidth=bandwidth, weight_bytes=nbytes, kv_bytes=kv_bytes)
    rate = {m: entry.get(m, {}).get("new_tokens_per_s") for m in ("ours", "hf_static")}
    if rate["ours"] and rate["hf_static"]:
        entry["ours_over_hf_static"] = round(rate["ours"] / rate["hf_static"], 2)
    entry["recompile_limit_hits"] = recompile_limit_hits()[hits:]
    for logger_name in WATCHED_LOGGERS:
        logging.getLogger(logger_name).removeHandler(warnings)
    entry["warnings"] = warnings.messages
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen3,llama,neox,llama_as_qwen3,neox_compiled")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip", default="", help="comma-separated methods to skip (ours, hf_static)")
    ap.add_argument(
        "--tiny", action="store_true", help="a smoke run on the CPU: tiny shapes, B = 2, P = 8, 4 new"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--add-kv-bound",
        default=None,
        metavar="FILE",
        help="add the KV-inclusive bound to an earlier result FILE from its own numbers (no run)",
    )
    args = ap.parse_args(argv)
    if args.add_kv_bound:
        return emit(add_kv_bound(json.loads(Path(args.add_kv_bound).read_text())), args.out)
    args.skip = set(filter(None, args.skip.split(",")))
    if args.tiny:
        args.device, args.batch, args.prompt, args.new, args.repeats = "cpu", 2, 8, 4, 1
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/rollout_families.py needs a CUDA device (or --tiny for a CPU smoke run)")
    else:
        args.device = "cuda"
    unknown = set(args.families.split(",")) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"--families: unknown {sorted(unknown)}; known: {sorted(FAMILIES)}")
    import transformers

    case = {"batch": args.batch, "prompt": args.prompt, "new": args.new}
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 2 * 2**30 if device.type == "cuda" else 2**24)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "case": case,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
        "copy_tb_per_s": round(bandwidth / 1e12, 3),
    }
    for name in args.families.split(","):
        result[name] = family(name, case, args, bandwidth)
        if args.out:  # what has run so far, in case a later family does not finish
            emit(result, args.out, quiet=True)
    result["summary"] = _summary(result)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
