"""Metrics edge cases: validation metrics with mixed ``n``, bootstraps that never touch the global NumPy RNG,
the ``maj@N`` tie-break, and response lengths that count tool tokens (``attention_mask``) while token
statistics use ``response_mask``.

Expected values are derived in the test (a loop, float64 or a small closed form), never copied from a run;
where verl behaves differently, ``docs/semantics.md`` says how and why.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.metrics import (
    bootstrap,
    compute_data_metrics,
    compute_throughput_metrics,
    flatten_validation_metrics,
    majority_vote,
    process_validation_metrics,
)
from ppo_core.metrics.validation import _majority_values
from ppo_core.testing.strategies import response_masks

pytestmark = pytest.mark.usefixtures("restore_global_rngs")  # some tests seed the global RNGs on purpose


# --------------------------------------------------------------------------------------------------------------
# Validation metrics with mixed n


def test_mixed_n_gives_separate_mean_names_and_shared_best() -> None:
    u1 = [1.0, 0.0, 0.0, 1.0]
    u2 = [1.0, 1.0]
    out = process_validation_metrics(["ds"] * 6, ["u1"] * 4 + ["u2"] * 2, {"acc": u1 + u2}, n_bootstrap=50)
    acc = out["ds"]["acc"]
    assert acc["mean@4"] == pytest.approx(np.mean(u1))  # only u1 has 4 responses
    assert acc["mean@2"] == pytest.approx(np.mean(u2))  # only u2 has 2
    assert acc["std@4"] == pytest.approx(np.std(u1)) and acc["std@2"] == pytest.approx(np.std(u2))
    # best@2 is produced by both prompts and averaged over them; u2 is all ones so its best@2 is exactly 1
    u1_alone = process_validation_metrics(["ds"] * 4, ["u1"] * 4, {"acc": u1}, n_bootstrap=50)["ds"]["acc"]
    assert acc["best@2/mean"] == pytest.approx((u1_alone["best@2/mean"] + 1.0) / 2)
    assert acc["best@4/mean"] == pytest.approx(u1_alone["best@4/mean"])  # only u1 reaches N = 4
    flat = flatten_validation_metrics(out)
    core = {k for k in flat if k.startswith("val-core/")}
    assert core == {"val-core/ds/acc/mean@4", "val-core/ds/acc/best@4/mean", "val-core/ds/acc/best@4/std"}
    assert "val-aux/ds/acc/mean@2" in flat and "val-aux/ds/acc/best@2/mean" in flat


def test_best_at_n_resamples_with_replacement_so_it_is_not_pass_at_n() -> None:
    n, n_bootstrap = 4, 20000
    values = [1.0] + [0.0] * (n - 1)  # p = 1/4; pass@4 of these 4 responses is exactly 1
    acc = process_validation_metrics(["ds"] * n, ["u"] * n, {"acc": values}, n_bootstrap=n_bootstrap)["ds"][
        "acc"
    ]
    expected = 1 - (1 - 1 / n) ** n  # P(at least one 1 among 4 draws with replacement)
    sigma = math.sqrt(expected * (1 - expected) / n_bootstrap)
    assert abs(acc["best@4/mean"] - expected) < 5 * sigma
    assert acc["best@4/mean"] < 0.9


# --------------------------------------------------------------------------------------------------------------
# Validation never reseeds (or reads) the global NumPy RNG


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_validation_leaves_the_global_numpy_rng_alone(groups: list[int], global_seed: int) -> None:
    uids = [f"u{g}" for g in groups]
    acc = [float((i * 7 + g) % 3 == 0) for i, g in enumerate(groups)]
    preds = [str((i + g) % 2) for i, g in enumerate(groups)]
    infos = {"acc": acc, "pred": preds}
    np.random.seed(global_seed)
    before = np.random.get_state()
    out = process_validation_metrics(["ds"] * len(uids), uids, infos, n_bootstrap=20)
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]
    # the results depend neither on the global state nor on the order of the prompts
    np.random.seed(global_seed ^ 1)
    # prompts in reverse order of first appearance; a prompt's responses keep their order (they are its sample)
    first_seen = list(dict.fromkeys(uids))
    order = sorted(range(len(uids)), key=lambda i: -first_seen.index(uids[i]))
    permuted = process_validation_metrics(
        ["ds"] * len(uids),
        [uids[i] for i in order],
        {k: [v[i] for i in order] for k, v in infos.items()},
        n_bootstrap=20,
    )
    assert permuted == out


def test_bootstrap_default_generator_is_local() -> None:
    np.random.seed(0)
    state = np.random.get_state()
    first = bootstrap([0.0, 1.0, 2.0], 2, [lambda x: x.max(axis=1)], n_bootstrap=50)
    np.random.seed(123)  # a different global state must not change the result
    second = bootstrap([0.0, 1.0, 2.0], 2, [lambda x: x.max(axis=1)], n_bootstrap=50)
    assert first == second
    np.random.seed(0)
    bootstrap([0.0, 1.0, 2.0], 2, [lambda x: x.max(axis=1)], n_bootstrap=50)
    assert np.array_equal(np.random.get_state()[1], state[1])


# --------------------------------------------------------------------------------------------------------------
# maj@N tie-break: the answer seen first wins, with the value of its first occurrence


def _majority_reference(votes: list[str], values: list[float]) -> float:
    counts = {v: votes.count(v) for v in votes}
    best = max(counts.values())
    winner = next(v for v in votes if counts[v] == best)
    return values[votes.index(winner)]


def test_first_seen_vote_wins_a_tie() -> None:
    assert majority_vote(["B", "A", "A", "B"], [0.1, 0.2, 0.3, 0.4]) == 0.1
    assert majority_vote(["A", "B", "B", "A"], [0.1, 0.2, 0.3, 0.4]) == 0.1
    assert majority_vote(["A", "B", "B"], [0.1, 0.2, 0.3]) == 0.2  # no tie: the majority, first value


@given(st.lists(st.tuples(st.sampled_from("ABC"), st.integers(0, 9)), min_size=1, max_size=10))
def test_majority_vote_matches_the_loop(pairs: list[tuple[str, int]]) -> None:
    votes = [v for v, _ in pairs]
    values = [float(x) for _, x in pairs]
    assert majority_vote(votes, values) == _majority_reference(votes, values)
    # the vectorized path behind maj@N agrees row by row (codes in first-seen order, as the caller builds them)
    codes = {}
    coded = np.array([[codes.setdefault(v, len(codes)) for v in votes]] * 2, dtype=np.int64)
    got = _majority_values(coded, np.array([values, values]))
    assert got.tolist() == [_majority_reference(votes, values)] * 2


# --------------------------------------------------------------------------------------------------------------
# Lengths for metrics come from attention_mask (tool tokens count); losses use response_mask


@st.composite
def _multi_turn_masks(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_mask [B, P + T]`` and ``response_mask [B, T]`` with response_mask inside the attended tokens."""
    response_mask = draw(response_masks(max_batch=6, max_len=8))
    rows, width = response_mask.shape
    prompt = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    tool = torch.rand(rows, width, generator=gen) < 0.4  # observation tokens: attended, not trained on
    prompt_mask = torch.rand(rows, prompt, generator=gen) < 0.8
    attention = torch.cat([prompt_mask, response_mask.bool() | tool], dim=1).long()
    return attention, response_mask


@given(_multi_turn_masks())
def test_length_metrics_use_attention_mask_losses_use_response_mask(
    masks: tuple[torch.Tensor, torch.Tensor],
) -> None:
    attention, response_mask = masks
    rows, width = response_mask.shape
    prompt = attention.shape[1] - width
    adv = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    zeros = torch.zeros(rows, width)
    fields = dict(response_mask=response_mask, token_level_scores=zeros, token_level_rewards=zeros,
                  advantages=adv, returns=zeros)  # fmt: skip
    with_attention = compute_data_metrics(
        TensorDict({**fields, "attention_mask": attention}, batch_size=[rows]), use_critic=False
    )
    without = compute_data_metrics(TensorDict(fields, batch_size=[rows]), use_critic=False)
    attended = attention[:, prompt:].sum(-1).double()
    trained = response_mask.sum(-1).double()
    assert with_attention["response_length/mean"] == pytest.approx(attended.mean().item())
    assert with_attention["response_length/max"] == attended.max().item()
    assert with_attention["response/aborted_ratio"] == pytest.approx((attended == 0).double().mean().item())
    assert without["response_length/mean"] == pytest.approx(trained.mean().item())
    # token-level statistics only ever see response_mask, attention mask or not
    valid = response_mask.bool()
    expected_adv = adv[valid].double().mean().item() if valid.any() else 0.0
    assert with_attention["critic/advantages/mean"] == pytest.approx(expected_adv)
    assert without["critic/advantages/mean"] == with_attention["critic/advantages/mean"]
    tokens = compute_throughput_metrics(
        TensorDict({**fields, "attention_mask": attention}, batch_size=[rows]), {"step": 1.0}, n_gpus=1
    )["perf/total_num_tokens"]
    assert tokens == attention.sum().item()  # prompt + every attended response token (tool tokens included)
