"""The built-in scorers agree on a missing or non-finite ground truth: an error (named by row through the reward),
never a silent 0."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppo_core.rewards import RuleBasedReward, ScorerError, gsm8k_score, math_score

SCORERS = [
    pytest.param(gsm8k_score, "#### 7", id="gsm8k"),
    pytest.param(lambda s, t, e=None: math_score(s, t, e, use_math_verify=False), r"\boxed{7}", id="math"),
]


@pytest.mark.parametrize(("scorer", "right"), SCORERS)
@pytest.mark.parametrize("truth", [None, "", "   "])
def test_a_missing_ground_truth_is_an_error(scorer, right, truth):
    for response in (right, "no answer at all"):  # also when the response has no answer to compare
        with pytest.raises(ValueError, match=r"_score needs a ground truth, got "):
            scorer(response, truth)


@pytest.mark.parametrize(("scorer", "right"), SCORERS)
@pytest.mark.parametrize("truth", [math.nan, math.inf, -math.inf])
def test_a_non_finite_ground_truth_is_an_error(scorer, right, truth):
    with pytest.raises(ValueError, match=r"_score needs a finite ground truth, got "):
        scorer(right, truth)


@pytest.mark.parametrize(("scorer", "right"), SCORERS)
def test_numbers_and_strings_still_score(scorer, right):
    assert scorer(right, "7")["score"] == scorer(right, 7)["score"] == scorer(right, 7.0)["score"] == 1.0
    assert scorer(right, "8")["score"] == 0.0


class CharTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(i) for i in row) for row in rows]


def test_the_reward_names_the_row_without_a_ground_truth():
    texts = [r"\boxed{1}", r"\boxed{2}"]
    ids = torch.tensor([[ord(c) for c in t] for t in texts])
    batch = TensorDict({"responses": ids, "response_mask": torch.ones_like(ids)}, batch_size=[2])
    batch.set("data_source", NonTensorStack.from_list(["math", "math"]))
    batch.set("ground_truth", NonTensorStack.from_list(["1", None]))
    with pytest.raises(ScorerError, match=r"math_score of data_source 'math' \(row 1\) raised ValueError: "):
        RuleBasedReward(CharTokenizer())(batch)
