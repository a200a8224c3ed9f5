"""KV-cached, graph-captured decoding of the actor's megatron-core ``GPTModel`` (the megatron rollout engine).

The model decodes with its own weights (the actor's, no copy: verl's "hybrid engine"), in one of two ways:

- **its own forward** (the default where :func:`own_forward_unsupported` finds
  nothing, without ``batch_invariant``): :class:`~ppo_core_decode.megatron.MegatronDecodeForward`
  evaluates megatron's layers from their weights in place, residual adds fused with the norms after them and the
  query a view of the q/k/v GEMM's output (about three kernels per layer fewer than megatron's forward, the same
  numbers); at TP = 1 on CUDA its decode steps run through
  :func:`~ppo_core_decode.decode_linear.decode_linear` with the element-wise steps in the products' epilogues
  (``fused_decode``: five launches a layer, other roundings of the norms);
- **megatron's forward**: every :class:`~ppo_core.workers.megatron.model.SDPACoreAttention` is pointed at a
  :class:`~ppo_core_decode.kv_cache.KVCache` for the duration of a generation, rotates the new tokens by their
  per-row positions and attends through the cache; everything else (embedding, fused norms, projections and their
  tensor-parallel reductions, SwiGLU, residual adds, output layer) is ``GPTModel.forward``.

Both project only the last position onto the vocabulary (``logits_window``), and with tensor parallelism the
vocabulary shards ``[B, V/TP]`` are gathered so that every TP rank draws the same token from the same generator.
Decode steps are captured as CUDA graphs by :class:`~ppo_core_decode.decoding.StaticCacheDecoder` (NCCL
collectives are captured with them).

With ``batch_invariant=True`` (TP = 1) the engine computes with the batch-invariant functions of
:mod:`ppo_core_decode.batch_invariant` for the duration of a generation (or of ``recompute_logits``):
every linear layer's product (megatron's ``_forward_impl``) in fixed 64-row chunks, every :class:`FusedNorm` row by
row (RMSNorm; LayerNorm on fixed 64-row chunks), attention query by query. A row's logits then do not depend on the other rows, and cached
decoding equals a full recomputation through the same functions (``recompute_logits``) bit for bit. (With TP > 1 the all-reduce of a
row-parallel layer sums the ranks' partial products in an order set by the message size, which differs between a
decode step and a prefill: refused.)

Limits: pipeline parallelism (a stage holds only some layers) and sequence parallelism (one token per row cannot be
split over the TP ranks) are rejected with a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppo_core.workers.megatron.config import TP_NOT_INVARIANT, MegatronModelConfig
from ppo_core.workers.megatron.fused import FusedNorm
from ppo_core.workers.megatron.model import SDPACoreAttention, logits_window
from ppo_core_decode.batch_invariant import invariant_linear, invariant_rms_norm, invariant_rows
from ppo_core_decode.decoding import CachedRolloutEngine, ModelSpec
from ppo_core_decode.kv_cache import KVCache
from ppo_core_decode.megatron import MegatronDecodeForward, gather_vocabulary

__all__ = ["TP_NOT_INVARIANT", "MegatronRolloutEngine", "megatron_engine", "own_forward_unsupported"]


def own_forward_unsupported(module: nn.Module, config: MegatronModelConfig) -> str | None:
    """Why :class:`MegatronDecodeForward` cannot evaluate ``module`` (a ``GPTModel`` of ``config``), or None when it
    can.

    It evaluates pre-norm RMSNorm decoders with a SwiGLU MLP, no biases except an optional one on ``linear_qkv``,
    rotary positions applied by :class:`SDPACoreAttention` (or none), and an output layer (an actor). Not
    supported: ``model.norm="LayerNorm"`` (no fused residual add + LayerNorm kernel here), a critic's value head
    (it decodes nothing), and megatron options the configs of ppo-core do not set (MoE, q/k norms, fp32 or
    post-norm residuals, learned absolute positions, biases on the other linear layers, clamped or offset GLU).
    """
    tc = module.config
    if config.norm != "RMSNorm":
        return f"model.norm={config.norm!r}: the fused residual add + norm is RMSNorm's only"
    options = {
        "num_moe_experts": None,
        "qk_layernorm": False,
        "fp32_residual_connection": False,
        "apply_residual_connection_post_layernorm": False,
        "add_bias_linear": False,
        "multi_latent_attention": False,
        "use_te_activation_func": False,
        "activation_func_clamp_value": None,
    }
    for name, supported in options.items():
        if getattr(tc, name, supported) != supported:
            return f"the transformer config sets {name}={getattr(tc, name)!r}"
    if not tc.gated_linear_unit or tc.activation_func is not F.silu or getattr(tc, "glu_linear_offset", 0.0):
        return "the MLP is not SwiGLU (gated_linear_unit with F.silu and no offset)"
    embedding = getattr(module, "embedding", None)
    if embedding is None or getattr(embedding, "add_position_embedding", False):
        return "the model has no embedding, or learned absolute position embeddings"
    output = getattr(module, "output_layer", None)
    if output is None or not hasattr(output, "logits_window"):
        return "the model has no vocabulary output layer (a critic, or sequence parallelism)"
    decoder = getattr(module, "decoder", None)
    if decoder is None or not isinstance(getattr(decoder, "final_layernorm", None), FusedNorm):
        return "the decoder has no FusedNorm final norm"
    for layer in decoder.layers:
        norms = (layer.input_layernorm, layer.pre_mlp_layernorm)
        if not all(isinstance(norm, FusedNorm) for norm in norms):
            return "a layer's norms are not FusedNorm"
        if not isinstance(layer.self_attention.core_attention, SDPACoreAttention):
            return "a layer's core attention is not SDPACoreAttention (model.attention='sdpa')"
    return None


class MegatronRolloutEngine(CachedRolloutEngine):
    """Rollout engine over this rank's megatron ``GPTModel`` (see the module docstring).

    Args:
        module: the ``GPTModel`` (without its DDP wrapper), built with ``attention="sdpa"``.
        config: its :class:`~ppo_core.workers.megatron.config.MegatronModelConfig`.
        tp_group: the tensor-parallel process group (None when TP = 1).
        tp_size: tensor-parallel size.
        batch_invariant: compute with batch-invariant numerics (see the module docstring; TP = 1 only), through
            megatron's forward.
        own_forward: decode with :class:`~ppo_core_decode.megatron.MegatronDecodeForward` (True), or with
            megatron's ``GPTModel.forward`` (False); None: the former unless ``batch_invariant`` or the model is
            one it does not evaluate (:func:`own_forward_unsupported`).
        fused_decode: with the own forward at TP = 1, run the products of decode steps of up to
            :data:`~ppo_core_decode.decode_linear.MAX_ROWS` rows on CUDA through
            :func:`~ppo_core_decode.decode_linear.decode_linear` (residual adds, RMSNorms and SiLU x up in their
            epilogues; five launches a layer); None: wherever that holds.
        fold_norms: with ``fused_decode``, copy the q/k/v and ``linear_fc1`` weights with the norm before each
            folded in for generations of up to ``MAX_ROWS`` rows (about half the weights again in memory; a
            shorter decode step); False copies no weight (see :mod:`~ppo_core_decode.megatron`).
        cuda_graphs, kv_bucket, check_every, steps_per_graph, keep_cache: see
            :class:`~ppo_core_decode.decoding.StaticCacheDecoder`.
    """

    def __init__(
        self,
        module: nn.Module,
        config: MegatronModelConfig,
        *,
        tp_group: Any = None,
        tp_size: int = 1,
        batch_invariant: bool = False,
        own_forward: bool | None = None,
        fused_decode: bool | None = None,
        fold_norms: bool = True,
        cuda_graphs: bool | None = None,
        kv_bucket: int = 128,
        check_every: int = 8,
        steps_per_graph: int = 1,
        keep_cache: bool = False,
    ) -> None:
        tc = module.config
        if getattr(tc, "pipeline_model_parallel_size", 1) > 1:
            raise ValueError("the megatron rollout engine needs pipeline_model_parallel_size=1")
        if getattr(tc, "sequence_parallel", False):
            raise ValueError("the megatron rollout engine does not support sequence_parallel=True")
        self.attention = [m for m in module.modules() if isinstance(m, SDPACoreAttention)]
        if len(self.attention) != config.num_layers:
            raise ValueError(
                f"expected {config.num_layers} SDPACoreAttention layers (model.attention='sdpa'), found "
                f"{len(self.attention)}"
            )
        for index, layer in enumerate(self.attention):
            layer.kv_cache_layer = index
        if config.kv_heads % tp_size:
            raise ValueError(f"num_query_groups ({config.kv_heads}) must be divisible by tp_size ({tp_size})")
        if batch_invariant and tp_size > 1:
            raise ValueError(f"batch_invariant=True needs tp_size = 1, got {tp_size}: {TP_NOT_INVARIANT}")
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.batch_invariant = bool(batch_invariant)
        self._linears = [
            m for m in module.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]
        self._norms = [m for m in module.modules() if isinstance(m, FusedNorm)]
        self.config = config
        self.tp_group, self.tp_size = tp_group, tp_size
        unsupported = own_forward_unsupported(module, config)
        if own_forward is None:
            own_forward = not self.batch_invariant and unsupported is None
        elif own_forward and self.batch_invariant:
            raise ValueError("own_forward=True computes without batch invariance; pass batch_invariant=False")
        elif own_forward and unsupported is not None:
            raise ValueError(
                f"own_forward=True but MegatronDecodeForward cannot evaluate this model: {unsupported}"
            )
        self.own_forward = bool(own_forward)
        device = next(module.parameters()).device
        if fused_decode is None:
            fused_decode = self.own_forward and tp_size == 1 and device.type == "cuda"
        elif fused_decode and (not self.own_forward or tp_size > 1):
            raise ValueError(
                "fused_decode=True needs the engine's own forward (own_forward) and tp_size = 1 (the residual add "
                f"follows the all-reduce of a row-parallel product); got own_forward={self.own_forward}, "
                f"tp_size={tp_size}"
            )
        self.fused_decode = bool(fused_decode)
        self._own = (
            MegatronDecodeForward(
                module,
                config,
                tp_group=tp_group,
                tp_size=tp_size,
                fused_decode=self.fused_decode,
                fold_norms=fold_norms,
            )
            if own_forward
            else None
        )
        spec = ModelSpec(
            layers=config.num_layers,
            kv_heads=config.kv_heads // tp_size,
            head_dim=config.head_dim,
            dtype=config.torch_dtype,
            device=device,
        )
        options = {
            "cuda_graphs": cuda_graphs,
            "kv_bucket": kv_bucket,
            "check_every": check_every,
            "steps_per_graph": steps_per_graph,
        }
        forward = self._own if self._own is not None else self._forward
        self._init_decoder(module, forward, spec, config.vocab_size, keep_cache=keep_cache, **options)

    def _runs_module_forwards(self) -> bool:
        # the own forward applies its own functions to the weights (the word-embedding lookup it calls has no dropout
        # of its own), so a module in training mode is not switched to eval mode and back around each generation
        # (that visits every submodule: host time with the GPU idle); GPTModel.forward runs megatron's dropout
        return self._own is None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.batch_invariant = self.batch_invariant
        for layer in self.attention:
            layer.kv_cache = cache
        s = input_ids.shape[1]
        with logits_window(self.module, s - 1, s):
            out = self.module(input_ids, positions, None)
        last = out[:, -1]  # [B, V_padded / TP], model dtype (sampling reads it in fp32)
        return gather_vocabulary(last, self.config.vocab_size, self.tp_group, self.tp_size)

    @contextlib.contextmanager
    def _forwarding(self, length: int) -> Iterator[None]:
        """Within the block: rotary tables for ``length`` positions, the own forward's q/k/v weights of this
        generation (dropped on exit unless the decoder keeps its cache: its graphs read them), the batch-invariant
        layers if asked for; the attention layers' cache pointers are cleared on exit."""
        # tables long enough for training batches too, so a later forward never swaps them under a kept graph
        longest = max(length, self.config.max_position_embeddings)
        for layer in self.attention:
            layer.prepare_rotary(longest, self.config.head_dim, self.decoder.spec.device)
        if self._own is not None:
            self._own.refresh()
        try:
            with self._invariant_layers():
                yield
        finally:
            for layer in self.attention:
                layer.kv_cache = None
            if self._own is not None and not self.decoder.keep_cache:
                self._own.free()

    def release(self) -> None:
        """Free the KV cache, graphs, re-laid out q/k/v weights and folded copies kept by ``keep_cache=True``."""
        super().release()
        if self._own is not None:
            self._own.free()

    @contextlib.contextmanager
    def _invariant_layers(self) -> Iterator[None]:
        """With ``batch_invariant``: every linear layer's product and every norm through the batch-invariant
        functions (instance attributes over the class's methods, removed on exit)."""
        if not self.batch_invariant:
            yield
            return
        for linear in self._linears:
            linear._forward_impl = _invariant_product
        for norm in self._norms:
            if norm.rms:  # megatron's fused RMSNorm arithmetic (one rounding), one program per row on CUDA
                norm.forward = functools.partial(
                    invariant_rms_norm, weight=norm.weight, eps=norm.eps, model_rounding=False
                )
            else:
                norm.forward = functools.partial(invariant_rows, type(norm).forward.__get__(norm))
        try:
            yield
        finally:
            for module in (*self._linears, *self._norms):
                module.__dict__.pop("_forward_impl", None)
                module.__dict__.pop("forward", None)


def _invariant_product(
    input: torch.Tensor, weight: torch.Tensor, *args: Any, bias: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor:
    """A linear layer's local product (megatron's ``_forward_impl`` at TP = 1: no communication inside it) by
    :func:`~ppo_core_decode.batch_invariant.invariant_linear`."""
    return invariant_linear(input, weight, bias)


def megatron_engine(view: nn.Module, config: Any) -> MegatronRolloutEngine:
    """Deprecated (the registry's ``megatron`` entry is
    :class:`~ppo_core.workers.megatron.rollout_config.MegatronEngineConfig`): the engine of
    ``MegatronEngineConfig().build(view, config)`` on the megatron actor worker's policy view."""
    from ppo_core.workers.megatron.rollout_config import MegatronEngineConfig

    return MegatronEngineConfig().build(view, config)
