"""``WorkerReward`` and ``reward_reads``: what a resident step needs from a reward function, checked up front; the
rows a rank scores are the by-value rows (token placement, extra infos as the metrics count them)."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.trainer.reward import scores_to_token_level
from ppo_core.trainer.worker_reward import WorkerReward, reward_reads
from ppo_core.workers.resident_ops import score_rows


def lengths_with_infos(batch):
    n = batch["response_mask"].sum(-1).float()
    truth = batch.get("ground_truth").tolist()
    return n, {"acc": [float(t == 2) for t in truth], "pred": ["a"] * len(truth), "ok": [True] * len(truth)}


def test_worker_reward_checks_its_fields_and_pickles() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        WorkerReward(3)
    with pytest.raises(TypeError, match="reads must be a tuple of key names"):
        WorkerReward(lengths_with_infos, reads="responses")
    reward = WorkerReward(lengths_with_infos, reads=["response_mask"], fields=["ground_truth"])
    assert reward.reads == ("response_mask",) and pickle.loads(pickle.dumps(reward)) == reward


def test_reward_reads() -> None:
    class Declares:
        reads = ("responses",)

    class Bad:
        reads = "responses"

    assert reward_reads(Declares()) == ("responses",) and reward_reads(lengths_with_infos) is None
    with pytest.raises(TypeError, match=r"reward_fn\.reads"):
        reward_reads(Bad())


def test_score_rows_place_and_report_as_the_by_value_step() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    batch = TensorDict(
        {"response_mask": mask, "responses": torch.ones(3, 3, dtype=torch.long)}, batch_size=[3]
    )
    fields = TensorDict({"ground_truth": NonTensorStack.from_list([2, 1, 2])}, batch_size=[3])
    reward = WorkerReward(lengths_with_infos, reads=("responses",), fields=("ground_truth",))
    out = score_rows(batch, fields, reward)
    scores, infos = lengths_with_infos(batch.set("ground_truth", fields.get("ground_truth")))
    assert torch.equal(out["token_level_scores"], scores_to_token_level(scores, mask))
    assert torch.equal(out["row_score_sum"], out["token_level_scores"].double().sum(-1))
    # extra infos as float64 columns: what is not a number is NaN, and the metrics skip both alike
    extra = {k: out[f"extra/{k}"].tolist() for k in infos}
    sources = ["a", "b", "a"]
    assert reward_metrics_by_source(sources, out["row_score_sum"], extra) == reward_metrics_by_source(
        sources, out["token_level_scores"], infos
    )
    with pytest.raises(KeyError, match="reads"):
        score_rows(batch.select("response_mask"), fields, reward)


def test_unplaced_scores_keep_their_shape_and_are_checked() -> None:
    from ppo_core.trainer.reward import _normalize

    batch = TensorDict({"uid": NonTensorStack.from_list(["u0", "u1"])}, batch_size=[2])
    scores, _ = _normalize([1.0, 2.0], batch, width=3)  # a resident step places them at the ranks
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    with pytest.raises(ValueError, match=r"\[B\]=2 or \[B, R\]=\(2, 3\)"):
        _normalize(torch.zeros(2, 4), batch, width=3)
    with pytest.raises(ValueError, match="uids"):
        _normalize([1.0, float("nan")], batch, width=3)


def test_the_rule_based_reward_scores_a_batch_of_the_keys_it_declares() -> None:
    """``RuleBasedReward.reads`` is all it needs of the generation (a resident step fetches only that)."""
    from ppo_core.rewards import RuleBasedReward

    class Digits:
        def batch_decode(self, rows, skip_special_tokens=True):
            return ["#### " + "".join(str(t) for t in row) for row in rows]

    reward = RuleBasedReward(Digits(), timeout_s=None)
    assert reward_reads(reward) == ("responses", "response_mask")
    batch = TensorDict(
        {
            "responses": torch.tensor([[4, 2, 0], [7, 0, 0]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
            "data_source": NonTensorStack.from_list(["openai/gsm8k", "openai/gsm8k"]),
            "ground_truth": NonTensorStack.from_list(["42", "8"]),
        },
        batch_size=[2],
    )
    scores, _ = reward(batch)
    assert scores.tolist() == [1.0, 0.0]
