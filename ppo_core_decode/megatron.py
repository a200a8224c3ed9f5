"""The megatron rollout engine's own cached forward of a ``GPTModel``: megatron's layers evaluated from their weights
in place, with fewer kernels per decode step than megatron's ``forward``.

:class:`MegatronDecodeForward` is the counterpart of the Hugging Face engine's Llama-family path
(:class:`~ppo_core_decode.decoder_loop.DecoderLayerLoop` is their shared layer loop). Per layer of a decode step:

- every residual add is fused with the RMSNorm after it (megatron adds, then normalises: two kernels); on CUDA in
  half precision at TP = 1 a forward of several tokens (the prefill) adds the residual in the output and down
  projections' GEMMs instead and normalises the sum alone
  (:meth:`~ppo_core_decode.decoder_loop.DecoderLayerLoop._adds_residual_in_products`), the same add and norm with
  half the norm kernel's memory traffic;
- ``linear_qkv``'s rows, which megatron interleaves per query group (``q_0 .. q_{h/g-1} k v`` for each group),
  are re-laid out as ``[q; k; v]`` once per generation (:meth:`MegatronDecodeForward.refresh`), so that the query
  is a view of the GEMM's output: megatron gathers it out of the interleaved output with a strided copy every
  step. With one query group per rank the layout already is ``[q; k; v]`` and nothing is copied;
- rotation, cache write and attention as :class:`~ppo_core.workers.megatron.model.SDPACoreAttention` does them
  (megatron's fp32 rotary tables, one rounding), through
  :meth:`~ppo_core.workers.megatron.model.SDPACoreAttention.attend_cache`.

So a decode step's layer is about nine kernels (with TP > 1 two all-reduces more; with a q/k/v bias one bias add
more): add + norm, q/k/v GEMM, rotation + cache write, attention, output GEMM, add + norm, gate/up GEMM, SwiGLU,
down GEMM. The numbers are megatron's: the same roundings as its own forward (bit for bit on the CPU).

With ``fused_decode`` (TP = 1; the engine's default on CUDA) a decode step of up to 64 rows instead runs
:meth:`MegatronDecodeForward._decode_step`: four :func:`~ppo_core_decode.decode_linear.decode_linear` products and
the one-launch rotation + cache write + attention, five launches a layer. Each residual add is in the epilogue of
the product before it, which also writes the new residual's sums of squares, and the next product scales by the
norm's ``rstd`` in its epilogue. The norm's weight: with ``fold_norms`` (the default) each generation whose decode
steps take this path copies the q/k/v and ``linear_fc1`` weights with the weight of the norm before each folded
into their columns (about half the weights again in memory, refreshed at each layer's first use in the prefill, as
the Hugging Face engine folds its concatenated weights), and the products read the residual itself; without it no
weight is copied and the residual epilogue also writes the new residual times the next norm's weight (rounded) for
the next product to read, which makes the decode step longer (``docs/performance.md``). The norms and SwiGLU then
round as
:mod:`~ppo_core_decode.decode_linear` documents, not as megatron's fused kernels do.

Tensor parallelism: this rank's shards of every weight; the row-parallel outputs (``linear_proj``,
``linear_fc2``) are summed over the TP group with ``torch.distributed.all_reduce`` (captured with the CUDA graph,
as megatron's own reduction is); the embedding is megatron's vocabulary-parallel module itself; the logits'
vocabulary shards are gathered (:func:`gather_vocabulary`).

Configurations: :func:`~ppo_core.workers.megatron.rollout.own_forward_unsupported` names what this forward does
not evaluate (LayerNorm, biases on the other linear layers, learned absolute positions, a critic's value head and megatron options our configs do
not set); the engine then keeps megatron's own forward.

Shapes: ``B`` rows, ``S`` tokens per row in this forward, ``D`` model width, ``H``/``G`` query/key-value heads of
this rank, ``d`` head width, ``V`` vocabulary (``V_p``: padded, ``/TP``: this rank's shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ppo_core_decode.decode_linear import (
    decode_linear_available,
    fold_norm_weights,
)
from ppo_core_decode.decoder_loop import Attend, DecoderLayerLoop, StepWeights, add_linear_, split_qkv
from ppo_core_decode.elementwise_launch import engine_rms_norm, engine_silu_mul
from ppo_core_decode.kv_cache import KVCache

__all__ = ["MegatronDecodeForward", "gather_vocabulary"]


def gather_vocabulary(
    logits: torch.Tensor, vocab_size: int, tp_group: Any = None, tp_size: int = 1
) -> torch.Tensor:
    """This rank's vocabulary shard of the last position's logits ``[B, V_p / TP]`` -> the full unpadded ``[B, V]``
    on every rank (all-gathered over ``tp_group``), so that every rank draws the same token."""
    if tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[:, :vocab_size]


def qkv_row_order(heads: int, groups: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """The rows of megatron's interleaved ``linear_qkv`` weight (per group: its ``H / G`` query heads, its key, its
    value) in ``[q; k; v]`` order: ``[(H + 2G) d]`` indices.

    Example:
        >>> qkv_row_order(heads=2, groups=2, head_dim=1, device=torch.device("cpu"))
        tensor([0, 3, 1, 4, 2, 5])
    """
    per_group = heads // groups
    rows = torch.arange((heads + 2 * groups) * head_dim, device=device).view(groups, per_group + 2, head_dim)
    q, k, v = rows[:, :per_group], rows[:, per_group], rows[:, per_group + 1]
    return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])


class MegatronDecodeForward(DecoderLayerLoop):
    """The cached forward of this rank's ``GPTModel`` from its weights in place (see the module docstring).

    Args:
        module: the ``GPTModel``, its attention layers' ``kv_cache_layer`` set to their index. The caller checks
            that this forward evaluates it (:func:`~ppo_core.workers.megatron.rollout.own_forward_unsupported` is
            None; the megatron engine does): this package imports nothing of the workers, whose module classes that
            check names.
        config: its :class:`~ppo_core.workers.megatron.config.MegatronModelConfig`.
        tp_group: the tensor-parallel process group (None when TP = 1).
        tp_size: tensor-parallel size.
        fused_decode: run decode steps of up to ``MAX_ROWS`` half-precision rows through
            :meth:`_decode_step` (TP = 1 only; ignored otherwise).
        fold_norms: with ``fused_decode``, fold the norms' weights into copies of the q/k/v and ``linear_fc1``
            weights (see the module docstring); False copies no weight.

    Call :meth:`refresh` before the forwards of a generation (the re-laid out q/k/v weights and the folded copies
    follow the training updates) and :meth:`free` after it.
    """

    residual_in_products = True

    def __init__(
        self,
        module: nn.Module,
        config: Any,
        *,
        tp_group: Any = None,
        tp_size: int = 1,
        fused_decode: bool = False,
        fold_norms: bool = True,
    ) -> None:
        tc = module.config
        self.module = module
        self.layers = list(module.decoder.layers)
        self.vocab_size = config.vocab_size
        self.tp_group, self.tp_size = tp_group, tp_size
        self.heads = tc.num_attention_heads // tp_size
        self.groups = tc.num_query_groups // tp_size
        self.head_dim = tc.kv_channels
        # megatron's SwiGLU: one rounding with bias_activation_fusion, else eager's (SiLU rounded to the model
        # dtype before the product)
        self._silu_rounded = not tc.bias_activation_fusion
        # per layer: q/k/v weight [(H + 2G) d, D] and bias (None without) in [q; k; v] row order
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None] | None] | None = None
        # per layer: whether refresh() asked for a new layout that has not been made yet
        self._stale: list[bool] = []
        self._rows: torch.Tensor | None = None  # qkv_row_order on the weights' device (made once)
        self.fused_decode = bool(fused_decode) and tp_size == 1
        # with fused_decode: copy the q/k/v and linear_fc1 weights with the norm before each folded in (else the
        # residual epilogues write the next product's input scaled by the norm's weight, and no weight is copied)
        self.fold_norms = self.fused_decode and bool(fold_norms)
        # with fold_norms, per layer: the q/k/v weight ([q; k; v] rows) and linear_fc1's weight, each times the
        # weight of the norm before it (made at the layer's first use after refresh(), in place when they exist)
        self._folded: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        # whether this generation folds (set by its prefill: only where its decode steps can take the fused step)
        self._fold_now = False
        # with fused_decode, after the first decode step of a generation: the dtype the fused step's weights share
        # (None: it does not apply); _fused_checked says whether this generation has checked
        self._fused_dtype: torch.dtype | None = None
        self._fused_checked = False

    def refresh(self) -> None:
        """Mark every layer's q/k/v weight and bias stale: each is (re)laid out from the current ones as ``[q; k;
        v]`` rows at its first use in the next forward, in place when it exists (a kept CUDA graph reads them at
        fixed addresses). Built at first use, a layer's layout is queued just before its prefill: the host makes
        layer ``i + 1``'s while the device runs layer ``i``, instead of the device idling through all of them at
        the start of a generation. With one query group per rank megatron's layout is that already: the parameters
        themselves are used. With ``fused_decode`` the first decode step of the generation checks, once rather than
        at every step, that the fused step can read every weight."""
        if self._qkv is None:
            self._qkv = [None] * len(self.layers)
        self._stale = [True] * len(self.layers)
        self._fused_checked = False

    def _layer_qkv(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s q/k/v weight and bias in ``[q; k; v]`` row order, laid out first if :meth:`refresh` marked
        it stale."""
        if self._qkv is None:
            raise RuntimeError("MegatronDecodeForward.refresh() must run before a forward")
        if self._stale[i]:
            parameters = self._qkv_parameters(self.layers[i])
            if self.groups == 1:
                self._qkv[i] = parameters
            else:
                device = parameters[0].device
                if self._rows is None or self._rows.device != device:
                    self._rows = qkv_row_order(self.heads, self.groups, self.head_dim, device)
                previous = self._qkv[i]
                with torch.no_grad():
                    weight, bias = (
                        None
                        if tensor is None
                        else torch.index_select(
                            tensor, 0, self._rows, out=None if previous is None else previous[j]
                        )
                        for j, tensor in enumerate(parameters)
                    )
                self._qkv[i] = (weight, bias)
            if self._fold_now:
                self._fold(i)
            self._stale[i] = False
        return self._qkv[i]

    def _fold(self, i: int) -> None:
        """Layer ``i``'s folded weights (see ``_folded``), written into the previous generation's buffers where they
        match (a kept CUDA graph reads them at fixed addresses)."""
        if self._folded is None:
            self._folded = [None] * len(self.layers)
        layer = self.layers[i]
        pairs = (
            (self._qkv[i][0], layer.input_layernorm.weight),
            (layer.mlp.linear_fc1.weight, layer.pre_mlp_layernorm.weight),
        )
        previous = self._folded[i] or (None, None)
        folded = []
        for (weight, norm_weight), out in zip(pairs, previous, strict=True):
            meta = (weight.shape, weight.dtype, weight.device)
            if out is None or (out.shape, out.dtype, out.device) != meta:
                out = torch.empty_like(weight, memory_format=torch.contiguous_format)
            with torch.no_grad():
                fold_norm_weights(out, norm_weight.detach(), [weight.detach()])
            folded.append(out)
        self._folded[i] = (folded[0], folded[1])

    def free(self) -> None:
        """Drop the re-laid out q/k/v weights and the folded copies."""
        self._qkv = None
        self._folded = None
        self._fold_now = False
        self._fused_dtype = None
        self._fused_checked = False

    def _forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if h.shape[1] > 1 and all(self._stale):
            # a generation's prefill (every layer's weights still to be laid out): with fold_norms, fold at each
            # layer's first use where the decode steps that follow can take the fused step
            self._fold_now = self.fold_norms and decode_linear_available(
                h[:, -1], self.layers[0].mlp.linear_fc1.weight
            )
        return super()._forward(h, positions, cache)

    def _fused_step_applies(self, x: torch.Tensor) -> bool:
        """With ``fused_decode``: whether every product of a decode step of ``x [B, D]`` runs in ``decode_linear``
        (Triton on CUDA, ``B <= 64``, half precision; the weights checked once a generation)."""
        if not self.fused_decode:
            return False
        if not self._fused_checked:
            self._fused_dtype = self._fused_step_dtype()
            self._fused_checked = True
        return (
            self._fused_dtype is not None
            and self._fused_dtype == x.dtype
            and decode_linear_available(x, self._layer_qkv(0)[0])
        )

    def _fused_step_dtype(self) -> torch.dtype | None:
        """The dtype every weight and norm weight of the fused decode step has, each contiguous (what
        ``decode_linear`` reads), or None where they do not."""
        tensors = [self._output_weight(), self._final_norm().weight]
        for i, layer in enumerate(self.layers):
            qkv, mlp = self._layer_qkv(i)[0], layer.mlp
            tensors += [
                qkv,
                layer.self_attention.linear_proj.weight,
                mlp.linear_fc1.weight,
                mlp.linear_fc2.weight,
            ]
            tensors += [layer.input_layernorm.weight, layer.pre_mlp_layernorm.weight]
        dtype = tensors[0].dtype
        return dtype if all(t.is_contiguous() and t.dtype == dtype for t in tensors) else None

    # ----- the fused decode step's hooks (DecoderLayerLoop._decode_step, TP = 1): the norms' weights folded into
    # copies of the q/k/v and linear_fc1 weights (fold_norms) or written by the residual epilogue; the final norm
    # always in the output layer's epilogue (_fused_step_dtype checked its weight)

    def _step_weights(self, i: int, layer: nn.Module) -> StepWeights:
        qkv_weight, qkv_bias = self._layer_qkv(i)
        fc1_weight = layer.mlp.linear_fc1.weight
        if self._fold_now:
            qkv_weight, fc1_weight = self._folded[i]
        return StepWeights(
            qkv_weight,
            qkv_bias,
            layer.self_attention.linear_proj.weight,
            None,
            fc1_weight,
            None,
            layer.mlp.linear_fc2.weight,
            None,
        )

    def _folds_norms(self) -> bool:
        return self._fold_now

    def _norm_eps(self, norm: nn.Module) -> float:
        return norm.eps

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._output_weight(), None

    def _final_norm_in_head(self, h: torch.Tensor) -> bool:
        return True

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(qkv, self.heads, self.groups, self.head_dim)

    def _before_decode_step(self, cache: KVCache) -> None:
        # the rotary rows of this step's positions, gathered once for every layer
        self.layers[0].self_attention.core_attention.cache_rotary_rows(cache)

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_vocabulary(logits, self.vocab_size, self.tp_group, self.tp_size)

    def _final_norm(self) -> nn.Module:
        return self.module.decoder.final_layernorm

    def _output_weight(self) -> torch.Tensor:
        module = self.module
        if module.share_embeddings_and_output_weights:
            return module.shared_embedding_or_output_weight()
        return module.output_layer.weight

    @staticmethod
    def _qkv_parameters(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = layer.self_attention.linear_qkv
        return linear.weight, linear.bias

    # ----- the GEMMs: one place to swap them ----------------------------------------------------------------

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., D_in] @ weight [D_out, D_in]^T (+ bias)`` -> ``[..., D_out]``; the bias added after the
        product is rounded, as megatron's linear layers add it."""
        out = F.linear(x, weight)
        return out if bias is None else out + bias

    def _residual_product(
        self,
        x: torch.Tensor,
        linear: nn.Module,
        residual: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> torch.Tensor:
        """A row-parallel layer (no bias): this rank's partial product, summed over the TP group; with ``residual``
        the residual plus it (at TP = 1 one GEMM, see :func:`~ppo_core_decode.decoder_loop.add_linear_`)."""
        if residual is not None and self.tp_size == 1:
            return add_linear_(residual, x, linear.weight, inplace=inplace)
        out = self._linear(x, linear.weight, None)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out if residual is None else residual + out

    # ----- DecoderLayerLoop hooks ---------------------------------------------------------------------------

    def _layers(self) -> Sequence[nn.Module]:
        return self.layers

    def _norms(self, layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        return layer.input_layernorm, layer.pre_mlp_layernorm

    def _rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return engine_rms_norm(x, norm.weight, norm.eps, model_rounding=False)

    def _add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return engine_rms_norm(h, norm.weight, norm.eps, delta=delta, model_rounding=False)

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return engine_silu_mul(gate, up, model_rounding=self._silu_rounded)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # megatron's vocabulary-parallel embedding module (with TP its shards' lookups are summed over the group)
        return self.module.embedding.word_embeddings(input_ids)

    def _projections(
        self, i: int, layer: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self._linear(x, *self._layer_qkv(i))  # [B, S, (H + 2G) d]
        return self._split_qkv(qkv)

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> Attend:
        b = positions.shape[0]

        def attend(
            i: int, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            core: Any = layer.self_attention.core_attention
            out = core.attend_cache(cache, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            # [B, S, H d], or [B, 1, H d] where the cache attends the last query only
            return out.transpose(1, 2).reshape(b, out.shape[2], -1)

        return attend

    def _output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.self_attention.linear_proj

    def _down_projection(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.linear_fc2

    def _gate_up(self, i: int, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._linear(x, layer.mlp.linear_fc1.weight, None).chunk(2, dim=-1)  # [gate; up] per TP rank

    def _adds_residual_in_products(self, h: torch.Tensor) -> bool:
        # at TP = 1 only: with TP the residual add follows the all-reduce
        return self.tp_size == 1 and super()._adds_residual_in_products(h)

    def _logits(self, h_last: torch.Tensor, delta_last: torch.Tensor | None) -> torch.Tensor:
        if delta_last is None:
            last = self._rms_norm(h_last, self._final_norm())  # [B, D]
        else:
            _, last = self._add_rms_norm(h_last, delta_last, self._final_norm())  # [B, D]
        # [B, V_p / TP], model dtype (sampling reads it in fp32)
        logits = self._linear(last, self._output_weight(), None)
        return gather_vocabulary(logits, self.vocab_size, self.tp_group, self.tp_size)
