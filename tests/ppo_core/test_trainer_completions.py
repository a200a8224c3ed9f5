"""Validation completions as text (``completions.jsonl``, INFO log) and the validation's response-length metrics."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict
from test_trainer_loop import EOS, ToyActor, ToyTrainer, make_config, make_dataset, reward_first_token

from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import RolloutConfig, read_metrics_jsonl
from ppo_core.trainer.completions import (
    append_completions,
    completion_indices,
    completion_records,
    read_completions,
    reset_completions,
)
from ppo_core.trainer.validation import run_validation
from ppo_core.workers import WorkerSpec


class WordTokenizer:
    """Decodes ids as words ``t{id}`` (``<eos>`` for the end-of-turn id), so tests can count tokens."""

    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens is False  # completions show the special tokens
        return " ".join("<eos>" if i == EOS else f"t{i}" for i in ids)


@given(n=st.integers(0, 300), k=st.integers(0, 20))
def test_completion_indices_are_distinct_evenly_spread_and_fixed(n, k):
    got = completion_indices(n, k)
    assert len(got) == min(n, k) and got == sorted(set(got)) == completion_indices(n, k)
    assert all(0 <= i < n for i in got) and (not got or got[0] == 0)
    if len(got) > 1:  # evenly spread: gaps differ by at most one
        gaps = [b - a for a, b in itertools.pairwise(got)]
        assert max(gaps) - min(gaps) <= 1 and min(gaps) >= n // len(got)


def test_completion_indices_rejects_negative_sizes():
    with pytest.raises(ValueError, match="num_prompts and k must be >= 0"):
        completion_indices(-1, 2)


def test_records_skip_padding_and_carry_scores_and_extra_infos():
    prompts = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])  # left-padded
    responses = torch.tensor([[3, EOS, 0], [4, 4, 4]])  # right-padded; row 1 hits the cap
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": torch.cat([torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), response_mask], -1),
        },
        batch_size=[2],
    )
    batch.set("data_source", NonTensorStack.from_list(["a", "b"]))  # per-row values, as collate_prompts sets
    batch.set("ground_truth", NonTensorStack.from_list(["3", "9"]))
    records = completion_records(
        batch,
        [1, 0],
        tokenizer=WordTokenizer(),
        step=7,
        scores=torch.tensor([1.0, 0.0]),
        extra={"acc": [1.0, 0.0], "pred": ["3", ""], "vector": [[1], [2]]},
        indices=[40, 12],
    )
    assert records == [
        {
            "step": 7,
            "index": 40,
            "data_source": "b",
            "prompt": "t5 t6 t7 t8",
            "response": "t4 t4 t4",
            "ground_truth": "9",
            "score": 0.0,
            "acc": 0.0,
            "pred": "",
        },
        {
            "step": 7,
            "index": 12,
            "data_source": "a",
            "prompt": "t7 t8",
            "response": "t3 <eos>",
            "ground_truth": "3",
            "score": 1.0,
            "acc": 1.0,
            "pred": "3",
        },
    ]


def test_reset_removes_a_fresh_runs_file_and_truncates_a_resumed_one(tmp_path):
    path = str(tmp_path / "logs" / "completions.jsonl")
    reset_completions(path, None)  # no file yet: nothing to do
    rows = [{"step": s, "index": 0, "data_source": "a", "prompt": "p", "response": "r", "ground_truth": 1,
             "score": 0.0} for s in (0, 2, 4)]  # fmt: skip
    append_completions(path, rows)
    assert read_completions(tmp_path / "logs") == rows
    reset_completions(path, 2)
    assert [r["step"] for r in read_completions(path)] == [0, 2]
    reset_completions(path, None)
    assert not (tmp_path / "logs" / "completions.jsonl").exists()


def _fit(cfg, tokenizer, val):
    trainer = ToyTrainer(
        cfg, train_dataset=make_dataset(6), val_dataset=val, reward_fn=reward_first_token, tokenizer=tokenizer
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer


def test_every_validation_writes_the_same_prompts_completions_and_length_metrics(tmp_path, caplog):
    cfg = make_config(
        tmp_path,
        trainer={"test_freq": 2, "save_freq": 0, "total_epochs": 1, "log_val_generations": 2},
        rollout={"val_n": 2},
    )
    val = make_dataset(5, offset=1)
    with caplog.at_level(logging.INFO, logger="ppo_core.trainer.completions"):
        _fit(cfg, WordTokenizer(), val)
    records = read_completions(tmp_path)
    assert [(r["step"], r["index"]) for r in records] == [(s, i) for s in (0, 2, 3) for i in (0, 2)]
    for r in records:
        item = val[r["index"]]
        assert r["prompt"] == " ".join(f"t{i}" for i in item["input_ids"])
        assert r["data_source"] == item["data_source"] and r["ground_truth"] == item["ground_truth"]
        first = r["response"].split()[0]
        assert r["score"] == float(first == f"t{item['ground_truth']}")  # reward_first_token
    assert sum("validation completion (step 2, prompt 2" in m for m in caplog.messages) == 1
    # the length metrics: greedy responses of ToyActor do not depend on the prompt, so every validation
    # response has the length of the logged ones
    by_step = {r["step"]: r for r in read_metrics_jsonl(tmp_path)}
    for step in (0, 2, 3):
        (length,) = {len(r["response"].split()) for r in records if r["step"] == step}
        for source in ("toy", "toy2"):
            assert by_step[step][f"val-aux/{source}/response_length/mean@2"] == length
            assert by_step[step][f"val-aux/{source}/response_clipped/mean@2"] == float(length == 3)  # R = 3
    assert not any(k.startswith("val") for k in by_step[1])


def test_no_tokenizer_or_zero_generations_write_no_file(tmp_path):
    cfg = make_config(tmp_path / "a", trainer={"save_freq": 0, "total_epochs": 1})
    _fit(cfg, None, make_dataset(3, offset=1))
    assert not (tmp_path / "a" / "completions.jsonl").exists()
    assert "val-aux/toy/response_length/mean@1" in read_metrics_jsonl(tmp_path / "a")[0]
    cfg = make_config(tmp_path / "b", trainer={"save_freq": 0, "total_epochs": 1, "log_val_generations": 0})
    _fit(cfg, WordTokenizer(), make_dataset(3, offset=1))
    assert not (tmp_path / "b" / "completions.jsonl").exists()


def test_log_dir_holds_the_file_and_records_are_json(tmp_path):
    trainer = {"test_freq": 0, "save_freq": 0, "total_epochs": 1, "log_dir": str(tmp_path / "logs")}
    _fit(make_config(tmp_path / "ckpt", trainer=trainer), WordTokenizer(), make_dataset(4, offset=1))
    lines = (tmp_path / "logs" / "completions.jsonl").read_text().splitlines()
    # the default: 3 prompts, validated before training and at the end
    assert [(json.loads(line)["step"], json.loads(line)["index"]) for line in lines] == [
        (s, i) for s in (0, 3) for i in (0, 1, 2)
    ]


@pytest.mark.parametrize("name", ["reward", "response_length", "response_clipped"])
def test_extra_infos_must_not_take_the_validations_own_names(name):
    def reward(batch):
        scores = reward_first_token(batch)
        return scores, {name: scores.tolist()}

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    with (
        LocalWorkerGroup(WorkerSpec(ToyActor)) as group,
        pytest.raises(ValueError, match=f"'{name}' \\(reserved\\)"),
    ):
        run_validation(
            group,
            make_dataset(2),
            reward,
            rollout=RolloutConfig(),
            batch_size=None,
            step=0,
            seed=0,
            pad_token_id=0,
            collate_fn=None,
            executor=executor,
        )
    executor.shutdown()
