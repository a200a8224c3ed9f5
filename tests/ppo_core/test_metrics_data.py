"""compute_data_metrics against a float64 Python loop oracle; masked garbage never leaks, never NaN."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.metrics import compute_data_metrics

FEW = settings(max_examples=min(80, settings.default.max_examples))
JUNK = (float("nan"), float("inf"), -float("inf"), 1e30)


@st.composite
def data_batches(draw, with_prompt=True, junk=True):
    """A training batch; attention covers response gaps (tool tokens), masked positions may hold NaN/inf."""
    size = draw(st.integers(0, 8))
    width = draw(st.integers(1, 8))
    lengths = torch.tensor(
        draw(st.lists(st.integers(0, width), min_size=size, max_size=size)), dtype=torch.int64
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    attn_resp = torch.arange(width).expand(size, width) < lengths[:, None]
    gaps = torch.rand(size, width, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    # a gap (tool token) is never the last response token, so a row's reward token stays valid
    last = (lengths - 1).clamp(min=0)
    gaps[torch.arange(size), last] = False
    mask = attn_resp & ~gaps
    scores = torch.zeros(size, width, dtype=torch.float64)
    scores[torch.arange(size), last] = torch.randn(size, generator=gen, dtype=torch.float64) * (lengths > 0)
    fields = {
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": scores - 0.1 * mask,
        "advantages": torch.randn(size, width, generator=gen, dtype=torch.float64),
        "returns": torch.randn(size, width, generator=gen, dtype=torch.float64),
        "values": torch.randn(size, width, generator=gen, dtype=torch.float64),
    }
    if junk:
        for key in ("advantages", "returns", "values"):
            picks = torch.tensor(JUNK, dtype=torch.float64)[torch.randint(0, 4, (size, width), generator=gen)]
            fields[key] = torch.where(mask, fields[key], picks)
    if with_prompt:
        prompt_width = draw(st.integers(1, 4))
        prompt_len = torch.randint(0, prompt_width + 1, (size,), generator=gen)
        attn_prompt = (
            torch.arange(prompt_width).expand(size, prompt_width) >= prompt_width - prompt_len[:, None]
        )
        fields["attention_mask"] = torch.cat([attn_prompt, attn_resp], dim=1).long()
    return TensorDict(fields, batch_size=[size])


def _stats(values):
    return (sum(values) / len(values), max(values), min(values)) if values else (0.0, 0.0, 0.0)


def _unbiased_var(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def oracle(batch, use_critic=True, max_prompt_length=None):
    size, width = batch["response_mask"].shape
    mask = batch["response_mask"].tolist()
    if "attention_mask" in batch:
        attn = batch["attention_mask"].tolist()
        prompt_width = len(attn[0]) - width if size else 0
        resp_len = [float(sum(row[prompt_width:])) for row in attn]
        prompt_len = [float(sum(row[:prompt_width])) for row in attn]
    else:
        resp_len = [float(sum(row)) for row in mask]
        prompt_len = None
    alive = [i for i in range(size) if resp_len[i] > 0]
    out = {}
    for name, key in (("score", "token_level_scores"), ("rewards", "token_level_rewards")):
        rows = batch[key].tolist()
        out |= dict(
            zip(
                [f"critic/{name}/{s}" for s in ("mean", "max", "min")],
                _stats([sum(rows[i]) for i in alive]),
                strict=True,
            )
        )
    keys = ["advantages", "returns"] + (["values"] if use_critic else [])
    valid = {
        k: [batch[k][i, t].item() for i in range(size) for t in range(width) if mask[i][t]] for k in keys
    }
    for k in keys:
        out |= dict(zip([f"critic/{k}/{s}" for s in ("mean", "max", "min")], _stats(valid[k]), strict=True))
    if use_critic:
        r, v = valid["returns"], valid["values"]
        ev = (
            0.0
            if len(r) < 2
            else 1 - _unbiased_var([a - b for a, b in zip(r, v, strict=True)]) / (_unbiased_var(r) + 1e-5)
        )
        out["critic/vf_explained_var"] = ev
    for prefix, rows in (("response_length", range(size)), ("response_length_non_aborted", alive)):
        lens = [resp_len[i] for i in rows]
        out |= dict(zip([f"{prefix}/{s}" for s in ("mean", "max", "min")], _stats(lens), strict=True))
        out[f"{prefix}/clip_ratio"] = sum(1 for x in lens if x == width) / len(lens) if lens else 0.0
    out["response/aborted_ratio"] = (size - len(alive)) / size if size else 0.0
    if prompt_len is not None:
        out |= dict(
            zip([f"prompt_length/{s}" for s in ("mean", "max", "min")], _stats(prompt_len), strict=True)
        )
        if max_prompt_length is not None:  # prompts at the cap (the batch's width is its longest prompt)
            out["prompt_length/clip_ratio"] = (
                sum(1 for x in prompt_len if x >= max_prompt_length) / size if size else 0.0
            )
    return out


@FEW
@given(
    st.booleans().flatmap(lambda p: data_batches(with_prompt=p)),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 4)),
)
def test_matches_loop_oracle_and_is_finite(batch, use_critic, max_prompt_length):
    got = compute_data_metrics(batch, use_critic=use_critic, max_prompt_length=max_prompt_length)
    want = oracle(batch, use_critic, max_prompt_length)
    assert set(got) == set(want)
    for key, value in want.items():
        assert math.isfinite(got[key]), key
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


@FEW
@given(data_batches(with_prompt=False))
def test_without_attention_mask_lengths_come_from_response_mask(batch):
    got = compute_data_metrics(batch)
    assert not any(k.startswith("prompt_length") for k in got)
    want = oracle(batch)
    assert got["response_length/mean"] == pytest.approx(want["response_length/mean"])


@FEW
@given(data_batches(), st.data())
def test_invariant_to_row_order(batch, data):
    size = batch.batch_size[0]
    perm = data.draw(st.permutations(list(range(size))))
    a = compute_data_metrics(batch)
    b = compute_data_metrics(batch[torch.tensor(perm, dtype=torch.int64)])
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key


def test_all_masked_batch_reports_zeros_not_nan():
    nan = torch.full((3, 4), float("nan"), dtype=torch.float64)
    batch = TensorDict(
        {
            "response_mask": torch.zeros(3, 4, dtype=torch.bool),
            "token_level_scores": torch.zeros(3, 4),
            "token_level_rewards": torch.zeros(3, 4),
            "advantages": nan,
            "returns": nan,
            "values": nan,
        },
        batch_size=[3],
    )
    got = compute_data_metrics(batch)
    assert all(v == 0.0 for k, v in got.items() if k != "response/aborted_ratio"), got
    assert got["response/aborted_ratio"] == 1.0


def test_verl_example_and_use_critic_flag():
    """verl's test: 2 samples, scores 3 and 7 -> score mean 5.0; rewards 2 and 3 -> 2.5."""
    ones = torch.ones(2, 2)
    batch = TensorDict(
        {
            "response_mask": ones,
            "attention_mask": torch.ones(2, 4),
            "token_level_scores": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
            "token_level_rewards": torch.tensor([[0.5, 1.5], [1.0, 2.0]]),
            "advantages": ones,
            "returns": ones,
            "values": ones,
        },
        batch_size=[2],
    )
    got = compute_data_metrics(batch)
    assert got["critic/score/mean"] == 5.0 and got["critic/rewards/mean"] == 2.5
    assert got["response_length/clip_ratio"] == 1.0 and got["prompt_length/mean"] == 2.0
    no_critic = compute_data_metrics(batch, use_critic=False)
    assert "critic/values/mean" not in no_critic and "critic/vf_explained_var" not in no_critic


def test_num_turns_and_missing_key_errors():
    batch = TensorDict(
        {
            "response_mask": torch.ones(2, 2),
            **{
                k: torch.zeros(2, 2)
                for k in ("token_level_scores", "token_level_rewards", "advantages", "returns")
            },
            "__num_turns__": NonTensorStack(2, 4),
        },
        batch_size=[2],
    )
    got = compute_data_metrics(batch, use_critic=False)
    assert (got["num_turns/min"], got["num_turns/max"], got["num_turns/mean"]) == (2.0, 4.0, 3.0)
    with pytest.raises(KeyError, match=r"missing keys \['values'\]"):
        compute_data_metrics(batch, use_critic=True)
    bad = batch.clone()
    bad["advantages"] = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"key 'advantages' has shape \(2, 3\) but 'response_mask' has shape \(2, 2\)"
    ):
        compute_data_metrics(bad, use_critic=False)


def test_prompt_clip_ratio_counts_prompts_at_the_cap_not_the_batchs_longest():
    """Prompts of 2, 3 and 3 tokens padded to the batch's longest (3) under a cap of 64: none was cut (verl's
    "length == P" would count two of three); two prompts at a cap of 3 are."""
    from tensordict import TensorDict

    prompt = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response = torch.ones(3, 2, dtype=torch.long)
    zeros = torch.zeros(3, 2)
    batch = TensorDict(
        dict(
            response_mask=response,
            attention_mask=torch.cat([prompt, response], 1),
            token_level_scores=zeros,
            token_level_rewards=zeros,
            advantages=zeros,
            returns=zeros,
        ),
        batch_size=[3],
    )
    assert (
        compute_data_metrics(batch, use_critic=False, max_prompt_length=64)["prompt_length/clip_ratio"] == 0.0
    )
    assert (
        compute_data_metrics(batch, use_critic=False, max_prompt_length=3)["prompt_length/clip_ratio"]
        == 2 / 3
    )
    assert "prompt_length/clip_ratio" not in compute_data_metrics(batch, use_critic=False)
