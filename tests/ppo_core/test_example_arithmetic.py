"""Arithmetic word problems (``make-data --task arithmetic``): answers, levels, disjoint splits, schema, CLI."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.examples.arithmetic import (
    INSTRUCTION,
    LEVELS,
    ArithmeticConfig,
    data_source,
    make_arithmetic_splits,
)
from ppo_core.rewards import get_scorer, gsm8k_score

# the reference: each operation written out again, independently of the module's table
_REFERENCE = {
    "add": (lambda a, b: a + b, lambda a, b: []),
    "sub": (lambda a, b: a - b, lambda a, b: []),
    "mul": (lambda a, b: a * b, lambda a, b: []),
    "add_sub": (lambda a, b, c: a + b - c, lambda a, b, c: [a + b]),
    "sub_add": (lambda a, b, c: a - b + c, lambda a, b, c: [a - b]),
    "add_add": (lambda a, b, c: a + b + c, lambda a, b, c: [a + b]),
    "mul_add": (lambda a, b, c: a * b + c, lambda a, b, c: [a * b]),
    "mul_sub": (lambda a, b, c: a * b - c, lambda a, b, c: [a * b]),
}
_LEVEL_OPS = {1: {"add", "sub", "mul"}, 2: {"add", "sub", "mul"}, 3: set(_REFERENCE) - {"add", "sub", "mul"}}

levels_st = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3, unique=True)


def _key(row):
    info = row["extra_info"]
    return info["level"], info["operation"], tuple(info["operands"])


def _check_level(level, op, operands):
    assert op in _LEVEL_OPS[level]
    if level == 1:
        a, b = operands
        low_a, high_a = (2, 18) if op == "sub" else ((2, 9) if op == "mul" else (1, 9))
        assert low_a <= a <= high_a and (2 if op == "mul" else 1) <= b <= 9
    elif level == 2:
        a, b = operands
        if op == "mul":
            assert 10 <= a <= 30 and 2 <= b <= 9
        else:
            assert 10 <= a <= 99 and 10 <= b <= 99
    else:
        a, b, c = operands
        if op.startswith("mul"):
            assert 2 <= a <= 9 and 2 <= b <= 9 and 1 <= c <= 20
        else:
            assert 10 <= a <= 60 and 1 <= b <= 20 and 1 <= c <= 20


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), n_train=st.integers(0, 40), n_test=st.integers(0, 30), levels=levels_st
)
def test_answers_levels_and_text_against_a_reference(seed, n_train, n_test, levels):
    train, test = make_arithmetic_splits(n_train, n_test, seed=seed, config=ArithmeticConfig(levels=levels))
    assert (len(train), len(test)) == (n_train, n_test)
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            level, op, operands = _key(row)
            assert level in levels and row["data_source"] == data_source(level)
            _check_level(level, op, operands)
            value_of, steps_of = _REFERENCE[op]
            value = value_of(*operands)
            assert value >= 1 and all(
                v >= 1 for v in steps_of(*operands)
            )  # never negative, never "none left"
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(value)}
            info = row["extra_info"]
            assert (info["split"], info["index"]) == (split, i)
            # the numbers of the question are the stored operands, in order
            assert [int(x) for x in re.findall(r"\d+", info["question"])] == list(operands)
            assert row["prompt"] == [{"role": "user", "content": f"{info['question']} {INSTRUCTION}"}]
            assert row["ability"] == "math"
            # the worked solution, the bare answer and the ground truth all parse to the value
            scorer = get_scorer(row["data_source"])
            assert scorer is gsm8k_score
            assert scorer(info["answer"], row["reward_model"]["ground_truth"])["acc"] == 1.0
            assert info["answer"].endswith(f"\n#### {value}")
            assert gsm8k_score(f"#### {value}", info["answer"])["acc"] == 1.0
            assert scorer(f"#### {value + 1}", row["reward_model"]["ground_truth"])["acc"] == 0.0


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), n_train=st.integers(0, 300), n_test=st.integers(0, 60), levels=levels_st
)
def test_splits_are_disjoint_balanced_and_the_test_split_ignores_n_train(seed, n_train, n_test, levels):
    cfg = ArithmeticConfig(levels=levels)
    train, test = make_arithmetic_splits(n_train, n_test, seed=seed, config=cfg)
    test_keys = [_key(r) for r in test]
    assert len(set(test_keys)) == len(test_keys)  # no test problem twice
    assert not set(test_keys) & {_key(r) for r in train}
    assert not {r["extra_info"]["question"] for r in test} & {r["extra_info"]["question"] for r in train}
    for rows, n in ((train, n_train), (test, n_test)):
        counts = [sum(r["extra_info"]["level"] == level for r in rows) for level in levels]
        assert sum(counts) == n and max(counts) - min(counts) <= 1
    _, other_test = make_arithmetic_splits(n_train + 7, n_test, seed=seed, config=cfg)
    assert other_test == test


def test_every_operation_of_a_level_appears_and_operations_share_the_test_split():
    train, test = make_arithmetic_splits(600, 256, seed=0)
    for level, ops in LEVELS.items():
        assert set(ops) == _LEVEL_OPS[level]
        for rows in (train, test):
            assert {r["extra_info"]["operation"] for r in rows if r["extra_info"]["level"] == level} == set(
                ops
            )
        per_op = [sum(_key(r)[:2] == (level, op) for r in test) for op in ops]
        assert max(per_op) - min(per_op) <= 1


def test_same_seed_same_rows_other_seed_other_rows_global_rng_untouched():
    state = np.random.get_state()
    a = make_arithmetic_splits(50, 20, seed=5)
    assert make_arithmetic_splits(50, 20, seed=5) == a
    assert make_arithmetic_splits(50, 20, seed=6) != a
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1]) and state[2:] == after[2:]


def test_a_test_split_too_large_for_a_level_and_bad_arguments_raise():
    # level 1 holds 81 + 117 + 64 distinct problems; the test split may take at most half of each operation's
    _, test = make_arithmetic_splits(10, 40 + 58 + 32, seed=0, config=ArithmeticConfig(levels=[1]))
    assert len(test) == 130  # every operation at its cap
    ops = [r["extra_info"]["operation"] for r in test]
    assert (ops.count("add"), ops.count("sub"), ops.count("mul")) == (40, 58, 32)
    with pytest.raises(ValueError, match="test split of 131 level-1 problems"):
        make_arithmetic_splits(10, 131, seed=0, config=ArithmeticConfig(levels=[1]))
    with pytest.raises(ValueError, match="n_train must be >= 0"):
        make_arithmetic_splits(-1, 1, seed=0)
    for bad in ([], [4], [1, 1], [0]):
        with pytest.raises(ValueError, match="levels must be distinct values"):
            ArithmeticConfig(levels=bad)
    assert ArithmeticConfig.from_dict(ArithmeticConfig(levels=[3, 1]).to_dict()).levels == [3, 1]


def test_make_data_writes_the_splits_and_the_prompts_load_without_a_system_message(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    transformers = pytest.importorskip("transformers")
    from ppo_core.data import load_prompt_dataset
    from ppo_core.examples.make_data import main

    out = main(
        [str(tmp_path / "d"), "--task", "arithmetic", "--n-train", "30", "--n-test", "12", "--levels", "1,3"]
    )
    train, test = make_arithmetic_splits(30, 12, seed=0, config=ArithmeticConfig(levels=[1, 3]))
    assert pq.read_table(out.train_file).to_pylist() == train
    assert pq.read_table(out.test_file).to_pylist() == test
    tokenizer = transformers.AutoTokenizer.from_pretrained(out.model_dir, local_files_only=True)
    data = load_prompt_dataset(out.test_file, tokenizer, max_prompt_length=256)
    assert len(data) == 12 and data.stats.num_truncated == 0
    text = tokenizer.decode(data[0]["input_ids"])
    assert text.startswith("<|im_start|>user\n") and "system" not in text
    assert [item["data_source"] for item in data] == [r["data_source"] for r in test]


def test_make_data_options_conflict_or_skip_the_model(tmp_path, capsys):
    from ppo_core.examples.make_data import main
    from ppo_core_cli.main import main as cli

    out = main([str(tmp_path / "a"), "--task", "arithmetic", "--n-train", "4", "--n-test", "2", "--no-model"])
    assert out.model_dir is None and not (tmp_path / "a" / "model").exists()
    assert out.extra == {"n_train": 4, "n_test": 2}
    with pytest.raises(ValueError, match="--ops apply to --task example only"):
        main([str(tmp_path / "b"), "--task", "arithmetic", "--ops", "+-"])
    with pytest.raises(ValueError, match="--levels applies to --task arithmetic only"):
        main([str(tmp_path / "b"), "--levels", "1"])
    assert (
        cli(["make-data", str(tmp_path / "c"), "--task", "arithmetic", "--levels", "1", "--n-test", "999"])
        == 2
    )
    assert "ppo-core: error: a test split of 999 level-1 problems" in capsys.readouterr().err
    # a list option that is no list of integers is named
    with pytest.raises(ValueError, match=r"^--levels must be comma-separated integers, got 'a'$"):
        main([str(tmp_path / "d"), "--task", "arithmetic", "--levels", "a"])
    with pytest.raises(
        ValueError, match=r"^--word-operands must be comma-separated integers or 'none', got '1,x'$"
    ):
        main([str(tmp_path / "d"), "--word-operands", "1,x"])
