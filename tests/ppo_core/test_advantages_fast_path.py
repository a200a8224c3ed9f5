"""The token-level estimators cost their kernel and little more: the finiteness check and the masking live in the
scan (a flag it writes, read with one host sync), and the CPU path compiles nothing at run time.

Timings are never asserted here (the machine is shared); what is pinned is what makes the time: host syncs, passes
over ``[B, T]`` data, and the slow per-argument check running only when the scan's flag is set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _constant import constant_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ppo_core import kernels
from ppo_core.advantages import compute_gae, compute_reinforce_pp_advantage, compute_remax_advantage
from ppo_core.advantages import gae as gae_module
from ppo_core.advantages import returns as returns_module
from ppo_core.advantages._common import zero_outside
from ppo_core.kernels import chunked, reference, triton_scan
from ppo_core.kernels.whiten import whiten_valid
from ppo_core.masked import masked_whiten
from ppo_core.testing import ppo_batches

CPU_BACKENDS = [b for b in kernels.available_backends("cpu") if b != "reference"]
CHECKED_BACKENDS = [*CPU_BACKENDS, "reference"]
JUNK = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30])
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero"}


class _Recorder(TorchDispatchMode):
    """Counts host syncs, and passes: ops (views excluded) that read or write at least ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.syncs = 0
        self.passes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.syncs += 1
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_place = name.endswith("_") or "out" in (kwargs or {})
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        view = not in_place and any(t.untyped_storage().data_ptr() in storages for t in outputs)
        if not view and any(t.numel() >= self.numel for t in (*inputs, *outputs)):
            self.passes.append(name)
        return out


def _record(fn, numel: int) -> _Recorder:
    """Run ``fn`` under a :class:`_Recorder` that counts passes over at least half of ``numel`` elements."""
    with _Recorder(numel // 2) as recorder:
        fn()
    return recorder


def _case(batch: int = 48, length: int = 256, gaps: bool = True, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """float32 ``[B, T]`` rewards and values, random lengths, a gap on every third row if ``gaps``."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if gaps:
        mask[::3, length // 3 : length // 2] = False
    return rewards, values, mask


def _estimators(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> dict:
    b = torch.randn(r.shape[0], generator=torch.Generator().manual_seed(1)).to(r.device)
    return {
        "gae": lambda: compute_gae(r, v, m, gamma=0.99, lam=0.95, whiten=False),
        "gae_whiten": lambda: compute_gae(r, v, m, gamma=0.99, lam=0.95, whiten=True),
        "reinforce_pp": lambda: compute_reinforce_pp_advantage(r, m, gamma=0.99),
        "remax": lambda: compute_remax_advantage(r, b, m),
    }


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("gaps", [True, False])
@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_one_host_sync_per_call(
    name: str, gaps: bool, mask_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One value read per call: the flag of the scan (and of the 0/1 test of a mask that is not bool). On CPU the
    vectorised scan also reads whether the mask is already compact; that read is no sync on CPU and never runs on
    CUDA, where ``test_one_cuda_sync_per_call`` counts real syncs, so it is answered here outside the count."""
    r, v, m = _case(gaps=gaps)
    compact = chunked._is_prefix(m)
    assert compact is not gaps
    monkeypatch.setattr(chunked, "_is_prefix", lambda mask: compact)
    recorder = _record(_estimators(r, v, m.to(mask_dtype))[name], r.numel())
    assert recorder.syncs == 1, recorder.syncs


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, float("nan")])
@pytest.mark.parametrize("name", ["gae", "reinforce_pp", "remax"])
def test_a_mask_of_other_values_than_0_and_1_still_raises(name: str, bad: float) -> None:
    r, v, m = _case(batch=6, length=20)
    mask = m.to(torch.float32)
    mask[2, 3] = bad
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        _estimators(r, v, mask)[name]()
    if bad in (2.0, -1.0):  # integer masks too
        with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
            _estimators(r, v, mask.to(torch.int64))[name]()


@pytest.mark.parametrize("gaps", [True, False])
def test_public_gae_is_its_kernel_plus_at_most_two_passes(gaps: bool) -> None:
    """``compute_gae(whiten=False)`` adds at most two passes over ``[B, T]`` data to the raw scan it wraps."""
    r, v, m = _case(gaps=gaps)
    kernel = _record(lambda: kernels.masked_gae_returns_scan(r, v, m, 0.99, 0.95), r.numel())
    public = _record(_estimators(r, v, m)["gae"], r.numel())
    assert len(public.passes) <= len(kernel.passes) + 2, (public.passes, kernel.passes)


@pytest.mark.parametrize("gaps", [True, False])
def test_public_returns_estimators_add_only_their_own_arithmetic(gaps: bool) -> None:
    """REINFORCE++ adds its whitening to the scan, ReMax ``returns - baseline`` at valid tokens: little else."""
    r, v, m = _case(gaps=gaps)
    kernel = _record(lambda: kernels.masked_discounted_return_scan(r, m, 0.99), r.numel())
    returns = kernels.masked_discounted_return_scan(r, m, 0.99)
    whitening = _record(lambda: whiten_valid(returns, m), r.numel())
    rpp = _record(_estimators(r, v, m)["reinforce_pp"], r.numel())
    # the flag's sum is the one pass more
    assert len(rpp.passes) <= len(kernel.passes) + len(whitening.passes) + 1, (rpp.passes, kernel.passes)
    remax = _record(_estimators(r, v, m)["remax"], r.numel())
    # the flag's sum, mask.any for the baselines' check, the subtraction and the select
    assert len(remax.passes) <= len(kernel.passes) + 4, (remax.passes, kernel.passes)


@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_finite_inputs_never_reach_the_per_argument_check(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the per-argument finiteness check ran on finite inputs")

    monkeypatch.setattr(gae_module, "check_finite", forbidden)
    monkeypatch.setattr(returns_module, "check_finite", forbidden)
    r, v, m = _case()
    # junk on masked positions is ignored by the scan and must not raise its flag either
    r, v = r.masked_fill(~m, float("nan")), v.masked_fill(~m, float("inf"))
    _estimators(r, v, m)[name]()


def _junk_at_a_valid_position(batch, junk: float, data: st.DataObject) -> tuple[torch.Tensor, ...] | None:
    """Copies of rewards, values and baselines with ``junk`` at one drawn valid position (None if none is valid)."""
    valid = batch.response_mask.nonzero()
    if not len(valid):
        return None
    row, col = valid[data.draw(st.integers(0, len(valid) - 1))].tolist()
    bad_r, bad_v, bad_b = (
        batch.token_level_rewards.clone(),
        batch.values.clone(),
        batch.reward_baselines.clone(),
    )
    bad_r[row, col] = bad_v[row, col] = bad_b[row] = junk
    return bad_r, bad_v, bad_b


@settings(max_examples=40)
@given(batch=ppo_batches(max_batch=8, max_len=24, dense_rewards=True), junk=JUNK, data=st.data())
def test_nonfinite_at_a_valid_position_still_names_the_argument(
    batch, junk: float, data: st.DataObject
) -> None:
    bad = _junk_at_a_valid_position(batch, junk, data)
    if bad is None:
        return
    (bad_r, bad_v, bad_b), m = bad, batch.response_mask
    r, v, b = batch.token_level_rewards, batch.values, batch.reward_baselines
    if junk == 1e30:  # finite: no error, whatever the scan's flag says
        compute_gae(bad_r, bad_v, m, gamma=0.9, lam=0.9)
        compute_remax_advantage(bad_r, bad_b, m)
        return
    with pytest.raises(ValueError, match="rewards"):
        compute_gae(bad_r, v, m)
    with pytest.raises(ValueError, match="values"):
        compute_gae(r, bad_v, m)
    with pytest.raises(ValueError, match="rewards"):
        compute_reinforce_pp_advantage(bad_r, m)
    with pytest.raises(ValueError, match="rewards"):
        compute_remax_advantage(bad_r, b, m)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_remax_advantage(r, bad_b, m)


def test_overflow_of_finite_inputs_is_not_an_error() -> None:
    """The vectorised scan's flag also fires when finite TD errors overflow their sum; that is no input error."""
    r = torch.tensor([[3e38, 3e38, 0.0]])
    m = torch.tensor([[True, True, False]])
    adv, ret = compute_gae(r, torch.zeros_like(r), m, gamma=1.0, lam=1.0, whiten=False)
    want = reference.masked_gae_scan(r, torch.zeros_like(r), m, 1.0, 1.0)
    assert torch.equal(adv[m], want[m]) and bool(torch.isinf(adv[0, 0]))
    assert float(ret[0, 2]) == 0.0


@settings(max_examples=60)
@given(
    batch=ppo_batches(max_batch=8, max_len=40, dense_rewards=True),
    junk=JUNK,
    gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    lam=st.sampled_from([0.0, 0.95, 1.0]),
)
def test_checked_scans_are_the_raw_scans_zeroed_outside_the_mask(
    batch, junk: float, gamma: float, lam: float
) -> None:
    m = batch.response_mask
    r, v = batch.token_level_rewards, batch.values
    ref = reference.masked_gae_scan(r.double(), v.double(), m, gamma, lam)
    ref_ret = reference.masked_discounted_return_scan(r.double(), m, gamma)
    dirty_r, dirty_v = r.masked_fill(~m, junk), v.masked_fill(~m, junk)
    for backend in CHECKED_BACKENDS:
        adv, ret, flag = kernels.masked_gae_returns_checked(dirty_r, dirty_v, m, gamma, lam, backend=backend)
        assert not bool(flag), backend
        assert bool((adv[~m] == 0).all()) and bool((ret[~m] == 0).all()), backend
        torch.testing.assert_close(adv[m].double(), ref[m], atol=1e-4, rtol=0)
        torch.testing.assert_close(ret[m].double(), (ref + v.double())[m], atol=1e-4, rtol=0)
        out, flag = kernels.masked_discounted_return_checked(dirty_r, m, gamma, backend=backend)
        assert not bool(flag), backend
        assert bool((out[~m] == 0).all()), backend
        torch.testing.assert_close(out.double(), ref_ret, atol=1e-4, rtol=0)


@settings(max_examples=40)
@given(batch=ppo_batches(max_batch=8, max_len=24, dense_rewards=True), junk=JUNK, data=st.data())
def test_checked_flag_is_set_by_nonfinite_input_at_a_valid_position(
    batch, junk: float, data: st.DataObject
) -> None:
    bad = _junk_at_a_valid_position(batch, junk, data)
    if bad is None or junk == 1e30:
        return
    (bad_r, bad_v, _), m = bad, batch.response_mask
    r, v = batch.token_level_rewards, batch.values
    for backend in CHECKED_BACKENDS:
        assert bool(kernels.masked_gae_returns_checked(bad_r, v, m, 0.9, 0.9, backend=backend)[2]), backend
        assert bool(kernels.masked_gae_returns_checked(r, bad_v, m, 0.9, 0.9, backend=backend)[2]), backend
        assert bool(kernels.masked_discounted_return_checked(bad_r, m, 0.9, backend=backend)[1]), backend


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_left_padding_and_prefix_masks_take_the_same_answer(backend: str) -> None:
    """Prefix masks skip compaction on CPU; left padding, gaps and all-masked rows go through it. Both are exact."""
    r, v, _ = _case(batch=9, length=300, gaps=False, seed=3)
    positions = torch.arange(300)
    prefix = positions[None, :] < torch.tensor([300, 0, 1, 2, 31, 32, 33, 299, 150])[:, None]
    mixed = prefix.clone()
    mixed[1] = positions >= 200  # left padding
    mixed[4, 5:9] = False  # a gap
    for mask in (prefix, mixed):
        ref = reference.masked_gae_scan(r.double(), v.double(), mask, 0.99, 0.95)
        adv, _, _ = kernels.masked_gae_returns_checked(
            r.double(), v.double(), mask, 0.99, 0.95, backend=backend
        )
        torch.testing.assert_close(adv, torch.where(mask, ref, 0.0), atol=1e-12, rtol=0)
        raw = kernels.masked_gae_scan(r.double(), v.double(), mask, 0.99, 0.95, backend=backend)
        torch.testing.assert_close(raw, ref, atol=1e-12, rtol=0)  # masked positions carry, as documented
        ret_ref = reference.masked_discounted_return_scan(r.double(), mask, 0.99)
        out = kernels.masked_discounted_return_scan(r.double(), mask, 0.99, backend=backend)
        torch.testing.assert_close(out, ret_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_checked_scans_keep_the_dtype(dtype: torch.dtype) -> None:
    r, v, m = _case(batch=5, length=70)
    adv, ret, flag = kernels.masked_gae_returns_checked(r.to(dtype), v.to(dtype), m, 0.99, 0.95)
    assert adv.dtype == ret.dtype == dtype and not bool(flag)
    out, flag = kernels.masked_discounted_return_checked(r.to(dtype), m, 0.99)
    assert out.dtype == dtype and not bool(flag)
    mixed = kernels.masked_gae_returns_checked(r, v.double(), m, 0.99, 0.95)[0]
    assert mixed.dtype == torch.float64


def test_nothing_is_compiled_at_run_time(tmp_path: Path) -> None:
    """The CPU scans need no C compiler and write nothing (read-only file systems, slim containers)."""
    script = (
        "import subprocess\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('a subprocess was started')\n"
        "subprocess.Popen = refuse\n"
        "import torch\n"
        "from ppo_core import kernels\n"
        "from ppo_core.advantages import compute_gae, compute_reinforce_pp_advantage\n"
        "r = torch.randn(64, 4096)\n"
        "m = torch.ones(64, 4096, dtype=torch.bool)\n"
        "compute_gae(r, r, m)\n"
        "compute_reinforce_pp_advantage(r, m)\n"
        "for backend in kernels.available_backends('cpu'):\n"
        "    kernels.masked_gae_scan(r[:2, :50], r[:2, :50], m[:2, :50], 0.9, 0.9, backend=backend)\n"
    )
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    cache.mkdir()
    tmp.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PPO_CORE_CACHE_DIR": str(cache),
        "XDG_CACHE_HOME": str(cache),
        "TMPDIR": str(tmp),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(cache.iterdir()) and not list(tmp.iterdir())


interpret = pytest.mark.skipif(
    not (triton_scan.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with Triton installed",
)


def _check_triton_checked(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, launch=None) -> None:
    """Triton's checked kernels: zeros outside the mask, the loop's values inside, the flag's bits exact."""
    ref = reference.masked_gae_scan(r.double().cpu(), v.double().cpu(), m.cpu(), 0.99, 0.95)
    ref_ret = reference.masked_discounted_return_scan(r.double().cpu(), m.cpu(), 0.99)
    dirty_r, dirty_v = r.masked_fill(~m, float("nan")), v.masked_fill(~m, float("inf"))
    adv, ret, flag = triton_scan.gae_returns_checked_triton(dirty_r, dirty_v, m, 0.99, 0.95, launch=launch)
    mc = m.cpu()
    assert triton_scan.flag_bits(flag) == 0
    assert bool((adv[~m] == 0).all()) and bool((ret[~m] == 0).all())
    torch.testing.assert_close(adv.double().cpu(), torch.where(mc, ref, 0.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        ret.double().cpu(), torch.where(mc, ref + v.double().cpu(), 0.0), atol=1e-4, rtol=0
    )
    out, flag = triton_scan.discounted_return_scan_checked_triton(dirty_r, m, 0.99, launch=launch)
    assert triton_scan.flag_bits(flag) == 0
    torch.testing.assert_close(out.double().cpu(), ref_ret, atol=1e-4, rtol=0)
    if not bool(m.any()):
        return
    row, col = m.nonzero()[-1].tolist()
    bad_r, bad_v = r.clone(), v.clone()
    bad_r[row, col], bad_v[row, col] = float("inf"), float("nan")
    assert (
        triton_scan.flag_bits(
            triton_scan.gae_returns_checked_triton(bad_r, v, m, 0.99, 0.95, launch=launch)[2]
        )
        == 1
    )
    assert (
        triton_scan.flag_bits(
            triton_scan.gae_returns_checked_triton(r, bad_v, m, 0.99, 0.95, launch=launch)[2]
        )
        == 2
    )
    assert (
        triton_scan.flag_bits(
            triton_scan.gae_returns_checked_triton(bad_r, bad_v, m, 0.99, 0.95, launch=launch)[2]
        )
        == 3
    )
    assert (
        triton_scan.flag_bits(
            triton_scan.discounted_return_scan_checked_triton(bad_r, m, 0.99, launch=launch)[1]
        )
        == 1
    )


@interpret
@settings(max_examples=10)
@given(batch=ppo_batches(max_batch=5, max_len=40, dense_rewards=True))
def test_triton_checked_interpreted(batch) -> None:
    # several chunks and row blocks even on tiny inputs
    launch = triton_scan.ScanLaunch(block_b=2, block_t=16, num_warps=1)
    _check_triton_checked(batch.token_level_rewards, batch.values, batch.response_mask, launch)


@interpret
@pytest.mark.parametrize("shape", [(5, 40), (1, 1), (3, 0), (0, 4)])
def test_triton_flag_words_need_no_zeroing(shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every program writes its own flag word, so the buffer is never zeroed (no launch for it): flag words that
    start as all ones still read 0 after a scan of finite inputs, and only the right bit after a NaN."""
    flag_words = triton_scan._flag_words
    monkeypatch.setattr(triton_scan, "_flag_words", lambda *args: flag_words(*args).fill_(-1))
    r, v, m = _case(*shape, seed=shape[1])
    launch = triton_scan.ScanLaunch(block_b=2, block_t=16, num_warps=1)
    assert (
        triton_scan.flag_bits(triton_scan.gae_returns_checked_triton(r, v, m, 0.99, 0.95, launch=launch)[2])
        == 0
    )
    for options in ({"whiten": True}, {"baselines": torch.zeros(shape[0])}):
        flags = triton_scan.return_advantages_checked_triton(r, m, 0.99, launch=launch, **options)[2]
        assert triton_scan.flag_bits(flags) == 0
    if bool(m.any()):
        bad_v = v.masked_fill(m, float("nan"))
        assert triton_scan.flag_bits(triton_scan.gae_returns_checked_triton(r, bad_v, m, 0.99, 0.95)[2]) == 2


@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_estimators_validate_their_inputs_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimators check their arguments themselves and call the scans past the dispatcher's own checks (a
    second round of the same checks was host time on every call)."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dispatcher validated inputs the estimator had already checked")

    monkeypatch.setattr(kernels.dispatch, "_check_inputs", forbidden)
    r, v, m = _case(batch=6, length=20)
    _estimators(r, v, m)[name]()


def test_flags_set_reads_any_form_of_flag() -> None:
    flags_set = kernels.dispatch.flags_set
    assert not flags_set(torch.zeros(7, dtype=torch.int32), None)
    assert flags_set(torch.tensor([0, 0, 2], dtype=torch.int32))
    assert flags_set(torch.tensor(False), torch.tensor(True))
    assert not flags_set(torch.zeros(0, dtype=torch.int32), torch.tensor(False))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 700), (300, 5000)])
def test_triton_checked_on_gpu(shape: tuple[int, int]) -> None:
    if not triton_scan.is_available("cuda"):
        pytest.skip("Triton is not installed")
    r, v, m = (t.cuda() for t in _case(*shape, seed=shape[1]))
    _check_triton_checked(r, v, m)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_cuda_flags_in_reused_host_words(name: str) -> None:
    """On CUDA the scans write their flag words straight into this thread's pinned host buffer, reused by every
    call: a NaN is caught on every call, a finite call after it sees no stale word, and a batch of more rows than
    the buffer holds grows it."""
    for batch in (64, 5000):
        r, v, m = (t.cuda() for t in _case(batch=batch, length=40))
        bad_r = r.masked_fill(m, float("nan"))
        for _ in range(2):
            with pytest.raises(ValueError, match="NaN"):
                _estimators(bad_r, v, m)[name]()
            adv, _ = _estimators(r, v, m)[name]()
            assert bool(torch.isfinite(adv).all())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # Triton, and the vectorised scan on CUDA
@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_one_cuda_sync_per_call(name: str, dtype: torch.dtype) -> None:
    r, v, m = _case(batch=64, length=1000)
    r, v, m = r.to("cuda", dtype), v.to("cuda", dtype), m.cuda()
    fn = _estimators(r, v, m)[name]
    fn()  # compile and warm up outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@settings(max_examples=60)
@given(batch=ppo_batches(max_batch=10, max_len=40, dense_rewards=True), dtype=st.sampled_from(DTYPES))
def test_whitening_of_zero_padded_outputs_is_masked_whiten_within_rounding(batch, dtype: torch.dtype) -> None:
    """The same mean, unbiased variance and epsilon as ``masked_whiten`` (the moments in float64, in a fixed order:
    ``test_masked_moments.py`` pins the layout independence); exactly 0 where masked."""
    m = batch.response_mask
    x = zero_outside(batch.values.to(dtype), m)  # what the estimators whiten: exact zeros where masked
    got = whiten_valid(x, m)
    assert got.dtype == dtype
    assert torch.equal(got[~m.bool()], torch.zeros_like(got[~m.bool()]))
    want = zero_outside(masked_whiten(x.double(), m), m)
    tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 2e-2)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@given(case=constant_cases())
def test_whitening_of_constant_valid_values_is_exactly_zero(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, m = case
    got = whiten_valid(x, m)
    assert torch.equal(got, torch.zeros_like(x)), got


def test_whitening_about_a_large_common_offset_keeps_float32_precision() -> None:
    # 1e4 + noise of 1e-2: a float32 sum of the raw values would leave an error of about 0.1 after the division
    r, _, m = _case(batch=8, length=64)
    x = zero_outside(1e4 + 1e-2 * r, m)
    want = zero_outside(masked_whiten(x.double(), m), m)
    torch.testing.assert_close(whiten_valid(x, m).double(), want, rtol=0, atol=1e-5)


def test_host_flag_words_are_per_thread_reused_and_grow() -> None:
    import threading

    cpu = torch.device("cpu")
    words = triton_scan.host_flag_words(cpu, 10)
    assert words.dtype == torch.int32 and words.numel() >= 10
    assert triton_scan.host_flag_words(cpu, 5) is words  # reused while large enough
    bigger = triton_scan.host_flag_words(cpu, words.numel() + 1)
    assert bigger.numel() > words.numel() and triton_scan.host_flag_words(cpu, 3) is bigger
    other: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: other.append(triton_scan.host_flag_words(cpu, 3)))
    thread.start()
    thread.join()
    assert other[0] is not bigger  # another thread never shares this one's words


@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
@pytest.mark.parametrize("grad", [True, False])
def test_estimators_leave_grad_mode_as_they_found_it(name: str, grad: bool) -> None:
    """The estimators run without autograd (outputs that do not require grad, even from inputs that do) and
    restore the caller's grad mode, also when they raise."""
    r, v, m = _case(batch=4, length=16)
    r, v = r.requires_grad_(), v.requires_grad_()
    with torch.set_grad_enabled(grad):
        adv, ret = _estimators(r, v, m)[name]()
        assert torch.is_grad_enabled() is grad
        assert not adv.requires_grad and not ret.requires_grad
        bad = r.detach().masked_fill(m, float("nan"))
        with pytest.raises(ValueError, match="NaN"):
            _estimators(bad, v.detach(), m)[name]()
        assert torch.is_grad_enabled() is grad


def test_host_words_array_knows_only_this_threads_pinned_views() -> None:
    assert triton_scan.host_words_array(torch.zeros(4, dtype=torch.int32)) is None
    assert not kernels.dispatch.flags_set(torch.zeros(4, dtype=torch.int32)[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_flag_views_are_registered_reused_and_replaced_with_their_buffer() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    words = triton_scan.host_flag_words(device, 10)
    view = triton_scan._flag_words(10, 64, None, device, words)
    assert triton_scan._flag_words(10, 64, None, device, words) is view  # one view object per count
    array = triton_scan.host_words_array(view)
    assert array.shape == (view.numel(),)
    view.fill_(0)
    array[3] = 1  # the NumPy view is the pinned memory itself
    assert int(view[3]) == 1 and kernels.dispatch.flags_set(view)
    view.fill_(0)
    bigger = triton_scan.host_flag_words(device, words.numel() + 1)
    assert triton_scan.host_words_array(view) is None  # the replaced buffer's views are forgotten
    assert triton_scan._flag_words(10, 64, None, device, bigger) is not view


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gae", "gae_whiten", "reinforce_pp", "remax"])
def test_cuda_estimators_on_a_side_stream_read_their_own_streams_flags(name: str) -> None:
    """The flag read waits for the caller's current stream (a side stream here), not the default one."""
    r, v, m = (t.cuda() for t in _case(batch=256, length=2048))
    want = _estimators(r, v, m)[name]()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a read that does not wait sees stale words
        bad = r.masked_fill(m, float("nan"))
        with pytest.raises(ValueError, match="NaN"):
            _estimators(bad, v, m)[name]()
        got = _estimators(r, v, m)[name]()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
