"""KV-cached, graph-captured decoding of Hugging Face causal LMs (the rollout engine of the torch workers).

Two ways to run a ``transformers`` model through :class:`~ppo_core_decode.kv_cache.KVCache`:

- **Llama-family fast path** (``llama``, ``mistral``, ``qwen2``, ``qwen3`` model types with SiLU MLPs and full
  attention): the decoder layers are evaluated from the model's own modules and weights, the element-wise steps
  (RMSNorm, residual add + RMSNorm, rotary embedding, SwiGLU) each one compiled kernel on CUDA that rounds as the
  model's eager forward does, and by default the q/k/v and gate/up projections as one GEMM each over weights
  concatenated for the rollout (``fuse_projections``), so a decode step is about 11 kernels per layer. The rotary
  tables come from the model's own ``rotary_emb`` (any ``rope_scaling`` it supports). The model's own arithmetic:
  on the CPU the same tokens and log-probs as its own modules through the cache, bit for bit, in fp32 and bf16. On
  CUDA in half precision a forward of several tokens (the prefill) adds the residual in the output and down
  projections' GEMMs (``addmm``) and normalises the sum alone, where the model adds the rounded product in a kernel
  of its own (:meth:`~ppo_core_decode.decoder_loop.DecoderLayerLoop._adds_residual_in_products`; the decode step's
  products add in their epilogues).
- **Any other causal LM** whose attention goes through ``transformers``' attention interface: its own
  ``forward`` with a registered attention function that reads and writes the cache (``use_cache=False``: the
  model keeps no cache of its own). Correct for every such model, with the model's own (unfused) element-wise
  kernels: the generic path is the engine's reference loop (CUDA graphs, the cache's attention and the engine's
  sampler, no per-family fusion), not a fused path; ``docs/performance.md`` ("Rollout by model family") has its
  speed against Hugging Face's own ``generate``.

Both return the logits of the last position only (the prefill does not project every prompt position onto the
vocabulary), in the model's dtype: sampling reads them in fp32.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    >>> engine = HFRolloutEngine(lm)
    >>> engine.fast_path
    True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppo_core.rollout.registry import hf_causal_lm as _hf_causal_lm
from ppo_core_decode.batch_invariant import invariant_linear, invariant_rms_norm
from ppo_core_decode.decode_linear import (
    decode_linear_available,
    fold_norm_weights_all,
)
from ppo_core_decode.decoder_loop import Attend, DecoderLayerLoop, StepWeights, add_linear_, split_qkv
from ppo_core_decode.decoding import CachedRolloutEngine, ModelSpec
from ppo_core_decode.eager_rounding import (
    heads_rms_norm_as_model,
    rotary_as_model,
)
from ppo_core_decode.elementwise_launch import engine_rms_norm, engine_silu_mul
from ppo_core_decode.kv_cache import KVCache

__all__ = [
    "HFRolloutEngine",
    "hf_engine",
    "supports_fast_path",
    "unsupported_attention",
]

logger = logging.getLogger(__name__)

_FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION_NAME = "ppo_core_kv_cache"


def supports_fast_path(model: nn.Module) -> bool:
    """Whether ``model`` is a Llama-family ``*ForCausalLM`` the fused decode path evaluates exactly."""
    cfg = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if cfg is None or body is None or not hasattr(model, "lm_head"):
        return False
    if getattr(cfg, "model_type", None) not in _FAST_MODEL_TYPES or getattr(cfg, "hidden_act", "") != "silu":
        return False
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    if getattr(cfg, "use_sliding_window", False) or (
        cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None
    ):
        return False
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(body, name) for name in needed)


def _concatenated_all(
    groups: Sequence[
        tuple[tuple[nn.Linear, ...], tuple[torch.Tensor, torch.Tensor | None] | None, torch.Tensor | None]
    ],
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """For every ``(layers, out, scale)`` group: the weights of ``layers`` stacked along their outputs, and their
    biases (zeros for one without, None when none has one); written into ``out`` (weight, bias) when given. With
    ``scale [K]`` each weight's columns are multiplied by it as they are copied: the scaled stacks of all groups in
    one :func:`~ppo_core_decode.decode_linear.fold_norm_weights_all` (one Triton launch on CUDA)."""
    weights, folds = [], []
    for layers, out, scale in groups:
        weight_out = out[0] if out is not None else None
        if scale is None:
            weights.append(torch.cat([layer.weight for layer in layers], out=weight_out))
            continue
        if weight_out is None:
            rows = sum(layer.weight.shape[0] for layer in layers)
            weight_out = layers[0].weight.new_empty(rows, scale.shape[0])
        folds.append((weight_out, scale, [layer.weight for layer in layers]))
        weights.append(weight_out)
    fold_norm_weights_all(folds)
    built: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for (layers, out, _), weight in zip(groups, weights, strict=True):
        if all(layer.bias is None for layer in layers):
            built.append((weight, None))
            continue
        biases = [
            layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.weight.shape[0])
            for layer in layers
        ]
        built.append((weight, torch.cat(biases, out=out[1] if out is not None else None)))
    return built


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q [B, S, H, d]`` and ``k [B, S, G, d]`` as one view ``[B, S, H + G, d]`` of the memory they share, where
    ``k``'s heads follow ``q``'s with the same row strides (the ``[q; k; v]`` product split by
    :func:`~ppo_core_decode.decoder_loop.split_qkv`); None otherwise. A size-1 dim's stride addresses nothing and
    is not compared."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or q.device != k.device:
        return None
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return None
    d = q.shape[3]
    strides = (q.stride(0), q.stride(1), d, 1)
    for t in (q, k):
        if any(n > 1 and st != want for n, st, want in zip(t.shape, t.stride(), strides, strict=True)):
            return None
    same_memory = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    if not same_memory or k.storage_offset() != q.storage_offset() + q.shape[2] * d:
        return None
    return q.as_strided((*q.shape[:2], q.shape[2] + k.shape[2], d), strides, q.storage_offset())


def _projection_groups(layer: nn.Module) -> tuple[tuple[nn.Linear, ...], tuple[nn.Linear, ...]]:
    """A decoder layer's projections that run as one GEMM each: q/k/v, and gate/up."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


class _LlamaFamilyForward(DecoderLayerLoop):
    """The fused cached forward of a Llama-family model (see the module docstring).

    With ``fuse_projections`` each layer's query/key/value projections run as one GEMM, and its gate/up projections
    as another, over weights concatenated by :meth:`refresh` from the model's own (at the start of every
    generation, so they follow the training updates); small decode GEMMs are latency-bound, so one launch over
    the concatenation costs little more than the largest of its parts.
    """

    residual_in_products = True

    def __init__(
        self,
        model: nn.Module,
        fuse_projections: bool = True,
        batch_invariant: bool = False,
        fused_decode: bool = False,
    ) -> None:
        self.body, self.lm_head, cfg = model.model, model.lm_head, model.config
        self.batch_invariant = batch_invariant
        self.fused_decode = fused_decode
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.fuse_projections = fuse_projections
        # per layer: q/k/v weight and bias, gate/up weight and bias (a bias None when the model has none)
        self._fused: list[list[torch.Tensor | None]] | None = None
        # per layer and group: whether refresh() asked for a rebuild that has not run yet
        self._stale: list[list[bool]] = []
        # with fused_decode: the norms whose weights refresh() folds into the concatenated weights
        self._folded_norms = (
            {
                id(n)
                for layer in self.body.layers
                for n in (layer.input_layernorm, layer.post_attention_layernorm)
            }
            if fused_decode
            else set()
        )
        self._ones: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # (cache length, device, dtype) and cos | sin [L, 2d] of every position of the cache (made by the prefill)
        self._rotary_table: tuple[tuple | None, torch.Tensor | None] = (None, None)

    def refresh(self) -> None:
        """Mark the concatenated weights stale: each group is (re)built from the model's current weights at its
        first use in the next forward (:meth:`_group`), in place when it exists (a kept CUDA graph reads it at a
        fixed address); with ``fused_decode`` the weight of the norm before each group is folded into its columns
        as they are copied, and the forward normalises without it (:meth:`_norm_weight`).

        Built at first use, a layer's groups are queued just before its prefill: the host builds layer ``i + 1``'s
        while the device runs layer ``i``, instead of the device idling through all of them before the prefill.
        With ``fused_decode`` every layer's groups are built at the first layer's first use, their folds in one
        launch (:func:`~ppo_core_decode.decode_linear.fold_norm_weights_all`): one launch costs the host less than
        two a layer, and the device runs the folds while the host queues the first layer."""
        if not self.fuse_projections:
            return
        if self._fused is None:
            self._fused = [[None] * 4 for _ in self.body.layers]
        self._stale = [[True, True] for _ in self.body.layers]

    def _group(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s concatenated weight and bias of group ``j`` (0: q/k/v, 1: gate/up), built first if
        :meth:`refresh` marked it stale: with ``fused_decode`` every stale group of every layer at once (their
        norm-weight folds in one launch), else this group alone."""
        if self._stale[i][j]:
            stale = (
                [(a, b) for a, pair in enumerate(self._stale) for b, is_stale in enumerate(pair) if is_stale]
                if self.fused_decode
                else [(i, j)]
            )
            groups = []
            for a, b in stale:
                layer = self.body.layers[a]
                have = self._fused[a][2 * b]
                out = None if have is None else (have, self._fused[a][2 * b + 1])
                norm = (layer.input_layernorm, layer.post_attention_layernorm)[b]
                scale = norm.weight if self.fused_decode else None
                groups.append((_projection_groups(layer)[b], out, scale))
            with torch.no_grad():
                built = _concatenated_all(groups)
            for (a, b), pair in zip(stale, built, strict=True):
                self._fused[a][2 * b : 2 * b + 2] = pair
                self._stale[a][b] = False
        return self._fused[i][2 * j], self._fused[i][2 * j + 1]

    def free(self) -> None:
        """Drop the concatenated weights (the rotary table, ``L x 2d`` entries computed from the positions alone, is
        kept for the next generation of the same cache length)."""
        self._fused = None

    def _norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """``norm``'s weight, or ones when :meth:`refresh` folded it into the product after it (multiplying by one
        rounds nothing, so the norm is the model's but for its weight)."""
        weight = norm.weight
        if self._fused is None or id(norm) not in self._folded_norms:
            return weight
        ones = self._ones.get((weight.dtype, weight.device))
        if ones is None or ones.shape != weight.shape:
            ones = torch.ones_like(weight)
            self._ones[(weight.dtype, weight.device)] = ones
        return ones

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return invariant_linear(x, weight, bias) if self.batch_invariant else F.linear(x, weight, bias)

    def _layer(
        self,
        x: torch.Tensor,
        layer: nn.Linear,
        residual: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> torch.Tensor:
        """``layer(x)``, or ``residual`` plus it (one GEMM where the layer has no bias, see :func:`add_linear_`)."""
        if residual is None:
            return self._linear(x, layer.weight, layer.bias)
        if layer.bias is None:
            return add_linear_(residual, x, layer.weight, inplace=inplace)
        return residual + self._linear(x, layer.weight, layer.bias)

    def _rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_rms_norm(x, norm.weight, norm.variance_epsilon)
        return engine_rms_norm(x, self._norm_weight(norm), norm.variance_epsilon)

    def _add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, ...]:
        if self.batch_invariant:
            return invariant_rms_norm(h, norm.weight, norm.variance_epsilon, delta=delta)
        return engine_rms_norm(h, self._norm_weight(norm), norm.variance_epsilon, delta=delta)

    def _qk_norms(
        self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorms of ``q [B, S, H, d]`` and ``k [B, S, G, d]``: one kernel over both where they
        are adjacent in memory (views of the fused q/k/v product, :func:`_adjacent_heads`), else one each."""
        q_norm, k_norm = attn.q_norm, attn.k_norm
        both = None
        if not self.batch_invariant and q_norm.variance_epsilon == k_norm.variance_epsilon:
            both = _adjacent_heads(q, k)
        if both is None:
            return self._rms_norm(q, q_norm), self._rms_norm(k, k_norm)
        h = q.shape[2]
        out = heads_rms_norm_as_model(both, q_norm.weight, k_norm.weight, h, q_norm.variance_epsilon)
        return out[:, :, :h], out[:, :, h:]

    def _qk_norm_in_kernel(
        self, attn: nn.Module, cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Qwen3's q/k norms as the rotation kernel's ``qk_norm`` (``q [B, S, H, d]``, ``k``/``v [B, S, G, d]``):
        where a kernel rotates (:meth:`~ppo_core_decode.kv_cache.KVCache.rotates_in_kernel`: a prefill, a decode
        step, the one-launch decode step), the norms share one epsilon and their weights are contiguous in the
        model dtype; None otherwise (the norms run before it, :meth:`_qk_norms`). A launch a layer less, and in a
        prefill a pass over the queries and keys less."""
        q_norm, k_norm = attn.q_norm, attn.k_norm
        weights = (q_norm.weight, k_norm.weight)
        if (
            self.batch_invariant
            or q_norm.variance_epsilon != k_norm.variance_epsilon
            or any(w.dtype != q.dtype or not w.is_contiguous() for w in weights)
            or not cache.rotates_in_kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        ):
            return None
        return q_norm.weight, k_norm.weight, q_norm.variance_epsilon

    def _projections(self, i: int, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._fused is not None:
            return self._split_qkv(self._linear(x, *self._group(i, 0)))
        attn = layer.self_attn
        shape = (*x.shape[:2], -1, self.head_dim)
        return tuple(self._layer(x, proj).view(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(qkv, self.heads, self.kv_heads, self.head_dim)

    def _gate_up(self, i: int, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused is not None:
            return self._linear(x, *self._group(i, 1)).chunk(2, dim=-1)
        return self._layer(x, layer.mlp.gate_proj), self._layer(x, layer.mlp.up_proj)

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return engine_silu_mul(gate, up)

    def _down_projection(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.down_proj

    def _output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn.o_proj

    def _residual_product(
        self, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        return self._layer(x, linear, residual, inplace)

    def _fused_step_applies(self, h: torch.Tensor) -> bool:
        return (
            self.fused_decode and self._fused is not None and decode_linear_available(h, self._group(0, 0)[0])
        )

    def _layers(self) -> nn.ModuleList:
        return self.body.layers

    def _norms(self, layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        return layer.input_layernorm, layer.post_attention_layernorm

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(input_ids)

    def _rotary(
        self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary tables at ``positions [B, S]``, in its dtype as its forward uses them: ``cos``,
        ``sin`` ``[B, S, d]``. The prefill also tabulates every position of the cache once (the model's module on
        ``0 .. L - 1``: each entry is computed from its position alone, so it is the same bits), and a decode step
        gathers its rows from that table (one kernel instead of about ten)."""
        rotary = self.body.rotary_emb
        # rope types whose frequencies depend on the longest position seen are computed per call
        static = "dynamic" not in rotary.rope_type and rotary.rope_type != "longrope"
        like = h[:0]  # the module reads only its device and dtype
        if not static:
            return rotary(like, positions)
        key = (cache.length, h.device, h.dtype)
        if self._rotary_table[0] != key:
            cos, sin = rotary(like, torch.arange(cache.length, device=h.device)[None])
            self._rotary_table = (key, torch.cat([cos[0], sin[0]], dim=-1))  # [L, 2d]
        rows = self._rotary_table[1][positions]  # [B, S, 2d]
        return rows.chunk(2, dim=-1)

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> Attend:
        b = positions.shape[0]
        cos, sin = self._rotary(h, positions, cache)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, S, 1, d]
        cos_bhsd, sin_bhsd = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, 1, S, d], against [B, H, S, d]

        def attend(
            i: int, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            attn = layer.self_attn
            qk_norm = None
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm of queries and keys before the rotation
                qk_norm = self._qk_norm_in_kernel(attn, cache, q, k, v)
                if qk_norm is None:
                    q, k = self._qk_norms(attn, q, k)
            # the rotation (and, on CUDA, the cache write with it in one kernel) in the model's rounding
            out = cache.attend_rotated(
                i,
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                lambda q, k: rotary_as_model(q, k, cos_bhsd, sin_bhsd),
                lambda: (cos[:, :, 0], sin[:, :, 0]),
                attn.scaling,
                model_rounding=True,
                qk_norm=qk_norm,
            )
            return out.transpose(1, 2).reshape(b, out.shape[2], -1)  # S or, attending the last query only, 1

        return attend

    def _logits(self, h_last: torch.Tensor, delta_last: torch.Tensor | None) -> torch.Tensor:
        last = self._rms_norm(h_last if delta_last is None else h_last + delta_last, self.body.norm)
        if self.batch_invariant:
            return self._layer(last, self.lm_head)
        return self.lm_head(last)  # model dtype: sampling reads it in fp32 (no [B, V] fp32 copy)

    # ----- the fused decode step's hooks (DecoderLayerLoop._decode_step): the norms' weights are folded into the
    # concatenated q/k/v and gate/up weights by refresh(); the final norm's, never folded into the vocabulary's
    # weight, is in the head's epilogue where its dtype allows

    def _step_weights(self, i: int, layer: nn.Module) -> StepWeights:
        (qkv_w, qkv_b), (gate_up_w, gate_up_b) = self._group(i, 0), self._group(i, 1)
        attn, mlp = layer.self_attn, layer.mlp
        return StepWeights(
            qkv_w,
            qkv_b,
            attn.o_proj.weight,
            attn.o_proj.bias,
            gate_up_w,
            gate_up_b,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
        )

    def _folds_norms(self) -> bool:
        return True

    def _norm_eps(self, norm: nn.Module) -> float:
        return norm.variance_epsilon

    def _final_norm(self) -> nn.Module:
        return self.body.norm

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.lm_head.weight, self.lm_head.bias

    def _final_norm_in_head(self, h: torch.Tensor) -> bool:
        final = self.body.norm
        return final.weight.dtype == h.dtype and final.weight.is_contiguous()


class _GenericForward:
    """The model's own ``forward``, its attention routed through the cache by a registered attention function."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.attention_modules = [
            m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
        ]
        if not self.attention_modules:
            raise ValueError(
                f"{type(model).__name__} has no attention modules with a layer_idx; it cannot be decoded with "
                "ppo-core's KV cache (pass use_cache=False to recompute instead)"
            )
        _register_attention()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        for module in self.attention_modules:
            module._ppo_core_kv_cache = cache
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1]

    def attention_implementation(self) -> _AttentionSwitch:
        return _AttentionSwitch(self.model)


class _AttentionSwitch:
    """Within the block the model's attention implementation is the cached one; restored on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.previous: str | None = None

    def __enter__(self) -> None:
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(_ATTENTION_NAME)

    def __exit__(self, *exc: object) -> None:
        self.model.set_attn_implementation(self.previous)
        for module in self.model.modules():
            module.__dict__.pop("_ppo_core_kv_cache", None)


def _cached_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention-interface function: ``query [B, H, S, d]``, ``key``/``value [B, G, S, d]`` ->
    ``[B, S, H, d]`` through the module's current :class:`KVCache`, with the layer's sliding window
    (``sliding_window``) if it has one. What the cache's attention does not compute (soft-capped scores,
    attention sinks) is refused by name rather than left out (:func:`unsupported_attention` says so before a
    generation starts, for the models it knows)."""
    refused = [name for name in _REFUSED_ATTENTION_ARGUMENTS if kwargs.get(name) is not None]
    if refused:
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}) calls its attention with "
            f"{', '.join(f'{n} ({_REFUSED_ATTENTION_ARGUMENTS[n]})' for n in refused)}, which the hf rollout engine's "
            "cached attention does not compute; sample this model with the reference engine "
            "(rollout.engine: reference; SamplingConfig(engine='reference'))"
        )
    cache: KVCache = module._ppo_core_kv_cache
    out = cache.attend(module.layer_idx, query, key, value, scaling, window=kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


# attention-interface arguments the cached attention does not compute: their meaning, for the refusal
_REFUSED_ATTENTION_ARGUMENTS = {
    "softcap": "soft-capped attention scores",
    "s_aux": "attention sinks",
}


def unsupported_attention(model: nn.Module) -> str | None:
    """Why the ``hf`` engine cannot sample ``model`` exactly (a ``transformers`` causal LM), or None: its attention
    soft-caps its scores (Gemma 2's ``attn_logit_softcapping``) or has attention sinks (GPT-OSS's ``sinks``), which
    the engine's cached attention does not compute. ``auto`` then picks the reference engine (the model's own
    cache). Sliding windows are computed (:meth:`KVCache.attend`'s ``window``)."""
    cfg = getattr(model, "config", None)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"its attention soft-caps its scores (config.attn_logit_softcapping={softcap})"
    if any(
        isinstance(getattr(m, "sinks", None), torch.Tensor)
        for m in model.modules()
        if hasattr(m, "layer_idx")
    ):
        return "its attention has attention sinks (a `sinks` parameter in its attention modules)"
    return None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION_NAME, _cached_attention)


class HFRolloutEngine(CachedRolloutEngine):
    """Rollout engine for a Hugging Face causal LM (``*ForCausalLM``), colocated with its training: it decodes
    with the very module the actor trains (no weight copy, nothing to synchronise).

    Args:
        model: the causal LM (its ``config`` tells the shapes), or a wrapper holding it as ``.model`` (such as
            :class:`ppo_core.models.hf.HFCausalLM`).
        fast_path: use the Llama-family fused path; None: when :func:`supports_fast_path`.
        fuse_projections: on the fused path, run each layer's q/k/v and gate/up projections as one GEMM each,
            over concatenated copies of those weights made at the start of every generation and dropped after
            it (unless ``keep_cache``): about half the weights of a Llama-shaped model more memory while
            sampling, none during the update.
        batch_invariant: on the fused path, compute every GEMM, RMSNorm and attention with the batch-invariant
            functions of :mod:`ppo_core_decode.batch_invariant`: each row's logits do not depend on the other
            rows, so cached decoding equals a full recomputation (:meth:`recompute_logits`) bit for bit, and a
            prompt's response does not depend on its batch. Slower (GEMMs in 64-row chunks, attention query by
            query); off by default.
        fused_decode: on the fused path, run the projections of decode steps of up to
            :data:`~ppo_core_decode.decode_linear.MAX_ROWS` rows on CUDA through
            :func:`~ppo_core_decode.decode_linear.decode_linear`: residual adds, RMSNorms and SiLU x up in the
            products' epilogues (its roundings: see that module). The norms' weights are folded into the concatenated
            q/k/v and gate/up weights as they are copied, so it costs no memory beyond ``fuse_projections``. None:
            wherever it applies (the fused path with ``fuse_projections``, no ``batch_invariant``, a CUDA model).
        cuda_graphs, kv_bucket, check_every, steps_per_graph, keep_cache: see
            :class:`~ppo_core_decode.decoding.StaticCacheDecoder`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        fast_path: bool | None = None,
        fuse_projections: bool = True,
        batch_invariant: bool = False,
        fused_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        kv_bucket: int = 128,
        check_every: int = 8,
        steps_per_graph: int = 1,
        keep_cache: bool = False,
    ) -> None:
        hf_model = _hf_causal_lm(model)
        if hf_model is None:
            raise TypeError(
                f"HFRolloutEngine needs a transformers causal LM (or a wrapper holding one as .model), got "
                f"{type(model).__name__}"
            )
        model = hf_model
        cfg = model.config
        reason = unsupported_attention(model)
        if reason is not None:
            raise ValueError(
                f"the hf rollout engine cannot sample {type(model).__name__} exactly: {reason}; use the reference "
                "engine (rollout.engine: reference, or auto, which picks it for this model)"
            )
        self.model = model
        self.fast_path = supports_fast_path(model) if fast_path is None else bool(fast_path)
        if self.fast_path and not supports_fast_path(model):
            raise ValueError(
                f"fast_path=True but {type(model).__name__} is not a supported Llama-family model"
            )
        if batch_invariant and not self.fast_path:
            raise ValueError(
                "batch_invariant=True needs the Llama-family fused path (fast_path); "
                f"{type(model).__name__} runs through its own forward"
            )
        applies = self.fast_path and fuse_projections and not batch_invariant
        if fused_decode is None:
            fused_decode = applies and next(model.parameters()).device.type == "cuda"
        elif fused_decode and not applies:
            raise ValueError(
                "fused_decode=True needs the Llama-family fused path with fuse_projections=True and "
                "batch_invariant=False"
            )
        self.batch_invariant = bool(batch_invariant)
        self._forward = (
            _LlamaFamilyForward(model, fuse_projections, self.batch_invariant, bool(fused_decode))
            if self.fast_path
            else _GenericForward(model)
        )
        heads = cfg.num_attention_heads
        param = next(model.parameters())
        spec = ModelSpec(
            layers=cfg.num_hidden_layers,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            dtype=param.dtype,
            device=param.device,
        )
        options = {
            "cuda_graphs": cuda_graphs,
            "kv_bucket": kv_bucket,
            "check_every": check_every,
            "steps_per_graph": steps_per_graph,
        }
        self._init_decoder(model, self._forward, spec, cfg.vocab_size, keep_cache=keep_cache, **options)

    def _runs_module_forwards(self) -> bool:
        # the Llama-family path applies its own functions to the weights (the embedding and rotary modules it calls
        # behave alike in both modes); the generic path runs the model's forward, dropout included
        return not self.fast_path

    def _forwarding(self, length: int) -> contextlib.AbstractContextManager:
        if isinstance(self._forward, _GenericForward):
            return self._forward.attention_implementation()
        return self._fused_weights()

    @contextlib.contextmanager
    def _fused_weights(self) -> Iterator[None]:
        """The concatenated projections of this generation, from the current weights; dropped after it unless the
        decoder keeps its cache (its graphs read them)."""
        self._forward.refresh()
        try:
            yield
        finally:
            if not self.decoder.keep_cache:
                self._forward.free()

    def release(self) -> None:
        """Free the KV cache, graphs and concatenated weights kept by ``keep_cache=True``."""
        super().release()
        if isinstance(self._forward, _LlamaFamilyForward):
            self._forward.free()


def hf_engine(model: nn.Module, config: Any) -> HFRolloutEngine:
    """Deprecated (the registry's ``hf`` entry is :class:`~ppo_core_decode.config.HFEngineConfig`): the engine of
    ``HFEngineConfig().build(model, config)``, :class:`HFRolloutEngine` with ``config.batch_invariant``."""
    from ppo_core_decode.config import HFEngineConfig

    return HFEngineConfig().build(model, config)
