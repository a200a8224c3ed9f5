"""Token-budget micro-batches: the partition (every row once, every micro-batch within the budget or a single row,
the fewest micro-batches the lower bound allows when one fits), the config fields, and the workers' use of them
(row order restored after a forward pass, the summed gradient of an update unchanged)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.batch import partition_by_token_budget
from ppo_core.keys import KEYS
from ppo_core.workers._common import split_micro_batches
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig


@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 60))
def test_partition_covers_every_row_once_within_the_budget(lengths: list[int], budget: int) -> None:
    parts = partition_by_token_budget(lengths, budget)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p and p == sorted(p) for p in parts)
    assert [p[0] for p in parts] == sorted(p[0] for p in parts)
    for p in parts:
        assert len(p) == 1 or sum(lengths[i] for i in p) <= budget
    # a row over the budget is alone
    for i, n in enumerate(lengths):
        if n > budget:
            assert [i] in parts
    # never fewer micro-batches than the tokens need
    over = sum(n > budget for n in lengths)
    lower = over + math.ceil(sum(n for n in lengths if n <= budget) / budget)
    assert len(parts) >= min(lower, len(lengths))
    if lengths and sum(lengths) <= budget:
        assert parts == [list(range(len(lengths)))]


def test_partition_balances_the_micro_batches() -> None:
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]  # 40 tokens, budget 20: two micro-batches of 20
    parts = partition_by_token_budget(lengths, 20)
    assert sorted(sum(lengths[i] for i in p) for p in parts) == [20, 20]


def test_partition_edge_cases_and_errors() -> None:
    assert partition_by_token_budget([], 5) == []
    assert partition_by_token_budget([0, 0, 0], 1) == [[0, 1, 2]]
    assert partition_by_token_budget(torch.tensor([7]), 3) == [[0]]
    assert partition_by_token_budget([3.5, 3.5], 7) == [[0, 1]]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            partition_by_token_budget([1, 2], bad)
    with pytest.raises(ValueError, match="seqlens"):
        partition_by_token_budget([1, -2], 4)
    with pytest.raises(ValueError, match="1-D"):
        partition_by_token_budget(torch.ones(2, 2), 4)
    with pytest.raises(TypeError, match="seqlens"):
        partition_by_token_budget("12", 4)


def _batch(lengths: list[int], width: int = 12) -> TensorDict:
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return TensorDict(
        {KEYS.attention_mask: mask, "row": torch.arange(len(lengths))}, batch_size=[len(lengths)]
    )


@given(st.lists(st.integers(0, 12), min_size=1, max_size=20), st.integers(1, 30))
def test_split_micro_batches_by_tokens_returns_the_row_order(lengths: list[int], budget: int) -> None:
    batch = _batch(lengths)
    micros, order = split_micro_batches(batch, rows=None, max_tokens=budget)
    assert order is not None
    assert torch.equal(torch.cat([m["row"] for m in micros]), order)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    for m in micros:
        tokens = int(m[KEYS.attention_mask].sum())
        assert tokens <= budget or m.batch_size[0] == 1


def test_split_micro_batches_by_rows_and_empty_batches() -> None:
    batch = _batch([3, 4, 5, 6, 7])
    micros, order = split_micro_batches(batch, rows=2, max_tokens=None)
    assert order is None and [m["row"].tolist() for m in micros] == [[0, 1], [2, 3], [4]]
    empty = batch[:0]
    micros, order = split_micro_batches(empty, rows=None, max_tokens=4)
    assert order is None and len(micros) == 1 and micros[0].batch_size[0] == 0


@pytest.mark.parametrize("cls", [PPOActorConfig, PPOCriticConfig])
def test_config_takes_one_of_rows_or_tokens(cls) -> None:
    cfg = cls.from_dict({"ppo_max_token_len_per_gpu": 4096, "forward_max_token_len_per_gpu": 8192})
    assert cls.from_dict(cfg.to_dict()) == cfg and cfg.use_remove_padding
    with pytest.raises(ValueError, match=r"micro_batch_size.*ppo_max_token_len_per_gpu"):
        cls.from_dict({"micro_batch_size": 2, "ppo_max_token_len_per_gpu": 4096})
    with pytest.raises(ValueError, match=r"forward_micro_batch_size.*forward_max_token_len_per_gpu"):
        cls.from_dict({"forward_micro_batch_size": 2, "forward_max_token_len_per_gpu": 4096})
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        cls.from_dict({"ppo_max_token_len_per_gpu": 0})
    with pytest.raises(TypeError, match="use_remove_padding"):
        cls.from_dict({"use_remove_padding": "false"})
