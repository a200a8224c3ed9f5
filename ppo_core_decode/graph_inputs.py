"""The addresses a captured decode step reads: what decides whether the CUDA graphs captured in one generation may be
replayed in the next.

A CUDA graph replays its kernels with the arguments of its capture, device addresses included. The decoder frees
its KV cache at the end of a generation (its memory goes back to training) and the engines rebuild their
per-generation weights (concatenated and norm-folded copies) at the start of the next. Where the allocator hands
every one of them back at the address it had, the previous generation's graphs read exactly the tensors this one
made, and capturing them again (host time for every launch of a step: about 200 for a 28-layer model) can be
skipped. :func:`held_tensor_addresses` lists, in a fixed order, the address and size of every tensor an object
holds, so that the decoder compares two generations' lists instead of trusting that nothing moved.

What counts as held, walked from each root: a tensor; the items of a list or tuple and the values of a dict; a
module's parameters, buffers and tensor attributes, its submodules' too; the object behind a bound method; and the
attributes of an object of ppo-core's own packages (the engines' forwards, their weight holders). Objects of the
``skip`` types are not entered (the decoder passes its cache's buffers itself, without the per-forward values the
cache also holds). Sets are not entered (their order is not fixed; ppo-core keeps no tensor in one), nor are other
objects: a forward that reaches tensors another way (a closure, a global) is not :func:`fully_walked`, and the
decoder captures its graphs anew every generation. A tensor whose address cannot be read (a subclass without
storage of its own, whose data may move while it stays the same object) gives an entry equal to no other, so that
a generation holding one captures anew too.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

__all__ = ["fully_walked", "held_tensor_addresses"]

_OWN_PACKAGES = ("ppo_core", "ppo_core_decode")


@functools.cache
def _own_type(cls: type) -> bool:
    return cls.__module__.split(".", 1)[0] in _OWN_PACKAGES


@functools.cache
def _entered_attribute(cls: type) -> bool:
    """Whether a module attribute of class ``cls`` is walked: a tensor, or an object of ppo-core's."""
    return issubclass(cls, torch.Tensor) or _own_type(cls)


def _own(obj: object) -> bool:
    """Whether ``obj`` is an instance of a class defined in ppo-core's packages."""
    return _own_type(type(obj))


def fully_walked(forward: object) -> bool:
    """Whether :func:`held_tensor_addresses` sees every tensor ``forward`` can read between two calls: an object of
    ppo-core's own classes, or a method bound to one (the engines' forwards); not a function or a foreign object."""
    if inspect.ismethod(forward):
        forward = forward.__self__
    return _own(forward) and hasattr(forward, "__dict__")


def _address(t: torch.Tensor) -> tuple[object, int]:
    """``(data_ptr, numel)``, or ``(a new object, numel)`` where the address cannot be read (0 for a non-empty
    tensor, or an error): equal to no other entry."""
    try:
        at = t.data_ptr()
    except RuntimeError:
        at = 0
    n = t.numel()
    return (at if at or not n else object()), n


def held_tensor_addresses(*roots: object, skip: tuple[type, ...] = ()) -> tuple[tuple[object, int], ...]:
    """``(data_ptr, numel)`` of every tensor held by ``roots`` (see the module docstring), in the order of a
    depth-first walk: two walks of objects holding the same tensors at the same addresses give equal tuples, and a
    tensor freed and made again elsewhere, or of another size, changes the result.

    Example:
        >>> w = torch.zeros(3)
        >>> held_tensor_addresses([w, {"b": w}]) == ((w.data_ptr(), 3), (w.data_ptr(), 3))
        True
    """
    out: list[tuple[object, int]] = []
    seen: set[int] = set()
    stack: list[object] = list(reversed(roots))
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            out.append(_address(obj))
            continue
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        elif isinstance(obj, dict):
            stack.extend(reversed(list(obj.values())))
        elif inspect.ismethod(obj):
            stack.append(obj.__self__)
        elif isinstance(obj, nn.Module):
            found: list[object] = []
            for module in obj.modules():
                seen.add(id(module))
                attributes = module.__dict__
                found.extend(p for p in attributes["_parameters"].values() if p is not None)
                found.extend(b for b in attributes["_buffers"].values() if b is not None)
                found.extend(v for v in attributes.values() if _entered_attribute(type(v)))
            stack.extend(reversed(found))
        elif _own(obj) and hasattr(obj, "__dict__"):
            stack.extend(reversed(list(vars(obj).values())))
    return tuple(out)
