"""The layer loop of a pre-norm decoder evaluated through a :class:`~ppo_core_decode.kv_cache.KVCache`, shared by
the rollout engines that run a model's layers themselves rather than its ``forward`` (Hugging Face's Llama family,
:mod:`ppo_core_decode.hf`; megatron-core's GPT, :mod:`ppo_core_decode.megatron`).

A subclass says where the weights are and how each step rounds (hook methods); the loop fuses every residual add
with the norm after it (``_add_rms_norm``: one kernel on CUDA), so a layer is: fused add + norm, q/k/v projection,
rotation with the cache write, attention, output projection, fused add + norm, gate/up projection, SwiGLU, down
projection. Where a subclass says so (:meth:`DecoderLayerLoop._adds_residual_in_products`: its half-precision
forwards on CUDA), the output and down projections add the residual stream in their GEMM instead
(:func:`add_linear_`: the residual added in the GEMM's epilogue, written over the residual stream), and
the norm after each reads the new residual alone: a prefill's add + norm kernels then move half the bytes (each read
the residual and the product and wrote the new residual and the normalised input; the norm reads one and writes one).

The fused decode step (one token per row, :meth:`DecoderLayerLoop._decode_step`) is written here once too: the
products through :func:`~ppo_core_decode.decode_linear.decode_linear` with the adds, norms and SwiGLU in their
epilogues; the subclasses give their weights and norms through hooks (:class:`StepWeights`).

Shapes: ``B`` rows, ``S`` tokens per row in this forward, ``D`` model width, ``H``/``G`` query/key-value heads (of
this rank), ``d`` head width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ppo_core_decode.decode_linear import decode_linear, row_sumsq, row_sumsq_scaled
from ppo_core_decode.kv_cache import KVCache

__all__ = ["Attend", "DecoderLayerLoop", "StepWeights", "add_linear_", "split_qkv"]

Attend = Callable[[int, Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(i, layer, q [B, S, H, d], k [B, S, G, d], v [B, S, G, d]) -> [B, S, H * d]``: layer ``i``'s rotation
and attention through the cache (rotary tables of one forward, made once by :meth:`DecoderLayerLoop._attention`)."""


def split_qkv(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused ``[q; k; v]`` projection ``[B, S, (H + 2G) d]`` as views ``q [B, S, H, d]``, ``k``/``v [B, S, G, d]``.

    Example:
        >>> q, k, v = split_qkv(torch.zeros(2, 1, 24), heads=4, kv_heads=1, head_dim=4)
        >>> tuple(q.shape), tuple(k.shape)
        ((2, 1, 4, 4), (2, 1, 1, 4))
    """
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    shape = (*qkv.shape[:2], -1, head_dim)
    return q.view(shape), k.view(shape), v.view(shape)


def add_linear_(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, inplace: bool) -> torch.Tensor:
    """``h + x @ weight^T`` as one GEMM (``addmm``: the residual read and added in the GEMM's epilogue), written over
    ``h`` where ``inplace`` and ``h`` is contiguous; otherwise into a new tensor. How the epilogue rounds is the
    BLAS library's: cuBLAS's bf16 result is not the correctly rounded exact sum on a large share of the entries,
    where one rounding of an fp32 sum would give nearly all, so it rounds the product before the sum as a separate
    add does; the gain is the memory traffic (the product is never written and read back).

    Args:
        h: ``[..., D_out]`` the residual stream.
        x: ``[..., D_in]`` the product's input (the same leading shape).
        weight: ``[D_out, D_in]``.

    Returns:
        ``[..., D_out]``: ``h`` itself (updated) when written in place.

    Example:
        >>> h = torch.ones(2, 3)
        >>> add_linear_(h, torch.ones(2, 4), torch.ones(3, 4), inplace=True) is h, h[0, 0].item()
        (True, 5.0)
    """
    if h.shape[:-1] != x.shape[:-1] or weight.shape != (h.shape[-1], x.shape[-1]):
        raise ValueError(
            f"add_linear_: h {tuple(h.shape)}, x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make "
            "h + x @ weight^T"
        )
    x2 = x.reshape(-1, x.shape[-1])
    if inplace and h.is_contiguous():
        h.view(-1, h.shape[-1]).addmm_(x2, weight.t())
        return h
    return torch.addmm(h.reshape(-1, h.shape[-1]), x2, weight.t()).view(h.shape)


class StepWeights(NamedTuple):
    """One layer's weights as the fused decode step reads them (``[D_out, D_in]``, biases ``[D_out]`` or None):
    the q/k/v and gate/up weights concatenated (``[q; k; v]``, ``[gate; up]``), with the norm before each folded into
    their columns where the subclass folds (:meth:`DecoderLayerLoop._folds_norms`)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class DecoderLayerLoop:
    """A :class:`~ppo_core_decode.decoding.CachedForward` of a pre-norm decoder: ``input_ids``/``positions [B, S]``
    -> logits ``[B, V]`` of the last position, in the model dtype.

    Subclasses implement the hooks: ``_layers``, ``_norms``, ``_embed``, ``_attention``, ``_projections``,
    ``_output_projection``, ``_down_projection``, ``_gate_up``, ``_swiglu``, ``_residual_product``, ``_logits``,
    ``_rms_norm`` and ``_add_rms_norm``; one with a decode step of its
    own (one token per row through :func:`~ppo_core_decode.decode_linear.decode_linear`) also
    ``_fused_step_applies`` and the hooks of :meth:`_decode_step` (``_step_weights``, ``_folds_norms``,
    ``_norm_eps``, ``_final_norm``, ``_head``, ``_final_norm_in_head``, ``_split_qkv``; optionally
    ``_before_decode_step`` and ``_vocabulary``).
    """

    batch_invariant: bool = False
    residual_in_products: bool = False
    """Whether the subclass's :meth:`_attention_output` and :meth:`_mlp` take ``residual`` (see
    :meth:`_adds_residual_in_products`)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.batch_invariant = self.batch_invariant
        h = self._embed(input_ids)  # [B, S, D]
        b, s = input_ids.shape
        if s == 1 and self._fused_step_applies(h.view(b, -1)):
            return self._decode_step(h.view(b, -1), positions, cache)
        return self._forward(h, positions, cache)

    def sequence_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, keep: int
    ) -> torch.Tensor:
        """The logits of the last ``keep`` positions of a prefill of ``input_ids [B, S]`` -> ``[B, keep, V]``
        (every position through every layer; the cache prepared by
        :meth:`~ppo_core_decode.kv_cache.KVCache.begin_prefill`). Batch-invariantly, position ``j``'s logits are
        the bits a forward whose last position is ``j`` computes: those of the prefill or decode step that
        sampled token ``j + 1`` (training's exact log-probs, :mod:`ppo_core_decode.sequence_log_probs`)."""
        cache.batch_invariant = self.batch_invariant
        return self._forward(self._embed(input_ids), positions, cache, keep=keep)

    def _forward(
        self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, keep: int | None = None
    ) -> torch.Tensor:
        """The layers and the logits from the embedded tokens ``h [B, S, D]`` (a subclass that decodes some
        steps otherwise embeds once and picks): ``[B, V]`` of the last position, or ``[B, keep, V]`` of the last
        ``keep`` positions."""
        attend = self._attention(h, positions, cache)
        layers = self._layers()
        if not layers:
            raise ValueError("the decoder has no layers")
        fused_add = self._adds_residual_in_products(h)
        delta = None  # what the previous sub-layer adds to the residual stream h, where no product added it
        for i, layer in enumerate(layers):
            norm1, norm2 = self._norms(layer)
            if delta is None:
                x = self._rms_norm(h, norm1)
            else:  # the previous layer's residual add fused with this layer's norm
                h, x = self._add_rms_norm(h, delta, norm1)
            q, k, v = self._projections(i, layer, x)
            # the last layer's keys and values go to the cache for every position, but only the last position's
            # output reaches the logits: its attention, output projection and MLP run for that position alone
            last_only = keep is None and i == len(layers) - 1 and h.shape[1] > 1
            cache.last_query_only = last_only
            try:
                attn = attend(i, layer, q, k, v)
            finally:
                cache.last_query_only = False
            if last_only:
                h = h[:, -1:]
            if fused_add:
                # the products add the residual, written over it from the first layer's output projection on (the
                # embedding's output, which it reads, may be shared: that one add writes a new tensor)
                h = self._attention_output(layer, attn, residual=h, inplace=i > 0)
                x = self._rms_norm(h, norm2)
                h = self._mlp(i, layer, x, residual=h, inplace=True)
            else:
                h, x = self._add_rms_norm(h, self._attention_output(layer, attn), norm2)
                delta = self._mlp(i, layer, x)
        if keep is not None:
            return self._logits(h[:, -keep:], None if delta is None else delta[:, -keep:])
        return self._logits(h[:, -1], None if delta is None else delta[:, -1])

    def _adds_residual_in_products(self, h: torch.Tensor) -> bool:
        """Whether a forward of ``h [B, S, D]`` calls :meth:`_attention_output` and :meth:`_mlp` with the residual
        stream, which they add in their product (see the module docstring): where the subclass opts in
        (:attr:`residual_in_products`), on CUDA in half precision, where the decode step's products already add in
        their epilogue (the CPU keeps the models' roundings: each product and each sum), and not batch-invariantly."""
        return (
            self.residual_in_products
            and h.is_cuda
            and h.dtype in (torch.float16, torch.bfloat16)
            and not self.batch_invariant
        )

    # ----- hooks ---------------------------------------------------------------------------------------------

    def _fused_step_applies(self, h: torch.Tensor) -> bool:
        """Whether a decode step of the embedded tokens ``h [B, D]`` runs :meth:`_decode_step` rather than the
        layer loop (never, unless a subclass has one)."""
        return False

    def _decode_step(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A decode step of the embedded tokens ``h [B, D]`` (one per row) -> logits ``[B, V]`` through
        :func:`~ppo_core_decode.decode_linear.decode_linear`, the step both model forwards share: each residual add
        and the new residual's sums of squares in the epilogue of the product before it; each RMSNorm's row scale in
        the epilogue of the product after it, which reads the residual itself with the norm's weight folded into its
        own weight (:meth:`_folds_norms`), or else the new residual times the norm's weight, which the residual
        epilogue also writes; SiLU x up in the epilogue of gate/up. Five launches a layer with the rotation and
        attention. The final norm is in the output layer's epilogue where :meth:`_final_norm_in_head` (its weight
        is never folded into the output layer's, which would copy the vocabulary's weight: the last down product
        writes the new residual times it), else a norm of its own. Roundings: :mod:`~ppo_core_decode.decode_linear`
        (the norm scales the product rather than its input)."""
        attend = self._attention(h[:, None], positions, cache)
        self._before_decode_step(cache)
        b = h.shape[0]
        fold = self._folds_norms()
        layers = self._layers()
        final = self._final_norm()
        head_weight, head_bias = self._head()
        final_in_head = self._final_norm_in_head(h)

        def unfolded(norm: Any) -> torch.Tensor | None:
            """The weight the residual epilogue scales the next product's input by: none where it is folded."""
            return None if fold else norm.weight

        # [1, B]: the first norm's statistics; the first product's input
        sumsq, x = (row_sumsq(h), h) if fold else row_sumsq_scaled(h, self._norms(layers[0])[0].weight)
        for i, layer in enumerate(layers):
            w = self._step_weights(i, layer)
            norm1, norm2 = self._norms(layer)
            qkv = decode_linear(x, w.qkv, w.qkv_bias, sumsq=sumsq, eps=self._norm_eps(norm1)).y
            out = attend(i, layer, *self._split_qkv(qkv[:, None]))  # [B, 1, H * d]
            h, sumsq, scaled = decode_linear(
                out.view(b, -1), w.out, w.out_bias, residual=h, next_norm_weight=unfolded(norm2)
            )
            x = h if scaled is None else scaled  # the next product's input
            act = decode_linear(
                x, w.gate_up, w.gate_up_bias, sumsq=sumsq, eps=self._norm_eps(norm2), swiglu=True
            ).y
            if i < len(layers) - 1:
                following = unfolded(self._norms(layers[i + 1])[0])
            else:
                following = final.weight if final_in_head else None
            h, sumsq, scaled = decode_linear(act, w.down, w.down_bias, residual=h, next_norm_weight=following)
            x = h if scaled is None else scaled
        if final_in_head:
            logits = decode_linear(x, head_weight, head_bias, sumsq=sumsq, eps=self._norm_eps(final)).y
        else:
            logits = decode_linear(self._rms_norm(h, final), head_weight, head_bias).y
        return self._vocabulary(logits)

    def _step_weights(self, i: int, layer: Any) -> StepWeights:
        """Layer ``i``'s weights for :meth:`_decode_step` (built or refreshed first where the subclass keeps copies)."""
        raise NotImplementedError

    def _folds_norms(self) -> bool:
        """Whether this generation's :meth:`_step_weights` have the norms' weights folded into q/k/v and gate/up."""
        raise NotImplementedError

    def _norm_eps(self, norm: Any) -> float:
        """An RMSNorm's epsilon."""
        raise NotImplementedError

    def _final_norm(self) -> Any:
        """The norm after the last layer."""
        raise NotImplementedError

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output layer's weight ``[V, D]`` and bias (or None)."""
        raise NotImplementedError

    def _final_norm_in_head(self, h: torch.Tensor) -> bool:
        """Whether :meth:`_decode_step` applies the final norm in the output layer's epilogue (its weight of the
        dtype of ``h [B, D]``, contiguous)."""
        raise NotImplementedError

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, S, (H + 2G) d]`` -> ``q [B, S, H, d]``, ``k``/``v [B, S, G, d]`` (see :func:`split_qkv`)."""
        raise NotImplementedError

    def _before_decode_step(self, cache: KVCache) -> None:
        """What a decode step needs once before its layers (nothing by default)."""

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The decode step's output-layer product ``[B, V']`` -> the logits ``[B, V]`` (itself by default)."""
        return logits

    def _layers(self) -> Sequence[Any]:
        """The decoder layers, in order."""
        raise NotImplementedError

    def _norms(self, layer: Any) -> tuple[Any, Any]:
        """A layer's norm before attention and its norm before the MLP."""
        raise NotImplementedError

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, S]`` -> ``[B, S, D]``."""
        raise NotImplementedError

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> Attend:
        """This forward's attention (see :data:`Attend`); ``h [B, S, D]`` gives the device and dtype."""
        raise NotImplementedError

    def _projections(
        self, i: int, layer: Any, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalised ``x [B, S, D]`` -> ``q [B, S, H, d]``, ``k``/``v [B, S, G, d]``."""
        raise NotImplementedError

    def _attention_output(
        self, layer: Any, out: torch.Tensor, residual: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        """The output projection of attention ``out [B, S, H * d]`` -> ``[B, S, D]``; with ``residual [B, S, D]``
        (see :meth:`_adds_residual_in_products`) the residual plus the projection, over ``residual`` if
        ``inplace``."""
        return self._residual_product(out, self._output_projection(layer), residual, inplace)

    def _mlp(
        self, i: int, layer: Any, x: torch.Tensor, residual: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        """Normalised ``x [B, S, D]`` -> ``[B, S, D]``: SwiGLU of the gate/up product, then the down product; with
        ``residual`` as :meth:`_attention_output`."""
        gate, up = self._gate_up(i, layer, x)
        return self._residual_product(self._swiglu(gate, up), self._down_projection(layer), residual, inplace)

    def _output_projection(self, layer: Any) -> Any:
        """A layer's attention output projection (the linear module :meth:`_residual_product` applies)."""
        raise NotImplementedError

    def _down_projection(self, layer: Any) -> Any:
        """A layer's MLP down projection (the linear module :meth:`_residual_product` applies)."""
        raise NotImplementedError

    def _gate_up(self, i: int, layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s gate and up products of the normalised ``x [B, S, D]``, each ``[B, S, F]``."""
        raise NotImplementedError

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in the model's rounding."""
        raise NotImplementedError

    def _residual_product(
        self, x: torch.Tensor, linear: Any, residual: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        """``linear``'s product of ``x`` (with a tensor-parallel reduction where the subclass has one), or with
        ``residual`` the residual plus it (one GEMM where it can: :func:`add_linear_`), over ``residual`` if
        ``inplace``."""
        raise NotImplementedError

    def _logits(self, h_last: torch.Tensor, delta_last: torch.Tensor | None) -> torch.Tensor:
        """The last position's residual stream ``h_last [B, D]`` and the last MLP's output there ``[B, D]`` (None
        where the MLP added it to ``h_last``) -> logits ``[B, V]``."""
        raise NotImplementedError

    def _rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """``x [..., D]`` normalised by ``norm``."""
        raise NotImplementedError

    def _add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add ``h + delta`` and its normalisation by ``norm`` (one kernel on CUDA)."""
        raise NotImplementedError
