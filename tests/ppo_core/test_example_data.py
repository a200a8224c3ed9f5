"""The offline example: synthetic GSM8K-format task, BPE tokenizer with a chat template, tiny Qwen2 checkpoint."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

from ppo_core.data import load_prompt_dataset  # noqa: E402
from ppo_core.examples import (  # noqa: E402
    ArithTaskConfig,
    TinyModelConfig,
    format_sft_pairs,
    make_arith_rows,
    make_example_data,
)
from ppo_core.examples.make_data import main  # noqa: E402
from ppo_core.rewards import RuleBasedReward, get_scorer  # noqa: E402
from ppo_core.trainer import collate_prompts, merge_generation  # noqa: E402
from ppo_core.trainer.steps import assign_uids  # noqa: E402


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return make_example_data(tmp_path_factory.mktemp("example"), seed=0, n_train=256, n_test=32)


@pytest.fixture(scope="module")
def tokenizer(example):
    return transformers.AutoTokenizer.from_pretrained(example.model_dir, local_files_only=True)


def _reference_value(question: str) -> int:
    a, b = (int(x) for x in re.findall(r"\d+", question))
    return a - b if any(w in question for w in ("gives away", "lost")) else a + b


def test_files_and_checkpoint(example, tokenizer):
    assert os.path.isfile(example.train_file) and os.path.isfile(example.test_file)
    model = transformers.AutoModelForCausalLM.from_pretrained(example.model_dir, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer) == example.extra["vocab_size"]
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert os.path.isfile(os.path.join(example.model_dir, "model.safetensors"))
    assert sum(p.numel() for p in model.parameters()) == example.extra["num_parameters"] < 1_000_000


def test_tokenizer_chat_template_special_tokens_and_digits(example, tokenizer):
    with open(os.path.join(example.model_dir, "tokenizer_config.json")) as f:
        assert "chat_template" in json.load(f)
    assert not os.path.exists(os.path.join(example.model_dir, "chat_template.jinja"))
    messages = [{"role": "user", "content": "Mia has 12 shells."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nMia has 12 shells.<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|im_start|>user\nMia has 12 shells.<|im_end|>\n"
    assert (tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.eos_token) == (
        "<|endoftext|>",
        0,
        "<|im_end|>",
    )
    ids = tokenizer("#### 1234", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids[-4:]] == ["1", "2", "3", "4"]
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_rows_load_and_the_reference_solutions_score_one(example, tokenizer):
    for path, split in ((example.train_file, "train"), (example.test_file, "test")):
        data = load_prompt_dataset(path, tokenizer, max_prompt_length=64)
        assert data.stats.num_truncated == 0 and len(data) == len(pq.read_table(path))
        rows = pq.read_table(path).to_pylist()
        scorer = get_scorer(rows[0]["data_source"])
        for row, item in zip(rows, data, strict=True):
            info = row["extra_info"]
            assert info["split"] == split
            assert row["reward_model"]["ground_truth"] == str(_reference_value(info["question"]))
            assert scorer(info["answer"], item["ground_truth"])["acc"] == 1.0
            assert scorer("#### 1000", item["ground_truth"])["acc"] == 0.0


def test_format_pairs_teach_the_format_not_the_answers(example):
    rows = pq.read_table(example.train_file).to_pylist()
    pairs = list(format_sft_pairs(rows, seed=0))
    scorer = get_scorer("synthetic/arith_gsm8k")
    results = [
        scorer(resp, row["reward_model"]["ground_truth"]) for (_, resp), row in zip(pairs, rows, strict=True)
    ]
    assert all(r["pred"] != "" for r in results)  # every response is well formed
    assert sum(r["acc"] for r in results) / len(results) < 0.3  # values are random, not the answers
    assert [m for m, _ in pairs[:3]] == [row["prompt"] for row in rows[:3]]
    assert list(format_sft_pairs(rows, seed=0)) == pairs


def test_same_seed_same_files_and_the_global_rng_is_untouched(tmp_path):
    state = torch.random.get_rng_state()
    a = make_example_data(tmp_path / "a", seed=3, n_train=16, n_test=4)
    b = make_example_data(tmp_path / "b", seed=3, n_train=16, n_test=4)
    c = make_example_data(tmp_path / "c", seed=4, n_train=16, n_test=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    from safetensors.torch import load_file

    def content(d):
        weights = load_file(os.path.join(d.model_dir, "model.safetensors"))
        with open(os.path.join(d.model_dir, "tokenizer.json")) as f:
            vocab = f.read()
        return pq.read_table(d.train_file).to_pylist(), pq.read_table(d.test_file).to_pylist(), weights, vocab

    ra, rb, rc = content(a), content(b), content(c)
    assert ra[0] == rb[0] and ra[1] == rb[1] and ra[3] == rb[3]
    assert ra[2].keys() == rb[2].keys() and all(torch.equal(ra[2][k], rb[2][k]) for k in ra[2])
    assert ra[0] != rc[0]
    assert not all(torch.equal(ra[2][k], rc[2][k]) for k in ra[2])


@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 20),
    max_operand=st.integers(1, 30),
    ops=st.sampled_from([["+"], ["-"], ["+", "-"]]),
)
def test_arith_rows_against_a_reference(seed, n, max_operand, ops):
    rows = make_arith_rows(n, seed=seed, config=ArithTaskConfig(max_operand=max_operand, ops=ops))
    assert len(rows) == n
    for i, row in enumerate(rows):
        question = row["extra_info"]["question"]
        a, b = (int(x) for x in re.findall(r"\d+", question))
        assert 0 <= a <= max_operand and 0 <= b <= max_operand
        value = _reference_value(question)  # from the wording alone
        assert value >= 0
        x, op, y, v, final = re.fullmatch(
            r"(\d+) ([+-]) (\d+) = (\d+)\n#### (\d+)", row["extra_info"]["answer"]
        ).groups()
        assert op in ops and (int(x), int(y)) == (a, b) and int(v) == int(final) == value
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(value)}
        assert row["extra_info"]["index"] == i and row["prompt"][0]["content"].startswith(question)
    assert make_arith_rows(n, seed=seed, config=ArithTaskConfig(max_operand=max_operand, ops=ops)) == rows


def test_configs_validate_and_round_trip():
    for cfg in (ArithTaskConfig(max_operand=20, ops=["+", "-"]), TinyModelConfig(hidden_size=128)):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="ops must be a non-empty list"):
        ArithTaskConfig(ops=["*"])
    with pytest.raises(ValueError, match="max_operand must be >= 1"):
        ArithTaskConfig(max_operand=0)
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) must divide hidden_size"):
        TinyModelConfig(num_attention_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TinyModelConfig(num_key_value_heads=3)
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_arith_rows(-1, seed=0)


def test_command_line(tmp_path):
    out = main([str(tmp_path / "cli"), "--seed", "1", "--n-train", "8", "--n-test", "2", "--ops", "+-"])
    assert len(pq.read_table(out.train_file)) == 8 and len(pq.read_table(out.test_file)) == 2


def test_pipeline_from_files_to_rewards(example, tokenizer):
    """Prompts from parquet -> HF actor sampling -> rule-based reward, as the trainer strings them together."""
    from ppo_core.models import load_causal_lm
    from ppo_core.workers.torch import TorchActorWorker

    data = load_prompt_dataset(example.test_file, tokenizer, max_prompt_length=64)
    actor = TorchActorWorker(
        functools.partial(load_causal_lm, example.model_dir),
        {
            "rollout": {"max_new_tokens": 6, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": 0},
            "ppo_mini_batch_size": 4,
            "device": "cpu",
        },
    )
    prompts = assign_uids(collate_prompts(data[:4], tokenizer.pad_token_id), "0")
    batch = merge_generation(prompts, actor.generate_sequences(prompts.select("input_ids", "attention_mask")))
    scores, infos = RuleBasedReward(tokenizer)(batch)
    assert scores.shape == (4,) and set(scores.tolist()) <= {0.0, 1.0}
    assert len(infos["acc"]) == 4
    # a response that is the reference answer scores 1 through the same path
    answer = tokenizer(f"#### {data[0]['ground_truth']}", add_special_tokens=False)["input_ids"]
    batch["responses"][0] = 0
    batch["response_mask"][0] = 0
    batch["responses"][0, : len(answer)] = torch.tensor(answer)
    batch["response_mask"][0, : len(answer)] = 1
    assert RuleBasedReward(tokenizer)(batch)[0][0] == 1.0
