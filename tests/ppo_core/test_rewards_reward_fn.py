"""RuleBasedReward: decoding by response_mask, dispatch by data_source, inline vs process-pool Future, metrics."""

from __future__ import annotations

import concurrent.futures
import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.rewards import RuleBasedReward, ScorerError, gsm8k_score, math_score, reward_metrics_by_source
from ppo_core.trainer.reward import RewardFunctionError, call_reward_fn

EOS = 1


class CharTokenizer:
    """One token per character (id = code point); id 1 is the special EOS, dropped by skip_special_tokens."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(i) for i in row if not (skip_special_tokens and i == EOS)) for row in rows]


def boom(solution_str, ground_truth, extra_info=None):
    raise RuntimeError(f"cannot score {solution_str!r}")


def length_scorer(solution_str, ground_truth, extra_info=None):
    return len(solution_str) + extra_info["bonus"]


def _batch(texts, sources, truths, *, garbage="99", extras=None) -> TensorDict:
    """Responses right-padded with ``garbage`` characters that the mask hides, EOS kept with mask 1."""
    width = max(len(t) for t in texts) + 1 + len(garbage)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        row = [ord(c) for c in text] + [EOS]
        row += [ord(c) for c in garbage] * width
        ids[i] = torch.tensor(row[:width])
        mask[i, : len(text) + 1] = 1
    td = TensorDict({"responses": ids, "response_mask": mask}, batch_size=[len(texts)])
    td.set("data_source", NonTensorStack.from_list(list(sources)))
    td.set("ground_truth", NonTensorStack.from_list(list(truths)))
    if extras is not None:
        td.set("extra_info", NonTensorStack.from_list(list(extras)))
    return td


TEXTS = ["3 + 4 = 7\n#### 7", "#### 8", r"so \boxed{\frac{1}{2}}", "no answer", r"\boxed{\sqrt{4}}"]
SOURCES = ["openai/gsm8k", "openai/gsm8k", "HuggingFaceH4/MATH-500", "math", "lighteval/MATH"]
TRUTHS = ["7", "7", "0.5", "1", "2"]


def test_inline_scores_and_infos():
    reward = RuleBasedReward(CharTokenizer())
    scores, infos = reward(_batch(TEXTS, SOURCES, TRUTHS))
    expected = [1.0, 0.0, 1.0, 0.0, 1.0]
    assert scores.dtype == torch.float32 and scores.tolist() == expected
    assert infos["acc"] == expected
    assert infos["pred"] == ["7", "8", r"\frac{1}{2}", "", r"\sqrt{4}"]


def test_only_masked_tokens_are_decoded():
    reward = RuleBasedReward(CharTokenizer())
    # unmasked garbage "99" after the answer would turn "#### 7" into "#### 7999..." if it were decoded
    scores, _ = reward(_batch(["#### 7"], ["openai/gsm8k"], ["7"], garbage="99"))
    assert scores.tolist() == [1.0]
    assert reward.decode_responses(torch.tensor([[55, 1, 57]]), torch.tensor([[1, 1, 0]])) == ["7"]
    keep = RuleBasedReward(CharTokenizer(), skip_special_tokens=False)
    assert keep.decode_responses(torch.tensor([[55, 1, 57]]), torch.tensor([[1, 1, 0]])) == ["7\x01"]
    with pytest.raises(ValueError, match="must match"):
        reward.decode_responses(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2))


def test_overrides_extra_info_and_missing_keys():
    flexible = functools.partial(gsm8k_score, method="flexible")
    reward = RuleBasedReward(CharTokenizer(), scorers={"openai/gsm8k": flexible, "len/*": length_scorer})
    batch = _batch(
        ["it is 7", "abc"], ["openai/gsm8k", "len/x"], ["7", None], extras=[{"bonus": 0}, {"bonus": 10}]
    )
    scores, infos = reward(batch)
    assert scores.tolist() == [1.0, 13.0]
    # a float scorer returns no acc/format/pred; the format is GSM8K's "#### N" whatever the extraction method
    assert infos == {"acc": [1.0, None], "format": [0.0, None], "pred": ["7", None]}
    with pytest.raises(ValueError, match="no scorer is registered for data_source 'other'"):
        reward(_batch(["x"], ["other"], ["1"]))
    with pytest.raises(ValueError, match="needs batch key 'ground_truth'"):
        reward(_batch(["x"], ["math"], ["1"]).exclude("ground_truth"))


def test_bad_scorer_results_and_arguments():
    def no_score(solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    def text_score(solution_str, ground_truth, extra_info=None):
        return "high"

    for scorer, message in ((no_score, "without 'score'"), (text_score, "not a number: 'high'")):
        reward = RuleBasedReward(CharTokenizer(), scorers={"s": scorer})
        with pytest.raises(ScorerError, match=f"of data_source 's' \\(row 0\\) returned a .*{message}"):
            reward(_batch(["x"], ["s"], ["1"]))
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        RuleBasedReward(CharTokenizer(), num_workers=-1)
    with pytest.raises(ValueError, match="mp_context must be one of"):
        RuleBasedReward(CharTokenizer(), mp_context="threads")


def test_empty_batch():
    reward = RuleBasedReward(CharTokenizer(), num_workers=2)
    empty = TensorDict(
        {"responses": torch.zeros(0, 3, dtype=torch.long), "response_mask": torch.zeros(0, 3)}, batch_size=[0]
    )
    empty.set("data_source", NonTensorStack.from_list([]))
    empty.set("ground_truth", NonTensorStack.from_list([]))
    scores, infos = reward(empty)
    assert scores.shape == (0,) and infos == {}


@pytest.fixture(scope="module")
def pool_reward():
    reward = RuleBasedReward(
        CharTokenizer(),
        num_workers=2,
        scorers={"boom": boom, "slow/math": functools.partial(math_score, timeout_s=1)},
    )
    yield reward
    reward.close()


def test_process_pool_returns_a_future_with_the_same_scores(pool_reward):
    batch = _batch(TEXTS * 3, SOURCES * 3, TRUTHS * 3)
    inline = RuleBasedReward(CharTokenizer())(batch)
    future = pool_reward(batch)
    assert isinstance(future, concurrent.futures.Future)
    scores, infos = future.result(timeout=300)
    torch.testing.assert_close(scores, inline[0], rtol=0, atol=0)
    assert infos == inline[1]
    # the trainer's path: started now, awaited later
    token_scores, extra = call_reward_fn(pool_reward, batch, 1, None).result()  # type: ignore[arg-type]
    assert token_scores.shape == batch["responses"].shape
    assert token_scores.sum(-1).tolist() == inline[0].tolist()
    assert extra["acc"] == inline[1]["acc"]


def test_process_pool_times_out_a_pathological_answer(pool_reward):
    # math-verify's alarm works in the pool worker's main thread: the answer scores 0 instead of hanging
    batch = _batch([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{2}{4}}"], ["slow/math"] * 2, ["1", "0.5"])
    scores, _ = pool_reward(batch).result(timeout=300)
    assert scores.tolist() == [0.0, 1.0]


def test_process_pool_errors_reach_the_trainer(pool_reward):
    batch = _batch(["#### 7", "x"], ["openai/gsm8k", "boom"], ["7", "1"])
    with pytest.raises(RuntimeError, match="cannot score 'x'"):
        pool_reward(batch).result(timeout=300)
    with pytest.raises(RewardFunctionError, match=r"reward function .* failed at step 4"):
        call_reward_fn(pool_reward, batch, 4, None).result()  # type: ignore[arg-type]


def test_close_is_idempotent_and_the_pool_starts_on_first_use():
    reward = RuleBasedReward(CharTokenizer(), num_workers=1)
    assert reward._pool is None  # nothing is spawned until a batch needs scoring
    reward.close()
    with reward:
        reward._executor()
        assert reward._pool is not None
    assert reward._pool is None
    reward.close()


# ----- per-source metrics ---------------------------------------------------------------------------------------


@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.floats(-5, 5, allow_nan=False),
            st.one_of(st.none(), st.sampled_from([0.0, 1.0, float("nan")]), st.text(max_size=2)),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_reward_metrics_by_source_against_a_loop(rows):
    sources = [r[0] for r in rows]
    scores = [r[1] for r in rows]
    acc = [r[2] for r in rows]
    out = reward_metrics_by_source(sources, torch.tensor(scores), {"acc": acc, "pred": ["x"] * len(rows)})
    for source in set(sources):
        mine = [i for i, s in enumerate(sources) if s == source]
        assert out[f"reward/{source}/count"] == len(mine)
        assert out[f"reward/{source}/score/mean"] == pytest.approx(
            sum(scores[i] for i in mine) / len(mine), abs=1e-6
        )
        numbers = [acc[i] for i in mine if isinstance(acc[i], float) and not math.isnan(acc[i])]
        if numbers:
            assert out[f"reward/{source}/acc/mean"] == pytest.approx(sum(numbers) / len(numbers))
        else:
            assert f"reward/{source}/acc/mean" not in out
        assert f"reward/{source}/pred/mean" not in out


def test_reward_metrics_by_source_token_level_and_errors():
    token = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    out = reward_metrics_by_source(["a", "a"], token, prefix="train_reward")
    assert out == {"train_reward/a/count": 2.0, "train_reward/a/score/mean": 0.75}
    with pytest.raises(ValueError, match=r"scores must have shape \[B\]=3"):
        reward_metrics_by_source(["a"] * 3, [1.0, 2.0])
    with pytest.raises(ValueError, match="extra_infos\\['acc'\\] has 1 values for 2 responses"):
        reward_metrics_by_source(["a", "b"], [1.0, 2.0], {"acc": [1.0]})
