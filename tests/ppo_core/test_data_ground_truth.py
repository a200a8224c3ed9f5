"""A NaN or inf ground truth is refused when the prompts load (naming file and row), not scored 0 later."""

from __future__ import annotations

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core.data import PromptSchemaError, load_prompt_dataset


class CountingTokenizer:
    chat_template = "counting"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict, **kwargs):
        return [1] + [10 + ord(c) % 50 for m in messages for c in m["content"]]


def _rows(truths) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"ground_truth": truth},
        }
        for i, truth in enumerate(truths)
    ]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_parquet_float_column_with_a_non_finite_ground_truth(tmp_path, bad):
    path = os.fspath(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows([1.0, 2.0, bad, 4.0])), path)
    with pytest.raises(PromptSchemaError) as info:
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    assert (
        str(info.value)
        == f"{path} row 2: reward_model.ground_truth is {bad!r}; a ground truth must be finite"
    )


def test_jsonl_nan_ground_truth(tmp_path):
    path = os.fspath(tmp_path / "train.jsonl")
    with open(path, "w") as f:
        for row in _rows(["1", math.nan]):
            f.write(json.dumps(row) + "\n")  # Python writes NaN, and reads it back
    with pytest.raises(PromptSchemaError, match=r"train\.jsonl row 1: reward_model\.ground_truth is nan"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)


def test_finite_numbers_and_strings_load(tmp_path):
    path = os.fspath(tmp_path / "train.jsonl")
    with open(path, "w") as f:
        for row in _rows([1.5, 0, "nan is a word here", False]):
            f.write(json.dumps(row) + "\n")
    data = load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    assert [item["ground_truth"] for item in data] == [1.5, 0, "nan is a word here", False]
