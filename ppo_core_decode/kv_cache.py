"""A static key/value cache for batched decoding of left-padded prompts, and the attention that reads it.

Layout: one key and one value buffer per layer, ``[B, G, L, d]`` (batch, key/value heads on this rank, cache
slots, head width), allocated once for a whole generation. Slot ``j`` holds the token at column ``j`` of
``input_ids = [prompts | responses]``: the ``P`` prompt columns (left padding included) first, then the
responses. Because every row has the same prompt width, the token written by decode step ``t`` goes to the same
slot ``P + t - 1`` in every row, so writes are one ``index_copy_`` with a device-side slot index and the buffers
never move: the decode step can be captured once in a CUDA graph and replayed.

``key_valid [B, L]`` says which slots hold a real token (a prompt token, or a response token of a row that had not
finished when it was sampled); attention never looks at the others (left padding, tokens after EOS, slots not
written yet).

Two modes, set by the caller before each forward:

- ``"prefill"``: the ``P`` prompt tokens of every row at once; keys/values are written to slots ``[0, P)`` and
  each query attends causally to the valid prompt tokens before it (a padding query attends to itself only, so
  that it stays finite; its output is never used).
- ``"decode"``: one new token per row; it is written to ``slot`` and the query attends to the valid slots among
  the first ``kv_len`` (a Python int: the caller picks a length covering the filled part of the cache, so a graph
  captured for ``kv_len`` reads only that part).

Example:
    >>> cache = KVCache.allocate(layers=1, batch=1, kv_heads=1, head_dim=2, length=4, dtype=torch.float32,
    ...                          device="cpu")
    >>> cache.nbytes
    64
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ppo_core_decode.batch_invariant import invariant_attention
from ppo_core_decode.decode_attention import decode_attention
from ppo_core_decode.decode_rotary import (
    rotate_and_write_prompt_triton,
    rotate_and_write_triton,
    rotate_and_write_triton_available,
)
from ppo_core_decode.decode_rotary_attention import rotate_write_attend_triton
from ppo_core_decode.step_inputs import _record_and_mask, decode_step_inputs

__all__ = ["FUSED_DECODE", "KVCache", "prefill_attention_mask"]

#: Whether :meth:`KVCache.attend_rotated` decodes on CUDA in one launch per layer
#: (:func:`~ppo_core_decode.decode_rotary_attention.rotate_write_attend_triton`) rather than two (the rotation and
#: cache write, then the attention); read at each call, so that a benchmark can set it between runs.
#: ``PPO_CORE_DECODE_FUSED=0`` sets it False at import.
FUSED_DECODE: bool = os.environ.get("PPO_CORE_DECODE_FUSED", "1") != "0"


def prefill_attention_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, P, P]`` boolean mask, True where query ``i`` may attend to key ``j``: ``j <= i`` and ``j`` is a
    prompt token, or ``i == j`` (a padding query sees itself, so that its softmax is finite).

    Example:
        >>> prefill_attention_mask(torch.tensor([[0, 1, 1]]))[0, 0].int()
        tensor([[1, 0, 0],
                [0, 1, 0],
                [0, 1, 1]], dtype=torch.int32)
    """
    valid = prompt_mask.bool()
    p = valid.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=valid.device).tril()
    allowed = causal & valid[:, None, None, :]
    return allowed | torch.eye(p, dtype=torch.bool, device=valid.device)


def _zeroed_slots(
    layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's key and value buffer ``shape = [B, G, L, d]``: views of one allocation, zeroed by one kernel (a
    generation allocates its cache at its start, while the device waits for the host)."""
    keys, values = torch.zeros(2, layers, *shape, dtype=dtype, device=device)
    return list(keys.unbind(0)), list(values.unbind(0))


@dataclass(eq=False)
class KVCache:
    """Per-layer key/value buffers and what they hold (see the module docstring).

    Attributes:
        keys, values: one ``[B, G, L, d]`` buffer per layer.
        key_valid: ``[B, L]`` bool, slots holding a real token.
        positions: ``[B, S]`` rotary positions of the tokens of the current forward (set by the caller; models
            that apply their own position embeddings ignore it).
        slot: ``[]`` int64, the slot of the token of the current decode step.
        mode: ``"prefill"`` or ``"decode"``.
        kv_len: slots the current decode step attends to (a multiple of the caller's bucket, ``<= L``).
        prefill_mask: ``[B, 1, P, P]`` mask of the current prefill (:func:`prefill_attention_mask`); None when no
            prompt is padded (the mask is then the causal one, which SDPA applies itself: ``is_causal``, each
            key/value head shared by its query heads without a copy, so that CUDA runs a flash kernel).
        batch_invariant: attend with :func:`~ppo_core_decode.batch_invariant.invariant_attention` in both modes (set
            by the forward): each query alone over the slots up to its own, so that a prefill of the whole
            sequence and the decode step of a token give its query the same bits.
        last_query_only: in a prefill, :meth:`attend` writes every position's key and value but attends only the
            last position's queries (``[B, H, 1, d]`` out; set by the forward around its last layer, whose outputs
            are used at the last position only). That query sees every valid slot, so it gets what it gets in
            the full attention (up to the kernel's summation order).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_valid: torch.Tensor
    _positions: torch.Tensor | None = field(default=None, repr=False)
    slot: torch.Tensor | None = None
    mode: str = "prefill"
    kv_len: int = 0
    prefill_mask: torch.Tensor | None = None
    batch_invariant: bool = False
    last_query_only: bool = False
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)
    _filled: torch.Tensor | None = field(default=None, repr=False)
    _per_forward: dict = field(default_factory=dict, repr=False)
    _slots: tuple | None = field(default=None, repr=False)  # (layers, [B, G, L, d], dtype, device) once freed

    @property
    def positions(self) -> torch.Tensor | None:
        """``[B, S]`` rotary positions of the tokens of the current forward (set by the caller before each one)."""
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self._positions = value
        self._per_forward.clear()  # a new forward: what the layers shared belonged to the previous one

    def per_forward(self, key: object, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per forward (per assignment of :attr:`positions`) and shared by every layer
        that asks with the same ``key`` (such as the rotary tables at this forward's positions)."""
        if key not in self._per_forward:
            self._per_forward[key] = make()
        return self._per_forward[key]

    @classmethod
    def allocate(
        cls,
        *,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Zeroed buffers for ``layers`` layers of ``[batch, kv_heads, length, head_dim]`` (:func:`_zeroed_slots`)."""
        keys, values = _zeroed_slots(layers, (batch, kv_heads, length, head_dim), dtype, device)
        key_valid = torch.zeros(batch, length, dtype=torch.bool, device=device)
        return cls(keys=keys, values=values, key_valid=key_valid)

    @property
    def length(self) -> int:
        """Cache slots ``L``."""
        return int(self.key_valid.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers (0 while :meth:`free_slots` has freed them)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def free_slots(self) -> None:
        """Free the key and value buffers (the allocation behind every layer's), keeping :attr:`key_valid` and the
        buffers' shape: :meth:`allocate_slots` makes them again, zeroed. A decoder frees them between generations,
        so that their memory goes back to training, and keeps the rest of the generation's state."""
        if self.keys:
            self._slots = (len(self.keys), tuple(self.keys[0].shape), self.keys[0].dtype, self.keys[0].device)
        self.keys, self.values = [], []
        self.positions = None  # drops the last forward's shared values too

    def allocate_slots(self) -> None:
        """Zeroed key and value buffers again after :meth:`free_slots` (nothing while they exist, nor for a cache of no
        layers)."""
        if self.keys or self._slots is None:
            return
        self.keys, self.values = _zeroed_slots(*self._slots)

    def begin_prefill(self, prompt_mask: torch.Tensor, *, padded: bool | None = None) -> None:
        """Prepare a prefill of ``P`` columns whose real tokens ``prompt_mask [B, P]`` marks: they are the valid slots
        (none after them), their rotary positions count the real tokens before them. ``padded``: whether any
        prompt is padded, if the caller knows (None: read here, a host sync)."""
        mask = prompt_mask.bool()
        self.key_valid.zero_()
        self.key_valid[:, : mask.shape[1]] = mask
        if padded is None:  # one host sync per generation, before its first kernel
            padded = not bool(mask.all())
        self.mode, self.prefill_mask = "prefill", prefill_attention_mask(mask) if padded else None
        self.positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)

    def begin_decode(self, slot: torch.Tensor, kv_len: int, fed_valid: torch.Tensor | None = None) -> None:
        """Prepare a decode forward that writes ``slot`` and attends to the first ``kv_len`` slots; with
        ``fed_valid [B]`` (bool) first record in :attr:`key_valid` whether each row's fed token, which goes to
        ``slot``, is a real one (one kernel on CUDA for the record, the mask and the filled count)."""
        self.mode, self.slot, self.kv_len = "decode", slot, kv_len
        # one additive mask per step, shared by every layer (a boolean mask is converted by every attention call)
        self._filled, mask = _record_and_mask(self.key_valid, slot, fed_valid, self.keys[0].dtype)
        self._decode_mask = mask[:, None, None, :kv_len]
        self._per_forward.clear()  # a new forward (the caller sets no positions here)

    def begin_decode_step(
        self,
        t: torch.Tensor,
        prompt_len: torch.Tensor,
        prompt_width: int,
        kv_len: int,
        fed_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`begin_decode` for decode step ``t`` (``[]`` int64, ``>= 1``) of prompts ``prompt_width`` columns
        wide holding ``prompt_len [B]`` real tokens: slot ``P + t - 1``; returns the rows' rotary positions
        ``prompt_len + t - 1`` ``[B, 1]`` (also set as :attr:`positions`). One launch on CUDA
        (:func:`~ppo_core_decode.step_inputs.decode_step_inputs`)."""
        inputs = decode_step_inputs(
            t, prompt_len, prompt_width, self.key_valid, fed_valid, self.keys[0].dtype
        )
        self.mode, self.slot, self.kv_len = "decode", inputs.slot, kv_len
        self._filled, self._decode_mask = inputs.filled, inputs.mask[:, None, None, :kv_len]
        self.positions = inputs.positions
        return inputs.positions

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write this forward's keys/values of ``layer`` and attend over the cache.

        Args:
            layer: index of the layer's buffers.
            q: ``[B, H, S, d]`` queries (position embedding applied); ``S = P`` in prefill, 1 in decode.
            k, v: ``[B, G, S, d]`` keys (position embedding applied) and values; ``H`` a multiple of ``G``.
            scale: softmax scale (None: ``1 / sqrt(d)``).
            window: a sliding window of this many slots (``transformers``' ``sliding_window``): the query of slot
                ``i`` attends only to slots ``j > i - window``, besides the other rules; None: every slot. A
                window as long as the cache changes nothing and costs nothing.

        Returns:
            ``[B, H, S, d]`` attention outputs (``[B, H, 1, d]`` with :attr:`last_query_only`).
        """
        self._write(layer, k, v)
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be >= 1 slot, got {window}")
        if window is not None and window >= self.length:  # no two slots of the cache are that far apart
            window = None
        return self._attend_written(layer, q, k, v, scale, window)

    def _attend_written(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        window: int | None = None,
    ) -> torch.Tensor:
        """:meth:`attend` once this forward's keys and values ``k``/``v`` (``[B, G, S, d]``, the cache's slots or
        the tensors written there) are in the cache; ``window``: a sliding window shorter than the cache, or None."""
        last_only = self.mode == "prefill" and self.last_query_only
        if last_only:
            q = q[:, :, -1:]
        if self.batch_invariant:
            if window is not None:
                raise ValueError("the batch-invariant attention has no sliding window")
            return self._attend_invariant(layer, q, scale, written=k.shape[2])
        if self.mode == "prefill":
            h, g = q.shape[1], k.shape[1]
            mask = (
                self.prefill_mask
                if window is None
                else self._window_prefill_mask(window, k.shape[2], q.device)
            )
            # no padding: causal (the last query alone sees every key), and the flash kernel shares the key/value
            # heads among their query heads
            if mask is None:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=not last_only, scale=scale, enable_gqa=g != h
                )
            if g != h:  # the padded-mask kernels take one key head per query head
                k, v = (t.repeat_interleave(h // g, dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[:, :, -1:] if last_only else mask, scale=scale
            )
        bias = None if window is None else self._window_decode_bias(window, q.device)
        return self._decode_attention(layer, q, scale, bias)

    def _window_prefill_mask(self, window: int, p: int, device: torch.device) -> torch.Tensor:
        """The prefill's mask (:attr:`prefill_mask`, or the causal one without padding) with the keys ``window`` or
        more slots behind each query masked too: ``[B or 1, 1, P, P]`` bool, made once per forward and window and
        shared by the layers that use it."""

        def make() -> torch.Tensor:
            slots = torch.arange(p, device=device)
            near = (slots[:, None] - slots[None, :]) < window  # [P, P]: key j within the window of query i
            base = self.prefill_mask
            if base is None:  # no padding: the causal mask
                base = torch.ones(p, p, dtype=torch.bool, device=device).tril()[None, None]
            return base & near

        return self.per_forward(("window", window, p), make)

    def _window_decode_bias(self, window: int, device: torch.device) -> torch.Tensor:
        """The step's additive mask with the slots ``window`` or more behind the step's slot masked too (made once
        per forward and window from the step's device slot, so a captured CUDA graph makes it anew each replay)."""

        def make() -> torch.Tensor:
            slots = torch.arange(self.kv_len, device=device)
            outside = slots <= self.slot - window  # [kv_len]: too far behind the step's slot
            # a row that ended more than a window ago has no valid slot left in it: it sees its own (padding)
            # slot, so that its softmax stays finite (its output is never used); a running row's is valid anyway
            own = slots == self.slot
            return self._decode_mask.masked_fill(outside, float("-inf")).masked_fill(own, 0.0)

        return self.per_forward(("window", window), make)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this forward's keys and values of ``layer``: the first ``S`` slots in prefill, the step's slot in
        decode (one token per row)."""
        keys, values = self.keys[layer], self.values[layer]
        s = k.shape[2]
        if self.mode == "prefill":
            keys[:, :, :s] = k
            values[:, :, :s] = v
            return
        if s != 1:
            raise ValueError(f"a decode step feeds one token per row, got {s}")
        keys.index_copy_(2, self.slot.view(1), k)
        values.index_copy_(2, self.slot.view(1), v)

    def attend_rotated(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        tables: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        scale: float | None = None,
        *,
        model_rounding: bool,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """:meth:`attend` for queries and keys not rotated yet.

        ``rotate(q, k) -> (q, k)`` is the caller's rotary embedding. On CUDA it is replaced by Triton kernels that
        rotate by ``tables() -> (cos, sin)`` ``[B, S, d]`` (the forward's token positions) with the same rule
        (``model_rounding``: see :mod:`ppo_core_decode.decode_rotary`) and write the rotated keys and the values
        into the cache in the same launch:

        - a prefill rotates and writes its ``S`` tokens in one launch
          (:func:`~ppo_core_decode.decode_rotary.rotate_and_write_prompt_triton`), then attends over the cache's
          first ``S`` slots;
        - a decode step, with :data:`FUSED_DECODE` (and the Triton decode attention not turned off by
          ``PPO_CORE_DECODE_ATTENTION=sdpa``), rotates, writes and attends in one launch
          (:mod:`ppo_core_decode.decode_rotary_attention`); otherwise one launch rotates and writes, and the
          attention follows. Both write the same cache; their outputs are the same bits unless the one launch
          splits each row's slots over several programs (few rows: see
          :func:`~ppo_core_decode.decode_rotary_attention.default_split`), which changes the order of the
          softmax's fp32 sums (the outputs are still the same at every call).

        With :attr:`batch_invariant` the caller's rotation always runs (its bits are the contract there).

        Args:
            layer, scale: as in :meth:`attend`.
            q: ``[B, H, S, d]``; k, v: ``[B, G, S, d]`` (any strides).
            rotate: the caller's rotation of ``q`` and ``k``.
            tables: the forward's ``cos``/``sin`` ``[B, S, d]`` (called only when a kernel runs).
            model_rounding: whether ``rotate`` rounds each product and the sum to the model dtype.
            qk_norm: ``(q_weight [d], k_weight [d], eps)``: the per-head norms of ``q`` and ``k`` (Qwen3's), applied
                before the rotation inside the rotation's kernel; only where :meth:`rotates_in_kernel` (else a
                ``ValueError``: the caller normalises first).
        """
        kernel = self._rotation_kernel(q, k, v)
        one_launch = kernel and self._one_launch_step(q)
        if qk_norm is not None and not self._kernel_rotates(kernel, q):
            raise ValueError("qk_norm is for the rotation kernels only (see KVCache.rotates_in_kernel)")
        if kernel and self.mode == "prefill":
            cos, sin = tables()
            keys, values = self.keys[layer], self.values[layer]
            q = rotate_and_write_prompt_triton(
                q, k, v, cos, sin, keys, values, model_rounding=model_rounding, qk_norm=qk_norm
            )
            s = q.shape[2]
            return self._attend_written(layer, q, keys[:, :, :s], values[:, :, :s], scale)
        if kernel and self._one_token_step(q):
            cos, sin = (t[:, 0] for t in tables())  # [B, d]: the step's one position
            keys, values = self.keys[layer], self.values[layer]
            if one_launch:
                return rotate_write_attend_triton(
                    q,
                    k,
                    v,
                    cos,
                    sin,
                    keys,
                    values,
                    self.slot,
                    self._decode_mask,
                    scale,
                    model_rounding=model_rounding,
                    qk_norm=qk_norm,
                )
            q = rotate_and_write_triton(
                q,
                k,
                v,
                cos,
                sin,
                keys,
                values,
                self.slot,
                model_rounding=model_rounding,
                qk_norm=qk_norm,
            )
            return self._decode_attention(layer, q, scale)
        q, k = rotate(q, k)
        return self.attend(layer, q, k, v, scale)

    def _rotation_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`attend_rotated` rotates ``q``/``k`` and writes the cache with a Triton kernel."""
        return (
            not self.batch_invariant
            and rotate_and_write_triton_available(q)
            and all(t.stride(-1) == 1 for t in (q, k, v))
        )

    def rotates_in_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`attend_rotated` of ``q [B, H, S, d]``, ``k``/``v [B, G, S, d]`` rotates them in a Triton
        kernel (a prefill's, a decode step's, or the one-launch decode step's): the paths that also take the
        per-head query and key norms (``qk_norm``)."""
        return self._kernel_rotates(self._rotation_kernel(q, k, v), q)

    def _kernel_rotates(self, kernel: bool, q: torch.Tensor) -> bool:
        """:meth:`rotates_in_kernel` given :meth:`_rotation_kernel`'s answer ``kernel`` for ``q [B, H, S, d]``: a
        prefill, or a decode step of one token a row."""
        return kernel and (self.mode == "prefill" or self._one_token_step(q))

    def _one_token_step(self, q: torch.Tensor) -> bool:
        """Whether this forward of ``q [B, H, S, d]`` is a decode step of one token a row."""
        return self.mode == "decode" and q.shape[2] == 1

    def _one_launch_step(self, q: torch.Tensor) -> bool:
        """Whether a forward of ``q [B, H, S, d]`` whose rotation runs as a kernel (:meth:`_rotation_kernel`) is a
        decode step in one launch: one token per row, :data:`FUSED_DECODE`, the Triton attention not turned off
        (``PPO_CORE_DECODE_ATTENTION=sdpa``)."""
        return (
            self._one_token_step(q)
            and FUSED_DECODE
            and os.environ.get("PPO_CORE_DECODE_ATTENTION", "auto") != "sdpa"
        )

    def _decode_attention(
        self, layer: int, q: torch.Tensor, scale: float | None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's attention over the first ``kv_len`` slots with ``bias`` (None: the step's mask)."""
        keys, values = self.keys[layer], self.values[layer]
        # nothing past this step's slot is filled yet: the kernel stops there within the bucket's kv_len
        mask = self._decode_mask if bias is None else bias
        return decode_attention(
            q, keys[:, :, : self.kv_len], values[:, :, : self.kv_len], mask, scale, self._filled
        )

    def _attend_invariant(
        self, layer: int, q: torch.Tensor, scale: float | None, written: int
    ) -> torch.Tensor:
        """:meth:`attend`'s attention, once the keys and values are written, by
        :func:`~ppo_core_decode.batch_invariant.invariant_attention` (both modes; ``written``: the slots this
        forward wrote, the last ``q.shape[2]`` of which hold the queries' own tokens in a prefill)."""
        keys, values = self.keys[layer], self.values[layer]
        if self.mode == "prefill":
            slots, length = torch.arange(written - q.shape[2], written, device=q.device), written
        else:
            slots, length = self.slot.view(1), self.kv_len
        q = q if q.stride(-1) == 1 else q.contiguous()
        return invariant_attention(
            q, keys[:, :, :length], values[:, :, :length], self.key_valid[:, :length], slots, scale
        )
