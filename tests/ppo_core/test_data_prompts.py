"""Prompt datasets: verl-schema parquet / JSONL, errors naming row and field, chat template, length policies."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from ppo_core.data import (  # noqa: E402
    PromptDatasetConfig,
    PromptDatasetStats,
    PromptSchemaError,
    load_prompt_dataset,
    tokenize_chat,
)
from ppo_core.trainer import PromptDataLoader, collate_prompts  # noqa: E402


def _row(i: int, content: str | None = None, **overrides: object) -> dict:
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": content if content is not None else f"What is {i} + 1?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i, "split": "train"},
    }
    row.update(overrides)
    return row


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return os.fspath(path)


def _parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return os.fspath(path)


class CountingTokenizer:
    """A stand-in tokenizer: the template renders each message as its role id then one token per character.

    It is an independent, obvious reference for the length policies (the ids encode the characters' positions).
    """

    chat_template = "counting"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict, **kwargs):
        assert add_generation_prompt and tokenize and not return_dict
        ids = []
        for m in messages:
            ids += [1] + [10 + (ord(c) % 50) for c in m["content"]]
        ids.append(2)  # the generation prompt
        if kwargs.get("shout"):
            ids.append(3)
        return ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from _hf import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# ----- chat template --------------------------------------------------------------------------------------------


def test_ids_are_the_chatml_text_encoded_without_extra_special_tokens(tmp_path, tokenizer):
    rows = [_row(i) for i in range(3)]
    data = load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", rows), tokenizer, max_prompt_length=512)
    for item, row in zip(data, rows, strict=True):
        system, user = (m["content"] for m in row["prompt"])
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert item["input_ids"].tolist() == expected
        assert item["input_ids"].dtype == torch.long
        assert tokenizer.decode(item["input_ids"]) == text
        assert item["data_source"] == "openai/gsm8k"
        assert item["ground_truth"] == row["reward_model"]["ground_truth"]
        assert item["extra_info"] == row["extra_info"]
        assert "raw_prompt" not in item


def test_tokenize_chat_matches_apply_chat_template_and_passes_template_kwargs(tokenizer):
    messages = [{"role": "user", "content": "1,234 apples?"}]
    direct = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenize_chat(tokenizer, messages) == list(direct)
    assert tokenize_chat(CountingTokenizer(), messages, {"shout": True})[-1] == 3


def test_a_tokenizer_without_chat_template_is_refused(tmp_path):
    class NoTemplate(CountingTokenizer):
        chat_template = None

    with pytest.raises(ValueError, match="chat_template"):
        load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", [_row(0)]), NoTemplate(), max_prompt_length=8)


# ----- files ----------------------------------------------------------------------------------------------------


def test_parquet_and_jsonl_give_the_same_dataset_in_file_order(tmp_path):
    rows = [_row(i) for i in range(5)]
    tok = CountingTokenizer()
    a = load_prompt_dataset(_parquet(tmp_path / "a.parquet", rows), tok, max_prompt_length=100)
    b = load_prompt_dataset(_jsonl(tmp_path / "a.jsonl", rows), tok, max_prompt_length=100)
    both = load_prompt_dataset(
        [tmp_path / "a.parquet", _jsonl(tmp_path / "b.jsonl", rows[:2])], tok, max_prompt_length=100
    )
    assert len(a) == len(b) == 5 and len(both) == 7
    for x, y in zip(a, b, strict=True):
        assert x["input_ids"].tolist() == y["input_ids"].tolist()
        assert (x["ground_truth"], x["extra_info"]) == (y["ground_truth"], y["extra_info"])
    assert [it["ground_truth"] for it in both] == ["1", "2", "3", "4", "5", "1", "2"]
    assert [str(o) for o in both.origins][5] == f"{tmp_path / 'b.jsonl'} row 0"


def test_blank_jsonl_lines_are_skipped_and_bad_json_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n\n" + json.dumps(_row(1)) + "\n")
    assert len(load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)) == 2
    path.write_text(json.dumps(_row(0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl line 2: invalid JSON"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1: each line must be a JSON object, got list"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="must end with one of"):
        load_prompt_dataset(tmp_path / "p.csv", CountingTokenizer(), max_prompt_length=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(tmp_path / "missing.parquet", CountingTokenizer(), max_prompt_length=8)
    with pytest.raises(ValueError, match="at least one"):
        load_prompt_dataset([], CountingTokenizer(), max_prompt_length=8)


# ----- unreadable and empty files name the file (and the line) ---------------------------------------------------


def _damaged_parquet(tmp_path, how: str) -> str:
    _parquet(tmp_path / "good.parquet", [_row(i) for i in range(40)])
    raw = (tmp_path / "good.parquet").read_bytes()
    if how == "empty":
        damaged = b""
    elif how == "truncated":
        damaged = raw[: len(raw) // 2]
    elif how == "corrupted footer":
        damaged = raw[:-8] + (1 << 30).to_bytes(4, "little") + raw[-4:]  # the footer's length: past the file
    elif how == "corrupted metadata":
        damaged = raw[:4] + bytes(len(raw) - 12) + raw[-8:]
    else:  # a text file named .parquet
        damaged = b"data_source,prompt\nx,y\n"
    path = tmp_path / f"{how.replace(' ', '_')}.parquet"
    path.write_bytes(damaged)
    return os.fspath(path)


@pytest.mark.parametrize(
    "how", ["empty", "truncated", "corrupted footer", "corrupted metadata", "not parquet"]
)
def test_an_unreadable_parquet_file_is_named(tmp_path, how):
    path = _damaged_parquet(tmp_path, how)
    expected = "is empty \\(0 bytes\\)" if how == "empty" else "is not a readable parquet file"
    with pytest.raises(ValueError, match=f"prompt file {path} {expected}"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)


def test_a_non_utf8_jsonl_line_is_named_with_its_byte(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes((json.dumps(_row(0)) + "\n\n").encode() + b'{"data_source": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl line 3: not UTF-8 text \(byte 0xe9 at column 21"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.jsonl", b"", r"is empty \(0 bytes\)"),
        ("p.jsonl", b"\n  \n", r"is empty: it holds no row \(blank lines only\)"),
        ("p.parquet", None, r"is empty: it holds no row \(a parquet table of 0 rows\)"),
    ],
)
def test_an_empty_file_is_an_error_naming_it_even_after_full_ones(tmp_path, caplog, name, content, message):
    path = tmp_path / name
    if content is None:
        _parquet(path, [_row(0)])
        pq.write_table(pq.read_table(path).slice(0, 0), path)
    else:
        path.write_bytes(content)
    full = _jsonl(tmp_path / "full.jsonl", [_row(0)])
    with caplog.at_level("WARNING"), pytest.raises(ValueError, match=f"prompt file {path} {message}"):
        load_prompt_dataset([full, path], CountingTokenizer(), max_prompt_length=100)
    assert "after filtering" not in caplog.text


def test_a_dataset_filtered_to_nothing_says_so(tmp_path, caplog):
    rows = [_row(0, content="abcdefgh"), _row(1, content="abcdefghi")]
    with caplog.at_level("WARNING", logger="ppo_core.data.prompts"):
        data = load_prompt_dataset(
            _jsonl(tmp_path / "p.jsonl", rows), CountingTokenizer(), max_prompt_length=4, truncation="filter"
        )
    assert len(data) == 0
    assert "all 2 rows are longer than max_prompt_length=4 tokens" in caplog.text


# ----- schema errors name the row and the field ----------------------------------------------------------------

BAD_ROWS = [
    ({"prompt": [{"role": "user", "content": "a"}, {"content": "b"}]}, "prompt[1].role missing"),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content missing"),
    ({"prompt": [{"role": "user", "content": 3}]}, "prompt[0].content must be a string, got int"),
    ({"prompt": ""}, "prompt must be a non-empty prompt, got an empty string"),
    (
        {"prompt": "<|im_start|>user\nHi<|im_end|>"},
        "prompt is text that holds the chat-template marker '<|im_start|>'",
    ),
    (
        {"prompt": '[{"role": "user", "content": "hi"}]'},
        "prompt is text that looks like a JSON list of chat messages",
    ),
    ({"prompt": {"role": "user", "content": "a"}}, "prompt must be a list of chat messages"),
    ({"prompt": []}, "prompt must hold at least one message"),
    ({"prompt": ["hi"]}, "prompt[0] must be a mapping"),
    ({"prompt": None}, "prompt missing"),
    ({"data_source": None}, "data_source missing"),
    ({"data_source": ""}, "data_source must be a non-empty string"),
    ({"reward_model": None}, "reward_model missing"),
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth missing"),
    ({"reward_model": "7"}, "reward_model must be a mapping"),
    ({"extra_info": [1]}, "extra_info must be a mapping or null, got list"),
]


@pytest.mark.parametrize(("override", "message"), BAD_ROWS)
def test_jsonl_schema_errors_name_file_row_and_field(tmp_path, override, message):
    rows = [_row(i) for i in range(4)]
    rows[2] = {**rows[2], **override}
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PromptSchemaError) as info:
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    assert str(info.value).startswith(f"{path} row 2: ")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_an_absent_column_is_told_from_a_null_and_the_columns_are_listed(tmp_path, column):
    rows = [_row(i) for i in range(2)]
    rows[1]["question"] = rows[1].pop(column)
    path = _jsonl(tmp_path / "renamed.jsonl", rows)
    with pytest.raises(PromptSchemaError) as info:
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    message = str(info.value)
    assert message.startswith(f"{path} row 1: {column} missing: the row has no such column (its columns: ")
    assert "question" in message.split("its columns: ")[1]
    assert ("data.prompt_key" in message) == (column == "prompt")


def test_parquet_schema_errors_name_row_and_field(tmp_path):
    rows = [_row(i) for i in range(20)]
    rows[17]["prompt"][1] = {"content": "no role"}  # parquet fills the missing struct field with null
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(PromptSchemaError, match=r"bad\.parquet row 17: prompt\[1\]\.role missing"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)


def test_optional_fields_and_custom_prompt_key(tmp_path):
    row = _row(0, extra_info=None)
    row["question"] = row.pop("prompt")
    del row["reward_model"]
    path = _jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(PromptSchemaError, match="row 0: prompt missing"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100)
    with pytest.raises(PromptSchemaError, match="reward_model missing"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=100, prompt_key="question")
    data = load_prompt_dataset(
        path,
        CountingTokenizer(),
        max_prompt_length=100,
        prompt_key="question",
        require_ground_truth=False,
        keep_raw_prompt=True,
    )
    assert data[0]["ground_truth"] is None and data[0]["extra_info"] == {}
    assert data[0]["raw_prompt"] == row["question"]


# ----- length policies ------------------------------------------------------------------------------------------


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    max_len=st.integers(1, 16),
    policy=st.sampled_from(["filter", "left", "right"]),
)
def test_length_policies_against_a_reference(tmp_path_factory, lengths, max_len, policy):
    rows = [_row(i, content="abcdefghijklmnop"[:n]) for i, n in enumerate(lengths)]
    path = _jsonl(tmp_path_factory.mktemp("len") / "p.jsonl", rows)
    tok = CountingTokenizer()
    data = load_prompt_dataset(path, tok, max_prompt_length=max_len, truncation=policy)
    full = [tok.apply_chat_template(r["prompt"], True, True, False) for r in rows]
    too_long = [len(ids) > max_len for ids in full]
    if policy == "filter":
        expected = [ids for ids, long in zip(full, too_long, strict=True) if not long]
    elif policy == "left":
        expected = [ids[-max_len:] for ids in full]
    else:
        expected = [ids[:max_len] for ids in full]
    assert [it["input_ids"].tolist() for it in data] == expected
    stats = data.stats
    assert stats.num_rows == len(rows)
    assert stats.num_filtered == (sum(too_long) if policy == "filter" else 0)
    assert stats.num_truncated == (0 if policy == "filter" else sum(too_long))
    assert stats.num_kept == len(data) == len(rows) - stats.num_filtered
    assert stats.max_length == max(len(ids) for ids in full)
    mean = sum(len(ids) for ids in expected) / len(expected) if expected else 0.0
    assert stats.mean_length == pytest.approx(mean)


def test_error_policy_names_the_row_and_length(tmp_path):
    rows = [_row(0, content="ab"), _row(1, content="abcdefgh")]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    # row 0: system (1 + 9) + user (1 + 2) + generation prompt (1) = 14 tokens; row 1: 20 tokens
    with pytest.raises(ValueError, match=r"p\.jsonl row 1: prompt is 20 tokens .* max_prompt_length=16"):
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=16)


def test_error_policy_counts_the_long_rows_and_names_the_longest(tmp_path):
    rows = [_row(0, content="ab"), _row(1, content="abcdefgh"), _row(2, content="abcdefghijkl"), _row(3)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    # 14, 20 and 24 tokens (see above); row 3's default content decides whether it is long too
    lengths = [len(tokenize_chat(CountingTokenizer(), r["prompt"], {})) for r in rows]
    longer = [n for n in lengths if n > 16]
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(path, CountingTokenizer(), max_prompt_length=16)
    message = str(info.value)
    assert "p.jsonl row 1: prompt is 20 tokens after the chat template" in message, message
    assert f"{len(longer)} of 4 prompts are longer, the longest {max(lengths)} tokens" in message, message
    assert f"raise max_prompt_length to {max(lengths)}" in message


def test_filtered_counts_are_logged(tmp_path, caplog):
    rows = [_row(0, content="ab"), _row(1, content="abcdefgh")]
    with caplog.at_level("INFO", logger="ppo_core.data.prompts"):
        data = load_prompt_dataset(
            _jsonl(tmp_path / "p.jsonl", rows), CountingTokenizer(), max_prompt_length=16, truncation="filter"
        )
    assert len(data) == 1
    assert "1 filtered, 0 truncated" in caplog.text
    metrics = data.stats.to_metrics("train_data/")
    assert metrics["train_data/num_filtered"] == 1.0 and metrics["train_data/num_kept"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_prompt_length": 0}, "max_prompt_length must be an int >= 1"),
        ({"max_prompt_length": True}, "max_prompt_length must be an int >= 1"),
        ({"max_prompt_length": 8, "truncation": "middle"}, "truncation must be one of"),
        ({"max_prompt_length": 8, "prompt_key": ""}, "prompt_key must be a non-empty string"),
    ],
)
def test_bad_options(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", [_row(0)]), CountingTokenizer(), **kwargs)


# ----- what the trainer consumes --------------------------------------------------------------------------------


def test_dataset_feeds_the_resumable_loader(tmp_path):
    data = load_prompt_dataset(
        _jsonl(tmp_path / "p.jsonl", [_row(i) for i in range(6)]), CountingTokenizer(), max_prompt_length=100
    )
    loader = PromptDataLoader(data, batch_size=2, seed=3)
    first = next(iter(loader))
    state = loader.state_dict()
    rest = [b.get("ground_truth").tolist() for b in loader]
    again = PromptDataLoader(data, batch_size=2, seed=3)
    again.load_state_dict(state)
    assert [b.get("ground_truth").tolist() for b in again] == rest
    assert set(first.keys()) >= {"input_ids", "attention_mask", "data_source", "ground_truth", "extra_info"}
    batch = collate_prompts(data[:2])
    assert batch.get("extra_info").tolist() == [
        {"index": 0, "split": "train"},
        {"index": 1, "split": "train"},
    ]


def test_items_are_copies(tmp_path):
    data = load_prompt_dataset(
        _jsonl(tmp_path / "p.jsonl", [_row(0)]), CountingTokenizer(), max_prompt_length=100
    )
    data[0]["data_source"] = "changed"
    assert data[0]["data_source"] == "openai/gsm8k"
    assert isinstance(data[0:1], list) and len(data[0:1]) == 1


def test_config_round_trips_and_loads(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [_row(0, content="abcdefgh"), _row(1, content="ab")])
    cfg = PromptDatasetConfig(files=path, max_prompt_length=16, truncation="left")
    assert cfg.files == [path]
    assert PromptDatasetConfig.from_dict(cfg.to_dict()) == cfg
    data = cfg.load(CountingTokenizer())
    assert data.stats == PromptDatasetStats(
        num_rows=2, num_kept=2, num_truncated=1, max_length=20, mean_length=data.stats.mean_length
    )
    with pytest.raises(ValueError, match="truncation must be one of"):
        PromptDatasetConfig.from_dict({"truncation": "cut"})
    with pytest.raises(ValueError, match="unknown PromptDatasetConfig field"):
        PromptDatasetConfig.from_dict({"max_length": 3})


def test_a_plain_string_prompt_is_the_users_one_message(tmp_path):
    """A prompt column of plain strings (not chat messages) reads as the user's one message each: the same tokens as
    the messages written out."""
    plain = [{**_row(i), "prompt": f"What is {i} + 1?"} for i in range(3)]
    messages = [{**_row(i), "prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(3)]
    got = load_prompt_dataset(
        _jsonl(tmp_path / "plain.jsonl", plain), CountingTokenizer(), max_prompt_length=100
    )
    want = load_prompt_dataset(
        _jsonl(tmp_path / "msgs.jsonl", messages), CountingTokenizer(), max_prompt_length=100
    )
    assert [item["input_ids"].tolist() for item in got] == [item["input_ids"].tolist() for item in want]
