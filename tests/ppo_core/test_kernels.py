"""Every fast scan against the float64 per-timestep loop: gaps, all-masked rows, junk in masked slots, long rows."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import kernels
from ppo_core.kernels import chunked, reference, triton_scan
from ppo_core.testing import ppo_batches

TOL = 1e-4
COEFS = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 1.0]), st.floats(0.0, 1.0))
CPU_BACKENDS = [b for b in kernels.available_backends("cpu") if b != "reference"]
CUDA = torch.cuda.is_available()
interpret = pytest.mark.skipif(
    not (triton_scan.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with Triton installed",
)


def _oracle_gae(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    return reference.masked_gae_scan(r.double().cpu(), v.double().cpu(), m.cpu(), gamma, lam)


def _oracle_return(r: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    return reference.masked_discounted_return_scan(r.double().cpu(), m.cpu(), gamma)


def _max_err(out: torch.Tensor, ref: torch.Tensor, where: torch.Tensor | None = None) -> float:
    diff = (out.double().cpu() - ref).abs()
    if where is not None:
        diff = diff[where.cpu()]
    return float(diff.max()) if diff.numel() else 0.0


def _random_case(batch: int, length: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Random lengths, an interior gap on every third row, one all-masked row; ``[B, T]`` float32 on device."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask[::3, length // 3 : length // 2] = False
    mask[batch // 2] = False
    return rewards.to(device), values.to(device), mask.to(device)


def _compact_row(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[m], x.new_zeros(int((~m).sum()))])


@given(batch=ppo_batches(max_batch=10, max_len=40, dense_rewards=True), gamma=COEFS, lam=COEFS)
def test_scans_match_float64_loop(batch, gamma: float, lam: float) -> None:
    r, v, m = batch.token_level_rewards, batch.values, batch.response_mask
    ref = _oracle_gae(r, v, m, gamma, lam)
    ref_ret = _oracle_return(r, m, gamma)
    for backend in CPU_BACKENDS:
        adv, ret = kernels.masked_gae_returns_scan(r, v, m, gamma, lam, backend=backend)
        # Masked positions carry the state from the right, so they are compared too.
        assert _max_err(adv, ref) < TOL, backend
        assert _max_err(ret, ref + v.double()) < TOL, backend
        assert torch.equal(kernels.masked_gae_scan(r, v, m, gamma, lam, backend=backend), adv), backend
        out = kernels.masked_discounted_return_scan(r, m, gamma, backend=backend)
        assert _max_err(out, ref_ret) < TOL, backend
        assert bool((out[~m] == 0).all()), backend


@settings(max_examples=60)
@given(
    batch=ppo_batches(max_batch=6, max_len=24, dense_rewards=True),
    junk=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    gamma=COEFS,
)
def test_masked_slots_never_leak(batch, junk: float, gamma: float) -> None:
    r, v, m = batch.token_level_rewards, batch.values, batch.response_mask
    dirty_r, dirty_v = r.masked_fill(~m, junk), v.masked_fill(~m, junk)
    for backend in CPU_BACKENDS:
        clean = kernels.masked_gae_scan(r, v, m, gamma, 0.9, backend=backend)
        dirty = kernels.masked_gae_scan(dirty_r, dirty_v, m, gamma, 0.9, backend=backend)
        assert torch.equal(clean[m], dirty[m]), backend
        clean_ret = kernels.masked_discounted_return_scan(r, m, gamma, backend=backend)
        assert torch.equal(
            clean_ret, kernels.masked_discounted_return_scan(dirty_r, m, gamma, backend=backend)
        )


@settings(max_examples=40)
@given(batch=ppo_batches(max_batch=6, max_len=24, dense_rewards=True), gamma=COEFS, lam=COEFS)
def test_gaps_are_skipped(batch, gamma: float, lam: float) -> None:
    """A row with gaps gives, on its valid tokens, what the row with its valid tokens moved left gives."""
    r, v, m = batch.token_level_rewards, batch.values, batch.response_mask
    rows = torch.arange(m.shape[1])[None, :] < m.sum(dim=1, keepdim=True)
    packed_r, packed_v = (torch.stack([_compact_row(x[i], m[i]) for i in range(m.shape[0])]) for x in (r, v))
    for backend in CPU_BACKENDS:
        adv = kernels.masked_gae_scan(r, v, m, gamma, lam, backend=backend)
        packed_adv = kernels.masked_gae_scan(packed_r, packed_v, rows, gamma, lam, backend=backend)
        assert torch.allclose(adv[m], packed_adv[rows], atol=TOL, rtol=0), backend
        ret = kernels.masked_discounted_return_scan(r, m, gamma, backend=backend)
        packed_ret = kernels.masked_discounted_return_scan(packed_r, rows, gamma, backend=backend)
        assert torch.allclose(ret[m], packed_ret[rows], atol=TOL, rtol=0), backend


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.3, 0.0)])
def test_long_rows_cross_chunks(backend: str, gamma: float, lam: float) -> None:
    r, v, m = _random_case(7, 2100, seed=3)
    adv, ret = kernels.masked_gae_returns_scan(r, v, m, gamma, lam, backend=backend)
    ref = _oracle_gae(r, v, m, gamma, lam)
    assert _max_err(adv, ref) < TOL
    assert _max_err(ret, ref + v.double()) < TOL
    assert (
        _max_err(
            kernels.masked_discounted_return_scan(r, m, gamma, backend=backend), _oracle_return(r, m, gamma)
        )
        < TOL
    )


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "reference"])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0), (4, 6)])
def test_empty_and_all_masked(backend: str, shape: tuple[int, int]) -> None:
    r, v = torch.randn(shape), torch.randn(shape)
    m = torch.zeros(shape, dtype=torch.bool)
    adv, ret = kernels.masked_gae_returns_scan(r, v, m, 0.9, 0.9, backend=backend)
    assert adv.shape == shape and ret.shape == shape
    assert bool((adv == 0).all())
    assert torch.equal(ret, v)  # verl: returns on padding are the values stored there
    assert bool((kernels.masked_discounted_return_scan(r, m, 0.9, backend=backend) == 0).all())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(backend: str, dtype: torch.dtype) -> None:
    r, v, m = _random_case(5, 50, seed=11)
    r, v = r.to(dtype), v.to(dtype)
    adv = kernels.masked_gae_scan(r, v, m, 0.99, 0.95, backend=backend)
    ret = kernels.masked_discounted_return_scan(r, m, 0.99, backend=backend)
    assert adv.dtype == dtype and ret.dtype == dtype
    tol = TOL if dtype == torch.float64 else 0.05 * (1 + _oracle_gae(r, v, m, 0.99, 0.95).abs().max().item())
    assert _max_err(adv, _oracle_gae(r, v, m, 0.99, 0.95)) < tol
    mixed = kernels.masked_gae_scan(r.float(), v.double(), m, 0.99, 0.95, backend=backend)
    assert mixed.dtype == torch.float64


def test_cpu_backends_need_no_compiler() -> None:
    assert kernels.available_backends("cpu")[-2:] == ["chunked", "reference"]
    r, v, m = _random_case(4, 30, seed=2)
    assert _max_err(kernels.masked_gae_scan(r, v, m, 0.9, 0.8), _oracle_gae(r, v, m, 0.9, 0.8)) < TOL
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.masked_gae_scan(r, v, m, 0.9, 0.8, backend="cpu")


def test_auto_is_differentiable() -> None:
    r, v, m = _random_case(4, 300, seed=9)
    r64, v64 = r.double().requires_grad_(), v.double().requires_grad_()
    adv = kernels.masked_gae_scan(r64, v64, m, 0.9, 0.7)
    ref_r, ref_v = r.double().requires_grad_(), v.double().requires_grad_()
    ref = reference.masked_gae_scan(ref_r, ref_v, m, 0.9, 0.7)
    weights = torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((adv * weights).sum(), (r64, v64))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (ref_r, ref_v))
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-10)


def test_errors_name_the_argument() -> None:
    r, v, m = _random_case(2, 5, seed=0)
    with pytest.raises(ValueError, match=r"backend must be one of .*'triton'"):
        kernels.masked_gae_scan(r, v, m, 0.9, 0.9, backend="fast")
    with pytest.raises(ValueError, match="values"):
        kernels.masked_gae_scan(r, v[:, :4], m, 0.9, 0.9)
    with pytest.raises(ValueError, match="mask"):
        kernels.masked_discounted_return_scan(r, m[:1], 0.9)
    with pytest.raises(TypeError, match="rewards"):
        kernels.masked_discounted_return_scan(r.long(), m, 0.9)
    with pytest.raises(ValueError, match="rewards"):
        kernels.masked_discounted_return_scan(r[0], m[0], 0.9)
    with pytest.raises(TypeError, match="gamma"):
        kernels.masked_discounted_return_scan(r, m, "0.9")
    with pytest.raises(TypeError, match="lam"):
        kernels.masked_gae_scan(r, v, m, 0.9, None)
    if not CUDA:
        with pytest.raises(ValueError, match="not available"):
            kernels.masked_gae_scan(r, v, m, 0.9, 0.9, backend="triton")


def test_float_mask_accepted() -> None:
    r, v, m = _random_case(3, 9, seed=4)
    assert torch.equal(
        kernels.masked_gae_scan(r, v, m.float(), 0.9, 0.9), kernels.masked_gae_scan(r, v, m, 0.9, 0.9)
    )


@interpret
@settings(max_examples=10)
@given(batch=ppo_batches(max_batch=5, max_len=40, dense_rewards=True), gamma=COEFS, lam=COEFS)
def test_triton_interpreted_matches_loop(batch, gamma: float, lam: float) -> None:
    r, v, m = batch.token_level_rewards, batch.values, batch.response_mask
    # several chunks and row blocks even on tiny inputs
    launch = triton_scan.ScanLaunch(block_b=2, block_t=16, num_warps=1)
    adv, ret = triton_scan.gae_scan_triton(r, v, m, gamma, lam, with_returns=True, launch=launch)
    ref = _oracle_gae(r, v, m, gamma, lam)
    assert _max_err(adv, ref) < TOL and _max_err(ret, ref + v.double()) < TOL
    out = triton_scan.discounted_return_scan_triton(r, m, gamma, launch=launch)
    assert _max_err(out, _oracle_return(r, m, gamma)) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@given(batch=ppo_batches(max_batch=12, max_len=64, dense_rewards=True, device="cuda"), gamma=COEFS, lam=COEFS)
def test_gpu_backends_match_loop(batch, gamma: float, lam: float) -> None:
    r, v, m = batch.token_level_rewards, batch.values, batch.response_mask
    ref = _oracle_gae(r, v, m, gamma, lam)
    ref_ret = _oracle_return(r, m, gamma)
    for backend in kernels.available_backends("cuda"):
        adv, ret = kernels.masked_gae_returns_scan(r, v, m, gamma, lam, backend=backend)
        assert adv.device.type == "cuda"
        assert _max_err(adv, ref) < TOL and _max_err(ret, ref + v.double().cpu()) < TOL
        assert _max_err(kernels.masked_discounted_return_scan(r, m, gamma, backend=backend), ref_ret) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(256, 1024), (1024, 8192), (3, 5000), (1, 1), (300, 17)])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_triton_large_shapes(shape: tuple[int, int], gamma: float, lam: float) -> None:
    """At full size the float64 oracle is the chunked scan in float64 (itself checked against the loop above)."""
    if not triton_scan.is_available("cuda"):
        pytest.skip("Triton is not installed")
    r, v, m = _random_case(*shape, seed=shape[0] + shape[1], device="cuda")
    adv, ret = triton_scan.gae_scan_triton(r, v, m, gamma, lam, with_returns=True)
    ref = chunked.gae_scan_chunked(r.double(), v.double(), m, gamma, lam)
    assert _max_err(adv, ref.cpu(), m) < TOL
    assert _max_err(ret, (ref + v.double()).cpu(), m) < TOL
    out = triton_scan.discounted_return_scan_triton(r, m, gamma)
    assert _max_err(out, chunked.discounted_return_scan_chunked(r.double(), m, gamma).cpu()) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_triton_junk_and_dtypes() -> None:
    if not triton_scan.is_available("cuda"):
        pytest.skip("Triton is not installed")
    r, v, m = _random_case(64, 700, seed=1, device="cuda")
    clean = triton_scan.gae_scan_triton(r, v, m, 0.99, 0.95)[0]
    dirty = triton_scan.gae_scan_triton(
        r.masked_fill(~m, float("nan")), v.masked_fill(~m, float("inf")), m, 0.99, 0.95
    )[0]
    assert torch.equal(clean[m], dirty[m])
    ref = _oracle_gae(r, v, m, 0.99, 0.95)
    for dtype in (torch.float64, torch.bfloat16):
        want = _oracle_gae(r.to(dtype), v.to(dtype), m, 0.99, 0.95)
        out = triton_scan.gae_scan_triton(r.to(dtype), v.to(dtype), m, 0.99, 0.95)[0]
        assert out.dtype == dtype
        assert _max_err(out, want) < (TOL if dtype == torch.float64 else 0.01 * (1 + want.abs().max().item()))
    assert _max_err(triton_scan.gae_scan_triton(r, v, m, 0.99, 0.95, accumulate_fp64=True)[0], ref) < TOL


def test_auto_never_sends_float64_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton takes gamma/lam as fp32 scalars, so float64 inputs must take an exact path even where Triton exists.
    from ppo_core.kernels import dispatch

    monkeypatch.setattr(dispatch.triton_scan, "triton", object())  # as if Triton were installed
    f64, f32 = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3)
    cuda = torch.device("cuda")  # only its type is read
    assert dispatch._resolve("auto", cuda, (f64, f64)) == "chunked"
    assert dispatch._resolve("auto", cuda, (f32, f32)) == "triton"
    assert dispatch._resolve("auto", torch.device("cpu"), (f32, f32)) == "chunked"
