"""Checks of a rollout's inputs, shared by every decoding path: the prompts and the EOS/pad token ids.

A bad prompt batch fails far from its cause if it reaches the model (an ``IndexError`` in the embedding, a reshape
error in attention) or, worse, generates something without a word (a right-padded prompt continues from its
padding; an all-padding row from nothing; an EOS id outside the vocabulary never ends a response). The checks
here run once per generation on the small ``[B, P]`` prompt tensors, folded into one host synchronisation; the
slow descriptions (which rows, which ids) are computed only when one of them failed.

Right-padded prompts (a 0 of the mask after a 1 in some row) are accepted: :func:`check_prompts` moves each row's
tokens to the right end (a stable sort of the mask: the tokens keep their order), which is the left-padded batch
the decoders expect. The model sees the same tokens at the same positions (positions count the mask's ones), so
the responses are those of the left-padded prompts; the returned ``prompts`` are left-padded.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch
from torch import nn

from ppo_core._checks import check_mask_deferred, check_mask_flag, check_ndim, check_tensor, describe

__all__ = ["CheckedPrompts", "check_prompts", "check_token_id", "vocab_size_of"]

_SHOWN = 8  # row indices named in an error message


@dataclasses.dataclass(frozen=True)
class CheckedPrompts:
    """A prompt batch after :func:`check_prompts`."""

    prompts: torch.Tensor
    """``[B, P]`` token ids, left-padded (the input's rows, their tokens moved right where it was right-padded)."""
    mask: torch.Tensor
    """``[B, P]`` bool, true on prompt tokens."""
    padded: bool
    """Whether any row has padding (False: every mask entry is 1)."""


def check_token_id(name: str, value: object, vocab_size: int | None, *, optional: bool = False) -> int | None:
    """``value`` as an int if it is a token id of a vocabulary of ``vocab_size`` (``0 <= value < vocab_size``; only
    ``>= 0`` when ``vocab_size`` is None), else raise naming ``name``. None passes when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int token id, got {describe(value)}")
    value = int(value)
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        bound = f"in [0, {vocab_size}) (the model's vocabulary size)" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} must be a token id {bound}, got {value}")
    return value


def vocab_size_of(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds: its input embedding's rows (``get_input_embeddings()``, a wrapper's
    ``.model``), else ``config.vocab_size``; None when it says neither."""
    for candidate in (model, getattr(model, "model", None)):
        get_embeddings = getattr(candidate, "get_input_embeddings", None)
        if callable(get_embeddings):
            try:
                embeddings = get_embeddings()
            except NotImplementedError:
                embeddings = None
            rows = getattr(embeddings, "num_embeddings", None)
            if isinstance(rows, int):
                return rows
        size = getattr(getattr(candidate, "config", None), "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def check_prompts(
    prompts: object,
    prompt_mask: object,
    vocab_size: int | None,
    *,
    names: tuple[str, str] = ("prompts", "prompt_mask"),
) -> CheckedPrompts:
    """Validate a prompt batch for generation and left-pad it where it is right-padded (see the module docstring).

    Raises ``TypeError`` for a non-tensor or a non-integer ``prompts`` and ``ValueError``, naming the argument, for:
    a shape other than ``[B, P]``, a mask of another shape or on another device, ``P = 0``, a mask entry other than 0/1, a row with no
    prompt token (the message lists the rows), and a token id (padding included: the model embeds every position)
    outside ``[0, vocab_size)`` (the first one and how many). ``B = 0`` passes: the caller returns empty outputs.

    Args:
        prompts: ``[B, P]`` integer token ids, left-padded (right-padded ones are left-padded here).
        prompt_mask: ``[B, P]`` 1 on prompt tokens, 0 on padding (bool, integer or floating 0/1).
        vocab_size: the model's vocabulary size; None skips the upper bound.
        names: the two arguments' names in error messages.

    Example:
        >>> out = check_prompts(torch.tensor([[5, 6, 0], [7, 8, 9]]), torch.tensor([[1, 1, 0], [1, 1, 1]]), 10)
        >>> out.prompts.tolist(), out.mask.long().tolist(), out.padded
        ([[0, 5, 6], [7, 8, 9]], [[0, 1, 1], [1, 1, 1]], True)
    """
    ids_name, mask_name = names
    ids = check_ndim(ids_name, check_tensor(ids_name, prompts), 2)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{ids_name} must hold integer token ids (int64), got dtype {ids.dtype}")
    mask, invalid = check_mask_deferred(mask_name, prompt_mask, like=ids, like_name=ids_name)
    if mask.device != ids.device:
        raise ValueError(
            f"{mask_name} is on {mask.device} but {ids_name} on {ids.device}; put both on one device"
        )
    b, p = ids.shape
    if b == 0:
        return CheckedPrompts(prompts=ids, mask=mask, padded=False)
    if p == 0:
        raise ValueError(
            f"{ids_name} has shape {tuple(ids.shape)}: every prompt needs at least one token (P >= 1)"
        )
    bad_id = ids < 0
    if vocab_size is not None:
        bad_id = bad_id | (ids >= vocab_size)
    flags = [
        mask.all().logical_not(),  # padded
        (mask[:, :-1] & ~mask[:, 1:]).any(),  # right-padded: a 0 after a 1
        mask.any(dim=1).logical_not().any(),  # a row of padding only
        bad_id.any(),
    ]
    if invalid is not None:
        flags.append(invalid)
    padded, right, empty, out_of_range, *bad_mask = torch.stack(flags).tolist()  # the one host sync
    if bad_mask and bad_mask[0]:
        check_mask_flag(mask_name, invalid)
    if empty:
        rows = mask.any(dim=1).logical_not().nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:_SHOWN])) + (", ..." if len(rows) > _SHOWN else "")
        raise ValueError(
            f"{mask_name} has no prompt token (all 0) in {len(rows)} of {b} rows (rows {shown}): "
            "a response needs a prompt to continue; drop those rows"
        )
    if out_of_range:
        where = bad_id.nonzero()
        row, col = where[0].tolist()
        bound = f"[0, {vocab_size}) (the model's vocabulary size)" if vocab_size is not None else ">= 0"
        raise ValueError(
            f"{ids_name} holds {len(where)} token id(s) outside {bound}: the first is {int(ids[row, col])} at "
            f"row {row}, column {col} (padding positions included: the model embeds every position)"
        )
    if right:
        order = torch.sort(mask.to(torch.uint8), dim=1, stable=True).indices
        ids, mask = ids.gather(1, order), mask.gather(1, order)
    return CheckedPrompts(prompts=ids, mask=mask, padded=bool(padded))
