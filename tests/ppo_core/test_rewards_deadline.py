"""Scorer deadlines and errors: a scorer that hangs, raises or returns no finite score names its data source,
itself and its row (the trainer adds the step), inline and in the process pool, and leaves nothing running."""

from __future__ import annotations

import math
import multiprocessing
import signal
import threading
import time

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppo_core.rewards import (
    DEADLINE_SIGNAL,
    CallDeadline,
    DeadlineExceeded,
    RuleBasedReward,
    ScorerError,
    ScorerTimeoutError,
)
from ppo_core.trainer.reward import RewardFunctionError, call_reward_fn


class CharTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(i) for i in row) for row in rows]


def sleeps_forever(solution_str, ground_truth, extra_info=None):
    time.sleep(3600)


def spins_forever(solution_str, ground_truth, extra_info=None):
    while True:
        pass


def swallows_errors(solution_str, ground_truth, extra_info=None):
    while True:
        try:
            time.sleep(3600)
        except Exception:  # a scorer's broad except must not swallow the deadline
            continue


def divides_by_zero(solution_str, ground_truth, extra_info=None):
    return 1 / 0


def exact(solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def _batch(texts, sources, truths) -> TensorDict:
    width = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        ids[i, : len(text)] = torch.tensor([ord(c) for c in text])
        mask[i, : len(text)] = 1
    td = TensorDict({"responses": ids, "response_mask": mask}, batch_size=[len(texts)])
    td.set("data_source", NonTensorStack.from_list(list(sources)))
    td.set("ground_truth", NonTensorStack.from_list(list(truths)))
    td.set("uid", NonTensorStack.from_list([f"u{i}" for i in range(len(texts))]))
    return td


@pytest.mark.parametrize("scorer", [sleeps_forever, spins_forever, swallows_errors])
def test_inline_scorer_that_never_returns_times_out(scorer):
    reward = RuleBasedReward(CharTokenizer(), scorers={"task/hang": scorer, "ok": exact}, timeout_s=0.5)
    batch = _batch(["a", "b"], ["ok", "task/hang"], ["a", "x"])
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        call_reward_fn(reward, batch, 7, None).result()  # type: ignore[arg-type]
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "failed at step 7" in text
    assert f"{scorer.__module__}.{scorer.__qualname__} of data_source 'task/hang' (row 1)" in text
    assert "did not return within 0.5 s (timeout_s=0.5)" in text
    assert isinstance(info.value.__cause__, ScorerTimeoutError)
    assert info.value.__cause__.data_source == "task/hang" and info.value.__cause__.row == 1
    assert signal.getsignal(DEADLINE_SIGNAL) in (signal.SIG_DFL, None)  # the handler is given back
    # the reward still works afterwards
    assert reward(_batch(["a"], ["ok"], ["a"]))[0].tolist() == [1.0]


def test_scorer_that_raises_names_data_source_scorer_and_step():
    reward = RuleBasedReward(CharTokenizer(), scorers={"boom/*": divides_by_zero})
    with pytest.raises(RewardFunctionError) as info:
        call_reward_fn(reward, _batch(["a"], ["boom/1"], ["1"]), 3, None).result()  # type: ignore[arg-type]
    text = str(info.value)
    assert "failed at step 3" in text
    assert (
        "divides_by_zero of data_source 'boom/1' (row 0) raised ZeroDivisionError: division by zero" in text
    )
    scorer_error = info.value.__cause__
    assert isinstance(scorer_error, ScorerError)
    assert isinstance(scorer_error.__cause__, ZeroDivisionError)  # the scorer's own traceback is kept


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "returned a nan score; a score must be finite"),
        (-math.inf, "returned a -inf score"),
        ({"score": math.inf, "acc": 1.0}, "returned a inf score"),
        (None, "not a number: None"),
        ("1.0", "not a number: '1.0'"),
        (torch.tensor([1.0, 2.0]), "not one number"),
    ],
)
def test_scores_that_are_not_finite_numbers_are_errors(value, message):
    reward = RuleBasedReward(CharTokenizer(), scorers={"s": lambda *a: value})
    with pytest.raises(ScorerError, match=r"of data_source 's' \(row 0\) .*" + message.replace("(", r"\(")):
        reward(_batch(["a"], ["s"], ["a"]))


@pytest.mark.parametrize("value", [1, True, 0.5, torch.tensor(0.25), torch.tensor([2.0])])
def test_number_like_scores_are_accepted(value):
    reward = RuleBasedReward(CharTokenizer(), scorers={"s": lambda *a: value})
    scores, _ = reward(_batch(["a"], ["s"], ["a"]))
    assert scores.tolist() == [float(value)]


def test_no_deadline_when_timeout_is_none():
    reward = RuleBasedReward(CharTokenizer(), scorers={"s": exact}, timeout_s=None)
    assert reward.timeout_s is None
    assert reward(_batch(["a"], ["s"], ["a"]))[0].tolist() == [1.0]
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="timeout_s must be a number > 0 or None"):
            RuleBasedReward(CharTokenizer(), timeout_s=bad)


def test_deadline_off_the_main_thread_raises_in_time():
    release = threading.Event()
    errors = []

    def score_in_thread():
        with CallDeadline(0.3) as deadline:
            try:
                deadline.call(release.wait, 60)
            except DeadlineExceeded as exc:
                errors.append(exc)

    worker = threading.Thread(target=score_in_thread)
    worker.start()
    worker.join(10)
    release.set()  # lets the abandoned call end, so the test leaves no thread behind
    assert not worker.is_alive()
    assert len(errors) == 1 and errors[0].still_running
    assert "keeps running in a background thread" in str(errors[0])


def test_deadline_passes_results_and_errors_through():
    for seconds in (None, 5.0):
        with CallDeadline(seconds) as deadline:
            assert deadline.call(max, 3, 4) == 4
            with pytest.raises(ZeroDivisionError):
                deadline.call(divides_by_zero, "", "")
    with pytest.raises(ValueError, match="must be > 0 seconds or None"):
        CallDeadline(0)


@pytest.mark.slow  # spawning the pool's process
def test_pool_scorer_that_never_returns_times_out_and_leaves_no_process():
    before = set(multiprocessing.active_children())  # processes other tests of this session may still hold
    reward = RuleBasedReward(
        CharTokenizer(), num_workers=1, scorers={"hang": sleeps_forever, "ok": exact}, timeout_s=1
    )
    try:
        future = reward(_batch(["a", "b", "c"], ["ok", "ok", "hang"], ["a", "b", "c"]))
        with pytest.raises(
            ScorerTimeoutError, match=r"sleeps_forever of data_source 'hang' \(row 2\) did not"
        ):
            future.result(timeout=120)
        # the worker process survived the interruption and scores the next batch
        assert reward(_batch(["a"], ["ok"], ["a"])).result(timeout=60)[0].tolist() == [1.0]
    finally:
        reward.close()
    assert set(multiprocessing.active_children()) - before == set()
