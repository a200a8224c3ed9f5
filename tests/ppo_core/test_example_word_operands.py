"""The example task with word operands ("Mia finds one more"), and the format warm-up pairs ``make-data`` writes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.examples import NUMBER_WORDS, ArithTaskConfig, make_arith_rows


@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 20),
    max_operand=st.integers(1, 12),
    ops=st.sampled_from([["+"], ["-"], ["+", "-"]]),
    words=st.lists(st.integers(0, 10), min_size=1, max_size=3),
)
def test_word_operands_against_the_wording(seed, n, max_operand, ops, words):
    cfg = ArithTaskConfig(max_operand=max_operand, ops=ops, word_operands=words)
    rows = make_arith_rows(n, seed=seed, config=cfg)
    for row in rows:
        question = row["extra_info"]["question"]
        (a,) = (int(x) for x in re.findall(r"\d+", question))  # one digit operand: the second is a word
        word = next(w for w in NUMBER_WORDS if re.search(rf"\b{w}\b", question))
        b = NUMBER_WORDS.index(word)
        minus = any(v in question for v in ("gives away", "lost"))
        value = a - b if minus else a + b
        assert b in words and value >= 0 and row["reward_model"]["ground_truth"] == str(value)
        assert row["extra_info"]["answer"] == f"{a} {'-' if minus else '+'} {b} = {value}\n#### {value}"
        assert a <= max(max_operand, b)  # a subtraction may raise a to b
    assert make_arith_rows(n, seed=seed, config=cfg) == rows


def test_word_operand_errors():
    with pytest.raises(ValueError, match=r"word_operands must be a non-empty list of values in 0\.\.10"):
        ArithTaskConfig(word_operands=[11])
    with pytest.raises(ValueError, match="word_operands must be a non-empty list"):
        ArithTaskConfig(word_operands=[])


def test_make_data_writes_format_pairs(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("transformers")
    from ppo_core.examples.make_data import main
    from ppo_core.rewards import get_scorer

    data = main([str(tmp_path / "ex"), "--n-train", "32", "--n-test", "4"])  # the command's defaults
    train = pq.read_table(data.train_file).to_pylist()
    pairs = pq.read_table(data.sft_file).to_pylist()
    assert "one more" in train[0]["prompt"][0]["content"] or "got one" in train[0]["prompt"][0]["content"]
    assert [p["prompt"] for p in pairs] == [r["prompt"] for r in train]
    scorer = get_scorer(pairs[0]["data_source"])
    for pair, row in zip(pairs, train, strict=True):
        assert re.fullmatch(r"#### \d+", pair["response"])
        assert scorer(pair["response"], row["reward_model"]["ground_truth"])["pred"] != ""  # well formed
    none = main([str(tmp_path / "digits"), "--n-train", "4", "--n-test", "1", "--word-operands", "none"])
    question = pq.read_table(none.train_file).to_pylist()[0]["extra_info"]["question"]
    assert len(re.findall(r"\d+", question)) == 2
