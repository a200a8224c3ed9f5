"""Hypothesis strategies for PPO-shaped data, importable by users to property-test their own code.

The structure of a batch (sizes, response lengths, gaps, group layout) is drawn by hypothesis so that failures
shrink to small readable cases; the floating contents are drawn from a ``torch.Generator`` seeded by hypothesis,
which keeps generation fast and reproducible. Every strategy takes ``device`` so the same properties run on a GPU.

Example:
    >>> from hypothesis import given
    >>> from ppo_core.testing import ppo_batches
    >>> @given(ppo_batches(max_batch=8, max_len=16))
    ... def test_my_loss_ignores_padding(b):
    ...     assert b.response_mask.shape == b.token_level_rewards.shape
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "PPOBatch",
    "group_ids",
    "mask_rows",
    "ppo_batches",
    "response_masks",
]


_SHOWN_ROWS = 8
_SHOWN_WIDTH = 24


def _mask_summary(mask: torch.Tensor) -> str:
    """The structure of a ``[B, T]`` mask in one short line: rows as ``1``/``.`` strings, or valid counts if wide."""
    rows = (mask.detach().cpu() != 0).tolist()
    more = f", +{len(rows) - _SHOWN_ROWS} rows" if len(rows) > _SHOWN_ROWS else ""
    if mask.shape[-1] <= _SHOWN_WIDTH:
        shown = ["".join("1" if ok else "." for ok in row) for row in rows[:_SHOWN_ROWS]]
        return f"mask={shown}{more}"
    return f"valid_per_row={[sum(row) for row in rows[:_SHOWN_ROWS]]}{more}"


def _tensor_kind(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}"


@dataclass(repr=False)
class PPOBatch:
    """A PPO-shaped batch of ``B`` responses padded to ``T`` tokens.

    Attributes:
        response_mask: ``[B, T]`` bool, right-padded, possibly with interior gaps (multi-turn observation tokens)
            and all-masked rows.
        token_level_rewards: ``[B, T]`` float, the outcome reward at the last valid token of each row (all zero on
            an all-masked row), plus dense per-token rewards when drawn with ``dense_rewards=True``.
        values: ``[B, T]`` float critic values.
        old_log_probs / log_probs / ref_log_probs: ``[B, T]`` float, log-probabilities of the sampled tokens under
            three nearby real softmax policies (all <= 0).
        reward_baselines: ``[B]`` float (ReMax baselines).
        index: group id per row, a ``list`` of str or int, or a 1-D int64 tensor (see ``group_ids``). Rows of one
            group are contiguous in ``group_sizes`` order, but ``shuffle_groups`` may permute them.
        group_sizes: size of each group, in the order groups first appear.
        scores: ``[B]`` float, the drawn outcome reward per row before it was placed on a token.
    """

    response_mask: torch.Tensor
    token_level_rewards: torch.Tensor
    values: torch.Tensor
    old_log_probs: torch.Tensor
    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    reward_baselines: torch.Tensor
    index: list | torch.Tensor
    group_sizes: list[int] = field(default_factory=list)
    scores: torch.Tensor | None = None

    def __repr__(self) -> str:
        """One line: sizes, dtype, groups and the mask's structure (hypothesis prints this for a failing example).

        Every tensor is still available as an attribute; the default dataclass repr printed them all (70-140 lines).
        """
        index = type(self.index).__name__
        if isinstance(self.index, list) and self.index:
            index += f"[{type(self.index[0]).__name__}]"
        return (
            f"PPOBatch(B={self.batch_size}, T={self.seq_len}, {_tensor_kind(self.values)}, "
            f"group_sizes={self.group_sizes}, index={index}, {_mask_summary(self.response_mask)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """The same line for hypothesis' failure reports and IPython, which pretty-print dataclasses field by field."""
        printer.text(repr(self))

    @property
    def batch_size(self) -> int:
        return self.response_mask.shape[0]

    @property
    def seq_len(self) -> int:
        return self.response_mask.shape[1]


@st.composite
def mask_rows(
    draw: st.DrawFn,
    seq_len: int,
    *,
    gaps: bool = True,
    allow_empty: bool = True,
) -> list[int]:
    """One right-padded mask row of length ``seq_len`` as a list of 0/1, with optional interior gaps."""
    min_len = 0 if allow_empty else 1
    length = draw(st.integers(min_value=min_len, max_value=seq_len))
    row = [1] * length + [0] * (seq_len - length)
    if gaps and length >= 3 and draw(st.booleans()):
        start = draw(st.integers(min_value=1, max_value=length - 2))
        stop = draw(st.integers(min_value=start + 1, max_value=length - 1))
        for t in range(start, stop):
            row[t] = 0
    return row


@st.composite
def response_masks(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    min_len: int = 1,
    max_len: int = 16,
    gaps: bool = True,
    allow_empty_rows: bool = True,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``[B, T]`` bool response masks: right padding, optional interior gaps, optional all-masked rows."""
    batch = draw(st.integers(min_value=min_batch, max_value=max_batch))
    seq_len = draw(st.integers(min_value=min_len, max_value=max_len))
    rows = [draw(mask_rows(seq_len, gaps=gaps, allow_empty=allow_empty_rows)) for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(batch, seq_len)


@st.composite
def group_ids(draw: st.DrawFn, group_sizes: Sequence[int], kind: str | None = None) -> list | torch.Tensor:
    """Group labels for contiguous groups of the given sizes.

    ``kind`` is ``"str"`` (uuid-like strings, including look-alikes such as ``"01"`` and ``"1"``), ``"int"``
    (a Python list of ints, possibly negative or huge), ``"tensor"`` (1-D int64 tensor) or None (drawn).
    """
    kind = kind or draw(st.sampled_from(["str", "int", "tensor"]))
    n_groups = len(group_sizes)
    if kind == "str":
        labels = draw(
            st.lists(
                st.text(alphabet="0123456789abcdef-", min_size=1, max_size=6),
                min_size=n_groups,
                max_size=n_groups,
                unique=True,
            )
        )
    else:
        labels = draw(
            st.lists(
                st.integers(min_value=-(2**40), max_value=2**40),
                min_size=n_groups,
                max_size=n_groups,
                unique=True,
            )
        )
    ids = [label for label, size in zip(labels, group_sizes, strict=True) for _ in range(size)]
    if kind == "tensor":
        return torch.tensor(ids, dtype=torch.int64)
    return ids


def _check_range(name: str, low: int, high: int) -> None:
    """``0 <= min_<name> <= max_<name>``, else a ``ValueError`` naming both (a strategy would otherwise draw sizes
    outside what was asked)."""
    if low < 0 or high < low:
        raise ValueError(
            f"ppo_batches: need 0 <= min_{name} <= max_{name}, got min_{name}={low}, max_{name}={high}"
        )


@st.composite
def ppo_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 12,
    min_len: int = 1,
    max_len: int = 16,
    max_group_size: int = 4,
    gaps: bool = True,
    allow_empty_rows: bool = True,
    dense_rewards: bool = False,
    id_kind: str | None = None,
    shuffle_groups: bool = False,
    vocab_size: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PPOBatch:
    """A full :class:`PPOBatch` with groups of size ``1..max_group_size``.

    Rewards are an outcome score on the last valid token of each row (``dense_rewards`` adds per-token noise on
    valid tokens too). Log-probs come from three nearby softmax policies over ``vocab_size`` tokens.
    ``min_batch=0`` draws empty batches (``B = 0``) too, ``min_len=0`` zero-length responses (``T = 0``).
    """
    _check_range("batch", min_batch, max_batch)
    _check_range("len", min_len, max_len)
    if max_group_size < 1:
        raise ValueError(f"ppo_batches: max_group_size must be >= 1, got {max_group_size}")
    drawn = draw(
        st.lists(
            st.integers(min_value=1, max_value=max_group_size),
            min_size=0 if min_batch == 0 else 1,
            max_size=max_batch,
        )
    )
    group_sizes: list[int] = []
    for size in drawn:  # keep whole groups while they fit, then top up to min_batch with singletons
        if sum(group_sizes) + size <= max_batch:
            group_sizes.append(size)
    group_sizes += [1] * max(0, min_batch - sum(group_sizes))
    batch = sum(group_sizes)
    seq_len = draw(st.integers(min_value=min_len, max_value=max_len))
    rows = [draw(mask_rows(seq_len, gaps=gaps, allow_empty=allow_empty_rows)) for _ in range(batch)]
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    index = draw(group_ids(group_sizes, id_kind))

    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor(rows, dtype=torch.bool).reshape(batch, seq_len)
    score_kind = draw(st.sampled_from(["binary", "continuous"]))
    if score_kind == "binary":
        scores = torch.randint(0, 2, (batch,), generator=gen).to(torch.float64)
    else:
        scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(batch, seq_len, dtype=torch.float64)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    last = torch.where(mask, positions, torch.full_like(positions, -1))
    last = last.amax(dim=1) if seq_len else torch.full((batch,), -1, dtype=torch.long)
    has_valid = last >= 0
    rewards[has_valid.nonzero().squeeze(-1), last[has_valid]] = scores[has_valid]
    if dense_rewards:
        rewards = rewards + 0.1 * torch.randn(batch, seq_len, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)

    logits = torch.randn(batch, seq_len, vocab_size, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab_size, (batch, seq_len, 1), generator=gen)

    def _logp(z: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(z, dim=-1).gather(-1, tokens).squeeze(-1)

    old = _logp(logits)
    new = _logp(logits + 0.3 * torch.randn(logits.shape, generator=gen, dtype=torch.float64))
    ref = _logp(logits + 0.3 * torch.randn(logits.shape, generator=gen, dtype=torch.float64))
    baselines = torch.randn(batch, generator=gen, dtype=torch.float64)

    if shuffle_groups and batch > 1:
        perm = torch.randperm(batch, generator=gen)
        mask, rewards, values, old, new, ref, baselines, scores = (
            t[perm] for t in (mask, rewards, values, old, new, ref, baselines, scores)
        )
        index = index[perm] if isinstance(index, torch.Tensor) else [index[i] for i in perm.tolist()]

    def _to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype, device=device)

    if isinstance(index, torch.Tensor):
        index = index.to(device)
    return PPOBatch(
        response_mask=mask.to(device),
        token_level_rewards=_to(rewards),
        values=_to(values),
        old_log_probs=_to(old),
        log_probs=_to(new),
        ref_log_probs=_to(ref),
        reward_baselines=_to(baselines),
        index=index,
        group_sizes=group_sizes,
        scores=_to(scores),
    )
