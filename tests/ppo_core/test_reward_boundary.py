"""A reward function that returns NaN/inf fails at the reward boundary, naming the function, the step and the uids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppo_core.trainer import RewardFunctionError, scores_to_token_level
from ppo_core.trainer.reward import call_reward_fn

NAN, INF = float("nan"), float("inf")


def _batch(step: int = 7) -> TensorDict:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    uids = NonTensorStack(*(f"{step}:{i}" for i in range(4)))
    return TensorDict({"response_mask": mask, "uid": uids}, batch_size=[4])


@pytest.fixture
def pool():
    executor = concurrent.futures.ThreadPoolExecutor(1)
    yield executor
    executor.shutdown()


def judge_with_a_nan(batch: TensorDict) -> list[float]:
    return [1.0, NAN, 0.0, 0.5]


def test_nan_sequence_score_names_function_step_and_uid(pool):
    with pytest.raises(RewardFunctionError) as info:
        call_reward_fn(judge_with_a_nan, _batch(), 7, pool).result()
    message = str(info.value)
    assert message.startswith(f"reward function {__name__}.judge_with_a_nan failed at step 7 ")
    assert "reward scores hold NaN for 1 of 4 samples: uids [7:1] (rows [1])" in message
    assert info.value.step == 7 and info.value.reward_fn == f"{__name__}.judge_with_a_nan"
    assert isinstance(info.value.__cause__, ValueError)


def test_inf_token_scores_are_caught_even_on_masked_positions(pool):
    """Group estimators sum every position: a non-finite score anywhere is a broken reward."""
    token_scores = torch.zeros(4, 3)
    token_scores[2, 1] = -INF  # row 2 has no valid token at all
    token_scores[3, 0] = INF

    def token_judge(batch):
        return token_scores

    with pytest.raises(
        RewardFunctionError, match=r"hold inf for 2 of 4 samples: uids \[7:2, 7:3\] \(rows \[2, 3\]\)"
    ):
        call_reward_fn(token_judge, _batch(), 7, pool).result()


@pytest.mark.parametrize("kind", ["future", "awaitable", "tuple"])
def test_async_and_tuple_results_are_checked_too(pool, kind):
    scores = [NAN, 1.0, 1.0, NAN]
    if kind == "future":

        def fn(batch):
            return pool.submit(lambda: scores)
    elif kind == "awaitable":

        async def fn(batch):
            await asyncio.sleep(0)
            return scores
    else:

        def fn(batch):
            return scores, {"acc": [1, 0, 0, 1]}

    pending = call_reward_fn(fn, _batch(3), 3, pool)  # the failure surfaces where the reward is awaited
    with pytest.raises(RewardFunctionError, match=r"fn failed at step 3 .*uids \[3:0, 3:3\]"):
        pending.result()


def test_partial_and_callable_objects_are_named():
    class Judge:
        def __call__(self, batch):
            raise RuntimeError("judge down")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(
            RewardFunctionError, match=r"reward function .*Judge failed at step 2 .*judge down"
        ):
            call_reward_fn(Judge(), _batch(2), 2, pool)
        partial = functools.partial(judge_with_a_nan)
        with pytest.raises(
            RewardFunctionError, match=r"reward function .*\.judge_with_a_nan failed at step 2"
        ):
            call_reward_fn(partial, _batch(2), 2, pool).result()


def test_finite_scores_still_pass(pool):
    scores, extra = call_reward_fn(lambda b: [1.0, 2.0, 3.0, 4.0], _batch(), 7, pool).result()
    assert scores.tolist() == [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]]
    assert extra == {}


def test_scores_to_token_level_rejects_non_finite_scores_naming_rows_and_uids():
    mask = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"hold NaN for 1 of 3 samples: rows \[2\]"):
        scores_to_token_level([0.0, 1.0, NAN], mask)
    with pytest.raises(ValueError, match=r"uids \[b\] \(rows \[1\]\)"):
        scores_to_token_level(torch.tensor([0.0, INF, 1.0]), mask, uids=["a", "b", "c"])


@pytest.mark.parametrize("returned", [None, "0.5", {"score": [1.0, 0.0, 1.0, 0.0]}])
def test_a_result_that_is_no_scores_says_what_a_reward_function_returns(pool, returned):
    with pytest.raises(
        RewardFunctionError, match=rf"returned {type(returned).__name__}; it returns the scores of the 4"
    ):
        call_reward_fn(lambda b: returned, _batch(), 7, pool).result()
