"""The scans with the estimators' last step fused in: whitening statistics kept by the scan (Chan's merge per row,
a float64 combine in the normalising kernel) and ReMax's baseline subtracted by the scan, against the PyTorch
forms (:func:`~ppo_core.kernels.whiten.whiten_valid` of the checked scan). The Triton kernels run under
``TRITON_INTERPRET=1`` on CPU where Triton is installed, and on CUDA under the ``gpu`` marker; the dispatch
functions' PyTorch paths run everywhere."""

from __future__ import annotations

import os

import pytest
import torch
from _constant import constant_cases
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import kernels
from ppo_core.kernels import triton_scan
from ppo_core.kernels.whiten import whiten_valid
from ppo_core.testing import ppo_batches

INTERPRET = triton_scan.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and triton_scan.is_available("cuda")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if CUDA else [])
triton_devices = pytest.mark.skipif(
    not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton installed"
)
COEFS = st.sampled_from([0.0, 0.5, 0.95, 1.0])


def _case(batch: int, length: int, seed: int, device: str, offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Random lengths, interior gaps, an all-masked row, junk (NaN/inf) at masked positions."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, length, generator=gen) + offset
    v = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    m = torch.arange(length)[None, :] < lengths[:, None]
    m[::3, length // 3 : length // 2] = False
    if batch:
        m[batch // 2] = False
    r = r.masked_fill(~m, float("nan"))
    v = v.masked_fill(~m, float("inf"))
    return r.to(device), v.to(device), m.to(device)


def _close(got: torch.Tensor, want: torch.Tensor, m: torch.Tensor, tol: float = 2e-4) -> None:
    got, want, m = got.double().cpu(), want.double().cpu(), m.cpu()
    assert torch.all(got[~m] == 0), "masked positions must be exactly 0"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol * (1 + want.abs().max().item() if want.numel() else 1), err


def _want_gae(r, v, m, gamma, lam):
    adv, ret, _ = kernels.masked_gae_returns_checked(r.cpu(), v.cpu(), m.cpu(), gamma, lam, backend="chunked")
    return whiten_valid(adv.double(), m.cpu()), ret


@triton_devices
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(7, 40), (5, 1100), (1, 1), (3, 0), (0, 5)])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
def test_fused_gae_whitening_matches_torch(device, shape, gamma, lam) -> None:
    r, v, m = _case(*shape, seed=sum(shape), device=device)
    adv, ret, flag = triton_scan.gae_returns_checked_triton(r, v, m, gamma, lam, whiten=True)
    want_adv, want_ret = _want_gae(r, v, m, gamma, lam)
    assert triton_scan.flag_bits(flag) == 0 and adv.shape == r.shape
    _close(adv, want_adv, m)
    _close(ret, want_ret, m)


@triton_devices
@pytest.mark.parametrize("device", DEVICES)
def test_fused_whitening_across_chunks_and_programs(device) -> None:
    """Small launch blocks: many chunks per row (the per-row merge) and more rows than programs (the row loop);
    a large offset, where a sum of squares of raw values would cancel."""
    r, v, m = _case(9, 70, seed=3, device=device, offset=1000.0)
    launch = triton_scan.ScanLaunch(block_b=2, block_t=16, num_warps=1)
    adv, _, _ = triton_scan.gae_returns_checked_triton(r, v, m, 1.0, 1.0, whiten=True, launch=launch)
    _close(adv, _want_gae(r, v, m, 1.0, 1.0)[0], m)
    returns, _ = triton_scan.discounted_return_scan_checked_triton(r, m, 1.0)
    white, again, flag = triton_scan.return_advantages_checked_triton(r, m, 1.0, whiten=True, launch=launch)
    assert triton_scan.flag_bits(flag) == 0
    _close(again, returns, m, tol=1e-6)  # another launch shape: another rounding order
    _close(white, whiten_valid(returns.double().cpu(), m.cpu()), m)
    assert abs(white[m].double().mean().item()) < 1e-5 and abs(white[m].double().std().item() - 1) < 1e-4


@triton_devices
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=8, deadline=None)
@given(case=constant_cases(max_size=40), small_blocks=st.booleans())
def test_fused_whitening_of_constant_values_is_exactly_zero(device, case, small_blocks: bool) -> None:
    """One value at every valid token: each row's moments are about its own last valid value and the combine is
    about the reference of the first row with a valid token, so every difference is exactly 0 (the mean of equal
    floats, a rounded sum over their count, is in general not that value). Small blocks: many chunks per row,
    several rows per program."""
    x, m = (t.to(device) for t in case)
    r = x.masked_fill(~m, float("nan"))
    v = torch.zeros_like(r).masked_fill(~m, float("inf"))
    launch = triton_scan.ScanLaunch(block_b=2, block_t=16, num_warps=1) if small_blocks else None
    # gamma = 0: the raw advantages (V = 0) and the returns are the rewards
    adv, _, flag = triton_scan.gae_returns_checked_triton(r, v, m, 0.0, 0.5, whiten=True, launch=launch)
    white, _, flag_r = triton_scan.return_advantages_checked_triton(r, m, 0.0, whiten=True, launch=launch)
    assert triton_scan.flag_bits(flag) == triton_scan.flag_bits(flag_r) == 0
    assert torch.equal(adv, torch.zeros_like(adv)), adv
    assert torch.equal(white, torch.zeros_like(white)), white


@triton_devices
@pytest.mark.parametrize("device", DEVICES)
def test_fused_baselines_and_their_flag(device) -> None:
    r, _, m = _case(6, 50, seed=4, device=device)
    b = torch.randn(6).to(device)
    adv, ret, flag = triton_scan.return_advantages_checked_triton(r, m, 1.0, baselines=b)
    assert triton_scan.flag_bits(flag) == 0
    _close(adv, torch.where(m, ret - b[:, None], 0.0), m, tol=1e-6)
    # a NaN baseline of the all-masked row is never read; of a row with a valid token, it sets bit 1
    b_unused = b.clone()
    b_unused[3] = float("nan")  # row 3 = batch // 2 is all masked
    assert (
        triton_scan.flag_bits(triton_scan.return_advantages_checked_triton(r, m, 1.0, baselines=b_unused)[2])
        == 0
    )
    b_used = b.clone()
    b_used[0] = float("inf")
    row0 = bool(m[0].any())
    assert triton_scan.flag_bits(
        triton_scan.return_advantages_checked_triton(r, m, 1.0, baselines=b_used)[2]
    ) == (2 if row0 else 0)
    r_bad = r.clone()
    r_bad[m] = float("nan")
    assert (
        triton_scan.flag_bits(triton_scan.return_advantages_checked_triton(r_bad, m, 1.0, whiten=True)[2]) & 1
    )


@triton_devices
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=8, deadline=None)
@given(batch=ppo_batches(max_batch=6, max_len=24, dense_rewards=True), gamma=COEFS, lam=COEFS)
def test_fused_property_against_torch(device, batch, gamma, lam) -> None:
    r, v, m = (x.to(device) for x in (batch.token_level_rewards, batch.values, batch.response_mask))
    adv, ret, _ = triton_scan.gae_returns_checked_triton(r, v, m, gamma, lam, whiten=True)
    want_adv, want_ret = _want_gae(r, v, m, gamma, lam)
    _close(adv, want_adv, m, tol=1e-3)
    _close(ret, want_ret, m)


# ----- the dispatch functions: every backend gives the same whitened / baselined advantages ---------------------
@pytest.mark.parametrize("backend", ["chunked", "reference", *(["triton"] if CUDA else [])])
def test_dispatch_fused_forms_agree(backend) -> None:
    device = "cuda" if backend == "triton" else "cpu"
    r, v, m = _case(8, 33, seed=5, device=device)
    b = torch.randn(8, device=device)
    adv, ret, flag = kernels.masked_gae_returns_checked(r, v, m, 0.9, 0.8, whiten=True, backend=backend)
    want_adv, want_ret = _want_gae(r, v, m, 0.9, 0.8)
    assert not bool(flag)
    _close(adv, want_adv, m)
    _close(ret, want_ret, m)
    returns = kernels.masked_discounted_return_scan(r.cpu(), m.cpu(), 0.9, backend="reference")
    white, ret2, _ = kernels.masked_return_advantages_checked(r, m, 0.9, whiten=True, backend=backend)
    _close(ret2, returns, m)
    _close(white, whiten_valid(returns.double(), m.cpu()), m)
    based, _, flag = kernels.masked_return_advantages_checked(r, m, 0.9, baselines=b, backend=backend)
    assert not bool(flag)
    _close(based, torch.where(m.cpu(), returns - b.cpu()[:, None], 0.0), m)
    plain, _, _ = kernels.masked_return_advantages_checked(r, m, 0.9, backend=backend)
    _close(plain, returns, m)
    b[0] = float("nan")
    assert bool(kernels.masked_return_advantages_checked(r, m, 0.9, baselines=b, backend=backend)[2]) == bool(
        m[0].any()
    )
    with pytest.raises(ValueError, match="whiten or baselines"):
        kernels.masked_return_advantages_checked(r, m, 0.9, whiten=True, baselines=b, backend=backend)
