"""``cuda_compiled``: run a pure tensor function through ``torch.compile`` on CUDA, eagerly everywhere else.

The element-wise glue of a transformer (norms, rotary embeddings, log-softmax pieces) is memory-bound: eager
PyTorch reads and writes the tensor once per operation, a compiled kernel once in all. On the CPU the compile
time is not worth it (and CI must not pay it), so the function runs as written there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["cuda_compiled"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def cuda_compiled(fn: F | None = None, *, options: dict[str, Any] | None = None) -> Any:
    """Decorate ``fn`` so that calls whose first argument is a CUDA tensor run ``torch.compile(fn)`` (with the
    inductor ``options`` if given, e.g. ``{"emulate_precision_casts": True}`` to keep every explicit rounding to a
    lower precision that eager PyTorch would make).

    If the compiled call fails while the eager one succeeds (no Triton, no working compiler), a warning is
    logged once and ``fn`` stays eager from then on; an error of the inputs themselves is raised by the eager
    call as usual. Gradients flow through the compiled function (``torch.compile`` builds its backward).

    Example:
        >>> @cuda_compiled
        ... def double(x):
        ...     return x * 2
        >>> double(torch.ones(2))  # CPU: eager
        tensor([2., 2.])
    """
    if fn is None:
        return lambda f: cuda_compiled(f, options=options)
    compiled: Callable[..., Any] | None = None
    broken = False

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled, broken
        if broken or not (isinstance(args[0], torch.Tensor) and args[0].is_cuda):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, options=options) if options else torch.compile(fn)
        try:
            return compiled(*args, **kwargs)
        except Exception:
            out = fn(*args, **kwargs)  # raises if the inputs, not the compiler, are at fault
            logger.warning("torch.compile of %s failed; using eager kernels", fn.__name__, exc_info=True)
            broken = True
            return out

    return run  # type: ignore[return-value]
