"""Invariants of the advantage estimators: padding, splitting, permutation, whitening, immutability, dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.advantages import get_advantage_estimator
from ppo_core.testing import PPOBatch, ppo_batches
from ppo_core.testing.advantage_oracles import ADVANTAGE_ORACLES, advantage_inputs_from_batch

# at most 60 examples under the ci profile (the dev profile's 30 stay 30): each example is slow, and the suite
# must stay within its 10-minute budget on the 2-core CI machine
_CI_EXAMPLES = min(60, settings.default.max_examples)

NAMES = sorted(ADVANTAGE_ORACLES)
TOKEN_LEVEL = ("gae", "reinforce_plus_plus", "remax")
GROUP = tuple(n for n in NAMES if n not in TOKEN_LEVEL)
WHITENED = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
OPTS = {"gamma": 0.9, "lam": 0.8, "norm_by_std": True, "epsilon": 1e-6}
f64_batches = ppo_batches(dtype=torch.float64, min_batch=2, max_batch=10, max_len=10)


def pair_labels(batch_size: int) -> list[int]:
    """Labels putting every row in a group of 2 or 3 (what grpo_passk needs), for ``batch_size >= 2``."""
    labels = [i // 2 for i in range(batch_size)]
    if batch_size % 2:
        labels[-1] = labels[-2]
    return labels


def run(name: str, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    return get_advantage_estimator(name)(**{**OPTS, **kwargs})


def inputs(batch: PPOBatch, name: str) -> dict:
    kwargs = advantage_inputs_from_batch(batch)
    if name == "grpo_passk":
        kwargs["index"] = pair_labels(batch.batch_size)
    return kwargs


def garbage_like(t: torch.Tensor, seed: int, finite: bool) -> torch.Tensor:
    g = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype) * 100
    if not finite and t.numel():
        g.view(-1)[::3] = float("nan")
        g.view(-1)[1::3] = float("inf")
    return g


def assert_pair_equal(a: tuple, b: tuple, name: str, atol: float = 0.0) -> None:
    for x, y in zip(a, b, strict=True):
        if atol == 0.0:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@given(batch=f64_batches, seed=st.integers(0, 2**16))
def test_masked_inputs_never_change_token_level_outputs(batch: PPOBatch, seed: int) -> None:
    """Rewards and values at masked positions (even NaN/inf) change nothing: estimators ignore them and output 0 there."""
    mask = batch.response_mask
    dirty_r = torch.where(mask, batch.token_level_rewards, garbage_like(mask.double(), seed, finite=False))
    dirty_v = torch.where(mask, batch.values, garbage_like(mask.double(), seed + 1, finite=False))
    for name in TOKEN_LEVEL:
        clean = run(name, **inputs(batch, name))
        dirty = run(name, **{**inputs(batch, name), "token_level_rewards": dirty_r, "values": dirty_v})
        assert_pair_equal(clean, dirty, name)


@settings(max_examples=_CI_EXAMPLES)
@given(batch=f64_batches, data=st.data())
def test_outcome_estimators_only_see_row_sums(batch: PPOBatch, data: st.DataObject) -> None:
    """Moving a row's outcome reward to any column, masked or not, changes nothing: outcome estimators sum every position."""
    columns = data.draw(
        st.lists(st.integers(0, batch.seq_len - 1), min_size=batch.batch_size, max_size=batch.batch_size)
    )
    moved = torch.zeros_like(batch.token_level_rewards)
    moved[torch.arange(batch.batch_size), torch.tensor(columns)] = batch.token_level_rewards.sum(dim=-1)
    for name in GROUP:
        assert_pair_equal(
            run(name, **inputs(batch, name)),
            run(name, **{**inputs(batch, name), "token_level_rewards": moved}),
            name,
        )


@settings(max_examples=_CI_EXAMPLES)
@given(batch=f64_batches, extra=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_appending_padding_columns_changes_nothing(batch: PPOBatch, extra: int, seed: int) -> None:
    pad_mask = torch.zeros(batch.batch_size, extra, dtype=torch.bool)
    pad = garbage_like(pad_mask.double(), seed, finite=False)
    for name in NAMES:
        base = run(name, **inputs(batch, name))
        # outcome estimators count every position, masked ones included, so their padding rewards must be 0
        pad_r = pad if name in TOKEN_LEVEL else torch.zeros_like(pad)
        wide = run(
            name,
            **{
                **inputs(batch, name),
                "token_level_rewards": torch.cat([batch.token_level_rewards, pad_r], dim=1),
                "values": torch.cat([batch.values, pad], dim=1),
                "response_mask": torch.cat([batch.response_mask, pad_mask], dim=1),
            },
        )
        for short, long in zip(base, wide, strict=True):
            torch.testing.assert_close(long[:, : batch.seq_len], short, atol=1e-12, rtol=0)
            assert torch.equal(long[:, batch.seq_len :], torch.zeros_like(long[:, batch.seq_len :])), name


@settings(max_examples=_CI_EXAMPLES)
@given(batch=f64_batches, data=st.data())
def test_splitting_by_group_and_concatenating_changes_nothing(batch: PPOBatch, data: st.DataObject) -> None:
    """Group estimators without batch-global steps are per-group: any split along groups gives the same rows."""
    for name in ("grpo", "rloo", "opo", "gpg", "grpo_passk"):
        kwargs = inputs(batch, name)
        if name == "gpg":
            kwargs["alpha"] = 1.5  # the adaptive alpha is batch-global by definition
        labels = (
            kwargs["index"].tolist() if isinstance(kwargs["index"], torch.Tensor) else list(kwargs["index"])
        )
        distinct = list(dict.fromkeys(labels))
        side = data.draw(st.lists(st.booleans(), min_size=len(distinct), max_size=len(distinct)))
        chosen = {lab for lab, s in zip(distinct, side, strict=True) if s}
        full = run(name, **kwargs)
        for part in (True, False):
            rows = [i for i, lab in enumerate(labels) if (lab in chosen) == part]
            sub = {
                k: (v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows] if k == "index" else v)
                for k, v in kwargs.items()
            }
            for whole, piece in zip(full, run(name, **sub), strict=True):
                torch.testing.assert_close(whole[rows], piece, atol=1e-12, rtol=0)


@settings(max_examples=_CI_EXAMPLES)
@given(batch=f64_batches, data=st.data())
def test_row_permutation_permutes_outputs(batch: PPOBatch, data: st.DataObject) -> None:
    perm = data.draw(st.permutations(range(batch.batch_size)))
    for name in NAMES:
        kwargs = inputs(batch, name)
        shuffled = {
            k: (v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in perm] if k == "index" else v)
            for k, v in kwargs.items()
        }
        for whole, permuted in zip(run(name, **kwargs), run(name, **shuffled), strict=True):
            torch.testing.assert_close(whole[perm], permuted, atol=1e-9, rtol=0)


@given(batch=ppo_batches(dtype=torch.float64, min_batch=2, max_batch=10, max_len=10, dense_rewards=True))
def test_whitened_outputs_have_zero_mean_and_unit_variance(batch: PPOBatch) -> None:
    mask = batch.response_mask
    base = inputs(batch, "gae")
    raws = {
        "gae": run("gae", **base, whiten=False)[0],
        "reinforce_plus_plus": run("reinforce_plus_plus", **base)[1],
        # REINFORCE++-baseline before whitening is exactly Dr.GRPO
        "reinforce_plus_plus_baseline": run("grpo", **base, norm_by_std=False)[0],
    }
    for name in WHITENED:
        adv, _ = run(name, **base)
        valid, raw = adv[mask], raws[name][mask]
        assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask])), name
        if valid.numel() < 2:
            assert torch.equal(valid, torch.zeros_like(valid)), name
            continue
        assert abs(float(valid.mean())) < 1e-9, name
        raw_var = float(raw.var())
        # masked_whiten divides by sqrt(var + 1e-8): the output variance is var / (var + 1e-8)
        assert float(valid.var()) == pytest.approx(raw_var / (raw_var + 1e-8), abs=1e-9), name


def _compact(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Left-align each row's valid entries (drop interior gaps), zero-fill the rest."""
    out = torch.zeros_like(t)
    for i in range(t.shape[0]):
        kept = t[i][mask[i]]
        out[i, : kept.numel()] = kept
    return out


@given(batch=f64_batches)
def test_removing_gaps_changes_no_valid_output(batch: PPOBatch) -> None:
    """A run of masked tokens costs one gamma step whatever its length, so deleting it changes nothing."""
    mask = batch.response_mask
    compact_mask = _compact(mask, mask)
    for name in TOKEN_LEVEL:
        kwargs = inputs(batch, name)
        squeezed = {
            **kwargs,
            "token_level_rewards": _compact(batch.token_level_rewards, mask),
            "values": _compact(batch.values, mask),
            "response_mask": compact_mask,
        }
        for gapped, compact in zip(run(name, **kwargs), run(name, **squeezed), strict=True):
            torch.testing.assert_close(gapped[mask], compact[compact_mask], atol=1e-12, rtol=0)


@settings(max_examples=_CI_EXAMPLES)
@given(batch=ppo_batches(dtype=torch.float64, min_batch=2, max_batch=8, max_len=8, id_kind="str"))
def test_label_kind_does_not_change_outputs(batch: PPOBatch) -> None:
    labels = list(batch.index)
    codes = {lab: k * 7919 - 10**12 for k, lab in enumerate(dict.fromkeys(labels))}
    variants = (
        [f"uid-{lab}" for lab in labels],
        [codes[lab] for lab in labels],
        torch.tensor([codes[lab] for lab in labels]),
    )
    for name in GROUP:
        if name == "grpo_passk":
            continue
        base = run(name, **inputs(batch, name))
        for index in variants:
            assert_pair_equal(base, run(name, **{**inputs(batch, name), "index": index}), name, atol=1e-15)


@settings(max_examples=_CI_EXAMPLES)
@given(batch=ppo_batches(dtype=torch.float64, min_batch=2, max_batch=6, max_len=6))
def test_mask_dtypes_and_inputs_untouched_and_no_grad(batch: PPOBatch) -> None:
    for name in NAMES:
        kwargs = inputs(batch, name)
        kwargs = {
            k: (
                v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            )
            for k, v in kwargs.items()
        }
        before = {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        outs = [
            run(name, **{**kwargs, "response_mask": batch.response_mask.to(dt)})
            for dt in (torch.bool, torch.int64, torch.float32)
        ]
        for out in outs:
            assert not out[0].requires_grad and not out[1].requires_grad, name
            assert_pair_equal(outs[0], out, name)
        for k, v in before.items():
            assert torch.equal(kwargs[k].detach(), v), f"{name} mutated {k}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(name: str, shape: tuple[int, int]) -> None:
    b, t = shape
    adv, ret = run(
        name,
        token_level_rewards=torch.zeros(b, t),
        response_mask=torch.zeros(b, t, dtype=torch.bool),
        index=pair_labels(b) if b else [],
        values=torch.zeros(b, t),
        reward_baselines=torch.zeros(b),
    )
    assert adv.shape == ret.shape == (b, t)


def test_group_estimators_at_scale_sanity() -> None:
    """B = 65536 rows in 8192 uuid groups (no timing assertion): matches a reshape-based closed form."""
    n_groups, size = 8192, 8
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(n_groups * size, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(n_groups * size, 3, dtype=torch.float64)
    rewards[:, -1] = scores
    mask = torch.ones_like(rewards, dtype=torch.bool)
    labels = [f"{g:08x}-uuid" for g in range(n_groups) for _ in range(size)]
    by_group = scores.view(n_groups, size)
    centred = by_group - by_group.mean(dim=1, keepdim=True)
    grpo, _ = get_advantage_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=labels)
    torch.testing.assert_close(grpo[:, 0], (centred / (by_group.std(dim=1, keepdim=True) + 1e-6)).flatten())
    rloo, _ = get_advantage_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=labels)
    torch.testing.assert_close(rloo[:, 1], (centred * size / (size - 1)).flatten())
