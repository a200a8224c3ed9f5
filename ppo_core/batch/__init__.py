"""Batches of rows on ``tensordict.TensorDict``: data-parallel split/merge, row ops, mini-batches, balancing.

A batch is a ``TensorDict`` with ``batch_size=[B]``; per-row strings and objects (``uid``, ``data_source``,
prompts) are ``NonTensorStack`` fields and follow the rows through every operation.

Example:
    >>> import torch
    >>> from tensordict import NonTensorStack, TensorDict
    >>> from ppo_core.batch import merge_from_dp, split_for_dp
    >>> b = TensorDict({"x": torch.arange(5), "uid": NonTensorStack(*"abcde")}, batch_size=[5])
    >>> shards, info = split_for_dp(b, 2, pad="repeat")
    >>> merge_from_dp(shards, info).get("uid").tolist()
    ['a', 'b', 'c', 'd', 'e']
"""

from __future__ import annotations

from ppo_core.batch.balance import balance_by_seqlen, seqlen_balance_metrics
from ppo_core.batch.budget import partition_by_token_budget
from ppo_core.batch.dp import PAD_MODES, PadInfo, merge_from_dp, split_for_dp
from ppo_core.batch.group_balance import balance_groups_by_seqlen
from ppo_core.batch.minibatch import iter_minibatches
from ppo_core.batch.ops import (
    concat,
    pad_to_multiple,
    repeat,
    repeat_interleave,
    select,
    split,
    union,
    unpad,
)
from ppo_core.batch.validate import validate_batch

__all__ = [
    "PAD_MODES",
    "PadInfo",
    "balance_by_seqlen",
    "balance_groups_by_seqlen",
    "concat",
    "iter_minibatches",
    "merge_from_dp",
    "pad_to_multiple",
    "partition_by_token_budget",
    "repeat",
    "repeat_interleave",
    "select",
    "seqlen_balance_metrics",
    "split",
    "split_for_dp",
    "union",
    "unpad",
    "validate_batch",
]
