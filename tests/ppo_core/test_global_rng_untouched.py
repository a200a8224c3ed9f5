"""No advantage estimator, policy loss, validation metric, mini-batch iterator or balancer reads or moves the
global torch / NumPy / Python RNG: randomness comes from an explicit generator or seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import chain
from typing import TypeVar

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppo_core.advantages import advantage_estimator_names, get_advantage_estimator
from ppo_core.batch import balance_by_seqlen, iter_minibatches, split_for_dp
from ppo_core.losses import PolicyLossConfig, compute_policy_loss, policy_loss_names
from ppo_core.metrics import bootstrap, process_validation_metrics

T = TypeVar("T")


pytestmark = pytest.mark.usefixtures("restore_global_rngs")  # some tests seed the global RNGs on purpose


def _rows_batch(size: int) -> TensorDict:
    return TensorDict(
        {"x": torch.arange(size), "uid": NonTensorStack(*[f"u{i}" for i in range(size)])}, batch_size=[size]
    )


# --------------------------------------------------------------------------------------------------------------
# No estimator, loss, validation metric or batch iterator touches the global torch / numpy / python RNG


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
def test_advantage_estimators_leave_global_rngs_alone(name: str) -> None:
    x = _small_inputs()
    kwargs = dict(token_level_rewards=x["rewards"], response_mask=x["mask"], index=x["index"],
                  values=x["values"], reward_baselines=x["baselines"], gamma=0.99, lam=0.95)  # fmt: skip
    first, second = _run_twice_under_different_global_seeds(lambda: get_advantage_estimator(name)(**kwargs))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", policy_loss_names())
def test_policy_losses_leave_global_rngs_alone(name: str) -> None:
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


def test_validation_minibatches_and_balancing_leave_global_rngs_alone() -> None:
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
