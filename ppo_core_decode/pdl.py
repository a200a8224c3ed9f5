"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step is a chain of short kernels, each waiting for the one before; at 64 rows a kernel's launch and
ramp-up cost a few microseconds against a few microseconds of work. On Hopper GPUs (compute capability 9.0 or
later) a kernel launched with PDL may start while the previous one is still finishing: it reads what no earlier
kernel of the step writes (its weights) at once, then waits (``gdc_wait``) for the previous kernel's memory
before reading anything it produced, and signals (``gdc_launch_dependents``) that the next one may be scheduled:
the decode products and the one-launch attention right after their wait, the output layer after its loop. Weights
and cached keys can also be fetched into the L2 before the wait (:func:`prefetch_l2`). CUDA graphs capture these
launches with their programmatic edges.

Every kernel that takes part must wait before its first dependent read and before its first write, which the
kernels of :mod:`ppo_core_decode.decode_linear` and :mod:`ppo_core_decode.decode_rotary_attention` do. On by
default where supported: the gaps between the step's kernels disappear, which is what makes the fused products
faster than cuBLAS's (alone they are not; ``docs/performance.md``). The cuBLAS path (``fused_decode=False``) gains
nothing from it (its products do not take part). ``PPO_CORE_PDL=0`` turns it off (the kernels then launch as usual,
with the same results).
"""

from __future__ import annotations

import functools
import os

import torch

from ppo_core.kernels.triton_scan import _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["pdl_enabled", "prefetch_l2"]


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode kernels launch with PDL on ``device``: CUDA of compute capability >= 9, a Triton that has
    grid dependency control, not the interpreter, and not turned off by ``PPO_CORE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("PPO_CORE_PDL", "1") == "0":
        return False
    if _interpreting():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(index: int) -> bool:
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return cuda is not None and hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9


if triton is not None:

    @triton.jit
    def prefetch_l2(pointers):
        """``prefetch.global.L2`` of the 128-byte line holding each of ``pointers``: what a kernel launched with PDL
        reads that no earlier kernel writes (weights, cached keys), fetched into the L2 before it waits; a hint, no
        data comes back to the program, so it holds no registers for it."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1
        )

else:
    prefetch_l2 = None
