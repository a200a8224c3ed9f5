"""EOS and padding resolved at start (the chat template's end of turn wins over a tokenizer EOS that is not it,
config overrides checked against the vocabulary), routed to the workers and the SFT pairs; a tokenizer larger than
the model's embedding is an error before any model is built."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("omegaconf")

from tokenizers import AddedToken  # noqa: E402

from ppo_core_cli.config import JobConfig  # noqa: E402
from ppo_core_cli.job import check_tokenizer_fits, complete_workers, load_tokenizer  # noqa: E402
from ppo_core_cli.sft import tokenize_sft_pair  # noqa: E402
from ppo_core_cli.tokens import (  # noqa: E402
    check_vocabulary_fits,
    end_of_turn_token,
    resolve_special_tokens,
)

LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
)


@pytest.fixture
def tok(tokenizer_dir):
    """A fresh ChatML tokenizer (EOS <|im_end|>, pad <|endoftext|>) each test may change."""
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _id(tok, token):
    return tok.convert_tokens_to_ids(token)


def test_chatml_end_of_turn_wins_over_the_tokenizers_eos(tok, caplog):
    assert end_of_turn_token(tok) == "<|im_end|>"
    tok.eos_token, tok.pad_token = "<|im_start|>", None  # SmolLM2's GGUF tokenizer
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.tokens"):
        got = resolve_special_tokens(tok)
    assert (got.eos_token, got.eos_token_id) == ("<|im_end|>", _id(tok, "<|im_end|>"))
    assert got.eos_source == "the chat template's end of turn"
    assert (got.pad_token, got.pad_token_id, got.pad_source) == ("<|im_end|>", got.eos_token_id, "the EOS")
    assert "does not end an assistant turn" in caplog.text
    assert sum("EOS '<|im_end|>'" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_the_tokenizers_special_pad_token_is_kept(tok):
    got = resolve_special_tokens(tok)
    assert (got.eos_token, got.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert got.pad_source == "the tokenizer's pad token"


def test_llama3_template_ends_turns_with_eot_id(tok):
    tok.add_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        ],
        special_tokens=True,
    )
    tok.chat_template = LLAMA3_TEMPLATE
    assert end_of_turn_token(tok) == "<|eot_id|>"
    got = resolve_special_tokens(tok)
    assert (got.eos_token, got.eos_token_id) == ("<|eot_id|>", _id(tok, "<|eot_id|>"))


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, None, "{{ raise_exception('no assistant turns') }}"])
def test_without_an_end_of_turn_token_the_tokenizers_eos_is_used(tok, template):
    tok.chat_template = template
    assert end_of_turn_token(tok) is None
    got = resolve_special_tokens(tok)
    assert (got.eos_token, got.eos_source) == ("<|im_end|>", "the tokenizer's EOS")
    tok.eos_token = None
    with pytest.raises(ValueError, match=r"no EOS token .*set model\.eos_token"):
        resolve_special_tokens(tok)
    got = resolve_special_tokens(tok, eos_token="<|im_start|>")
    assert got.eos_token_id == _id(tok, "<|im_start|>")


def test_config_overrides_win_and_must_be_in_the_vocabulary(tok):
    got = resolve_special_tokens(tok, eos_token="<|endoftext|>", pad_token="<|im_start|>")
    assert (got.eos_token_id, got.pad_token_id) == (_id(tok, "<|endoftext|>"), _id(tok, "<|im_start|>"))
    assert (got.eos_source, got.pad_source) == ("model.eos_token", "model.pad_token")
    with pytest.raises(
        ValueError, match=r"model\.eos_token='<\|eot_id\|>' is not a token of the tokenizer at 'here'"
    ):
        resolve_special_tokens(tok, eos_token="<|eot_id|>", where="here")
    with pytest.raises(ValueError, match=r"model\.pad_token='<pad>' is not a token"):
        resolve_special_tokens(tok, pad_token="<pad>")


def test_a_content_token_is_never_the_fallback_pad(tok):
    tok.pad_token = "Mia"  # a word of the vocabulary, not a special token
    assert tok.pad_token_id == tok("Mia", add_special_tokens=False)["input_ids"][0]
    got = resolve_special_tokens(tok)
    assert (got.pad_token, got.pad_source) == ("<|im_end|>", "the EOS")


def test_workers_and_sft_get_the_resolved_tokens(tiny):
    job = JobConfig.from_dict(
        {"model": {"path": tiny, "eos_token": "<|endoftext|>", "pad_token": "<|im_start|>"}}
    )
    tok = load_tokenizer(job)
    actor, _ = complete_workers(job, tok, tiny)
    assert (actor.rollout.eos_token_id, actor.rollout.pad_token_id) == (
        _id(tok, "<|endoftext|>"),
        _id(tok, "<|im_start|>"),
    )
    pair = tokenize_sft_pair(
        tok, [{"role": "user", "content": "hi"}], "#### 8", eos_token_id=_id(tok, "<|im_start|>")
    )
    assert pair.input_ids[-1] == _id(tok, "<|im_start|>") and pair.loss_mask[-1] == 1


def test_a_tokenizer_larger_than_the_embedding_is_an_error_naming_both(tiny, tokenizer_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    check_vocabulary_fits(tok, tokenizer_dir, tiny)  # the matching pair passes
    small = tmp_path / "small"
    shutil.copytree(tiny, small)
    with open(small / "config.json") as f:
        config = json.load(f)
    config["vocab_size"] = len(tok) - 5
    with open(small / "config.json", "w") as f:
        json.dump(config, f)
    message = rf"{re.escape(tokenizer_dir)}' has {len(tok)} tokens .*{re.escape(str(small))}' has an embedding of {len(tok) - 5} rows"
    with pytest.raises(ValueError, match=message):
        check_vocabulary_fits(tok, tokenizer_dir, str(small))
    job = JobConfig.from_dict({"model": {"path": str(small), "tokenizer_path": tokenizer_dir}})
    with pytest.raises(ValueError, match=r"small"):
        check_tokenizer_fits(job, tok)
    # the critic's checkpoint is checked too
    job = JobConfig.from_dict(
        {"model": {"path": tiny, "critic_path": str(small), "tokenizer_path": tokenizer_dir}}
    )
    with pytest.raises(ValueError, match=rf"{len(tok) - 5} rows"):
        check_tokenizer_fits(job, tok)


def test_train_stops_at_the_vocabulary_check_before_building_a_model(
    tiny, tokenizer_dir, tmp_path, monkeypatch
):
    from ppo_core_cli import train

    small = tmp_path / "small"
    shutil.copytree(tiny, small)
    with open(small / "config.json") as f:
        config = json.load(f)
    config["vocab_size"] = 10
    with open(small / "config.json", "w") as f:
        json.dump(config, f)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(train, "worker_specs", no_model)
    monkeypatch.setattr(train, "load_datasets", no_model)
    job = JobConfig.from_dict({"model": {"path": str(small)}, "run_dir": str(tmp_path / "run")})
    with pytest.raises(ValueError, match=r"embedding of 10 rows"):
        train.run_train(job)
