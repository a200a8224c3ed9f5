"""compute_rollout_correction: float64 oracle, verl's formulas on hand-made cases, and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core import RolloutCorrectionConfig, compute_rollout_correction
from ppo_core.rollout_correction import ROLLOUT_RS_OPTIONS
from ppo_core.testing import rollout_correction_oracle


@st.composite
def log_prob_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T]`` old and rollout log-probs (near or far apart, so truncation and the exp clamp engage), a mask
    with empty rows, and garbage (NaN, inf) at masked positions."""
    batch = draw(st.integers(0, 5))
    length = draw(st.integers(0, 7))
    spread = draw(st.sampled_from([0.001, 0.1, 1.0, 8.0, 60.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 6
    rollout = old + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    garbage = draw(st.sampled_from([0.0, math.nan, math.inf]))
    return torch.where(mask, old, garbage), torch.where(mask, rollout, -garbage), mask


def _thresholds(draw: st.DrawFn, options: list[str]) -> str:
    specs = []
    for option in options:
        if option.endswith("k1"):
            upper = draw(st.sampled_from([1.001, 1.3, 2.0, 50.0]))
            lower = draw(st.sampled_from([None, 0.2, 0.9, 0.999]))
            specs.append(str(upper) if lower is None else f"{lower}_{upper}")
        else:
            specs.append(str(draw(st.sampled_from([1e-4, 0.01, 0.3, 5.0, 1e4]))))
    return ",".join(specs)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    cfg: dict = {
        "rollout_is": draw(st.sampled_from([None, "token", "sequence"])),
        "rollout_is_threshold": draw(st.sampled_from([1e-3, 1.0, 1.5, 2.0, 10.0, 1e12])),
        "rollout_is_batch_normalize": draw(st.booleans()),
    }
    options = draw(st.lists(st.sampled_from(ROLLOUT_RS_OPTIONS), max_size=3, unique=True))
    if options:
        cfg["rollout_rs"] = ",".join(options)
        cfg["rollout_rs_threshold"] = _thresholds(draw, options)
    return cfg


def _assert_matches_oracle(old, rollout, mask, cfg, rtol=1e-9, atol=1e-12) -> None:
    weights, out_mask, metrics = compute_rollout_correction(old, rollout, mask, cfg)
    ref_w, ref_mask, ref_metrics = rollout_correction_oracle(old, rollout, mask, cfg)
    torch.testing.assert_close(out_mask.double(), ref_mask, rtol=0, atol=0)
    assert (weights is None) == (ref_w is None)
    if weights is not None:
        torch.testing.assert_close(weights.double(), ref_w, rtol=rtol, atol=atol)
    assert metrics.keys() == ref_metrics.keys()
    for name, value in ref_metrics.items():
        assert math.isfinite(metrics[name]), name
        assert metrics[name] == pytest.approx(value, rel=rtol * 1e3, abs=1e-9), name


@given(log_prob_pairs(), configs())
def test_matches_float64_oracle(inputs, cfg) -> None:
    _assert_matches_oracle(*inputs, cfg)


@given(log_prob_pairs(), configs())
def test_rejection_only_removes_valid_tokens_and_weights_are_bounded(inputs, cfg) -> None:
    old, rollout, mask = inputs
    weights, out_mask, _ = compute_rollout_correction(old, rollout, mask, cfg)
    assert out_mask.dtype == mask.dtype and not bool((out_mask & ~mask).any())
    if weights is not None:
        assert bool(torch.isfinite(weights).all()) and bool((weights[~mask] == 0).all())
        if not cfg["rollout_is_batch_normalize"]:
            assert bool((weights <= cfg["rollout_is_threshold"]).all())
            assert bool((weights[mask] >= math.exp(-20) * (1 - 1e-12)).all())


@given(log_prob_pairs(), configs())
def test_sequence_filters_keep_or_drop_whole_rows(inputs, cfg) -> None:
    old, rollout, mask = inputs
    if "rollout_rs" not in cfg:
        return
    sequence_only = ",".join(o for o in cfg["rollout_rs"].split(",") if not o.startswith("token"))
    if not sequence_only or sequence_only != cfg["rollout_rs"]:
        return
    _, out_mask, _ = compute_rollout_correction(old, rollout, mask, cfg)
    for row, kept in zip(mask, out_mask, strict=True):
        assert bool((kept == row).all()) or not bool(kept.any())


def test_verl_formulas_on_a_hand_made_batch() -> None:
    """Values computed by hand from verl's formulas (no empty row: verl and ppo-core agree there)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lr = [[0.5, -1.0, 0.0], [-0.1, -2.0]]
    flat = [x for row in lr for x in row]
    # token TIS, threshold 1.5
    w, _, m = compute_rollout_correction(
        old, rollout, mask, {"rollout_is": "token", "rollout_is_threshold": 1.5}
    )
    expected = [[min(math.exp(x), 1.5) for x in lr[0]], [min(math.exp(x), 1.5) for x in lr[1]] + [0.0]]
    torch.testing.assert_close(w, torch.tensor(expected))
    raw = [math.exp(x) for x in flat]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(raw) / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.5))
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5)  # e^-1, e^-2 < 1/1.5
    clamped = [min(max(x, 1 / 1.5), 1.5) for x in raw]
    mean_c = sum(clamped) / 5
    ess = 1 / (sum((c / mean_c) ** 2 for c in clamped) / 5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)
    assert m["rollout_corr/kl"] == pytest.approx(-sum(flat) / 5, rel=1e-6)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in flat) / 5, rel=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in flat) / 5 - 1, rel=1e-6)
    sums = [sum(row) for row in lr]
    assert m["rollout_corr/chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in sums) / 2 - 1, rel=1e-6)
    # sequence IS: exp of the row sums, truncated at 2, batch-normalised over rows
    cfg = {"rollout_is": "sequence", "rollout_is_batch_normalize": True}
    w, _, m = compute_rollout_correction(old, rollout, mask, cfg)
    rows = [min(math.exp(s), 2.0) for s in sums]
    norm = sum(rows) / 2
    torch.testing.assert_close(w, torch.tensor([[rows[0] / norm] * 3, [rows[1] / norm] * 2 + [0.0]]))
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(norm)
    # seq-level MIS (verl's decoupled_seq_is_rs): seq_sum_k1 keeps 0.5 <= pi_rollout / pi_old <= 2 per row,
    # i.e. log 0.5 <= -sum(log r) <= log 2: row 0 (-sum = 0.5) stays, row 1 (-sum = 2.1) goes
    cfg = {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"}
    _, kept, m = compute_rollout_correction(old, rollout, mask, cfg)
    torch.testing.assert_close(kept, torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # token_k2 <= 0.1 keeps |log r| <= sqrt(0.2) = 0.447; seq_max_k3 <= 0.2 keeps rows whose max r-1-log r <= 0.2
    cfg = {"rollout_rs": "token_k2,seq_max_k3", "rollout_rs_threshold": "0.1,0.2"}
    _, kept, m = compute_rollout_correction(old, rollout, mask, cfg)
    # k2 = 0.125, 0.5, 0 | 0.005, 2: three tokens above 0.1; k3 = 0.149, 0.368, 0 | 0.005, 1.135: both rows' max
    # is above 0.2, so every token goes
    torch.testing.assert_close(kept, torch.tensor([[0, 0, 0], [0, 0, 0]]))
    assert m["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_max_k3_max"] == pytest.approx(math.exp(-2) + 1, rel=1e-6)
    cfg = {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.2}
    _, kept, _ = compute_rollout_correction(old, rollout.clone().fill_(0) + old, mask, cfg)
    torch.testing.assert_close(kept, mask)  # no mismatch: nothing rejected


def test_token_k1_single_threshold_is_symmetric() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-0.6, 0.6, -0.8, 0.8]])  # log r = 0.6, -0.6, 0.8, -0.8; log 2 = 0.693
    _, kept, _ = compute_rollout_correction(
        old, rollout, torch.ones(1, 4), {"rollout_rs": "token_k1", "rollout_rs_threshold": 2}
    )
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("shape", [(0, 0), (0, 4), (3, 0), (2, 3)])
def test_no_valid_token_gives_zero_metrics_and_no_error(shape) -> None:
    old = torch.full(shape, math.nan)
    cfg = {"rollout_is": "sequence", "rollout_rs": "seq_mean_k3,token_k1", "rollout_rs_threshold": "0.1,2",
           "rollout_is_batch_normalize": True}  # fmt: skip
    w, kept, m = compute_rollout_correction(old, old, torch.zeros(shape, dtype=torch.bool), cfg)
    assert w.shape == shape and bool((w == 0).all()) and not bool(kept.any())
    assert m and all(v == 0.0 for k, v in m.items() if not k.endswith("batch_norm_factor"))
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == 1.0


def test_batch_of_one_row_and_one_token() -> None:
    old, rollout = torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[-1.25]], dtype=torch.float64)
    cfg = {"rollout_is": "sequence", "rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 1.0}
    _assert_matches_oracle(old, rollout, torch.ones(1, 1), cfg)
    w, _, m = compute_rollout_correction(old, rollout, torch.ones(1, 1), cfg)
    assert float(w) == pytest.approx(math.exp(0.25))
    assert m["rollout_corr/rollout_is_std"] == 0.0 and m["rollout_corr/rollout_is_seq_std"] == 0.0


@pytest.mark.parametrize("name", ["old_log_probs", "rollout_log_probs"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_valid_log_prob_raises_naming_it(name, bad) -> None:
    tensors = {"old_log_probs": torch.zeros(2, 3), "rollout_log_probs": torch.zeros(2, 3)}
    tensors[name][1, 2] = bad
    with pytest.raises(ValueError, match=name):
        compute_rollout_correction(*tensors.values(), torch.ones(2, 3), {"rollout_is": "token"})


def test_masked_garbage_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    old, rollout = -torch.rand(3, 5, generator=gen), -torch.rand(3, 5, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.4
    cfg = {"rollout_is": "sequence", "rollout_rs": "token_k3,seq_mean_k1", "rollout_rs_threshold": "0.05,1.5"}
    clean = compute_rollout_correction(old, rollout, mask, cfg)
    dirty = compute_rollout_correction(old.masked_fill(~mask, math.nan), rollout.masked_fill(~mask, -math.inf),
                                       mask, cfg)  # fmt: skip
    torch.testing.assert_close(clean[0], dirty[0], rtol=0, atol=0)
    torch.testing.assert_close(clean[1], dirty[1], rtol=0, atol=0)
    assert clean[2] == dirty[2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    old = (-3 * torch.rand(4, 6, generator=gen)).to(dtype)
    rollout = (old.float() + 0.3 * torch.randn(4, 6, generator=gen)).to(dtype)
    mask = torch.ones(4, 6)
    cfg = {"rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_rs": "seq_mean_k2",
           "rollout_rs_threshold": 0.05}  # fmt: skip
    w, kept, m = compute_rollout_correction(old, rollout, mask, cfg)
    assert w.dtype == torch.float32
    ref_w, ref_kept, ref_m = compute_rollout_correction(old.float(), rollout.float(), mask, cfg)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(kept, ref_kept, rtol=0, atol=0)
    assert m == ref_m


def test_extreme_thresholds() -> None:
    old = torch.tensor([[0.0, -50.0, -1.0]])
    rollout = torch.tensor([[-60.0, 0.0, -1.0]])  # log r = 60, -50, 0: beyond the exp(+-20) bound
    mask = torch.ones(1, 3)
    w, _, m = compute_rollout_correction(
        old, rollout, mask, {"rollout_is": "token", "rollout_is_threshold": 1e30}
    )
    torch.testing.assert_close(w, torch.tensor([[math.exp(20), math.exp(-20), 1.0]]))
    assert all(math.isfinite(v) for v in m.values())
    w, _, _ = compute_rollout_correction(
        old, rollout, mask, {"rollout_is": "token", "rollout_is_threshold": 1e-30}
    )
    torch.testing.assert_close(w, torch.full((1, 3), 1e-30))
    _, kept, _ = compute_rollout_correction(
        old, rollout, mask, {"rollout_rs": "token_k3", "rollout_rs_threshold": 1e300}
    )
    torch.testing.assert_close(kept, mask)
    _, kept, _ = compute_rollout_correction(
        old, rollout, mask, {"rollout_rs": "token_k2", "rollout_rs_threshold": 1e-300}
    )
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 1.0]]))  # log r = 0 has k2 = 0: kept


def test_bool_and_float_masks_give_the_same_result() -> None:
    old, rollout = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    cfg = {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}
    w_b, kept_b, m_b = compute_rollout_correction(old, rollout, torch.tensor([[True, True]]), cfg)
    w_f, kept_f, m_f = compute_rollout_correction(old, rollout, torch.ones(1, 2), cfg)
    assert kept_b.dtype == torch.bool and kept_f.dtype == torch.float32
    torch.testing.assert_close(kept_b.float(), kept_f)
    torch.testing.assert_close(w_b, w_f)
    assert m_b == m_f


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, "unknown option"),
        ({"rollout_rs": "token_k2"}, "rollout_rs_threshold is needed"),
        ({"rollout_rs": "token_k2,seq_max_k3", "rollout_rs_threshold": "1,2,3"}, "needs 1 .shared. or 2"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"}, "one positive upper bound"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_0.5"}, "lower <= upper"),
        ({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": -2.0}, "0 < lower"),
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.0}, "finite and > 0"),
        ({"rollout_is_threshold": 0.0}, "rollout_is_threshold"),
        ({"rollout_is": "tokens"}, "rollout_is"),
        ({"loss_type": "reinforce"}, "only 'ppo_clip'"),
        ({"bypass_mode": True, "rollout_is": "token"}, "bypass_mode=True"),
    ],
)
def test_config_errors(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig.from_dict(fields)


def test_config_round_trips_and_wrong_config_type() -> None:
    cfg = RolloutCorrectionConfig(
        rollout_is="sequence", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"
    )
    assert RolloutCorrectionConfig.from_dict(cfg.to_dict()) == cfg and cfg.enabled
    assert not RolloutCorrectionConfig(bypass_mode=True).enabled
    with pytest.raises(TypeError, match="RolloutCorrectionConfig"):
        compute_rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token")


@given(log_prob_pairs(), configs())
def test_an_empty_row_changes_no_metric(inputs, cfg) -> None:
    """verl counts a row without a valid token as a row with log-ratio 0 in its row statistics; here it is no row."""
    old, rollout, mask = inputs
    if old.shape[1] == 0:
        return
    pad = lambda x, v: torch.cat([x, torch.full((1, x.shape[1]), v, dtype=x.dtype)])  # noqa: E731
    w, kept, metrics = compute_rollout_correction(old, rollout, mask, cfg)
    w2, kept2, metrics2 = compute_rollout_correction(
        pad(old, -1.0), pad(rollout, -5.0), pad(mask, False), cfg
    )
    assert metrics2.keys() == metrics.keys()
    for name, value in metrics.items():
        assert metrics2[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    assert not bool(kept2[-1].any()) and bool((kept2[:-1] == kept).all())
    if w is not None:
        assert bool((w2[-1] == 0).all()) and torch.allclose(w2[:-1], w, rtol=1e-12, atol=0)
