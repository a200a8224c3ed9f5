"""The rollout's input checks (:mod:`ppo_core.rollout.prompt_checks`): right-padded prompts are left-padded against a
loop, every bad prompt batch or token id raises naming the argument before any forward, on each decoding path
(the generic loop with and without a cache, the Hugging Face static-cache engine), in one host read."""

from __future__ import annotations

import pytest
import torch
from _tiny_lm import EOS, LM, NoCache, V
from _tiny_lm import left_padded_prompts as _prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.keys import KEYS
from ppo_core.rollout import SamplingConfig, generate
from ppo_core.rollout.prompt_checks import check_prompts, check_token_id, vocab_size_of

transformers = pytest.importorskip("transformers")

HF_VOCAB = 61


def _hf_lm() -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen2ForCausalLM(config).eval()


# (name, model factory, vocabulary size): the three decoding paths of generate()
PATHS = [("cached", LM, V), ("recompute", lambda: NoCache(LM()), None), ("hf", _hf_lm, HF_VOCAB)]


def _left_packed(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop reference: each row's padding first (in order), then its tokens (in order)."""
    rows_ids, rows_mask = [], []
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist(), strict=True):
        pad = [i for i, m in zip(row_ids, row_mask, strict=True) if not m]
        tok = [i for i, m in zip(row_ids, row_mask, strict=True) if m]
        rows_ids.append(pad + tok)
        rows_mask.append([0] * len(pad) + [1] * len(tok))
    return torch.tensor(rows_ids), torch.tensor(rows_mask)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 6), data=st.data())
def test_any_padding_is_left_packed_in_order_in_one_host_read(rows, width, data):
    bits = data.draw(
        st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=rows, max_size=rows)
    )
    bits = [row if any(row) else [True, *row[1:]] for row in bits]  # every row has a token
    mask = torch.tensor(bits, dtype=torch.long)
    ids = torch.arange(rows * width).view(rows, width)
    reads, real = [], torch.Tensor.tolist
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
        out = check_prompts(ids, mask, vocab_size=rows * width)
    assert len(reads) == 1
    want_ids, want_mask = _left_packed(ids, mask)
    assert torch.equal(out.prompts, want_ids) and torch.equal(out.mask, want_mask.bool())
    assert out.padded == (not bool(mask.all()))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 6),
    dtype=st.sampled_from([torch.bool, torch.long, torch.float32]),
    bad=st.sampled_from([None, 2.0, -1.0, 0.5]),
    data=st.data(),
)
def test_a_mask_other_than_0_1_raises_in_the_same_host_read(rows, width, dtype, bad, data):
    raw = torch.ones(rows, width).to(dtype)
    if bad is not None and dtype != torch.bool and (dtype.is_floating_point or bad == int(bad)):
        raw.view(-1)[data.draw(st.integers(0, rows * width - 1))] = bad
    reads, real = [], torch.Tensor.tolist
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
        if bool(((raw != 0) & (raw != 1)).any()):
            with pytest.raises(ValueError, match="prompt_mask must contain only 0 and 1"):
                check_prompts(torch.zeros(rows, width, dtype=torch.long), raw, vocab_size=3)
        else:
            assert (
                check_prompts(torch.zeros(rows, width, dtype=torch.long), raw, vocab_size=3).padded is False
            )
    assert len(reads) == 1


@pytest.mark.parametrize(("path", "model", "vocab"), PATHS, ids=[p[0] for p in PATHS])
def test_right_padded_prompts_generate_what_the_left_padded_ones_do(path, model, vocab):
    p = _prompts(3, batch=5, width=4)
    left_ids, left_mask = p["input_ids"], p["attention_mask"]
    right_ids, right_mask = (
        left_ids.flip(1),
        left_mask.flip(1),
    )  # the flip reverses the tokens: flip them back
    for row in range(5):
        n = int(right_mask[row].sum())
        right_ids[row, :n] = right_ids[row, :n].flip(0)
    lm = model()
    cfg = SamplingConfig(max_new_tokens=4, eos_token_id=EOS, temperature=0.0)
    want = generate(lm, left_ids, left_mask, cfg)
    got = generate(lm, right_ids, right_mask, cfg)
    assert torch.equal(got[KEYS.prompts], left_ids)
    for key in (KEYS.responses, KEYS.response_mask, KEYS.input_ids, KEYS.attention_mask):
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(
        got[KEYS.rollout_log_probs], want[KEYS.rollout_log_probs], rtol=1e-5, atol=1e-6
    )


class _Forbidden(torch.nn.Module):
    """Fails the test if any forward runs: every bad input must be caught before the model sees it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = getattr(inner, "config", None)

    def forward(self, *args, **kwargs):
        raise AssertionError("the model ran on a bad input")


BAD_INPUTS = [
    (
        "all-padding rows",
        ValueError,
        r"prompt_mask has no prompt token \(all 0\) in 2 of 4 rows \(rows 1, 3\)",
    ),
    (
        "id too large",
        ValueError,
        r"prompts holds 1 token id\(s\) outside .*the first is \d+ at row 2, column 1",
    ),
    (
        "id negative",
        ValueError,
        r"prompts holds 1 token id\(s\) outside .*the first is -1 at row 2, column 1",
    ),
    ("float prompts", TypeError, r"prompts must hold integer token ids .*float32"),
    ("no columns", ValueError, r"prompts has shape \(4, 0\): every prompt needs at least one token"),
    ("eos too large", ValueError, r"config.eos_token_id must be a token id in \[0, \d+\)"),
    ("eos negative", ValueError, r"config.eos_token_id must be a token id .*got -1"),
    ("pad too large", ValueError, r"config.pad_token_id must be a token id in \[0, \d+\)"),
    ("pad negative", ValueError, r"config.pad_token_id must be a token id .*got -1"),
]


@pytest.mark.parametrize(
    ("path", "model", "case", "error", "match"),
    [
        pytest.param(path, model, *bad, id=f"{path}-{bad[0]}")
        for path, model, vocab in PATHS
        for bad in BAD_INPUTS
        # a model that states no vocabulary size is checked for negative ids only
        if vocab is not None or not bad[0].endswith("too large")
    ],
)
def test_bad_inputs_raise_naming_the_argument_before_any_forward(path, model, case, error, match):
    p = _prompts(1, batch=4, width=3)
    ids, mask = p["input_ids"].clone(), p["attention_mask"].clone()
    lm = model()
    size = vocab_size_of(lm) or 10_000
    settings_ = {"max_new_tokens": 2, "temperature": 0.0, "eos_token_id": EOS}
    if case == "all-padding rows":
        mask[[1, 3]] = 0
    elif case == "id too large":
        ids[2, 1] = size
    elif case == "id negative":
        ids[2, 1] = -1
    elif case == "float prompts":
        ids = ids.float()
    elif case == "no columns":
        ids, mask = ids[:, :0], mask[:, :0]
    elif case.startswith(("eos", "pad")):
        settings_[f"{case[:3]}_token_id"] = size if case.endswith("large") else -1
    forbidden = lm if path == "hf" else _Forbidden(lm)
    if path == "hf":
        forbidden.model.forward = _Forbidden(lm).forward  # the engine runs the body's modules, not lm.forward
        forbidden.model.embed_tokens.forward = _Forbidden(lm).forward
    with pytest.raises(error, match=match):
        generate(forbidden, ids, mask, SamplingConfig(**settings_))


@pytest.mark.parametrize(("path", "model", "vocab"), PATHS, ids=[p[0] for p in PATHS])
def test_no_rows_give_empty_outputs_of_the_documented_shapes(path, model, vocab):
    out = generate(
        model(),
        torch.zeros(0, 3, dtype=torch.long),
        torch.zeros(0, 3, dtype=torch.long),
        SamplingConfig(max_new_tokens=5, temperature=0.0),
    )
    assert out.batch_size == torch.Size([0])
    assert out[KEYS.prompts].shape == (0, 3) and out[KEYS.input_ids].shape == (0, 8)
    for key in (KEYS.responses, KEYS.response_mask, KEYS.rollout_log_probs):
        assert out[key].shape == (0, 5), key


def test_a_mask_on_another_device_is_named():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt_mask is on meta but prompts on cpu"):
        check_prompts(ids, torch.ones(2, 3, device="meta"), vocab_size=4)


def test_the_row_list_of_an_error_is_cut_after_eight():
    mask = torch.zeros(20, 2, dtype=torch.long)
    mask[0] = 1
    with pytest.raises(ValueError, match=r"in 19 of 20 rows \(rows 1, 2, 3, 4, 5, 6, 7, 8, \.\.\.\)"):
        check_prompts(torch.zeros(20, 2, dtype=torch.long), mask, vocab_size=4)


def test_token_ids_and_vocabulary_sizes():
    assert check_token_id("eos_token_id", 3, 4) == 3
    assert check_token_id("eos_token_id", None, 4, optional=True) is None
    assert check_token_id("eos_token_id", 10**6, None) == 10**6
    with pytest.raises(TypeError, match="eos_token_id must be an int token id, got bool True"):
        check_token_id("eos_token_id", True, 4)
    with pytest.raises(TypeError, match="pad_token_id must be an int token id, got NoneType"):
        check_token_id("pad_token_id", None, 4)
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id >= 0, got -2"):
        check_token_id("eos_token_id", -2, None)
    assert vocab_size_of(LM()) == V
    assert vocab_size_of(_hf_lm()) == HF_VOCAB
    assert vocab_size_of(NoCache(LM())) is None
    assert vocab_size_of(torch.nn.Embedding(7, 2)) is None
