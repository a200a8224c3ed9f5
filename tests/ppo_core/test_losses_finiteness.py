"""NaN/inf at valid positions raise ValueError naming the argument (as the advantage estimators do); one host sync.

Masked positions stay free to hold anything (pinned by the padding tests of each loss); here a single poisoned
*valid* entry must be reported, with the argument's name and the position, instead of a silent NaN loss.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import (
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    policy_loss_names,
)
from ppo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from ppo_core.testing import policy_loss_inputs

BAD = [float("nan"), float("inf"), -float("inf")]
POLICY_ARGS = ["old_log_prob", "log_prob", "advantages", "rollout_is_weights"]


def _config(name: str) -> PolicyLossConfig:
    return PolicyLossConfig(loss_mode=name, dro_beta=0.1 if name == "dro" else None)


def _policy_args(shape=(3, 4)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) - 0.1
    return {
        "old_log_prob": old,
        "log_prob": old + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64),
        "advantages": torch.randn(shape, generator=gen, dtype=torch.float64),
        "response_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]]),
        "rollout_is_weights": 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64),
    }


def _poisoned(t: torch.Tensor, index: tuple[int, int], value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _call_policy(name: str, args: dict[str, torch.Tensor]):
    args = dict(args)
    return compute_policy_loss(
        args.pop("old_log_prob"),
        args.pop("log_prob"),
        args.pop("advantages"),
        args.pop("response_mask"),
        config=_config(name),
        generator=torch.Generator().manual_seed(0),
        **args,
    )


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("arg", POLICY_ARGS)
@pytest.mark.parametrize("bad", BAD)
def test_policy_loss_names_the_argument_with_a_non_finite_valid_entry(name, arg, bad):
    args = _policy_args()
    args[arg] = _poisoned(args[arg], (1, 2), bad)
    kind = "NaN" if bad != bad else "inf"
    with pytest.raises(ValueError, match=rf"^{arg} contains {kind} at 1 valid \(response_mask=1\) position\(s\), "
                       r"the first at index \[1, 2\]"):  # fmt: skip
        _call_policy(name, args)


@pytest.mark.parametrize("name", policy_loss_names())
def test_policy_loss_ignores_non_finite_masked_entries(name):
    args = _policy_args()
    clean, _ = _call_policy(name, args)
    for arg in POLICY_ARGS:
        args[arg] = _poisoned(_poisoned(args[arg], (0, 3), float("nan")), (2, 0), float("inf"))
    dirty, _ = _call_policy(name, args)
    assert torch.equal(clean, dirty)


@settings(max_examples=40)
@given(inputs=policy_loss_inputs(with_is_weights=True), data=st.data())
def test_any_poisoned_valid_entry_is_reported_where_it_is(inputs, data):
    mask = inputs.response_mask
    valid = mask.nonzero().tolist()
    if not valid:
        loss, _ = compute_policy_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, mask,
                                      config=PolicyLossConfig())  # fmt: skip
        assert loss.item() == 0.0
        return
    i, t = data.draw(st.sampled_from(valid))
    arg = data.draw(st.sampled_from(POLICY_ARGS))
    args = {
        "old_log_prob": inputs.old_log_prob,
        "log_prob": inputs.log_prob,
        "advantages": inputs.advantages,
        "response_mask": mask,
        "rollout_is_weights": inputs.rollout_is_weights,
    }
    args[arg] = _poisoned(args[arg], (i, t), data.draw(st.sampled_from(BAD)))
    with pytest.raises(ValueError, match=rf"^{arg} contains .* the first at index \[{i}, {t}\]"):
        _call_policy(data.draw(st.sampled_from(["vanilla", "gspo", "geo_mean", "kl_cov"])), args)


@pytest.mark.parametrize("arg", ["vpreds", "returns", "values"])
@pytest.mark.parametrize("bad", BAD)
def test_value_loss_names_the_argument(arg, bad):
    args = {
        k: torch.randn(2, 3, generator=torch.Generator().manual_seed(i))
        for i, k in enumerate(("vpreds", "returns", "values"))
    }
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    args[arg] = _poisoned(args[arg], (1, 1), bad)
    with pytest.raises(ValueError, match=rf"^{arg} contains .* at 1 valid \(response_mask=1\) .*\[1, 1\]"):
        compute_value_loss(args["vpreds"], args["returns"], args["values"], mask)
    args[arg] = _poisoned(args[arg], (1, 1), 0.0)
    args[arg] = _poisoned(args[arg], (0, 2), bad)  # masked: ignored
    loss, _ = compute_value_loss(args["vpreds"], args["returns"], args["values"], mask)
    assert torch.isfinite(loss)


def test_value_loss_without_clipping_does_not_read_the_rollout_values():
    values = torch.full((2, 3), float("nan"))
    loss, clipfrac = compute_value_loss(torch.ones(2, 3), torch.zeros(2, 3), values, torch.ones(2, 3),
                                        cliprange_value=None)  # fmt: skip
    assert loss.item() == 0.5 and clipfrac.item() == 0.0


@pytest.mark.parametrize("bad", BAD)
def test_agg_loss_names_loss_mat(bad):
    loss = _poisoned(torch.ones(2, 3), (0, 1), bad)
    with pytest.raises(ValueError, match=r"^loss_mat contains .* valid \(loss_mask=1\) .*\[0, 1\]"):
        agg_loss(loss, torch.ones(2, 3))
    assert agg_loss(loss, torch.tensor([[1, 0, 1], [1, 1, 1]])).item() == 1.0


def test_agg_loss_overflowing_sum_of_finite_values_is_not_reported_as_nan():
    """The fused check reads a sum: an overflow of finite entries must not be mistaken for NaN input."""
    loss = torch.full((2, 2), 3e38)
    assert agg_loss(loss, torch.ones(2, 2), "token-sum").item() == float("inf")


@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var, masked_whiten])
@pytest.mark.parametrize("bad", BAD)
def test_masked_statistics_name_values(fn, bad):
    values = _poisoned(torch.arange(6.0).reshape(2, 3), (1, 0), bad)
    with pytest.raises(ValueError, match=r"^values contains .* valid \(mask=1\) .*\[1, 0\]"):
        fn(values, torch.ones(2, 3))
    masked = torch.tensor([[1, 1, 1], [0, 1, 1]])
    out = fn(values, masked)
    if fn is masked_whiten:  # transforms every entry; the masked one keeps its inf/NaN but never leaks
        out = out[masked.bool()]
    assert torch.isfinite(out).all()


def test_masked_mean_with_dim_reports_the_bad_row():
    values = _poisoned(torch.ones(3, 4), (2, 3), float("nan"))
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        masked_mean(values, torch.ones(3, 4), dim=-1)


@contextlib.contextmanager
def _count_host_syncs() -> Iterator[list[str]]:
    """Record every Tensor -> Python conversion (each one is a device sync on an accelerator)."""
    names = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")
    original = {n: getattr(torch.Tensor, n) for n in names}
    calls: list[str] = []

    def counting(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return original[name](self, *args, **kwargs)

        return method

    try:
        for n in names:
            setattr(torch.Tensor, n, counting(n))
        yield calls
    finally:
        for n, f in original.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("name", sorted(set(policy_loss_names()) - {"clip_cov", "kl_cov"}))
def test_policy_loss_costs_one_host_sync(name):
    """One fused check (all inputs and the 0/1 test of an integer mask); clip_cov/kl_cov also count tokens."""
    args = _policy_args()
    with _count_host_syncs() as calls:
        _call_policy(name, args)
    assert len(calls) == 1, calls


def test_value_loss_and_agg_loss_cost_one_host_sync():
    x = torch.randn(4, 5)
    mask = torch.ones(4, 5, dtype=torch.long)
    with _count_host_syncs() as calls:
        compute_value_loss(x, x, x, mask)
    assert len(calls) == 1, calls
    with _count_host_syncs() as calls:
        agg_loss(x, mask)
    assert len(calls) == 1, calls


def test_a_non_binary_mask_is_still_reported_by_the_fused_check():
    args = _policy_args()
    args["response_mask"] = torch.full((3, 4), 0.5)
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        _call_policy("vanilla", args)
    with pytest.raises(ValueError, match="loss_mask must contain only 0 and 1"):
        agg_loss(torch.ones(2, 2), torch.full((2, 2), 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(set(policy_loss_names()) - {"clip_cov", "kl_cov"}))
def test_on_cuda_the_check_is_one_synchronisation_and_still_names_the_argument(name):
    args = {k: v.cuda() for k, v in _policy_args().items()}
    _call_policy(name, args)  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss, _ = _call_policy(name, args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch announces once per process that the debug mode is a prototype: that warning is not a synchronisation
    syncs = [w for w in caught if "called a synchronizing" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    cpu_loss, _ = _call_policy(name, _policy_args())
    assert loss.item() == pytest.approx(cpu_loss.item(), rel=1e-9, abs=1e-12)
    args["advantages"] = _poisoned(args["advantages"], (1, 2), float("nan"))
    with pytest.raises(ValueError, match=r"^advantages contains NaN .*\[1, 2\]"):
        _call_policy(name, args)
