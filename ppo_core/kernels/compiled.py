"""``cuda_compiled``: run a pure tensor function through ``torch.compile`` on CUDA, eagerly everywhere else.

The element-wise glue of a transformer (norms, rotary embeddings, log-softmax pieces) is memory-bound: eager
PyTorch reads and writes the tensor once per operation, a compiled kernel once in all. On the CPU the compile
time is not worth it (and CI must not pay it), so the function runs as written there.

Staying compiled. ``torch._dynamo`` compiles one graph per set of guards (grad mode, which inputs require grad,
dtypes, 0/1-specialised sizes...) and keeps at most ``torch._dynamo.config.recompile_limit`` (8) of them per code
object; past that it runs the function eagerly for the rest of the process, which only its own log line says.
A training worker calls the same norm with and without grad mode (log-prob passes, the update), on trained and
frozen weights (policy, reference), in two dtypes: enough variants to reach the limit. So each combination of grad
mode and ``requires_grad`` flags of the tensor arguments gets its own compiled copy of the function (its own code
object, named ``<fn>__grad...``, hence its own budget of 8), and a copy that still reaches the limit is reported
by a warning of this module's logger naming the function, the variant and dynamo's reason
(:func:`recompile_limit_hits` lists them). Setting ``torch._dynamo.config.fail_on_recompile_limit_hit = True``
(e.g. in a test) makes such a call raise instead.

A function called on tensors of several shape classes (``by_shape=True``) also gets a copy per class: each tensor
argument's dtype, rank, which of its dims are 1 and whether it is contiguous. The rollout engine's norms are such
functions: one Qwen3 layer normalises the residual stream ``[B, S, D]``, the queries ``[B, S, H, d]`` and keys
``[B, S, G, d]`` (views into the q/k/v product) and the last position ``[B, D]``, in a prefill and in one-token
decode steps, with a batch size per generation; dynamo compiles a graph for each rank, each ``S = 1``
specialisation, each stride pattern and each dim that first changes, more than 8 for one code object. Within a
class a dim that changes becomes dynamic (one recompile), so a class compiles at most about rank + 1 times.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["cuda_compiled", "recompile_limit_hits", "watch_recompile_limit"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_VARIANTS: dict[str, str] = {}
"""Code-object name of every compiled variant -> a description (function, grad mode, inputs requiring grad)."""
_HITS: list[str] = []
_WATCHING = False


class _RecompileLimitWatch(logging.Filter):
    """Observes dynamo's "hit config.recompile_limit" record (never drops a record) and reports our variants."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        if "recompile_limit" in text or "cache_size_limit" in text:
            for name, variant in _VARIANTS.items():
                if f"'{name}'" in text:
                    reason = text.split("last reason:", 1)[-1].split("\n", 1)[0].strip()
                    _HITS.append(variant)
                    logger.warning(
                        "torch.compile of %s hit torch._dynamo's recompile limit: this variant now runs eagerly "
                        "(same results, slower) for the rest of the process; dynamo's last reason: %s",
                        variant,
                        reason,
                    )
        return True


def _watch() -> None:
    global _WATCHING
    if not _WATCHING:
        logging.getLogger("torch._dynamo.convert_frame").addFilter(_RecompileLimitWatch())
        _WATCHING = True


def watch_recompile_limit(code_name: str, description: str) -> None:
    """Report (as for :func:`cuda_compiled`'s variants) when the function whose code object is named ``code_name``
    hits dynamo's recompile limit: for a ``torch.compile`` of a function that is not ours (flex attention)."""
    _VARIANTS[code_name] = description
    _watch()


def recompile_limit_hits() -> list[str]:
    """The compiled variants (``"rms_norm (grad mode on; requires grad: x, weight)"``...) that have hit dynamo's
    recompile limit in this process, in order; empty while every compiled function stays compiled."""
    return list(_HITS)


def _copy(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own named ``name`` (dynamo keeps its compiled graphs per code object)."""
    renamed = (
        {"co_name": name, "co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {"co_name": name}
    )
    code = fn.__code__.replace(**renamed)  # co_qualname: Python 3.11+
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _shape_class(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per tensor argument: its dtype, rank, which dims are 1 and whether it is contiguous (see ``by_shape``)."""
    return tuple(
        (a.dtype, a.dim(), tuple(s == 1 for s in a.shape), a.is_contiguous())
        for a in args
        if isinstance(a, torch.Tensor)
    )


def _describe_class(shapes: tuple[Any, ...]) -> list[str]:
    """Per tensor argument of a :func:`_shape_class`: ``"bfloat16 [_, 1, _] strided"`` (``_``: a dim not 1)."""
    parts = []
    for dtype, _, ones, contiguous in shapes:
        dims = ", ".join("1" if one else "_" for one in ones)
        parts.append(f"{str(dtype).removeprefix('torch.')} [{dims}]{'' if contiguous else ' strided'}")
    return parts


def _on(t: torch.Tensor, device_types: tuple[str, ...]) -> bool:
    return (t.is_cuda and "cuda" in device_types) or t.device.type in device_types


def cuda_compiled(
    fn: F | None = None,
    *,
    options: dict[str, Any] | None = None,
    device_types: tuple[str, ...] = ("cuda",),
    backend: str = "inductor",
    by_shape: bool = False,
) -> Any:
    """Decorate ``fn`` so that calls whose first argument is a CUDA tensor run ``torch.compile(fn)`` (with the
    inductor ``options`` if given, e.g. ``{"emulate_precision_casts": True}`` to keep every explicit rounding to a
    lower precision that eager PyTorch would make).

    Each combination of grad mode and ``requires_grad`` flags of the tensor arguments is compiled separately (see
    the module docstring), so alternating between them never exhausts dynamo's recompile limit.

    If the compiled call fails while the eager one succeeds (no Triton, no working compiler), a warning is
    logged once and ``fn`` stays eager from then on; an error of the inputs themselves is raised by the eager
    call as usual. Gradients flow through the compiled function (``torch.compile`` builds its backward).

    Args:
        fn: a pure tensor function whose first argument is a tensor.
        options: inductor options.
        device_types: the devices of the first argument whose calls are compiled (tests add ``"cpu"``).
        backend: the ``torch.compile`` backend (tests use ``"eager"`` to count graphs without code generation).
        by_shape: also compile a copy per shape class of the tensor arguments (dtype, rank, which dims are 1,
            contiguity; see the module docstring), for a function called on tensors of several ranks and layouts.

    Example:
        >>> @cuda_compiled
        ... def double(x):
        ...     return x * 2
        >>> double(torch.ones(2))  # CPU: eager
        tensor([2., 2.])
    """
    if fn is None:
        return lambda f: cuda_compiled(
            f, options=options, device_types=device_types, backend=backend, by_shape=by_shape
        )
    variants: dict[tuple[Any, ...], Callable[..., Any]] = {}
    broken = False

    def variant(key: tuple[Any, ...], args: tuple[Any, ...]) -> Callable[..., Any]:
        grad, flags, shapes = key
        tensors = [
            n for n, a in zip(fn.__code__.co_varnames, args, strict=False) if isinstance(a, torch.Tensor)
        ]
        needing = [n for n, f in zip(tensors, flags, strict=False) if f] or ["none"]
        name = f"{fn.__name__}__grad{int(grad)}_" + "".join(str(int(f)) for f in flags)
        description = (
            f"{fn.__name__} (grad mode {'on' if grad else 'off'}; requires grad: {', '.join(needing)}"
        )
        if by_shape:
            name += f"__shape{sum(k[0] == key[0] and k[1] == key[1] for k in variants)}"
            classes = _describe_class(shapes)
            description += "; " + ", ".join(f"{n}: {c}" for n, c in zip(tensors, classes, strict=False))
        _VARIANTS[name] = description + ")"
        _watch()
        kwargs: dict[str, Any] = {} if backend == "inductor" else {"backend": backend}
        if options:
            kwargs["options"] = options
        variants[key] = torch.compile(_copy(fn, name), **kwargs)
        return variants[key]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal broken
        first = args[0]
        if broken or not (isinstance(first, torch.Tensor) and _on(first, device_types)):
            return fn(*args, **kwargs)
        flags = tuple(a.requires_grad for a in args if isinstance(a, torch.Tensor))
        key = (torch.is_grad_enabled(), flags, _shape_class(args) if by_shape else None)
        compiled = variants.get(key) or variant(key, args)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if type(exc).__name__ == "FailOnRecompileLimitHit":
                raise  # asked for by torch._dynamo.config.fail_on_recompile_limit_hit
            out = fn(*args, **kwargs)  # raises if the inputs, not the compiler, are at fault
            logger.warning("torch.compile of %s failed; using eager kernels", fn.__name__, exc_info=True)
            broken = True
            return out

    return run  # type: ignore[return-value]
