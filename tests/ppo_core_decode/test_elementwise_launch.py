"""The prefill's element-wise launches (:mod:`ppo_core_decode.elementwise_launch`): SwiGLU in both roundings against
the compiled / eager functions the engines used before, on strided halves of a gate/up product (the engines' dispatch
to them: ``tests/ppo_core/test_rollout_residual_products.py`` and ``test_rollout_megatron_decode.py``).

The Triton kernel runs on CUDA and, on the CPU, under ``TRITON_INTERPRET=1`` with Triton installed; elsewhere the
functions run their PyTorch form, which these tests check as well."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ppo_core_decode.elementwise_launch as el
from ppo_core.kernels.fused import silu_mul
from ppo_core_decode.eager_rounding import silu_mul_as_model

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and el.triton is not None
_KERNEL = _INTERPRET or (torch.cuda.is_available() and el.triton is not None)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _close_to(got: torch.Tensor, want: torch.Tensor, steps: float = 1.0) -> None:
    """Within ``steps`` units of the dtype's last place (relative), NaN where ``want`` is NaN, inf where it is inf:
    the kernel's ``exp`` and the compiled or eager SiLU's may part in fp32's last bit, which a rounding to half
    precision turns into one step of it at most (the interpreter's casts truncate: one more)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=steps * ulp, atol=1e-6, equal_nan=True)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 7),
    f=st.sampled_from([1, 3, 17, 64, el.MAX_BLOCK_F + 9]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    model_rounding=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_swiglu_is_the_engines_function_in_either_rounding(rows, f, dtype, model_rounding, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    product = (4 * torch.randn(rows, 2 * f, generator=gen)).to(dtype)  # a gate/up product: [gate | up]
    gate, up = product.chunk(2, dim=-1)  # strided halves, as the engines pass them
    got = el.silu_mul_launch(gate, up, model_rounding=model_rounding)
    want = silu_mul_as_model(gate, up) if model_rounding else silu_mul(gate, up)
    assert got.is_contiguous()
    _close_to(got, want, steps=2.0 if _INTERPRET else 1.0)
    # the halves' strides change nothing: the same bits as contiguous copies
    assert torch.equal(
        got, el.silu_mul_launch(gate.contiguous(), up.contiguous(), model_rounding=model_rounding)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_keeps_leading_dimensions_non_finite_values_and_empty_inputs(device) -> None:
    gate = torch.tensor([[[0.0, float("inf"), -float("inf"), float("nan"), 2.0, -30.0]]], device=device)
    up = torch.tensor([[[1.0, 2.0, 1.0, 1.0, float("inf"), 3.0]]], device=device)
    for model_rounding, reference in ((True, silu_mul_as_model), (False, silu_mul)):
        got = el.silu_mul_launch(gate, up, model_rounding=model_rounding)
        assert got.shape == gate.shape
        _close_to(got, reference(gate, up))
    empty = torch.zeros(0, 3, 5, device=device)
    assert el.silu_mul_launch(empty, empty).shape == (0, 3, 5)
    assert el.silu_mul_launch(torch.zeros(2, 0, device=device), torch.zeros(2, 0, device=device)).shape == (
        2,
        0,
    )


def test_swiglu_names_what_does_not_match() -> None:
    with pytest.raises(ValueError, match=r"gate and up must match: gate is torch.float32 \(2, 3\)"):
        el.silu_mul_launch(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="gate and up must match"):
        el.silu_mul_launch(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="at least one dimension"):
        el.silu_mul_launch(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"float16, bfloat16 or float32, got torch\.float64"):
        el.silu_mul_launch(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64))


def test_launches_directly_on_cuda_tensors_of_float_dtypes_only() -> None:
    assert not el.launches_directly(torch.zeros(2, 3))  # the CPU keeps the model's own arithmetic
    if torch.cuda.is_available() and el.triton is not None:
        assert el.launches_directly(torch.zeros(2, 3, device="cuda", dtype=torch.bfloat16))
        assert not el.launches_directly(torch.zeros(2, 3, device="cuda", dtype=torch.float64))


@pytest.mark.skipif(not _KERNEL, reason="the Triton kernel needs CUDA, or TRITON_INTERPRET=1 and triton")
def test_the_kernel_runs_where_it_can(monkeypatch) -> None:
    """Under the interpreter or on CUDA the launch is the kernel's (not the PyTorch form): it is called, and agrees
    with the PyTorch form of the same arithmetic."""
    calls = []
    monkeypatch.setattr(el, "_silu_mul_launch", _Counting(el._silu_mul_launch, calls))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate, up = torch.randn(4, 40, device=device), torch.randn(4, 40, device=device)
    got = el.silu_mul_launch(gate, up)
    assert calls == [(4, 1)]
    _close_to(got, el._silu_mul_reference(gate, up, True))


class _Counting:
    """A kernel's launcher whose launches are recorded (their grids)."""

    def __init__(self, launch, calls: list) -> None:
        self.launch, self.calls = launch, calls

    def __call__(self, grid, *args, **kwargs):
        self.calls.append(grid)
        return self.launch(grid, *args, **kwargs)


@pytest.mark.parametrize("model_rounding", [True, False])
def test_the_engine_functions_keep_the_compiled_functions_where_no_launch_applies(
    monkeypatch, model_rounding
):
    """On the CPU each engine function is, bit for bit, the function of its rounding the engines called before; a
    residual branch that only broadcasts against the stream (megatron's norm accepts one) keeps it on CUDA too."""
    from ppo_core.kernels import fused
    from ppo_core_decode.eager_rounding import add_rms_norm_as_model, rms_norm_as_model

    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(3, 5, 16, generator=gen), torch.randn(3, 5, 16, generator=gen)
    w, gate, up = (
        torch.rand(16, generator=gen),
        torch.randn(4, 9, generator=gen),
        torch.randn(4, 9, generator=gen),
    )
    norm, add_norm, swiglu = (
        (rms_norm_as_model, add_rms_norm_as_model, silu_mul_as_model)
        if model_rounding
        else (fused.rms_norm, fused.add_rms_norm, fused.silu_mul)
    )
    assert torch.equal(el.engine_rms_norm(x, w, 1e-6, model_rounding=model_rounding), norm(x, w, 1e-6))
    got, want = (
        el.engine_rms_norm(x, w, 1e-6, delta=delta, model_rounding=model_rounding),
        add_norm(x, delta, w, 1e-6),
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(el.engine_silu_mul(gate, up, model_rounding=model_rounding), swiglu(gate, up))
    launched = []
    monkeypatch.setattr(el, "launches_directly", lambda t: True)
    monkeypatch.setattr(
        el, "rms_norm_launch", lambda *a, **k: launched.append(k) or el.invariant_rms_norm(*a, **k)
    )
    row = delta[:, :1]  # [3, 1, 16]: broadcasts, is not the stream's shape
    got, want = (
        el.engine_rms_norm(x, w, 1e-6, delta=row, model_rounding=model_rounding),
        add_norm(x, row, w, 1e-6),
    )
    assert not launched and torch.equal(got[1], want[1])
    el.engine_rms_norm(x, w, 1e-6, delta=delta, model_rounding=model_rounding)
    assert len(launched) == 1 and launched[0]["delta"] is delta
    assert launched[0]["model_rounding"] is model_rounding
