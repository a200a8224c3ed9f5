"""``cuda_compiled`` stays compiled: one compiled variant per grad mode and ``requires_grad`` pattern (so the
alternation of a training worker never reaches dynamo's recompile limit), and a variant that does reach it is
reported (warning, :func:`recompile_limit_hits`) or raises when ``fail_on_recompile_limit_hit`` is set.

Compiled on the CPU with the ``eager`` backend: dynamo's guards and recompiles are the same as with inductor on
CUDA, without code generation."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from ppo_core.kernels import compiled as compiled_module
from ppo_core.kernels import fused
from ppo_core.kernels.compiled import cuda_compiled, recompile_limit_hits


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch):
    """Compile ``fused``'s row kernels on the CPU (eager backend); yield dynamo's frame counters."""
    torch._dynamo.reset()
    for name in ("_rms_norm_rows", "_add_rms_norm_rows"):
        fn = getattr(fused, name).__wrapped__
        monkeypatch.setattr(fused, name, cuda_compiled(fn, device_types=("cpu",), backend="eager"))
    from torch._dynamo.utils import counters

    counters.clear()
    yield counters
    torch._dynamo.reset()


def _megatron_like_calls(norm, dtypes=(torch.float32,)) -> None:
    """What a colocated megatron actor does with a norm: log-prob passes (no grad), the update (grad, trained
    weight), the reference (no grad, frozen weight), packed ``[T, 1, D]`` and padded ``[s, b, D]`` activations of
    several lengths, decode steps of one token."""
    shapes = [(5, 1, 8), (7, 1, 8), (3, 2, 8), (9, 4, 8), (1, 1, 8)]
    for grad, trained, shape, dtype in itertools.product([True, False], [True, False], shapes, dtypes):
        weight = torch.ones(8, dtype=dtype, requires_grad=trained)
        x = torch.randn(*shape, dtype=dtype, requires_grad=grad and trained)
        with torch.set_grad_enabled(grad):
            out = norm(x, weight)
        torch.testing.assert_close(out, _reference(x.detach(), weight.detach()))


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight


class _Records(logging.Handler):
    """The warnings logged under ``torch._dynamo`` while it is attached there: torch's ``torch._dynamo`` logger does
    not propagate to the root logger (where pytest's ``caplog`` listens) once torch's logging is set up."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_warnings():
    records, logger = _Records(), logging.getLogger("torch._dynamo")
    logger.addHandler(records)
    yield records.messages
    logger.removeHandler(records)


@pytest.mark.slow
def test_rms_norm_never_reaches_the_recompile_limit(counted, dynamo_warnings: list[str]) -> None:
    before = len(recompile_limit_hits())
    _megatron_like_calls(lambda x, w: fused.rms_norm(x, w, 1e-6))
    assert len(recompile_limit_hits()) == before
    assert not [m for m in dynamo_warnings if "recompile" in m]
    assert counted["stats"]["unique_graphs"] > 0  # it did compile


def test_the_old_single_compiled_function_did_reach_it(dynamo_warnings: list[str]) -> None:
    """The regression this guards: one ``torch.compile`` of the whole norm falls back to eager (and the warning
    the test above looks for is seen)."""
    torch._dynamo.reset()
    single = torch.compile(fused._rms_norm_rows.__wrapped__, backend="eager")
    _megatron_like_calls(lambda x, w: single(x, w, 1e-6))
    assert any("recompile_limit" in m for m in dynamo_warnings)
    torch._dynamo.reset()


def _dtype_hungry() -> object:
    def scale_by_dtype(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    return cuda_compiled(scale_by_dtype, device_types=("cpu",), backend="eager")


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.complex64]  # fmt: skip


def test_a_variant_that_reaches_the_limit_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()
    fn = _dtype_hungry()
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        for dtype in _DTYPES:  # ten dtypes: ten guards on one variant
            assert torch.equal(fn(torch.ones(3, dtype=dtype)), torch.full((3,), 2, dtype=dtype))
    (record,) = [r for r in caplog.records if r.name == compiled_module.__name__]
    message = record.getMessage()
    assert "scale_by_dtype (grad mode on; requires grad: none)" in message and "recompile limit" in message
    assert recompile_limit_hits()[-1] == "scale_by_dtype (grad mode on; requires grad: none)"
    torch._dynamo.reset()


def test_fail_on_recompile_limit_hit_raises() -> None:
    torch._dynamo.reset()
    fn = _dtype_hungry()
    strict = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    with strict, pytest.raises(Exception, match=r"recompile_limit|recompile limit"):
        for dtype in _DTYPES:
            fn(torch.ones(3, dtype=dtype))
    torch._dynamo.reset()


def test_cpu_calls_stay_eager_by_default() -> None:
    from torch._dynamo.utils import counters

    frames = sum(counters["frames"].values())
    out = fused.rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0)
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0]]) / 12.5**0.5)
    assert sum(counters["frames"].values()) == frames  # dynamo never saw the call


def test_watched_foreign_functions_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A ``torch.compile`` of a function that is not ours (flex attention) is watched by its code name."""
    torch._dynamo.reset()

    def foreign_kernel(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled_module.watch_recompile_limit("foreign_kernel", "foreign_kernel (a library's)")
    fn = torch.compile(foreign_kernel, backend="eager")
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        for dtype in _DTYPES:
            fn(torch.ones(3, dtype=dtype))
    assert recompile_limit_hits()[-1] == "foreign_kernel (a library's)"
    torch._dynamo.reset()


def _many_shapes() -> list[torch.Tensor]:
    """Ranks 2 to 4, sizes of 1, strided views and two dtypes: what the rollout engine's norms see."""
    base = torch.randn(3, 5, 4, 8)
    views = [
        base,
        base[:, :1],
        base[..., :2, :],
        base.view(15, 4, 8),
        base.view(3, 5, 32),
        base[:, -1:].flatten(2),
    ]
    views += [
        base[:, -1].flatten(1),
        base.view(60, 8)[:, None],
        torch.randn(7, 6, 8),
        torch.randn(7, 1, 2, 8),
    ]
    return views + [v.to(torch.bfloat16) for v in views]


def _norm_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight


def test_by_shape_compiles_each_shape_class_apart() -> None:
    torch._dynamo.reset()
    fn = cuda_compiled(_norm_like, device_types=("cpu",), backend="eager", by_shape=True)
    strict = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=3)
    with strict:
        for x in _many_shapes():
            weight = torch.ones(x.shape[-1], dtype=x.dtype)
            assert torch.equal(fn(x, weight), _norm_like(x, weight))
    torch._dynamo.reset()


def test_without_by_shape_the_shapes_reach_the_limit() -> None:
    torch._dynamo.reset()
    fn = cuda_compiled(_norm_like, device_types=("cpu",), backend="eager")
    strict = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    with strict, pytest.raises(Exception, match=r"recompile_limit|recompile limit"):
        for x in _many_shapes():
            fn(x, torch.ones(x.shape[-1], dtype=x.dtype))
    torch._dynamo.reset()


def test_a_shape_class_that_reaches_the_limit_is_named(caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()

    def first_row(x: torch.Tensor) -> torch.Tensor:
        return x[0] * 2

    fn = cuda_compiled(first_row, device_types=("cpu",), backend="eager", by_shape=True)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__), torch.no_grad():
        for n in range(2, 13):  # one class (rank 1, no size 1, contiguous), a size that never goes dynamic...
            torch._dynamo.mark_static(x := torch.ones(n), 0)
            fn(x)
    assert any(
        "first_row (grad mode off; requires grad: none; x: float32 [_])" in h for h in recompile_limit_hits()
    )
    torch._dynamo.reset()
