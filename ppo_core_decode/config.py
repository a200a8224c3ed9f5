"""Typed configs of the KV-cached engines: the decoder's settings (:class:`CachedEngineConfig`) and the ``hf``
engine's (:class:`HFEngineConfig`), each checked once when built and building its engine.

Light on purpose: it imports no engine (the engine modules are imported by ``build``), so a job naming
``rollout.engine: hf`` with ``rollout.engine_config: {...}`` is checked before any model library loads.

Example:
    >>> HFEngineConfig(kv_bucket=64).kv_bucket
    64
    >>> HFEngineConfig(check_every=0)
    Traceback (most recent call last):
    ...
    ppo_core._checks.FieldValueError: check_every must be >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ppo_core._checks import check_int
from ppo_core.rollout.engine_config import RolloutEngineConfig

__all__ = ["CachedEngineConfig", "HFEngineConfig"]


@dataclass(kw_only=True)
class CachedEngineConfig(RolloutEngineConfig):
    """The settings of :class:`~ppo_core_decode.decoding.StaticCacheDecoder` that every KV-cached engine shares."""

    cuda_graphs: bool | None = None
    """Capture decode steps as CUDA graphs; None: when the model is on a CUDA device."""
    kv_bucket: int = 128
    """Granularity (slots) of the cache length a decode graph attends to (one graph per bucket)."""
    check_every: int = 8
    """Decode steps between two checks for "every row has finished" (each a host sync)."""
    steps_per_graph: int = 1
    """Most consecutive decode steps captured in one CUDA graph (never across a check): one launch instead of one
    a step; worth raising with ``keep_cache`` (graphs captured once for every generation of the same shapes)."""
    keep_cache: bool = False
    """Keep the KV cache and graphs for the next generation with the same shapes and settings (memory held
    between steps, also during the update)."""
    fused_decode: bool | None = None
    """Run the projections of small decode steps on CUDA through the fused Triton products
    (:func:`~ppo_core_decode.decode_linear.decode_linear`: residual adds, RMSNorms and SiLU x up in their
    epilogues); None: wherever that applies (a CUDA model on the fused path, not batch-invariant)."""

    def __post_init__(self) -> None:
        for name in ("kv_bucket", "check_every", "steps_per_graph"):
            check_int(name, getattr(self, name), 1)

    def decoder_options(self) -> dict[str, Any]:
        """The :class:`~ppo_core_decode.decoding.StaticCacheDecoder` keyword arguments."""
        return {
            "cuda_graphs": self.cuda_graphs,
            "kv_bucket": self.kv_bucket,
            "check_every": self.check_every,
            "steps_per_graph": self.steps_per_graph,
            "keep_cache": self.keep_cache,
        }


@dataclass(kw_only=True)
class HFEngineConfig(CachedEngineConfig):
    """``hf``: :class:`~ppo_core_decode.hf.HFRolloutEngine`, the static-KV-cache engine for Hugging Face causal LMs
    (the fused path for the Llama family, the model's own forward through the cache for the others)."""

    fast_path: bool | None = None
    """Use the Llama-family fused path (``llama``, ``mistral``, ``qwen2``, ``qwen3``); None: wherever the model
    supports it; True for another model is an error when the engine is built."""
    fuse_projections: bool = True
    """On the fused path, run each layer's q/k/v and gate/up projections as one GEMM each over concatenated copies
    of those weights, made at the start of every generation (about half the weights again in memory while
    sampling, none during the update)."""

    def build(self, model: nn.Module, sampling: Any) -> Any:
        """An :class:`~ppo_core_decode.hf.HFRolloutEngine` on ``model`` with ``sampling.batch_invariant``."""
        from ppo_core_decode.hf import HFRolloutEngine

        return HFRolloutEngine(
            model,
            fast_path=self.fast_path,
            fuse_projections=self.fuse_projections,
            batch_invariant=bool(sampling.batch_invariant),
            fused_decode=self.fused_decode,
            **self.decoder_options(),
        )
