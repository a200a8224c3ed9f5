"""The layer loop of a pre-norm decoder evaluated through a :class:`~ppo_core.rollout.kv_cache.KVCache`, shared by
the rollout engines that run a model's layers themselves rather than its ``forward`` (Hugging Face's Llama family,
:mod:`ppo_core.rollout.hf`; megatron-core's GPT, :mod:`ppo_core.workers.megatron.decode`).

A subclass says where the weights are and how each step rounds (hook methods); the loop fuses every residual add
with the norm after it (``_add_rms_norm``: one kernel on CUDA), so a decode step's layer is: fused add + norm,
q/k/v projection, rotation with the cache write, attention, output projection, fused add + norm, gate/up
projection, SwiGLU, down projection.

Shapes: ``B`` rows, ``S`` tokens per row in this forward, ``D`` model width, ``H``/``G`` query/key-value heads (of
this rank), ``d`` head width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppo_core.rollout.kv_cache import KVCache

__all__ = ["Attend", "DecoderLayerLoop", "split_qkv"]

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


class DecoderLayerLoop:
    """A :class:`~ppo_core.rollout.decoding.CachedForward` of a pre-norm decoder: ``input_ids``/``positions [B, S]``
    -> logits ``[B, V]`` of the last position, in the model dtype.

    Subclasses implement the hooks: ``_layers``, ``_norms``, ``_embed``, ``_attention``, ``_projections``,
    ``_attention_output``, ``_mlp``, ``_logits``, ``_rms_norm`` and ``_add_rms_norm``; one with a decode step of its
    own (one token per row through fused kernels) also ``_fused_step_applies`` and ``_decode_step``.
    """

    batch_invariant: bool = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.batch_invariant = self.batch_invariant
        h = self._embed(input_ids)  # [B, S, D]
        b, s = input_ids.shape
        if s == 1 and self._fused_step_applies(h.view(b, -1)):
            return self._decode_step(h.view(b, -1), positions, cache)
        return self._forward(h, positions, cache)

    def _forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The layers and the logits from the embedded tokens ``h [B, S, D]`` (a subclass that decodes some
        steps otherwise embeds once and picks)."""
        attend = self._attention(h, positions, cache)
        layers = self._layers()
        delta = None  # what the previous sub-layer adds to the residual stream h
        for i, layer in enumerate(layers):
            norm1, norm2 = self._norms(layer)
            if delta is None:
                x = self._rms_norm(h, norm1)
            else:  # the previous layer's residual add fused with this layer's norm
                h, x = self._add_rms_norm(h, delta, norm1)
            q, k, v = self._projections(i, layer, x)
            # the last layer's keys and values go to the cache for every position, but only the last position's
            # output reaches the logits: its attention, output projection and MLP run for that position alone
            last_only = i == len(layers) - 1 and h.shape[1] > 1
            cache.last_query_only = last_only
            try:
                attn_out = self._attention_output(layer, attend(i, layer, q, k, v))
            finally:
                cache.last_query_only = False
            if last_only:
                h = h[:, -1:]
            h, x = self._add_rms_norm(h, attn_out, norm2)
            delta = self._mlp(i, layer, x)
        if delta is None:
            raise ValueError("the decoder has no layers")
        return self._logits(h[:, -1], delta[:, -1])

    # ----- hooks ---------------------------------------------------------------------------------------------

    def _fused_step_applies(self, h: torch.Tensor) -> bool:
        """Whether a decode step of the embedded tokens ``h [B, D]`` runs :meth:`_decode_step` rather than the
        layer loop (never, unless a subclass has one)."""
        return False

    def _decode_step(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A decode step of the embedded tokens ``h [B, D]`` -> logits ``[B, V]`` by other kernels than the loop's
        (see :meth:`_fused_step_applies`)."""
        raise NotImplementedError

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

    def _attention_output(self, layer: Any, out: torch.Tensor) -> torch.Tensor:
        """The output projection of attention ``out [B, S, H * d]`` -> ``[B, S, D]``."""
        raise NotImplementedError

    def _mlp(self, i: int, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``x [B, S, D]`` -> ``[B, S, D]``."""
        raise NotImplementedError

    def _logits(self, h_last: torch.Tensor, delta_last: torch.Tensor) -> torch.Tensor:
        """The last position's residual stream ``h_last [B, D]`` and the last MLP's output there ``[B, D]`` ->
        logits ``[B, V]``."""
        raise NotImplementedError

    def _rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """``x [..., D]`` normalised by ``norm``."""
        raise NotImplementedError

    def _add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add ``h + delta`` and its normalisation by ``norm`` (one kernel on CUDA)."""
        raise NotImplementedError
