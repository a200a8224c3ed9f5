"""``ppo-core sft``: the response-only loss against a loop, pairs tokenised as the chat template renders prompts, schema
errors naming the row, and a short warm-up that learns the format and writes a loadable checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from ppo_core.data import tokenize_chat  # noqa: E402
from ppo_core.examples.make_data import write_parquet  # noqa: E402
from ppo_core_cli.config import SFTConfig  # noqa: E402
from ppo_core_cli.sft import (  # noqa: E402
    SFTPair,
    collate_sft,
    load_sft_pairs,
    response_nll,
    run_sft,
    tokenize_sft_pair,
)


def _nll_loop(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Oracle: float64, one token at a time."""
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[b, t]:
                row = logits[b, t - 1].double()
                total += float(torch.logsumexp(row, 0) - row[ids[b, t]])
                count += 1
    return total / count if count else 0.0


@given(
    b=st.integers(1, 4),
    s=st.integers(1, 7),
    v=st.integers(2, 9),
    seed=st.integers(0, 10_000),
    density=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_response_nll_matches_a_loop(b, s, v, seed, density):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g) * 3
    ids = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) < density).long()
    got = response_nll(logits.requires_grad_(), ids, mask)
    assert math.isclose(
        float(got.detach()), _nll_loop(logits.detach(), ids, mask), rel_tol=1e-5, abs_tol=1e-6
    )
    got.backward()  # differentiable, also with nothing masked in (a zero loss)
    assert torch.isfinite(logits.grad).all()


def test_response_nll_half_precision_and_shapes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.long)
    full = response_nll(logits, ids, mask)
    half = response_nll(logits.bfloat16(), ids, mask)
    assert half.dtype == torch.float32 and math.isclose(float(half), float(full), rel_tol=2e-2)
    with pytest.raises(ValueError, match="must agree"):
        response_nll(logits, ids[:, :4], mask)


def test_collate_right_pads():
    batch = collate_sft([SFTPair([3, 4], [0, 1]), SFTPair([5, 6, 7], [0, 0, 1])], pad_token_id=9)
    assert batch["input_ids"].tolist() == [[3, 4, 9], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0], [0, 0, 1]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ppo_core.examples.tokenizer import train_bpe_tokenizer

    corpus = ["Mia has 7 shells. Write the final answer after ####.", "#### 8", "user assistant"] * 20
    return train_bpe_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=300)


def test_pair_is_the_chat_prompt_then_the_response_and_eos(tokenizer):
    messages = [{"role": "user", "content": "Mia has 7 shells."}]
    pair = tokenize_sft_pair(tokenizer, messages, "#### 8")
    prompt = tokenize_chat(tokenizer, messages)
    answer = tokenizer("#### 8", add_special_tokens=False)["input_ids"]
    assert pair.input_ids == prompt + answer + [tokenizer.eos_token_id]
    assert pair.loss_mask == [0] * len(prompt) + [1] * (len(answer) + 1)
    assert tokenizer.decode(pair.input_ids[len(prompt) :], skip_special_tokens=True) == "#### 8"


def test_pairs_file_errors_name_the_row_and_field(tokenizer, tmp_path):
    good = {"prompt": [{"role": "user", "content": "hi"}], "response": "#### 1"}
    path = write_parquet([good, {**good, "response": ""}], tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet row 1: response must be a non-empty string"):
        load_sft_pairs(path, tokenizer)
    path = write_parquet([good, {"prompt": [{"content": "x"}], "response": "y"}], tmp_path / "bad2.parquet")
    with pytest.raises(ValueError, match=r"bad2\.parquet row 1: prompt\[0\]\.role missing"):
        load_sft_pairs(path, tokenizer)
    path = write_parquet([good], tmp_path / "ok.parquet")
    with pytest.raises(
        ValueError, match=r"ok\.parquet row 0: the pair is \d+ tokens, more than sft\.max_length=3"
    ):
        load_sft_pairs(path, tokenizer, max_length=3)
    assert len(load_sft_pairs(path, tokenizer)) == 1
    # the prompt under another column: the row's columns and the setting that names it
    path = write_parquet([{"question": good["prompt"], "response": "#### 1"}], tmp_path / "renamed.parquet")
    with pytest.raises(ValueError) as err:
        load_sft_pairs(path, tokenizer)
    assert str(err.value) == (
        f"{path} row 0: prompt missing: the row has no such column (its columns: question, response); "
        "sft.prompt_key names the column of chat messages"
    )
    assert len(load_sft_pairs(path, tokenizer, prompt_key="question")) == 1
    # a prompt file of the training (no responses): the row's columns and the setting, as for the prompt
    path = write_parquet([{"prompt": good["prompt"], "data_source": "x"}], tmp_path / "prompts_only.parquet")
    with pytest.raises(ValueError) as err:
        load_sft_pairs(path, tokenizer)
    assert str(err.value).startswith(
        f"{path} row 0: response missing: the row has no such column (its columns: data_source, prompt); "
        "sft.response_key names the responses' column"
    )
    # a data source is not needed, nor refused when null
    path = write_parquet([{**good, "data_source": None}], tmp_path / "null_source.parquet")
    assert len(load_sft_pairs(path, tokenizer)) == 1


def test_the_command_names_a_bad_pairs_file_in_one_line(tmp_path, capsys):
    """A row the warm-up cannot read stops ``ppo-core sft`` with one ``ppo-core: error:`` line (exit 2), as the
    other commands' input errors do, not a traceback."""
    import pathlib

    from ppo_core.examples import make_example_data
    from ppo_core_cli.main import main

    ex = make_example_data(tmp_path / "ex", seed=0, n_train=8, n_test=4)
    good = {"prompt": [{"role": "user", "content": "hi"}], "response": "#### 1"}
    bad = write_parquet([good, {**good, "response": ""}], tmp_path / "bad.parquet")
    tiny = pathlib.Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_cpu.yaml"
    argv = [
        f"vars.root={tmp_path / 'ex'}",
        f"sft.model_path={ex.model_dir}",
        f"sft.output_dir={tmp_path / 'o'}",
    ]
    capsys.readouterr()  # what making the example printed
    assert main(["-q", "sft", str(tiny), *argv, f"sft.files=[{bad}]"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"ppo-core: error: {bad} row 1: response must be a non-empty string, got ''"], lines
    assert not (tmp_path / "o").exists()


def test_config_errors():
    with pytest.raises(ValueError, match=r"sft\.model_path must be set"):
        run_sft(SFTConfig(files=["x.parquet"], output_dir="o"))
    with pytest.raises(ValueError, match=r"sft\.files must name"):
        run_sft(SFTConfig(model_path="m", output_dir="o"))


@pytest.mark.slow
def test_warm_up_learns_the_format_and_writes_a_checkpoint(tmp_path):
    from ppo_core.examples import make_example_data
    from ppo_core.models import load_causal_lm
    from ppo_core.rewards import get_scorer

    ex = make_example_data(tmp_path / "ex", seed=0, n_train=128, n_test=8)
    state = torch.random.get_rng_state()
    result = run_sft(
        SFTConfig(
            model_path=ex.model_dir, files=[ex.sft_file], output_dir=str(tmp_path / "sft"), steps=60, lr=3e-3
        )
    )
    assert torch.equal(torch.random.get_rng_state(), state)  # the draws use their own generator
    assert result.num_pairs == 128 and len(result.losses) == 60
    assert sum(result.losses[-5:]) / 5 < 0.5 * sum(result.losses[:5]) / 5
    tok = transformers.AutoTokenizer.from_pretrained(result.output_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(result.output_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Mia has 3 pens. Write the final answer after ####."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert get_scorer("synthetic/arith_gsm8k")(text, "3")["pred"] != "", text  # a well-formed answer
    # the written checkpoint is the trained model: same logits through our wrapper
    ours = load_causal_lm(result.output_dir)
    ids = prompt["input_ids"]
    torch.testing.assert_close(ours(ids), model(input_ids=ids).logits)
