"""CUDA scans in Triton: the masked recurrences as associative scans over time, one pass over memory.

Both recurrences have the first-order linear form ``x_t = a_t * x_{t+1} + b_t`` (reverse in time), whose steps
compose associatively: ``(a1, b1)`` then ``(a2, b2)`` is ``(a1 * a2, a2 * b1 + b2)``. Each program owns
``BLOCK_B`` rows and walks them from the end in chunks of ``BLOCK_T`` steps; a chunk is loaded in descending
time order (lane 0 = latest step), scanned with ``tl.associative_scan`` and joined to the state carried from the
chunk on its right, so every input is read once and every output written once.

GAE needs two scans per chunk. The bootstrap value is itself a carried recurrence (``nextv_t`` is the value of
the next valid token after ``t``: ``a = 0, b = V`` where the token at ``t + 1`` is valid, ``a = 1, b = 0``
where it is masked), computed from inputs loaded one step to the right (cache hits, not extra DRAM traffic).
The advantage scan then uses ``a = gamma * lam, b = delta`` at valid tokens and ``a = 1, b = 0`` at masked
ones, which carries both the bootstrap value and the running advantage across a gap, as the reference does.
The discounted return is the second scan alone with ``a = gamma, b = r``.

The ``*_checked`` entry points are the estimators' form: outputs exactly 0 at masked positions, and one flag word
per program, which the program always writes (so nothing zeroes the buffer first: no extra launch), with a bit set
when a reward or value it read at a valid position is NaN or inf. The caller needs no pass of its own over the
inputs and one host sync to read the flags (:func:`flag_bits`).

Precision: the scans run in float32 for float32 inputs; against the float64 loop the largest error seen at
1024 x 8192 was 5e-5 (gamma = lam = 1, the worst case: nothing decays). ``accumulate_fp64=True`` runs them in
float64, for more time.

Falls back cleanly: without Triton or CUDA, :func:`is_available` is False and nothing here is compiled.
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (slowly), which the tests use where Triton is installed.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
from dataclasses import dataclass

import torch

from ppo_core._config_base import ConfigBase
from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2
from ppo_core.kernels.triton_launch import DirectLauncher
from ppo_core.masked import WHITEN_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: CPU-only installs and non-CUDA builds of PyTorch lack it.
    triton = None
    tl = None

__all__ = [
    "ScanLaunch",
    "discounted_return_scan_checked_triton",
    "discounted_return_scan_triton",
    "flag_bits",
    "gae_returns_checked_triton",
    "gae_scan_triton",
    "host_flag_words",
    "is_available",
    "return_advantages_checked_triton",
]


@dataclass(kw_only=True)
class ScanLaunch(ConfigBase):
    """Launch shape of a scan kernel (the defaults come from :func:`_default_launch`)."""

    block_b: int
    """Rows per program (a power of two)."""
    block_t: int
    """Time steps per chunk (a power of two); each program loops over ``ceil(T / block_t)`` chunks."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 2
    """Software-pipelining depth of the chunk loop (loads of the next chunk overlap this chunk's scan)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA with Triton, or any device when interpreting)."""
    if triton is None:
        return False
    if _interpreting():
        return True
    device = torch.device(device) if device is not None else torch.device("cuda")
    return device.type == "cuda" and torch.cuda.is_available()


@functools.lru_cache(maxsize=256)
def _default_launch(length: int) -> ScanLaunch:
    # One row per program, chunks of up to 512 steps, 4 elements per thread: the fastest shape of a sweep at
    # 1024 x 8192 (benchmarks/advantages.py --sweep); short rows get shorter chunks and fewer warps.
    block_t = min(512, max(128, next_power_of_2(length)))
    return ScanLaunch(block_b=1, block_t=block_t, num_warps=block_t // 128, num_stages=3)


def _check_launch(launch: ScanLaunch) -> ScanLaunch:
    sizes = (launch.block_b, launch.block_t)
    if any(n < 1 or n & (n - 1) for n in sizes) or launch.block_b * launch.block_t < 32 * launch.num_warps:
        # Fewer elements than threads means a replicated layout, where Triton's scan lowering has had bugs.
        raise ValueError(
            f"launch must have power-of-two block_b and block_t with block_b * block_t >= 32 * num_warps, got {launch}"
        )
    return launch


if triton is not None:
    # The scan kernels are launched through DirectLauncher (their compiled kernels called directly after the first
    # launch of a configuration), which needs every runtime parameter unspecialised: no kernel for a row count or
    # length of 1 or a multiple of 16, none for 16-byte aligned pointers (the kernels mask every access and assume
    # neither). Losing those hints may cost vectorised loads: benchmarks/advantages.py measures the kernels
    # (kernel_ms) and the launch (estimator_layer_us).
    _SCALARS = ("n_rows", "length", "gamma", "coef", "eps")
    _POINTERS = tuple(
        f"{name}_ptr" for name in ("r", "v", "m", "x", "adv", "ret", "out", "flag", "stats", "b")
    )
    _unspecialised = triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=_POINTERS)

    @triton.jit
    def _compose(a_later, b_later, a_earlier, b_earlier):
        # Lanes run from later to earlier steps, so the left operand is the step applied first.
        return a_later * a_earlier, a_earlier * b_later + b_earlier

    @triton.jit
    def _nonfinite(x, valid):
        # int32 1 at the valid lanes holding NaN or +-inf (NaN fails every comparison), else 0
        return (valid & ((tl.abs(x) < float("inf")) == 0)).to(tl.int32)

    @triton.jit
    def _merge_moments(count, mean, m2, ref, x, valid, lanes, zero):
        # Chan et al.'s pairwise update of per-row (count, mean, M2) with the valid lanes of one chunk: the chunk's
        # own mean and centred sum of squares first, so no sum of squares of raw values (no cancellation). All
        # about the row's reference ``ref``, its first valid value in scan order (its last valid token), taken from
        # the chunk that holds it: constant valid values are exactly 0 about it, so their mean and M2 are 0 (the
        # mean of n equal floats, a rounded sum over n, is in general not that value).
        first = tl.min(tl.where(valid, lanes, 1 << 30), axis=1)
        ref = tl.where(count > 0, ref, tl.sum(tl.where(lanes == first[:, None], x, zero), axis=1))
        xs = tl.where(valid, x - ref[:, None], zero)
        n_c = tl.sum(valid.to(x.dtype), axis=1)
        mean_c = tl.sum(xs, axis=1) / tl.maximum(n_c, 1.0)
        d_c = tl.where(valid, xs - mean_c[:, None], zero)
        m2_c = tl.sum(d_c * d_c, axis=1)
        n_new = count + n_c
        w = n_c / tl.maximum(n_new, 1.0)
        d = mean_c - mean
        return n_new, mean + d * w, m2 + m2_c + d * d * count * w, ref

    @triton.jit
    def _store_moments(stats_ptr, rows, n_rows, count, mean, m2, ref):
        ok = rows < n_rows
        tl.store(stats_ptr + rows * 4, count, mask=ok)
        tl.store(stats_ptr + rows * 4 + 1, mean, mask=ok)
        tl.store(stats_ptr + rows * 4 + 2, m2, mask=ok)
        tl.store(stats_ptr + rows * 4 + 3, ref, mask=ok)

    @triton.jit
    def _load_moments(stats_ptr, idx, n_rows):
        # (count, mean, M2, reference) of rows idx as float64, the mean about the reference; rows past the end
        # count 0
        ok = idx < n_rows
        n = tl.load(stats_ptr + idx * 4, mask=ok, other=0.0).to(tl.float64)
        mu = tl.load(stats_ptr + idx * 4 + 1, mask=ok, other=0.0).to(tl.float64)
        m2 = tl.load(stats_ptr + idx * 4 + 2, mask=ok, other=0.0).to(tl.float64)
        ref = tl.load(stats_ptr + idx * 4 + 3, mask=ok, other=0.0).to(tl.float64)
        return n, mu, m2, ref

    @_unspecialised
    def _whiten_kernel(
        x_ptr,
        m_ptr,
        out_ptr,
        stats_ptr,
        n_rows,
        length,
        eps,
        ACC: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        # Every program combines the per-row moments of the scan (float64: the count is exact and the merge of
        # thousands of rows loses nothing), then normalises its share of the rows. Each row's mean is about its own
        # reference; the combined mean is about the reference of the first row with a valid token, so that
        # constant valid values give a mean and a variance of exactly 0, and outputs of exactly 0.
        offs = tl.arange(0, BLOCK_S)
        n_acc = tl.zeros([BLOCK_S], tl.float64)
        first_acc = tl.zeros([BLOCK_S], tl.int32) + n_rows
        for start in range(0, n_rows, BLOCK_S):
            n, _, _, _ = _load_moments(stats_ptr, start + offs, n_rows)
            n_acc += n
            first_acc = tl.minimum(first_acc, tl.where(n > 0.0, start + offs, n_rows))
        total = tl.sum(n_acc, axis=0)
        _first_n, _first_mu, _first_m2, base_ref = _load_moments(stats_ptr, tl.min(first_acc, axis=0), n_rows)
        s_acc = tl.zeros([BLOCK_S], tl.float64)
        for start in range(0, n_rows, BLOCK_S):
            n, mu, _, ref = _load_moments(stats_ptr, start + offs, n_rows)
            s_acc += n * ((ref - base_ref) + mu)
        mean = tl.sum(s_acc, axis=0) / tl.maximum(total, 1.0)
        m2_acc = tl.zeros([BLOCK_S], tl.float64)
        for start in range(0, n_rows, BLOCK_S):
            n, mu, m2, ref = _load_moments(stats_ptr, start + offs, n_rows)
            d = (ref - base_ref) + mu - mean
            m2_acc += m2 + n * d * d
        # unbiased variance; 0 with fewer than two valid tokens (the output is then exactly 0)
        var = tl.where(total > 1.0, tl.sum(m2_acc, axis=0) / tl.maximum(total - 1.0, 1.0), 0.0)
        ref_a = base_ref.to(ACC)
        mean_a = mean.to(ACC)
        rstd = 1.0 / tl.sqrt(var.to(ACC) + eps)
        lanes = tl.arange(0, BLOCK_T)
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            base = tl.cast(row, tl.int64) * length
            for start in range(0, length, BLOCK_T):
                t = start + lanes
                ok = t < length
                x = tl.load(x_ptr + base + t, mask=ok, other=0.0).to(ACC)
                m = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
                y = tl.where(m, ((x - ref_a) - mean_a) * rstd, 0.0)
                tl.store(out_ptr + base + t, y.to(out_ptr.dtype.element_ty), mask=ok)

    @_unspecialised
    def _gae_kernel(
        r_ptr,
        v_ptr,
        m_ptr,
        adv_ptr,
        ret_ptr,
        flag_ptr,
        stats_ptr,
        n_rows,
        length,
        gamma,
        coef,
        WITH_RETURNS: tl.constexpr,
        CHECKED: tl.constexpr,
        STATS: tl.constexpr,
        ACC: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        base = rows.to(tl.int64)[:, None] * length
        lanes = tl.arange(0, BLOCK_T)[None, :]
        row_ok = (rows < n_rows)[:, None]
        last_lane = lanes == BLOCK_T - 1
        carry_v = tl.zeros([BLOCK_B], ACC)
        carry_adv = tl.zeros([BLOCK_B], ACC)
        count = tl.zeros([BLOCK_B], ACC)
        mean = tl.zeros([BLOCK_B], ACC)
        m2 = tl.zeros([BLOCK_B], ACC)
        ref = tl.zeros([BLOCK_B], ACC)
        # Non-finite inputs seen per lane, OR-ed over the chunks and reduced once after the loop.
        bad_r = tl.zeros([BLOCK_B, BLOCK_T], tl.int32)
        bad_v = tl.zeros([BLOCK_B, BLOCK_T], tl.int32)
        for start in range(0, length, BLOCK_T):
            t = length - 1 - start - lanes
            ok = row_ok & (t >= 0)
            # The shifted loads must also stop at t >= 0: lanes past the row start would read before row 0.
            ok_next = ok & (t + 1 < length)
            r = tl.load(r_ptr + base + t, mask=ok, other=0.0).to(ACC)
            v = tl.load(v_ptr + base + t, mask=ok, other=0.0).to(ACC)
            m = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
            v_right = tl.load(v_ptr + base + t + 1, mask=ok_next, other=0.0).to(ACC)
            m_right = tl.load(m_ptr + base + t + 1, mask=ok_next, other=0) != 0
            zero = tl.zeros([BLOCK_B, BLOCK_T], ACC)
            one = zero + 1.0
            a_v, b_v = tl.associative_scan(
                (tl.where(m_right, zero, one), tl.where(m_right, v_right, zero)), axis=1, combine_fn=_compose
            )
            next_v = a_v * carry_v[:, None] + b_v
            delta = tl.where(m, r + gamma * next_v - v, zero)
            a_g, b_g = tl.associative_scan(
                (tl.where(m, zero + coef, one), delta), axis=1, combine_fn=_compose
            )
            adv = a_g * carry_adv[:, None] + b_g
            if CHECKED:
                # Masked lanes may hold NaN/inf in v (and so in adv + v): select, never multiply by the mask.
                tl.store(adv_ptr + base + t, tl.where(m, adv, zero), mask=ok)
                if WITH_RETURNS:
                    tl.store(ret_ptr + base + t, tl.where(m, adv + v, zero), mask=ok)
                bad_r = bad_r | _nonfinite(r, m)
                bad_v = bad_v | _nonfinite(v, m)
            else:
                tl.store(adv_ptr + base + t, adv, mask=ok)
                if WITH_RETURNS:
                    tl.store(ret_ptr + base + t, adv + v, mask=ok)
            if STATS:
                count, mean, m2, ref = _merge_moments(count, mean, m2, ref, adv, m, lanes, zero)
            carry_v = tl.sum(tl.where(last_lane, next_v, zero), axis=1)
            carry_adv = tl.sum(tl.where(last_lane, adv, zero), axis=1)
        if CHECKED:
            # bit 0: a reward, bit 1: a value at a valid position is NaN or inf
            tl.store(flag_ptr + tl.program_id(0), tl.max(bad_r) | (tl.max(bad_v) * 2))
        if STATS:
            _store_moments(stats_ptr, rows, n_rows, count, mean, m2, ref)

    @_unspecialised
    def _return_kernel(
        r_ptr,
        m_ptr,
        out_ptr,
        flag_ptr,
        stats_ptr,
        b_ptr,
        adv_ptr,
        n_rows,
        length,
        gamma,
        CHECKED: tl.constexpr,
        STATS: tl.constexpr,
        BASELINE: tl.constexpr,
        ACC: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        base = rows.to(tl.int64)[:, None] * length
        lanes = tl.arange(0, BLOCK_T)[None, :]
        row_ok = (rows < n_rows)[:, None]
        last_lane = lanes == BLOCK_T - 1
        carry = tl.zeros([BLOCK_B], ACC)
        bad_r = tl.zeros([BLOCK_B, BLOCK_T], tl.int32)
        count = tl.zeros([BLOCK_B], ACC)
        mean = tl.zeros([BLOCK_B], ACC)
        m2 = tl.zeros([BLOCK_B], ACC)
        ref = tl.zeros([BLOCK_B], ACC)
        seen = tl.zeros([BLOCK_B], tl.int32)
        if BASELINE:
            baseline = tl.load(b_ptr + rows, mask=rows < n_rows, other=0.0).to(ACC)
        for start in range(0, length, BLOCK_T):
            t = length - 1 - start - lanes
            ok = row_ok & (t >= 0)
            r = tl.load(r_ptr + base + t, mask=ok, other=0.0).to(ACC)
            m = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
            zero = tl.zeros([BLOCK_B, BLOCK_T], ACC)
            a, b = tl.associative_scan(
                (tl.where(m, zero + gamma, zero + 1.0), tl.where(m, r, zero)), axis=1, combine_fn=_compose
            )
            run = a * carry[:, None] + b
            tl.store(out_ptr + base + t, tl.where(m, run, zero), mask=ok)
            if BASELINE:
                tl.store(adv_ptr + base + t, tl.where(m, run - baseline[:, None], zero), mask=ok)
                seen = tl.maximum(seen, tl.max(m.to(tl.int32), axis=1))
            if STATS:
                count, mean, m2, ref = _merge_moments(count, mean, m2, ref, run, m, lanes, zero)
            carry = tl.sum(tl.where(last_lane, run, zero), axis=1)
            if CHECKED:
                bad_r = bad_r | _nonfinite(r, m)
        if CHECKED:
            flags = tl.max(bad_r)
            if BASELINE:
                # bit 1: the baseline of a row with a valid token is NaN or inf (other rows never read theirs)
                flags = flags | (tl.max(_nonfinite(baseline, seen != 0)) * 2)
            tl.store(flag_ptr + tl.program_id(0), flags)
        if STATS:
            _store_moments(stats_ptr, rows, n_rows, count, mean, m2, ref)

    _whiten_launcher = DirectLauncher(_whiten_kernel)
    _gae_launcher = DirectLauncher(_gae_kernel)
    _return_launcher = DirectLauncher(_return_kernel)


def _acc(dtype: torch.dtype, accumulate_fp64: bool) -> object:
    return tl.float64 if accumulate_fp64 or dtype == torch.float64 else tl.float32


def _grid(batch: int, launch: ScanLaunch) -> tuple[int]:
    return (cdiv(batch, launch.block_b),)


def _flag_words(
    batch: int, length: int, launch: ScanLaunch | None, device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    """The ``[P]`` int32 flag words of a checked scan's ``P`` programs (each program writes its own: no zeroing):
    the first ``P`` of ``out`` if given, else new ones on ``device``."""
    programs = _grid(batch, launch or _default_launch(length))[0] if batch * length else 0
    if out is None:
        return torch.empty(programs, dtype=torch.int32, device=device)
    if device.type == "cuda" and _HOST.__dict__.get("words", {}).get(device) is out:
        return _host_view(out, device, programs)  # this thread's pinned words: one view per count
    if out.dtype != torch.int32 or out.dim() != 1 or out.numel() < programs:
        raise ValueError(
            f"flags must be int32 with at least {programs} entries, got {out.dtype} {tuple(out.shape)}"
        )
    return out[:programs]


_HOST = threading.local()


def host_flag_words(device: torch.device, programs: int) -> torch.Tensor:
    """At least ``programs`` int32 words of pinned host memory the kernels of ``device`` write directly (no copy
    back, no zeroing launch), reused by every call of this thread: read them only after the stream has finished.
    (A plain CPU tensor off CUDA, for the interpreter.)"""
    cache = _HOST.__dict__.setdefault("words", {})
    words = old = cache.get(device)
    if words is None or words.numel() < programs:
        words = torch.empty(max(programs, 4096), dtype=torch.int32, pin_memory=device.type == "cuda")
        cache[device] = words
        views = _HOST.__dict__.get("views", {})
        for key in [key for key, (base, _) in views.items() if base is old]:  # the replaced buffer's views go
            _forget(views, key)
    return words


_HOST_ARRAY = "_ppo_core_host_array"
"""The attribute of a pinned flag-word view that holds its NumPy view (see :func:`host_words_array`)."""


def _host_view(words: torch.Tensor, device: torch.device, programs: int) -> torch.Tensor:
    """``words[:programs]`` of this thread's pinned words of ``device``, made once per buffer and count, carrying
    its NumPy view for :func:`host_words_array`."""
    views = _HOST.__dict__.setdefault("views", {})
    entry = views.get((device, programs))
    if entry is None:
        view = words[:programs]
        setattr(view, _HOST_ARRAY, view.numpy())
        entry = views[(device, programs)] = (words, view)
        if len(views) > 64:  # many batch sizes: keep the newest
            _forget(views, next(iter(views)))
    return entry[1]


def _forget(views: dict, key: tuple[torch.device, int]) -> None:
    """Drop a view of :func:`_host_view`: :func:`host_words_array` no longer knows it."""
    delattr(views.pop(key)[1], _HOST_ARRAY)


def host_words_array(flags: torch.Tensor) -> object | None:
    """The NumPy view of flag words made by :func:`_flag_words` from this thread's pinned words (readable without
    a copy once the stream that launched the scan has finished), None for any other tensor."""
    return getattr(flags, _HOST_ARRAY, None)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def sync_current_stream() -> None:
    """Wait for the current CUDA stream of the current device (where the scans launch): its ``torch.cuda.Stream``
    object looked up by the raw stream (cheaper than ``torch.cuda.current_stream()``, which builds a new one at
    every call)."""
    device_index = torch.cuda.current_device()
    if _RAW_STREAM is None:
        torch.cuda.current_stream(device_index).synchronize()
        return
    streams = _HOST.__dict__.setdefault("streams", {})
    raw = _RAW_STREAM(device_index)
    stream = streams.get((device_index, raw))
    if stream is None:
        stream = torch.cuda.current_stream(device_index)
        if len(streams) >= 64:
            streams.clear()
        streams[(device_index, raw)] = stream
    stream.synchronize()


def flag_bits(flags: torch.Tensor) -> int:
    """The bits of a checked scan's per-program flag words OR-ed together (one host sync; 0 when none is set).

    Example:
        >>> flag_bits(torch.tensor([0, 2, 0, 1], dtype=torch.int32))
        3
    """
    words = flags.cpu()
    if not bool(words.any()):  # the usual case: no list of P Python ints
        return 0
    return functools.reduce(operator.or_, words.tolist(), 0)


def _operand(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` in ``dtype`` and contiguous, as the kernels read it: the tensor itself when it already is."""
    if (dtype is None or tensor.dtype == dtype) and tensor.is_contiguous():
        return tensor
    return tensor.detach().to(dtype or tensor.dtype).contiguous()


def _new_stats(batch: int, acc_fp64: bool, device: torch.device) -> torch.Tensor:
    """``[B, 4]`` per-row (count, mean, M2, reference) of the valid outputs, the mean about the reference (the row's
    last valid output), written by a scan for :func:`_whiten`."""
    return torch.empty(batch, 4, dtype=torch.float64 if acc_fp64 else torch.float32, device=device)


@functools.lru_cache(maxsize=16)
def _whiten_programs(device: torch.device) -> int:
    # Persistent programs, a few per multiprocessor: each one reads every row's moments once (L2 hits), so fewer
    # programs than rows keep that redundant read small for batches of many short rows.
    if device.type != "cuda":
        return 2  # the interpreter: still more than one program, so the row loop is exercised
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _whiten(
    values: torch.Tensor, mask_u8: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, acc: object
) -> torch.Tensor:
    """``out = (values - mean) * rsqrt(var + eps)`` at valid positions, 0 elsewhere, from a scan's row moments."""
    batch, length = values.shape
    if values.numel():
        block_t = min(2048, max(128, next_power_of_2(length)))
        _whiten_launcher(
            (min(batch, _whiten_programs(values.device)),),
            values,
            mask_u8,
            out,
            stats,
            batch,
            length,
            WHITEN_EPS,
            ACC=acc,
            BLOCK_S=min(1024, max(16, next_power_of_2(batch))),
            BLOCK_T=block_t,
            num_warps=4,
        )
    return out


def _gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    with_returns: bool,
    flag: torch.Tensor | None,
    accumulate_fp64: bool,
    launch: ScanLaunch | None,
    whiten: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    r, v = _operand(rewards, dtype), _operand(values, dtype)
    m = _operand(mask).view(torch.uint8)
    batch, length = r.shape
    adv = torch.empty_like(r)
    ret = torch.empty_like(r) if with_returns else adv  # an unused pointer when not writing returns
    acc = _acc(dtype, accumulate_fp64)
    # an unused pointer when not whitening
    stats = _new_stats(batch, acc == tl.float64, r.device) if whiten else adv
    if r.numel():
        launch = _check_launch(launch) if launch else _default_launch(length)
        _gae_launcher(
            _grid(batch, launch),
            r,
            v,
            m,
            adv,
            ret,
            adv if flag is None else flag,  # an unused pointer when not checking
            stats,
            batch,
            length,
            float(gamma),
            float(gamma * lam),
            WITH_RETURNS=with_returns,
            CHECKED=flag is not None,
            STATS=whiten,
            ACC=acc,
            BLOCK_B=launch.block_b,
            BLOCK_T=launch.block_t,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )
        if whiten:
            _whiten(adv, m, stats, adv, acc)  # in place: each program rewrites only what it read
    return adv, (ret if with_returns else None)


def gae_scan_triton(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    with_returns: bool = False,
    accumulate_fp64: bool = False,
    launch: ScanLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw masked GAE advantages (and ``advantages + values`` if ``with_returns``) in one kernel launch.

    Args:
        rewards, values: ``[B, T]`` floating CUDA tensors.
        mask: ``[B, T]`` bool CUDA tensor.
        gamma, lam: discount and GAE lambda.
        with_returns: also write ``returns = advantages + values`` from the same pass.
        accumulate_fp64: run the scans in float64 (float32 otherwise, float64 anyway for float64 inputs).
        launch: launch shape override (benchmarks); default from the shape.

    Returns:
        ``(advantages, returns or None)``, each ``[B, T]`` in the promoted dtype of rewards and values.

    Example:
        >>> m = torch.tensor([[True, False, True]], device="cuda")
        >>> r = torch.tensor([[0.0, 5.0, 1.0]], device="cuda")
        >>> gae_scan_triton(r, torch.zeros_like(r), m, 1.0, 1.0)[0]
        tensor([[1., 1., 1.]], device='cuda:0')
    """
    return _gae(
        rewards,
        values,
        mask,
        gamma,
        lam,
        with_returns=with_returns,
        flag=None,
        accumulate_fp64=accumulate_fp64,
        launch=launch,
    )


def gae_returns_checked_triton(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = False,
    accumulate_fp64: bool = False,
    launch: ScanLaunch | None = None,
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, exactly 0 at masked positions, and the kernel's non-finite flag; one launch
    (two with ``whiten``).

    With ``whiten`` the scan also keeps each row's count, mean and centred sum of squares of its valid advantages
    (Chan's merge, chunk by chunk, in registers), and a second kernel combines them (float64) and normalises
    ``(A - mean) * rsqrt(var + eps)`` (unbiased variance, 0 with fewer than two valid tokens): the whitening of
    :func:`ppo_core.masked.masked_whiten` without a pass of its own over the raw advantages.

    Args:
        rewards, values: ``[B, T]`` floating CUDA tensors.
        mask: ``[B, T]`` bool CUDA tensor.
        gamma, lam: discount and GAE lambda.
        whiten: return the advantages whitened over all valid tokens of the batch.
        accumulate_fp64: run the scans in float64.
        launch: launch shape override (benchmarks).
        flags: where the programs write their flag words (int32, at least one per program): device memory or
            pinned host memory (:func:`host_flag_words`); new device memory by default.

    Returns:
        ``(advantages, returns, flags)``: two ``[B, T]`` tensors in the promoted dtype of rewards and values, and
        the ``[P]`` int32 flag words of the programs (:func:`flag_bits`): bit 0 set when a reward and bit 1 when a
        value at a valid position is NaN or inf (the whitened advantages are then meaningless: the caller raises).

    Example:
        >>> m = torch.tensor([[True, False, True]], device="cuda")
        >>> r = torch.tensor([[0.0, float("nan"), 1.0]], device="cuda")
        >>> adv, ret, flags = gae_returns_checked_triton(r, torch.zeros_like(r), m, 1.0, 1.0)
        >>> adv, flag_bits(flags)
        (tensor([[1., 0., 1.]], device='cuda:0'), 0)
    """
    flags = _flag_words(*rewards.shape, launch, rewards.device, flags)
    adv, ret = _gae(
        rewards,
        values,
        mask,
        gamma,
        lam,
        with_returns=True,
        flag=flags,
        accumulate_fp64=accumulate_fp64,
        launch=launch,
        whiten=whiten,
    )
    assert ret is not None
    return adv, ret, flags


def _discounted(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    *,
    flag: torch.Tensor | None,
    accumulate_fp64: bool,
    launch: ScanLaunch | None,
    whiten: bool = False,
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r = _operand(rewards)
    m = _operand(mask).view(torch.uint8)
    batch, length = r.shape
    out = torch.empty_like(r)
    adv = torch.empty_like(r) if whiten or baselines is not None else None
    acc = _acc(r.dtype, accumulate_fp64)
    stats = _new_stats(batch, acc == tl.float64, r.device) if whiten else out  # unused pointer otherwise
    b = _operand(baselines, r.dtype) if baselines is not None else out
    if r.numel():
        launch = _check_launch(launch) if launch else _default_launch(length)
        _return_launcher(
            _grid(batch, launch),
            r,
            m,
            out,
            out if flag is None else flag,
            stats,
            b,
            out if adv is None else adv,
            batch,
            length,
            float(gamma),
            CHECKED=flag is not None,
            STATS=whiten,
            BASELINE=baselines is not None,
            ACC=acc,
            BLOCK_B=launch.block_b,
            BLOCK_T=launch.block_t,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )
        if whiten:
            _whiten(out, m, stats, adv, acc)
    return out, adv


def discounted_return_scan_triton(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    *,
    accumulate_fp64: bool = False,
    launch: ScanLaunch | None = None,
) -> torch.Tensor:
    """Masked discounted reward-to-go (0 at masked positions) in one kernel launch.

    Args:
        rewards: ``[B, T]`` floating CUDA tensor.
        mask: ``[B, T]`` bool CUDA tensor.
        gamma: discount.
        accumulate_fp64: run the scan in float64.
        launch: launch shape override (benchmarks).

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> m = torch.tensor([[True, False, True]], device="cuda")
        >>> discounted_return_scan_triton(torch.tensor([[1.0, 5.0, 1.0]], device="cuda"), m, 0.5)
        tensor([[1.5000, 0.0000, 1.0000]], device='cuda:0')
    """
    return _discounted(rewards, mask, gamma, flag=None, accumulate_fp64=accumulate_fp64, launch=launch)[0]


def discounted_return_scan_checked_triton(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    *,
    accumulate_fp64: bool = False,
    launch: ScanLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`discounted_return_scan_triton` and the kernel's non-finite flag (bit 0: a reward at a valid position).

    Returns:
        ``(returns, flags)``: ``[B, T]`` returns (0 at masked positions) and the ``[P]`` int32 flag words.

    Example:
        >>> m = torch.tensor([[True, False, True]], device="cuda")
        >>> out, flags = discounted_return_scan_checked_triton(torch.tensor([[1.0, 5.0, 1.0]], device="cuda"), m, 0.5)
        >>> flag_bits(flags)
        0
    """
    _, out, flags = return_advantages_checked_triton(
        rewards, mask, gamma, accumulate_fp64=accumulate_fp64, launch=launch
    )
    return out, flags


def return_advantages_checked_triton(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    *,
    whiten: bool = False,
    baselines: torch.Tensor | None = None,
    accumulate_fp64: bool = False,
    launch: ScanLaunch | None = None,
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages from the masked discounted return, the return itself and the non-finite flag, from one scan (and
    one normalising kernel with ``whiten``).

    ``advantages`` is the return whitened over all valid tokens (``whiten``, REINFORCE++), the return minus each
    row's baseline (``baselines``, ReMax), or the return itself; 0 at masked positions.

    Args:
        rewards: ``[B, T]`` floating CUDA tensor.
        mask: ``[B, T]`` bool CUDA tensor.
        gamma: discount.
        whiten: whiten the return (see :func:`gae_returns_checked_triton`).
        baselines: ``[B]`` per-row baselines subtracted from the return (not with ``whiten``).
        accumulate_fp64: run the scan in float64.
        launch: launch shape override (benchmarks).
        flags: where the programs write their flag words (see :func:`gae_returns_checked_triton`).

    Returns:
        ``(advantages, returns, flags)``: two ``[B, T]`` tensors in the dtype of ``rewards`` and the ``[P]`` int32
        flag words (:func:`flag_bits`), bit 0 set when a reward at a valid position and bit 1 when the baseline
        of a row with a valid token is NaN or inf.

    Example:
        >>> m = torch.tensor([[True, False, True]], device="cuda")
        >>> r = torch.tensor([[1.0, 5.0, 1.0]], device="cuda")
        >>> adv, ret, flags = return_advantages_checked_triton(r, m, 1.0, baselines=torch.tensor([0.5], device="cuda"))
        >>> adv, flag_bits(flags)
        (tensor([[1.5000, 0.0000, 0.5000]], device='cuda:0'), 0)
    """
    if whiten and baselines is not None:
        raise ValueError("return_advantages_checked_triton: give whiten or baselines, not both")
    flags = _flag_words(*rewards.shape, launch, rewards.device, flags)
    out, adv = _discounted(
        rewards,
        mask,
        gamma,
        flag=flags,
        accumulate_fp64=accumulate_fp64,
        launch=launch,
        whiten=whiten,
        baselines=baselines,
    )
    return (out if adv is None else adv), out, flags
