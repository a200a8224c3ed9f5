"""Host-side state of the decode kernels that split one reduction over several programs and combine it in the launch.

:mod:`ppo_core_decode.decode_linear` (split-K) and :mod:`ppo_core_decode.decode_rotary_attention` (a split of the
cache's slots) give a reduction to ``S`` programs when too few programs would otherwise keep the GPU busy. Each
program writes its fp32 partial to a workspace and adds one to an arrival counter of its output block (an atomic
with acquire-release order); the program that arrives last sums the ``S`` partials in a fixed order, writes the
output and resets the counter to zero. This module holds what both need from the host:

- :func:`sm_count`: the device's number of streaming multiprocessors, to size the split;
- :func:`arrival_counters`: one zeroed ``int32`` buffer per device, shared by every such kernel. It is zero between
  launches because each launch leaves it so; two launches never use it at once because kernels on one stream run
  in order (with programmatic dependent launch, a kernel touches the counters only after ``gdc_wait``, i.e. after
  the previous kernel has finished). A CUDA graph captured around such a launch reads the same buffer at every
  replay. Launches on one device must therefore not run concurrently on two streams.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["arrival_counters", "sm_count"]

_COUNTERS: dict[torch.device, torch.Tensor] = {}
# buffers replaced by larger ones: a CUDA graph captured earlier may still use them
_OUTGROWN: list[torch.Tensor] = []


@functools.cache
def sm_count(device: torch.device) -> int:
    """The number of streaming multiprocessors of ``device`` (off CUDA 132, a large Hopper GPU's: under
    ``TRITON_INTERPRET=1`` the kernels choose their launch shape as they would on such a GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed ``int32`` arrival counters on ``device`` (one buffer per device, kept between calls:
    see the module docstring for why it stays zero)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
