"""Pitfalls 25-37 of the verl inventory (§16): one focused test (or more) per pitfall pinning OUR behaviour.

What we chose is stated in ``docs/semantics.md``; expected values here are derived in the test (a loop, float64
or a small closed form), never copied from a run. Pitfalls 36 (GDPO) and 37 (PF-PPO) concern algorithms we do not
implement; their tests pin the underlying concern: where a sequence score lands, and that nothing touches the
global RNGs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from itertools import chain
from typing import TypeVar

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.advantages import advantage_estimator_names, get_advantage_estimator
from ppo_core.batch import (
    balance_by_seqlen,
    concat,
    iter_minibatches,
    merge_from_dp,
    pad_to_multiple,
    select,
    split_for_dp,
    union,
    unpad,
)
from ppo_core.kl_control import AdaptiveKLController
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.losses import PolicyLossConfig, compute_policy_loss, policy_loss_names
from ppo_core.metrics import (
    bootstrap,
    compute_data_metrics,
    compute_throughput_metrics,
    flatten_validation_metrics,
    majority_vote,
    process_validation_metrics,
    reduce_metrics,
)
from ppo_core.metrics.validation import _majority_values
from ppo_core.testing.strategies import response_masks
from ppo_core.trainer import PromptDataLoader, scores_to_token_level
from ppo_core.trainer.checkpoint import capture_rng_state, restore_rng_state, step_of_checkpoint
from ppo_core.trainer.steps import assign_uids, merge_generation

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _restore_global_rngs() -> Iterator[None]:
    """Several tests seed the global RNGs on purpose; leave them as the next test file expects."""
    state = capture_rng_state()
    yield
    restore_rng_state(state)


# --------------------------------------------------------------------------------------------------------------
# 25. Entropy with masked (-inf) vocabulary entries: 0 · log 0 := 0, never NaN


@st.composite
def _masked_logits(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` float64 logits with some ``-inf`` entries (never a whole row) and the ``[N, V]`` finite mask."""
    rows = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    finite = torch.rand(rows, vocab, generator=gen) < 0.6
    finite[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = True  # one finite per row
    return logits.masked_fill(~finite, float("-inf")), finite


def _entropy_over_finite(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Loop reference: the entropy of the softmax restricted to the finite entries (float64)."""
    out = []
    for z, keep in zip(logits, finite, strict=True):
        p = torch.softmax(z[keep], dim=-1)
        out.append(-(p * p.log()).sum())
    return torch.stack(out)


@given(_masked_logits())
def test_pitfall_25_masked_vocab_entries_count_as_zero_log_zero(
    case: tuple[torch.Tensor, torch.Tensor],
) -> None:
    logits, finite = case
    logits = logits.clone().requires_grad_(True)
    entropy = entropy_from_logits(logits)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, _entropy_over_finite(logits.detach(), finite))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~finite] == 0).all()  # masked entries get the limit gradient 0, not NaN


def test_pitfall_25_logprob_of_a_masked_label_and_invalid_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    # two equal finite logits: p = 1/2 each, and the masked one has probability 0
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([0])), torch.tensor([math.log(0.5)]))
    assert logprobs_from_logits(logits, torch.tensor([2])).item() == float("-inf")
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0)]))
    inf, nan = float("inf"), float("nan")
    for row in (torch.tensor([[-inf, -inf]]), torch.tensor([[nan, 0.0]]), torch.tensor([[inf, 0.0]])):
        with pytest.raises(ValueError, match="logits"):
            entropy_from_logits(row)
        with pytest.raises(ValueError, match="logits"):
            logprobs_from_logits(row, torch.tensor([1]))


# --------------------------------------------------------------------------------------------------------------
# 26. union compares NaN as equal (tensors and non-tensors), returns a new batch; concat([]) raises


def test_pitfall_26_union_treats_identical_nan_tensors_as_equal_and_copies() -> None:
    x = torch.tensor([float("nan"), 1.0, float("inf")])
    a = TensorDict({"x": x.clone(), "tag": NonTensorStack(float("nan"), "p", 3)}, batch_size=[3])
    b = TensorDict(
        {"x": x.clone(), "tag": NonTensorStack(float("nan"), "p", 3), "y": torch.arange(3)}, batch_size=[3]
    )
    out = union(a, b)
    assert set(out.keys()) == {"x", "tag", "y"}
    assert torch.equal(out["y"], torch.arange(3))
    assert "y" not in a  # not in place, unlike verl's DataProto.union
    out["x"][1] = 5.0
    assert a["x"][1].item() == 1.0  # the result has its own storage


def test_pitfall_26_union_refuses_different_values_naming_the_key() -> None:
    a = TensorDict({"x": torch.tensor([float("nan"), 1.0])}, batch_size=[2])
    b = TensorDict({"x": torch.tensor([float("nan"), 2.0])}, batch_size=[2])
    with pytest.raises(ValueError, match="'x'"):
        union(a, b)
    c = TensorDict({"x": torch.tensor([0.0, 1.0])}, batch_size=[2])  # NaN vs a number is a difference
    with pytest.raises(ValueError, match="'x'"):
        union(a, c)
    s1 = TensorDict({"s": NonTensorStack("a", "b")}, batch_size=[2])
    s2 = TensorDict({"s": NonTensorStack("a", "c")}, batch_size=[2])
    with pytest.raises(ValueError, match="'s'"):
        union(s1, s2)


def test_pitfall_26_concat_empty_list_and_mismatches_raise() -> None:
    with pytest.raises(ValueError, match="batches"):
        concat([])
    a = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(TypeError, match="'x'"):
        concat([a, TensorDict({"x": torch.zeros(1, 3, dtype=torch.float64)}, batch_size=[1])])
    with pytest.raises(ValueError, match="'x'"):
        concat([a, TensorDict({"x": torch.zeros(1, 4)}, batch_size=[1])])
    with pytest.raises(ValueError, match="missing"):
        concat([a, TensorDict({"z": torch.zeros(1, 3)}, batch_size=[1])])


# --------------------------------------------------------------------------------------------------------------
# 27/28. Padding for data parallelism: cyclic from row 0, PadInfo keeps every rank, merge trims exactly


def _rows_batch(size: int) -> TensorDict:
    return TensorDict(
        {"x": torch.arange(size), "uid": NonTensorStack(*[f"u{i}" for i in range(size)])}, batch_size=[size]
    )


def test_pitfall_27_five_rows_on_four_ranks() -> None:
    shards, info = split_for_dp(_rows_batch(5), 4, pad="repeat")
    # ceil(5 / 4) = 2 rows per rank, 8 - 5 = 3 padding rows copied cyclically from row 0 (verl: the last row)
    assert [s["x"].tolist() for s in shards] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert (info.shard_size, info.pad_size, info.valid_counts) == (2, 3, [2, 2, 1, 0])
    assert info.row_mask().tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert merge_from_dp(shards, info).get("uid").tolist() == [f"u{i}" for i in range(5)]
    # per-rank metrics: one entry per rank (none dropped), weighted by its real rows = the global mean
    per_rank = []
    for rank, shard in enumerate(shards):
        real = shard["x"][: info.valid_rows(rank)].double()
        per_rank.append({"x_mean": real.mean().item() if real.numel() else 0.0})
    assert len(per_rank) == 4
    assert reduce_metrics(per_rank, weights=info.valid_counts)["x_mean"] == pytest.approx(2.0)  # mean(0..4)
    with pytest.raises(ValueError, match="dp_size"):
        split_for_dp(_rows_batch(5), 4)


@given(st.integers(0, 20), st.integers(1, 9))
def test_pitfall_27_split_merge_roundtrip_and_padinfo(size: int, dp_size: int) -> None:
    shards, info = split_for_dp(_rows_batch(size), dp_size, pad="repeat")
    padded = size + (-size) % dp_size if size else 0
    assert info.pad_size == padded - size
    assert len(shards) == dp_size and all(s.batch_size[0] == info.shard_size for s in shards)
    flat = [v for s in shards for v in s["x"].tolist()]
    assert flat == [i % max(size, 1) for i in range(padded)]
    assert sum(info.valid_counts) == size
    mask = info.row_mask().flatten().tolist()
    assert mask == [i < size for i in range(padded)]
    assert merge_from_dp(shards, info)["x"].tolist() == list(range(size))


def test_pitfall_28_pad_cycles_from_the_first_row_and_can_exceed_the_batch() -> None:
    padded, pad = pad_to_multiple(_rows_batch(5), 12)
    assert pad == 7  # larger than B = 5
    assert padded["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert padded.get("uid").tolist()[5:] == ["u0", "u1", "u2", "u3", "u4", "u0", "u1"]


@given(st.integers(0, 15), st.integers(1, 16))
def test_pitfall_28_pad_to_multiple_then_unpad(size: int, k: int) -> None:
    padded, pad = pad_to_multiple(_rows_batch(size), k)
    assert pad == (-size) % k and (size + pad) % k == 0
    assert padded["x"].tolist() == [i % max(size, 1) for i in range(size + pad)]
    assert unpad(padded, pad)["x"].tolist() == list(range(size))


# --------------------------------------------------------------------------------------------------------------
# 29. balance_by_seqlen: equal-size partitions, rank j gets partition j, loud failure, never worse than greedy


def _greedy_imbalance(weights: list[int], k: int) -> int:
    """Longest-first into the lightest partition with room (equal sizes): the baseline we must not lose to."""
    cap = len(weights) // k
    sums, counts = [0] * k, [0] * k
    for w in sorted(weights, reverse=True):
        j = min((j for j in range(k) if counts[j] < cap), key=lambda j: (sums[j], counts[j], j))
        sums[j] += w
        counts[j] += 1
    return max(sums) - min(sums)


@given(st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), st.integers(1, 5))), st.data())
def test_pitfall_29_equal_size_partitions_map_to_ranks(k_rows: tuple[int, int], data: st.DataObject) -> None:
    k, per_rank = k_rows
    seqlens = data.draw(st.lists(st.integers(0, 1000), min_size=k * per_rank, max_size=k * per_rank))
    parts, perm = balance_by_seqlen(seqlens, k)
    assert sorted(perm.tolist()) == list(range(len(seqlens)))
    assert [len(p) for p in parts] == [per_rank] * k
    sums = [sum(seqlens[i] for i in p) for p in parts]
    imbalance = max(sums) - min(sums)
    assert imbalance <= _greedy_imbalance(seqlens, k)
    assert imbalance <= max(seqlens) - min(seqlens)  # the equal-size Karmarkar-Karp bound
    batch = TensorDict({"x": torch.arange(len(seqlens))}, batch_size=[len(seqlens)])
    shards, _ = split_for_dp(select(batch, perm), k)
    assert [s["x"].tolist() for s in shards] == parts  # partition j lands on rank j


def test_pitfall_29_too_small_or_non_divisible_batches_fail_loudly() -> None:
    with pytest.raises(ValueError, match="k=4"):
        balance_by_seqlen([1, 2, 3], 4)
    with pytest.raises(ValueError, match="divisible"):
        balance_by_seqlen([1, 2, 3, 4, 5], 2)
    parts, _ = balance_by_seqlen([1, 2, 3, 4, 5], 2, equal_size=False)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------------------------------
# 30. Validation metrics with mixed n


def test_pitfall_30_mixed_n_gives_separate_mean_names_and_shared_best() -> None:
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


def test_pitfall_30_best_at_n_resamples_with_replacement_so_it_is_not_pass_at_n() -> None:
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
# 31. Validation never reseeds (or reads) the global NumPy RNG


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_pitfall_31_validation_leaves_the_global_numpy_rng_alone(groups: list[int], global_seed: int) -> None:
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


def test_pitfall_31_bootstrap_default_generator_is_local() -> None:
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
# 32. maj@N tie-break: the answer seen first wins, with the value of its first occurrence


def _majority_reference(votes: list[str], values: list[float]) -> float:
    counts = {v: votes.count(v) for v in votes}
    best = max(counts.values())
    winner = next(v for v in votes if counts[v] == best)
    return values[votes.index(winner)]


def test_pitfall_32_first_seen_vote_wins_a_tie() -> None:
    assert majority_vote(["B", "A", "A", "B"], [0.1, 0.2, 0.3, 0.4]) == 0.1
    assert majority_vote(["A", "B", "B", "A"], [0.1, 0.2, 0.3, 0.4]) == 0.1
    assert majority_vote(["A", "B", "B"], [0.1, 0.2, 0.3]) == 0.2  # no tie: the majority, first value


@given(st.lists(st.tuples(st.sampled_from("ABC"), st.integers(0, 9)), min_size=1, max_size=10))
def test_pitfall_32_majority_vote_matches_the_loop(pairs: list[tuple[str, int]]) -> None:
    votes = [v for v, _ in pairs]
    values = [float(x) for _, x in pairs]
    assert majority_vote(votes, values) == _majority_reference(votes, values)
    # the vectorized path behind maj@N agrees row by row (codes in first-seen order, as the caller builds them)
    codes = {}
    coded = np.array([[codes.setdefault(v, len(codes)) for v in votes]] * 2, dtype=np.int64)
    got = _majority_values(coded, np.array([values, values]))
    assert got.tolist() == [_majority_reference(votes, values)] * 2


# --------------------------------------------------------------------------------------------------------------
# 33. Resume at an epoch boundary trains the next epoch; beta, RNG and the step are restored


def _prompts(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [i + 1]} for i in range(n)]


def _ids(batches: list[TensorDict]) -> list[list[int]]:
    return [b["input_ids"].flatten().tolist() for b in batches]


@given(st.integers(1, 9), st.integers(1, 4), st.booleans(), st.integers(0, 12))
def test_pitfall_33_resumed_loader_continues_the_uninterrupted_sequence(
    size: int, batch_size: int, drop_last: bool, consumed: int
) -> None:
    def loader() -> PromptDataLoader:
        return PromptDataLoader(_prompts(size), batch_size, seed=3, drop_last=drop_last)

    per_epoch = len(loader())
    reference = loader()
    epochs = consumed // max(per_epoch, 1) + 2
    stream = [b for _ in range(epochs) for b in reference]  # the uninterrupted run
    first = loader()
    taken = 0
    while taken < consumed and per_epoch:
        for _ in first:
            taken += 1
            if taken == consumed:
                break
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    done_in_epoch = taken % per_epoch if per_epoch else 0
    # a state saved at an epoch's end resumes with the whole next epoch, never with zero steps
    assert len(rest) == per_epoch - done_in_epoch
    assert _ids(rest) == _ids(stream[taken : taken + len(rest)])


def test_pitfall_33_end_of_epoch_state_reads_as_next_epoch_start() -> None:
    loader = PromptDataLoader(_prompts(6), 2, seed=0)
    epoch0 = list(loader)
    assert loader.state_dict() == {"epoch": 1, "position": 0}
    resumed = PromptDataLoader(_prompts(6), 2, seed=0)
    resumed.load_state_dict({"epoch": 0, "position": 3})  # a raw end-of-epoch position, as verl stores it
    assert resumed.state_dict() == {"epoch": 1, "position": 0}
    epoch1 = list(resumed)
    assert len(epoch1) == 3
    assert sorted(chain(*_ids(epoch1))) == sorted(chain(*_ids(epoch0))) == list(range(1, 7))


def test_pitfall_33_kl_beta_rng_and_step_survive_a_resume() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    for kl in (0.3, 0.05):
        ctrl.update(kl, n_steps=8)
    resumed = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value
    expected = ctrl.value * (1 + 0.2 * 8 / 100)  # error = clip(0.12 / 0.1 - 1, ±0.2) = 0.2
    for c in (ctrl, resumed):
        c.update(0.12, n_steps=8)
    assert resumed.value == ctrl.value == pytest.approx(expected)

    state = capture_rng_state()
    draws = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    assert step_of_checkpoint("/ckpt/global_step_17") == 17  # global_steps come from the folder name


# --------------------------------------------------------------------------------------------------------------
# 34. Lengths for metrics come from attention_mask (tool tokens count); losses use response_mask


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
def test_pitfall_34_length_metrics_use_attention_mask_losses_use_response_mask(
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


@pytest.mark.parametrize("width", [0, 1, 3])
def test_pitfall_34_missing_response_mask_is_the_response_part_of_attention_mask(width: int) -> None:
    prompt = 2
    attention = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])[:, : prompt + width]
    prompts = assign_uids(TensorDict({"input_ids": torch.ones(2, prompt)}, batch_size=[2]), "0")
    generated = TensorDict(
        {"responses": torch.ones(2, width, dtype=torch.long), "attention_mask": attention}, batch_size=[2]
    )
    merged = merge_generation(prompts, generated)
    # verl's compute_response_mask fallback: the last R columns (an empty [B, 0] mask when R = 0)
    assert torch.equal(merged["response_mask"], attention[:, prompt:])
    # an agent loop's own mask (tool tokens excluded) is kept, never recomputed from attention_mask
    agent_mask = torch.zeros(2, width, dtype=torch.long)
    generated.set("response_mask", agent_mask)
    assert torch.equal(merge_generation(prompts, generated)["response_mask"], agent_mask)


# --------------------------------------------------------------------------------------------------------------
# 36. A sequence score lands on the last valid response token; an empty response gets nothing (never column -1)


@given(response_masks(max_batch=8, max_len=10), st.integers(0, 2**31 - 1))
def test_pitfall_36_sequence_score_goes_to_last_valid_token(mask: torch.Tensor, seed: int) -> None:
    rows, width = mask.shape
    scores = torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 1.0  # never 0
    out = scores_to_token_level(scores, mask)
    assert out.shape == (rows, width) and out.dtype == torch.float32
    for i in range(rows):
        valid = [t for t in range(width) if mask[i, t]]
        expected = torch.zeros(width)
        if valid:  # an empty response writes nowhere: not to column -1, not anywhere
            expected[valid[-1]] = scores[i]
        assert torch.equal(out[i], expected)


def test_pitfall_36_empty_response_never_writes_to_the_last_column() -> None:
    mask = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]])  # empty, first token only, interior gap at the end
    out = scores_to_token_level([5.0, 2.0, 3.0], mask)
    assert out.tolist() == [[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]
    assert out[:, -1].abs().sum().item() == 0.0
    # zero-width responses (R = 0) hold no valid token: nothing is written, and nothing fails
    assert scores_to_token_level([5.0, 2.0], torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)


# --------------------------------------------------------------------------------------------------------------
# 37. No estimator, loss, validation metric or batch iterator touches the global torch / numpy / python RNG


def _global_rng_snapshot() -> tuple[torch.Tensor, tuple, tuple]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_same_rng(before: tuple[torch.Tensor, tuple, tuple]) -> None:
    torch_state, np_state, py_state = _global_rng_snapshot()
    assert torch.equal(torch_state, before[0])
    assert np_state[0] == before[1][0] and np.array_equal(np_state[1], before[1][1])
    assert np_state[2:] == before[1][2:]
    assert py_state == before[2]


def _small_inputs() -> dict[str, torch.Tensor | list[str]]:
    gen = torch.Generator().manual_seed(7)
    rows, width = 6, 5
    mask = torch.rand(rows, width, generator=gen) < 0.8
    mask[:, 0] = True
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64)
    new = old + 0.1 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    rewards[:, -1] = torch.randint(0, 2, (rows,), generator=gen).double()
    return dict(mask=mask, old=old, new=new, rewards=rewards,
                values=torch.randn(rows, width, generator=gen, dtype=torch.float64),
                baselines=torch.randn(rows, generator=gen, dtype=torch.float64),
                index=["a", "a", "b", "b", "c", "c"])  # fmt: skip


def _run_twice_under_different_global_seeds(fn: Callable[[], T]) -> list[T]:
    """Call ``fn`` under two global seeds; assert neither call moved any global RNG; return both results."""
    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        before = _global_rng_snapshot()
        results.append(fn())
        _assert_same_rng(before)
    return results


@pytest.mark.parametrize("name", advantage_estimator_names())
def test_pitfall_37_advantage_estimators_leave_global_rngs_alone(name: str) -> None:
    x = _small_inputs()
    kwargs = dict(token_level_rewards=x["rewards"], response_mask=x["mask"], index=x["index"],
                  values=x["values"], reward_baselines=x["baselines"], gamma=0.99, lam=0.95)  # fmt: skip
    first, second = _run_twice_under_different_global_seeds(lambda: get_advantage_estimator(name)(**kwargs))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", policy_loss_names())
def test_pitfall_37_policy_losses_leave_global_rngs_alone(name: str) -> None:
    x = _small_inputs()
    adv = x["rewards"].sum(-1, keepdim=True).expand_as(x["old"]) - 0.5
    # generous clip_cov / kl_cov settings so that their random / top-k selection actually runs; dro needs its beta
    config = PolicyLossConfig(loss_mode=name, clip_cov_ratio=0.2, clip_cov_lb=-100.0, clip_cov_ub=100.0,
                              kl_cov_ratio=0.2, dro_beta=0.1)  # fmt: skip

    def call() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return compute_policy_loss(x["old"], x["new"], adv, x["mask"], config=config,
                                   generator=torch.Generator().manual_seed(3))  # fmt: skip

    (loss_a, metrics_a), (loss_b, metrics_b) = _run_twice_under_different_global_seeds(call)
    assert torch.equal(loss_a, loss_b)
    assert metrics_a.keys() == metrics_b.keys()
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


def test_pitfall_37_validation_minibatches_and_balancing_leave_global_rngs_alone() -> None:
    batch = _rows_batch(8)

    def call() -> tuple:
        mbs = [
            m["x"].tolist()
            for m in iter_minibatches(batch, 4, epochs=2, generator=torch.Generator().manual_seed(1))
        ]
        val = process_validation_metrics(["d"] * 4, ["u", "u", "v", "v"],
                                         {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["x", "y", "x", "x"]},
                                         n_bootstrap=30)  # fmt: skip
        boot = bootstrap([0.0, 1.0], 2, [lambda s: s.max(axis=1)], n_bootstrap=30)
        parts, _ = balance_by_seqlen([5, 1, 4, 2, 3, 3], 3)
        shards, _ = split_for_dp(batch, 3, pad="repeat")
        return mbs, val, boot, parts, [s["x"].tolist() for s in shards]

    first, second = _run_twice_under_different_global_seeds(call)
    assert first == second
    assert sorted(chain(*first[0][:2])) == list(range(8))  # each epoch still visits every row once
    with pytest.raises((TypeError, ValueError), match="generator"):
        iter_minibatches(batch, 4, shuffle=True)  # no silent fallback to the global RNG
