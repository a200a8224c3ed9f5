"""Data metrics from per-shard parts equal ``compute_data_metrics`` of the whole batch, for any cut into shards:
row statistics bit for bit, token statistics within 1e-12 relative; the lengths feed the timing metrics."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from ppo_core.metrics.partial import data_metric_parts, lengths_of_parts, reduce_data_metric_parts


@st.composite
def batches(draw: st.DrawFn) -> tuple[TensorDict, list[int], bool]:
    rows = draw(st.integers(min_value=1, max_value=8))
    width = draw(st.integers(min_value=1, max_value=5))
    prompt = draw(st.integers(min_value=0, max_value=3))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)  # 0: an aborted row
    mask = (torch.arange(width).expand(rows, width) < lengths.unsqueeze(-1)).long()
    prompt_mask = torch.randint(0, 2, (rows, prompt), generator=gen)
    data = {"response_mask": mask, "attention_mask": torch.cat([prompt_mask, mask], -1)}
    for key in ("token_level_scores", "token_level_rewards", "advantages", "returns", "values"):
        data[key] = torch.randn(rows, width, generator=gen).masked_fill(mask == 0, float("nan"))
        if key.startswith("token_level"):
            data[key] = torch.nan_to_num(data[key], nan=0.0)  # summed over every position
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=rows), max_size=3)))
    return TensorDict(data, batch_size=[rows]), cuts, draw(st.booleans())


def _parts(batch: TensorDict, cuts: list[int], use_critic: bool):
    bounds = [0, *cuts, int(batch.batch_size[0])]
    return [data_metric_parts(batch[lo:hi], use_critic) for lo, hi in itertools.pairwise(bounds)]


@given(batches())
def test_parts_reduce_to_the_whole_batch_metrics(case) -> None:
    batch, cuts, use_critic = case
    want = compute_data_metrics(batch, use_critic=use_critic)
    got = reduce_data_metric_parts(_parts(batch, cuts, use_critic), use_critic=use_critic)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key.startswith(("critic/score", "critic/rewards", "response", "prompt")) or key.endswith(
            ("max", "min")
        ):
            assert got[key] == value, key  # row columns and extremes: the same numbers
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


@given(batches())
def test_lengths_of_parts_give_the_timing_metrics(case) -> None:
    batch, cuts, _ = case
    lengths = lengths_of_parts(_parts(batch, cuts, False))
    timing = {"step": 2.0, "gen": 1.0, "update_actor": 0.5}
    assert compute_timing_metrics(None, timing, lengths=lengths) == compute_timing_metrics(batch, timing)
    assert compute_throughput_metrics(None, timing, 2, lengths=lengths) == compute_throughput_metrics(
        batch, timing, 2
    )


def test_a_nan_that_would_reach_a_metric_is_named_and_no_parts_is_an_error() -> None:
    batch = TensorDict(
        {
            "response_mask": torch.ones(1, 2),
            "token_level_scores": torch.zeros(1, 2),
            "token_level_rewards": torch.zeros(1, 2),
            "advantages": torch.tensor([[0.0, float("nan")]]),
            "returns": torch.zeros(1, 2),
        },
        batch_size=[1],
    )
    with pytest.raises(ValueError, match="advantages"):
        data_metric_parts(batch, use_critic=False)
    with pytest.raises(KeyError, match="values"):
        data_metric_parts(batch, use_critic=True)
    with pytest.raises(ValueError, match="no data metric parts"):
        reduce_data_metric_parts([], use_critic=False)
