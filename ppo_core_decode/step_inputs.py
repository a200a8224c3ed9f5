"""The inputs of a decode step in one launch: its cache slot, the rows' rotary positions, the record of the fed
token and the attention mask.

Decode step ``t`` (``t >= 1``: the prefill drew token 0) feeds each row the token drawn at ``t - 1``, which goes to
cache slot ``P + t - 1`` (``P`` the prompt width) and sits at rotary position ``prompt_len + t - 1`` (the row's
real prompt tokens before it, then its responses). Before the step's forward:

- ``key_valid [B, L]`` (bool) gets ``fed_valid [B]`` at the slot: whether each row's fed token is a real one (the
  row had not finished when it was drawn);
- the additive mask ``[B, L]`` in the model dtype is ``0`` where ``key_valid`` holds, ``-inf`` elsewhere (one per
  step, shared by every layer);
- the filled count is ``slot + 1``.

In PyTorch these are four kernels with a launch gap each; :func:`decode_step_inputs` writes them in one Triton
launch, one program a row, on CUDA (and under
``TRITON_INTERPRET=1`` on CPU tensors), and :func:`decode_step_inputs_reference` is its contract (any device).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ppo_core.kernels.compiled import cuda_compiled
from ppo_core.kernels.launch_sizes import next_power_of_2
from ppo_core.kernels.triton_scan import _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["DecodeStepInputs", "decode_step_inputs", "decode_step_inputs_reference"]

_BLOCK_L = 1024
"""Cache slots a program handles per loop iteration."""


class DecodeStepInputs(NamedTuple):
    """What :func:`decode_step_inputs` returns."""

    slot: torch.Tensor
    """``[]`` int64: ``P + t - 1``."""
    positions: torch.Tensor
    """``[B, 1]`` int64: ``prompt_len + t - 1``."""
    filled: torch.Tensor
    """``[]`` int64: ``slot + 1``, the slots that may hold a token."""
    mask: torch.Tensor
    """``[B, L]`` additive mask in ``dtype``: 0 on valid slots, ``-inf`` elsewhere."""


@cuda_compiled
def _slot_and_positions(
    t: torch.Tensor, prompt_len: torch.Tensor, prompt_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return t + (prompt_width - 1), (prompt_len + t - 1)[:, None]


@cuda_compiled
def _record_and_mask(
    key_valid: torch.Tensor, slot: torch.Tensor, fed_valid: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    valid = key_valid
    if fed_valid is not None:
        at_slot = torch.arange(key_valid.shape[1], device=slot.device) == slot
        valid = torch.where(at_slot, fed_valid[:, None], key_valid)
        key_valid.copy_(valid)
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    return slot + 1, torch.where(valid, zero, float("-inf"))


def decode_step_inputs_reference(
    t: torch.Tensor,
    prompt_len: torch.Tensor,
    prompt_width: int,
    key_valid: torch.Tensor,
    fed_valid: torch.Tensor | None,
    dtype: torch.dtype,
) -> DecodeStepInputs:
    """:func:`decode_step_inputs` in PyTorch (compiled on CUDA): ``t [] int64``, ``prompt_len [B] int64``,
    ``key_valid [B, L]`` bool (``fed_valid [B]`` bool written at the slot in place, unless None).

    Example:
        >>> valid = torch.tensor([[True, False, False]])
        >>> out = decode_step_inputs_reference(torch.tensor(1), torch.tensor([1]), 2, valid, torch.tensor([True]),
        ...                                    torch.float32)
        >>> int(out.slot), out.positions.tolist(), valid.tolist(), out.mask.tolist()
        (2, [[1]], [[True, False, True]], [[0.0, -inf, 0.0]])
    """
    slot, positions = _slot_and_positions(t, prompt_len, prompt_width)
    filled, mask = _record_and_mask(key_valid, slot, fed_valid, dtype)
    return DecodeStepInputs(slot, positions, filled, mask)


def decode_step_inputs(
    t: torch.Tensor,
    prompt_len: torch.Tensor,
    prompt_width: int,
    key_valid: torch.Tensor,
    fed_valid: torch.Tensor | None,
    dtype: torch.dtype,
) -> DecodeStepInputs:
    """Decode step ``t``'s slot, positions, filled count and mask, with ``fed_valid`` recorded in ``key_valid``
    (module docstring): one Triton launch for CUDA tensors (or under ``TRITON_INTERPRET=1``) with at least one
    row, else :func:`decode_step_inputs_reference`.

    Args:
        t: ``[]`` int64, the step (``>= 1``).
        prompt_len: ``[B]`` int64, each row's real prompt tokens.
        prompt_width: ``P``, the prompt columns (padding included).
        key_valid: ``[B, L]`` bool, contiguous; updated in place at the slot when ``fed_valid`` is given.
        fed_valid: ``[B]`` bool, or None (nothing recorded).
        dtype: the mask's dtype (the model's).
    """
    rows, length = key_valid.shape
    kernel = (
        triton is not None
        and (key_valid.is_cuda or _interpreting())
        and rows > 0
        and key_valid.is_contiguous()
        and tuple(prompt_len.shape) == (rows,)
        and prompt_len.dtype == torch.int64
        and t.dtype == torch.int64
        and t.numel() == 1
        and (fed_valid is None or (tuple(fed_valid.shape) == (rows,) and fed_valid.dtype == torch.bool))
    )
    if not kernel:
        return decode_step_inputs_reference(t, prompt_len, prompt_width, key_valid, fed_valid, dtype)
    device = key_valid.device
    slot = torch.empty((), dtype=torch.int64, device=device)
    filled = torch.empty((), dtype=torch.int64, device=device)
    positions = torch.empty(rows, 1, dtype=torch.int64, device=device)
    mask = torch.empty(rows, length, dtype=dtype, device=device)
    _step_inputs_kernel[(rows,)](
        t,
        prompt_len,
        key_valid,
        fed_valid if fed_valid is not None else key_valid,
        slot,
        filled,
        positions,
        mask,
        length,
        prompt_width,
        RECORD=fed_valid is not None,
        BLOCK_L=min(_BLOCK_L, next_power_of_2(length)),
        num_warps=4,
    )
    return DecodeStepInputs(slot, positions, filled, mask)


if triton is not None:

    @triton.jit
    def _step_inputs_kernel(
        T,
        PromptLen,
        KeyValid,
        FedValid,
        Slot,
        Filled,
        Positions,
        Mask,
        length,
        prompt_width,
        RECORD: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        row = tl.program_id(0)
        t = tl.load(T)
        slot = t + prompt_width - 1
        tl.store(Positions + row, tl.load(PromptLen + row) + t - 1)
        tl.store(Slot, slot, mask=row == 0)
        tl.store(Filled, slot + 1, mask=row == 0)
        base = row.to(tl.int64) * length
        if RECORD:
            fed = tl.load(FedValid + row)
            # only this row's slot changes; another thread of this program may read it back for the mask below,
            # hence the barrier between the store and the loads
            tl.store(KeyValid + base + slot, fed, mask=(slot >= 0) & (slot < length))
            tl.debug_barrier()
        for start in range(0, length, BLOCK_L):
            cols = start + tl.arange(0, BLOCK_L)
            inside = cols < length
            valid = tl.load(KeyValid + base + cols, mask=inside, other=0) != 0
            tl.store(
                Mask + base + cols,
                tl.where(valid, 0.0, float("-inf")).to(Mask.dtype.element_ty),
                mask=inside,
            )
