"""A cached direct launcher for one ``@triton.jit`` kernel: after the first launch of a configuration, the compiled
kernel is called directly (``compiled[grid](*params)``, the form of Triton's fused-softmax tutorial), skipping the
binding, specialisation and cache key that Triton's launcher (``kernel[grid](...)``) redoes at every call.

Reusing a compiled kernel is only safe if every call that reuses it would have been given the same kernel by Triton.
What Triton specialises a kernel on (Triton 3.9: ``triton/runtime/jit.py``, and ``native_specialize_impl``, the
C++ of ``python/src/specialize.cc``, probed on the CPU):

- a constexpr parameter: its value, as ``str(value)`` (jit.py:409-410, 618), so ``True``, ``1`` and ``1.0`` differ;
- any other parameter: ``specialize_impl(arg, is_const, specialize, align)`` with ``specialize`` false for the
  parameters in ``do_not_specialize`` and ``align`` false for those in ``do_not_specialize_on_alignment``
  (jit.py:411-415, 810-811). By the type of the argument:

  - ``int``: ``i32``, ``i64`` or ``u64`` by its range; without ``do_not_specialize`` also the value 1 (made a
    constexpr) and, without ``do_not_specialize_on_alignment`` either, divisibility by 16;
  - ``torch.Tensor`` (and anything else with a ``data_ptr``): ``*`` and its dtype; with neither declaration also
    whether ``data_ptr()`` is a multiple of 16;
  - ``bool``: ``u1``, ``float``: ``fp32``; never their values (an annotated parameter takes its annotation's type,
    jit.py:416-425);
  - ``None``: a constexpr; a tuple: each item recursively *with* value and alignment specialisation whatever the
    declarations say; constexprs, JIT functions and tensor descriptors: constexpr or descriptor types; anything
    else (numpy scalars, ``int`` subclasses) is refused;

- the options: the keyword arguments (``num_warps``, ``num_stages``, ...) with ``debug``, the instrumentation mode
  and the fpsan flag read from ``triton.knobs`` at every launch (jit.py:733-736), and a stages-inspection hook
  (jit.py:753);
- the device: one cache per current device (jit.py:739, 746).

The JIT launcher also runs ``pre_run_hooks`` (jit.py:743), checks that the global variables the kernel read have not
changed (jit.py:769), accepts a callable grid, pads the grid to three dimensions and passes every parameter in
signature order, constexprs included (jit.py:778-788); ``CompiledKernel.__getitem__`` does the last part itself
(``triton/compiler/compiler.py:509-520``).

So the launcher keys its cache on what Triton specialises on: the current device; each runtime argument's dtype, or
its ``i32``/``i64``/``u64`` range, or its ``float``/``bool`` type, and, for a parameter whose value or alignment
Triton specialises (not declared in ``do_not_specialize`` / ``do_not_specialize_on_alignment``), those facts too:
whether an ``int`` is 1 and whether it is a multiple of 16, whether a tensor's ``data_ptr()`` is a multiple of 16;
each constexpr's name, type and value; and the launch options given (``num_warps``, ``num_stages``, ``maxnreg``,
``launch_pdl``, ...). Two calls with one key are two calls Triton gives one compiled kernel. A declared parameter
keeps the key short (fewer facts computed per launch); an undeclared one keeps Triton's alignment-aware code (a
kernel's vectorised loads need its pointers and row strides known to be multiples of 16). The launcher accepts only
tensors, ``int``, ``float`` and ``bool`` as runtime arguments (tuples and None specialise on values whatever the
declarations say: :class:`TypeError`). Everything else that shapes Triton's choice makes a launch take the JIT
launcher: a set launch hook (a profiler), a pre-run hook, a debug/instrumentation/fpsan knob, a stages-inspection
hook, a callable grid, ``TRITON_INTERPRET=1`` when the launcher is built (the interpreter has no compiled kernel), a
global variable the kernel read that no longer holds the value it was compiled with (checked before every direct
launch, as Triton's launcher checks it: the JIT launcher then raises Triton's error), and a compile that did not
return a kernel (asynchronous compilation). Knobs that Triton reads only when it compiles (``TRITON_F32_DEFAULT``,
fp fusion, the target arch) are outside its launcher's cache key too: they are not rechecked by either path.

Any exception from the direct path (an API this Triton version lacks) makes the launch retry through the JIT
launcher; if that succeeds the launcher uses the JIT launcher from then on and logs one warning (if it fails too, the
call was at fault: its error is raised and the direct path stays). In Triton 3.9 the direct call raises before the
kernel is enqueued (argument conversion, module loading) or when the launch itself fails (the launch hooks, which
run after it, take the JIT launcher anyway), so the retry does not run a kernel twice.

Thread safety: each launcher's cache is a dict, whose ``get`` and item assignment are atomic in CPython; two threads
missing the same key both take the JIT launcher and store equal entries. The launch counters are diagnostics and
may undercount under threads.

Usage (``kernel`` a ``@triton.jit`` function with its runtime parameters first, constexprs last)::

    launch = DirectLauncher(kernel)
    launch((programs,), x, out, n, BLOCK=1024, num_warps=4, num_stages=2)
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
except ImportError:  # optional: the launcher is only built where the kernels are
    triton = None

__all__ = ["DirectLauncher"]

logger = logging.getLogger(__name__)

_PAD = {1: (1, 1), 2: (1,), 3: ()}
_UNSET = object()


@dataclass(frozen=True)
class _Param:
    name: str
    constexpr: bool
    do_not_specialize: bool
    do_not_specialize_on_alignment: bool
    default: object = _UNSET


def _declared_params(fn: Any) -> list[_Param]:
    """The parameters of a ``JITFunction`` (its ``params``) or of the interpreter's ``InterpretedFunction`` (its
    Python function and the declarations it was given)."""
    if hasattr(fn, "params"):
        return [
            _Param(
                p.name,
                p.is_constexpr,
                p.do_not_specialize,
                p.do_not_specialize_on_alignment,
                p.default if p.has_default else _UNSET,
            )
            for p in fn.params
        ]
    if not callable(getattr(fn, "fn", None)):
        raise TypeError(f"DirectLauncher wraps a @triton.jit function, got {fn!r}")
    declared = getattr(fn, "kwargs", {})
    dns = declared.get("do_not_specialize") or ()
    dns_oa = declared.get("do_not_specialize_on_alignment") or ()
    params = []
    for i, p in enumerate(inspect.signature(fn.fn).parameters.values()):
        ann = p.annotation
        ann = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
        default = _UNSET if p.default is inspect.Parameter.empty else p.default
        params.append(
            _Param(
                p.name,
                "constexpr" in ann,
                i in dns or p.name in dns,
                i in dns_oa or p.name in dns_oa,
                default,
            )
        )
    return params


def _arg_kind(arg: object) -> object:
    """What Triton's type of ``arg`` depends on when its value and alignment are not specialised; None when the
    launcher does not take such an argument."""
    kind = type(arg)
    if kind is int:
        if -(2**31) <= arg < 2**31:
            return "i32"
        return "i64" if -(2**63) <= arg < 2**63 else "u64"
    if kind is float or kind is bool:
        return kind
    if isinstance(arg, torch.Tensor):
        return arg.dtype
    return None


def _arg_kind_and_value(arg: object) -> object:
    """:func:`_arg_kind` and, for an ``int``, whether it is 1 (a parameter declared in
    ``do_not_specialize_on_alignment`` alone: Triton specialises its value 1, not its divisibility)."""
    if type(arg) is int:
        return _arg_kind(arg), arg == 1
    return _arg_kind(arg)


def _arg_kind_value_and_alignment(arg: object) -> object:
    """:func:`_arg_kind` and, for an ``int``, whether it is 1 and whether it is a multiple of 16; for a tensor,
    whether its address is (an undeclared parameter: Triton specialises all three)."""
    if type(arg) is int:
        return _arg_kind(arg), arg == 1, arg % 16 == 0
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return _arg_kind(arg)


_OPTIONS = frozenset(
    {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid"}
)
"""The launch options a call may give besides the constexprs (compile options of Triton's NVIDIA backend, each
part of Triton's cache key and of this launcher's)."""


def _hook_set(hook: object) -> bool:
    # A callable (Triton <= 3.5) or a HookChain, set when it has calls (Triton >= 3.6)
    return hook is not None and bool(getattr(hook, "calls", True))


def _needs_jit_launcher() -> bool:
    """Whether a process-wide Triton setting shapes the launch or the compile key beyond the launcher's cache key."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return False
    runtime, compilation = knobs.runtime, knobs.compilation
    return bool(
        getattr(runtime, "debug", False)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
        or _hook_set(getattr(runtime, "launch_enter_hook", None))
        or _hook_set(getattr(runtime, "launch_exit_hook", None))
        or getattr(compilation, "instrumentation_mode", "")
        or getattr(compilation, "fpsan_homomorphic_casts", False)
    )


def _current_device() -> int:
    # The device Triton's launcher keys its cache on (and the compiled kernel launches on).
    return triton.runtime.driver.active.get_current_device()


class DirectLauncher:
    """Launches ``fn`` through its compiled kernel once Triton's launcher has compiled it for the same key.

    Args:
        fn: a ``@triton.jit`` function whose runtime parameters come first and whose constexpr parameters come last.
            Declaring a parameter in ``do_not_specialize`` (scalars) or ``do_not_specialize_on_alignment``
            (pointers) shortens the key; an undeclared one is keyed on what Triton specialises it on.

    Raises:
        ValueError: a runtime parameter follows a constexpr parameter (named in the message).
    """

    def __init__(self, fn: Any) -> None:
        params = _declared_params(fn)
        runtime = [p for p in params if not p.constexpr]
        constexprs = [p for p in params if p.constexpr]
        late = [p.name for p in params[len(runtime) :] if not p.constexpr]
        if late:  # the runtime arguments are passed first, the constexprs appended after them
            raise ValueError(f"{_name(fn)}: runtime parameter {late[0]!r} follows a constexpr parameter")
        self._fn = fn
        self._runtime = tuple(runtime)
        self._constexprs = tuple(constexprs)
        self._constexpr_names = frozenset(p.name for p in constexprs)
        # per runtime parameter, the facts of its argument that Triton specialises on (see the module docstring)
        self._kinds = tuple(_kind_function(p) for p in runtime)
        self._cache: dict[tuple, tuple[Any, tuple]] = {}
        self.direct = os.environ.get("TRITON_INTERPRET") != "1" and hasattr(fn, "params")
        """Whether launches may skip Triton's launcher: False under the interpreter and after a fallback."""
        self.direct_launches = 0
        """Launches through the compiled kernel (a diagnostic)."""
        self.jit_launches = 0
        """Launches through Triton's launcher (a diagnostic)."""

    def key_parts(self, args: tuple) -> tuple:
        """The facts of the runtime arguments ``args`` the cache is keyed on, one per argument."""
        return tuple([kind(arg) for kind, arg in zip(self._kinds, args, strict=True)])

    def __call__(self, grid: tuple[int, ...], *args: object, **kwargs: object) -> Any:
        """Launch on ``grid`` with the runtime arguments ``args`` in signature order, the constexprs by name and
        the launch options (``num_warps``, ``num_stages``, ``maxnreg``, ``launch_pdl``...; those not given take
        Triton's defaults). Returns what Triton's launcher returns (the ``CompiledKernel``).

        Raises:
            TypeError: a runtime argument that is not a tensor, int, float or bool; a wrong number of them; a keyword
                that is neither a constexpr nor a launch option; a missing constexpr.
        """
        key = failure = None
        if (
            self.direct
            and type(grid) is tuple
            and len(grid) in _PAD
            and not getattr(self._fn, "pre_run_hooks", None)
            and not _needs_jit_launcher()
        ):
            try:
                key = (
                    _current_device(),
                    self.key_parts(args),
                    tuple(kwargs.items()),
                    tuple(map(type, kwargs.values())),
                )
                entry = self._cache.get(key)
                if entry is not None and self._globals_unchanged():
                    compiled, tail = entry
                    compiled[grid + _PAD[len(grid)]](*args, *tail)
                    self.direct_launches += 1
                    return compiled
            except Exception as error:
                # an API this Triton lacks, or a bad call: the JIT launcher below tells which
                key, failure = None, error
        tail = self._check(args, kwargs)
        kernel = self._fn[grid](*args, **kwargs)
        self.jit_launches += 1
        if failure is not None:
            self._stop(f"the direct launch failed ({failure!r})")
        elif key is not None and self.direct and kernel is not None and hasattr(type(kernel), "__getitem__"):
            self._cache[key] = (kernel, tail)
        return kernel

    def _globals_unchanged(self) -> bool:
        """Triton's check before every launch: the global variables the kernel read when it was compiled (module
        constants such as a ``tl.constexpr`` flag) still hold the values it read; where one changed, the JIT
        launcher raises its error."""
        used = getattr(self._fn, "used_global_vals", None)
        if not used:
            return True
        missing = _UNSET
        return all(scope.get(name, missing) == value for (name, _), (value, scope) in used.items())

    def _check(self, args: tuple, kwargs: dict[str, object]) -> tuple:
        """The constexprs in signature order, after checking that the call is one the launcher can key."""
        name = _name(self._fn)
        if len(args) != len(self._runtime):
            raise TypeError(f"{name} takes {len(self._runtime)} runtime arguments, got {len(args)}")
        for p, arg in zip(self._runtime, args, strict=True):
            if _arg_kind(arg) is None:
                raise TypeError(
                    f"{name}: argument {p.name!r} is a {type(arg).__name__}; DirectLauncher takes tensors, int, "
                    "float and bool (Triton specialises the others on their values)"
                )
        unknown = set(kwargs) - self._constexpr_names - _OPTIONS
        if unknown:
            raise TypeError(f"{name}: {sorted(unknown)} are neither constexpr parameters nor launch options")
        missing = [p.name for p in self._constexprs if p.name not in kwargs and p.default is _UNSET]
        if missing:
            raise TypeError(f"{name}: missing constexpr arguments {missing}")
        return tuple(kwargs.get(p.name, p.default) for p in self._constexprs)

    def _stop(self, why: str) -> None:
        self.direct = False
        logger.warning("%s: launching through Triton's launcher from now on: %s", _name(self._fn), why)


def _kind_function(p: _Param) -> Any:
    """The key part of parameter ``p``'s argument by its declarations: its kind alone where Triton specialises
    neither its value nor its alignment, more where it does."""
    if p.do_not_specialize:
        return _arg_kind
    if p.do_not_specialize_on_alignment:
        return _arg_kind_and_value
    return _arg_kind_value_and_alignment


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", repr(fn))
