"""One-pass CPU scans: a small C kernel compiled on first use and called through ctypes.

The scans are a sequential dependency along time but independent across rows, so the fastest CPU form is one
tight loop per row (a few cycles per token, one read of each input, one write of each output) with rows split
across threads. PyTorch has no such primitive, and a vectorised formulation needs ~15 full passes over memory,
so the loop is written in C (about 40 lines, no PyTorch headers: it compiles in well under a second with any C
compiler) and cached under ``$PPO_CORE_CACHE_DIR`` (default ``~/.cache/ppo_core``). Where no compiler works,
:func:`is_available` is False and the dispatcher uses the vectorised chunked scan instead.

Shapes: ``rewards``, ``values``, ``mask`` are ``[B, T]``; float32 and float64 run natively (the running state is
kept in double either way), other floating dtypes run in float32 and are cast back.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["discounted_return_scan_cpu", "gae_scan_cpu", "is_available"]

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#define DEFINE_SCANS(SUFFIX, REAL)                                                                          \
void masked_gae_##SUFFIX(const REAL *rewards, const REAL *values, const uint8_t *mask, REAL *adv_out,      \
                         REAL *ret_out, int64_t length, int64_t row_begin, int64_t row_end, double gamma,  \
                         double lam) {                                                                     \
    const double coef = gamma * lam;                                                                       \
    for (int64_t b = row_begin; b < row_end; ++b) {                                                        \
        const REAL *r = rewards + b * length, *v = values + b * length;                                    \
        const uint8_t *m = mask + b * length;                                                              \
        REAL *adv = adv_out + b * length, *ret = ret_out ? ret_out + b * length : 0;                       \
        double nextv = 0.0, lastgae = 0.0;                                                                 \
        for (int64_t t = length - 1; t >= 0; --t) {                                                        \
            if (m[t]) {                                                                                    \
                const double vt = (double)v[t];                                                            \
                lastgae = (double)r[t] + gamma * nextv - vt + coef * lastgae;                              \
                nextv = vt;                                                                                \
            }                                                                                              \
            adv[t] = (REAL)lastgae;                                                                        \
            if (ret) ret[t] = (REAL)(lastgae + (double)v[t]);                                              \
        }                                                                                                  \
    }                                                                                                      \
}                                                                                                          \
void masked_return_##SUFFIX(const REAL *rewards, const uint8_t *mask, REAL *out, int64_t length,           \
                            int64_t row_begin, int64_t row_end, double gamma) {                            \
    for (int64_t b = row_begin; b < row_end; ++b) {                                                        \
        const REAL *r = rewards + b * length;                                                              \
        const uint8_t *m = mask + b * length;                                                              \
        REAL *g = out + b * length;                                                                        \
        double run = 0.0;                                                                                  \
        for (int64_t t = length - 1; t >= 0; --t) {                                                        \
            if (m[t]) { run = (double)r[t] + gamma * run; g[t] = (REAL)run; } else { g[t] = (REAL)0; }     \
        }                                                                                                  \
    }                                                                                                      \
}
DEFINE_SCANS(f32, float)
DEFINE_SCANS(f64, double)
"""
# Masked tokens are skipped by branching, never by multiplying with the mask, so a NaN stored at a masked
# position cannot leak into a valid one (the reference loop has the same property through torch.where).

_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
_NATIVE = {torch.float32: "f32", torch.float64: "f64"}
_MIN_ELEMENTS_PER_THREAD = 1 << 15  # below this a thread hand-off costs more than it saves
_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


def _cache_dir() -> Path:
    root = os.environ.get("PPO_CORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ppo_core"
    )
    return Path(root)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(directory: Path, compiler: str) -> Path:
    tag = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + compiler + sys.platform).encode()).hexdigest()[:16]
    library = directory / f"masked_scans_{tag}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        source = Path(tmp) / "masked_scans.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / library.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], check=True, capture_output=True)
        os.replace(built, library)  # atomic, so concurrent test workers never load a half-written file
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found; CPU scans use the vectorised chunked path")
        return None
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / "ppo_core"):
        try:
            lib = ctypes.CDLL(str(_build(directory, compiler)))
        except (OSError, subprocess.CalledProcessError) as err:
            logger.info("building the CPU scan kernel in %s failed: %s", directory, err)
            continue
        for suffix in _NATIVE.values():
            getattr(lib, f"masked_gae_{suffix}").argtypes = [_PTR] * 5 + [_I64] * 3 + [_F64] * 2
            getattr(lib, f"masked_return_{suffix}").argtypes = [_PTR] * 3 + [_I64] * 3 + [_F64]
        return lib
    return None


def is_available() -> bool:
    """Whether the compiled CPU kernel can be used (a C compiler was found and the build succeeded)."""
    return _library() is not None


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    # Keyed by pid: a pool inherited through fork() has no threads behind it and would hang the child.
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppo_core_scan")


def _over_rows(
    fn: Callable[..., object], args_before: list, args_after: list, batch: int, length: int
) -> None:
    """Call ``fn(*args_before, length, row_begin, row_end, *args_after)`` over row slices, in parallel."""
    workers = max(1, min(torch.get_num_threads(), batch, (batch * length) // _MIN_ELEMENTS_PER_THREAD))
    if workers == 1:
        fn(*args_before, length, 0, batch, *args_after)
        return
    bounds = [batch * i // workers for i in range(workers + 1)]
    # ctypes releases the GIL for the duration of each foreign call, so the slices run concurrently.
    futures = [
        _pool(workers, os.getpid()).submit(fn, *args_before, length, lo, hi, *args_after)
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    for future in futures:
        future.result()


def _prepare(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype, list[torch.Tensor]]:
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    work = dtype if dtype in _NATIVE else torch.float32
    return dtype, work, [t.detach().to(work).contiguous() for t in tensors]


def gae_scan_cpu(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    with_returns: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw masked GAE advantages (and ``advantages + values`` if ``with_returns``) in one pass.

    Args:
        rewards, values: ``[B, T]`` floating CPU tensors.
        mask: ``[B, T]`` bool CPU tensor.
        gamma, lam: discount and GAE lambda.
        with_returns: also produce ``returns = advantages + values`` in the same pass.

    Returns:
        ``(advantages, returns or None)``, each ``[B, T]`` in the promoted dtype of rewards and values.

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> gae_scan_cpu(torch.tensor([[0.0, 5.0, 1.0]]), torch.zeros(1, 3), m, 1.0, 1.0)[0]
        tensor([[1., 1., 1.]])
    """
    lib = _library()
    assert lib is not None, "gae_scan_cpu called without a compiled kernel"
    dtype, work, (r, v) = _prepare(rewards, values)
    m = mask.contiguous()
    batch, length = r.shape
    adv = torch.empty_like(r)
    ret = torch.empty_like(r) if with_returns else None
    if r.numel():
        fn = getattr(lib, f"masked_gae_{_NATIVE[work]}")
        ptrs = [
            r.data_ptr(),
            v.data_ptr(),
            m.data_ptr(),
            adv.data_ptr(),
            ret.data_ptr() if ret is not None else None,
        ]
        _over_rows(fn, ptrs, [float(gamma), float(lam)], batch, length)
    return adv.to(dtype), (ret.to(dtype) if ret is not None else None)


def discounted_return_scan_cpu(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Masked discounted reward-to-go in one pass (0 at masked positions).

    Args:
        rewards: ``[B, T]`` floating CPU tensor.
        mask: ``[B, T]`` bool CPU tensor.
        gamma: discount.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> discounted_return_scan_cpu(torch.tensor([[1.0, 5.0, 1.0]]), m, 0.5)
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    lib = _library()
    assert lib is not None, "discounted_return_scan_cpu called without a compiled kernel"
    dtype, work, (r,) = _prepare(rewards)
    m = mask.contiguous()
    out = torch.empty_like(r)
    if r.numel():
        fn = getattr(lib, f"masked_return_{_NATIVE[work]}")
        _over_rows(fn, [r.data_ptr(), m.data_ptr(), out.data_ptr()], [float(gamma)], *r.shape)
    return out.to(dtype)
