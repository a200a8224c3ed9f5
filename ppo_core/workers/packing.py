"""Padding-free micro-batches: the valid tokens of padded rows packed into one sequence, and the way back.

The algorithm hands an engine padded micro-batches (``input_ids``/``attention_mask [b, S]``, ``S = P + R``: left-padded
prompts, right-padded responses) and wants per-token outputs ``[b, R]``, where response token ``t`` of a row is
predicted by the model output at position ``P + t - 1``. An engine that packs runs the model once on the
``N = attention_mask.sum()`` valid tokens laid end to end, one document per row (per-document causal attention,
positions restarting at 0: :mod:`ppo_core.kernels.packed_attention`), then reads the outputs it needs:

- ``output_index [n]``: packed positions whose outputs predict a response token (those where ``P + t - 1`` is a
  valid token), in row-major order of the response grid;
- ``output_slots [n]``: where they go in the flattened ``[b * R]`` grid;
- :meth:`PackedMicroBatch.unpack` scatters ``[n, ...]`` values into ``[b, R, ...]`` with zeros elsewhere
  (differentiably).

A response token whose predicting position is padding (after the end of a short response, or a row with an empty
prompt) gets 0; the loss masks those positions anyway (``response_mask`` is 0 there), and where it is 1 the packed
outputs equal the padded path's. The packed sequence may be padded at its end with one extra document (``pad_to``:
a multiple for sequence parallelism, a common length for pipeline stages); no output is read from it.

Example:
    >>> ids = torch.tensor([[0, 5, 6, 7, 0], [4, 5, 6, 0, 0]])
    >>> mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    >>> packed = pack_micro_batch(ids, mask, response_len=2)
    >>> packed.input_ids.tolist(), packed.documents.position_ids.tolist()
    ([5, 6, 7, 4, 5, 6], [0, 1, 2, 0, 1, 2])
    >>> packed.output_index.tolist(), packed.output_slots.tolist()
    ([1, 2, 5], [0, 1, 2])
    >>> packed.unpack(torch.tensor([1.0, 2.0, 3.0]))
    tensor([[1., 2.],
            [3., 0.]])
"""

from __future__ import annotations

import dataclasses

import torch

from ppo_core.kernels.packed_attention import PackedDocuments

__all__ = ["PackedMicroBatch", "pack_micro_batch"]


@dataclasses.dataclass(frozen=True, eq=False)
class PackedMicroBatch:
    """One padded micro-batch as a packed sequence (see the module docstring)."""

    input_ids: torch.Tensor
    """``[T]`` the valid tokens of every row in order, then the padding (id 0) if any."""
    documents: PackedDocuments
    """The ``T`` tokens' documents: one per row with valid tokens, plus the padding."""
    output_index: torch.Tensor
    """``[n]`` int64 packed positions whose outputs predict response tokens."""
    output_slots: torch.Tensor
    """``[n]`` int64 indices into the flattened ``[rows * response_len]`` grid of those response tokens."""
    rows: int
    """``b``: rows of the padded micro-batch."""
    response_len: int
    """``R``: response columns of the padded micro-batch."""

    @property
    def num_tokens(self) -> int:
        """``T``: packed length, padding included."""
        return int(self.input_ids.shape[0])

    def labels(self, responses: torch.Tensor) -> torch.Tensor:
        """The response tokens ``[n]`` that the outputs at :attr:`output_index` predict (``responses [b, R]``)."""
        return responses.reshape(-1)[self.output_slots]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [n, ...]`` (one per :attr:`output_index`) as ``[b, R, ...]``, zeros elsewhere; differentiable."""
        if values.shape[0] != self.output_slots.shape[0]:
            raise ValueError(
                f"values must have one entry per output position ({self.output_slots.shape[0]}), got "
                f"{tuple(values.shape)}"
            )
        grid = values.new_zeros((self.rows * self.response_len, *values.shape[1:]))
        grid = grid.index_copy(0, self.output_slots, values)
        return grid.view(self.rows, self.response_len, *values.shape[1:])


def pack_micro_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    pad_to_multiple: int = 1,
    min_tokens: int = 1,
) -> PackedMicroBatch:
    """Pack the valid tokens of a padded micro-batch into one sequence.

    Args:
        input_ids: ``[b, S]`` prompts then responses.
        attention_mask: ``[b, S]`` 1 on valid tokens (any pattern; positions count valid tokens only).
        response_len: ``R``, the response columns at the end of ``S`` (``S > R``: at least one prompt column).
        pad_to_multiple: pad the packed length up to a multiple of this (sequence parallelism needs ``TP``).
        min_tokens: pad the packed length up to at least this many tokens (a common length for pipeline stages;
            at least 1 so that a micro-batch without valid tokens still runs the model).

    Returns:
        The :class:`PackedMicroBatch` (one host synchronisation: the row lengths).

    Raises:
        ValueError: shapes that do not match, ``S <= R``, or sizes below 1.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [b, S], got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    rows, seq = input_ids.shape
    if not 0 <= response_len < seq:
        raise ValueError(
            f"response_len must be in [0, S) with S = {seq} (a prompt column predicts the first response "
            f"token), got {response_len}"
        )
    if pad_to_multiple < 1 or min_tokens < 1:
        raise ValueError(f"pad_to_multiple and min_tokens must be >= 1, got {pad_to_multiple}, {min_tokens}")
    valid = attention_mask.bool()
    lengths = valid.sum(-1).tolist()
    n = sum(lengths)
    total = max(n, min_tokens)
    total = -(-total // pad_to_multiple) * pad_to_multiple
    device = input_ids.device
    ids = input_ids[valid]
    if total > n:
        ids = torch.cat([ids, ids.new_zeros(total - n)])
    documents = PackedDocuments.from_seqlens([*lengths, total - n], device)
    # packed position of every valid token (row-major order is the packing order)
    packed_pos = valid.reshape(-1).long().cumsum(0).sub_(1).view(rows, seq)
    window = slice(seq - response_len - 1, seq - 1)
    predicts = valid[:, window].reshape(-1)
    slots = predicts.nonzero().squeeze(1)
    return PackedMicroBatch(
        input_ids=ids,
        documents=documents,
        output_index=packed_pos[:, window].reshape(-1)[slots],
        output_slots=slots.to(device),
        rows=int(rows),
        response_len=int(response_len),
    )
