"""The cached direct launcher of the Triton scans (:mod:`ppo_core.kernels.triton_launch`).

On the CPU with stand-ins for Triton's ``JITFunction`` and ``CompiledKernel`` (what is cached, what is passed, when
the JIT launcher is used); where Triton is installed, against Triton's own specialisation code (equal launcher keys
mean equal specialisations) and, under ``TRITON_INTERPRET=1``, the real scans launched with every parameter
positionally as the compiled kernel is; on CUDA (``gpu``), the real compiled kernels: the direct path gives the JIT
path's outputs and flags bit for bit, misaligned inputs included.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import pytest
import torch

from ppo_core.kernels import triton_launch, triton_scan
from ppo_core.kernels.triton_launch import DirectLauncher

INTERPRET = triton_scan.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and triton_scan.is_available("cuda")


# ----- stand-ins for JITFunction and CompiledKernel ------------------------------------------------------------
@dataclass
class _Param:
    """The attributes of Triton's ``KernelParam`` the launcher reads."""

    name: str
    is_constexpr: bool = False
    do_not_specialize: bool = False
    do_not_specialize_on_alignment: bool = False
    default: object = None
    has_default: bool = False


class _Compiled:
    def __init__(self, log: list, error: Exception | None = None) -> None:
        self.log, self.error = log, error

    def __getitem__(self, grid):
        def runner(*args):
            if self.error is not None:
                raise self.error
            self.log.append(("direct", grid, args))

        return runner


@dataclass
class _Jit:
    """Records ``fn[grid](*args, **kwargs)`` and returns a new compiled stand-in (or ``returns``)."""

    params: list[_Param]
    log: list = field(default_factory=list)
    pre_run_hooks: list = field(default_factory=list)
    used_global_vals: dict = field(default_factory=dict)
    error: Exception | None = None
    returns: object = "compiled"
    __name__ = "fake_kernel"

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if self.error is not None:
                raise self.error
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log) if self.returns == "compiled" else self.returns

        return run


class _constexpr:  # what Triton's constexpr annotations are named
    pass


class _Interpreted:
    """The attributes of the interpreter's ``InterpretedFunction`` the launcher reads: no ``params``, the Python
    function and the declarations it was given."""

    def __init__(self, **declarations: object) -> None:
        self.kwargs, self.log = declarations, []

    @staticmethod
    def fn(x_ptr, n, BLOCK: _constexpr):
        pass

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))

        return run


def _kernel(**changes: _Param) -> _Jit:
    """``(x_ptr, out_ptr, n, scale, BLOCK: constexpr, FLAG: constexpr = False)``, declared as the launcher needs."""
    params = {
        "x_ptr": _Param("x_ptr", do_not_specialize_on_alignment=True),
        "out_ptr": _Param("out_ptr", do_not_specialize_on_alignment=True),
        "n": _Param("n", do_not_specialize=True),
        "scale": _Param("scale", do_not_specialize=True),
        "BLOCK": _Param("BLOCK", is_constexpr=True),
        "FLAG": _Param("FLAG", is_constexpr=True, default=False, has_default=True),
    }
    params.update(changes)
    return _Jit(list(params.values()))


@pytest.fixture
def compiled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers built in the test use compiled kernels (even in a TRITON_INTERPRET=1 run), on device 0, with no
    Triton hook or knob set."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_needs_jit_launcher", lambda: False)


def _args(dtype: torch.dtype = torch.float32, n: int = 10, scale: object = 0.5) -> tuple:
    return torch.zeros(8, dtype=dtype), torch.zeros(8, dtype=dtype), n, scale


@pytest.mark.usefixtures("compiled_mode")
def test_first_launch_compiles_then_the_compiled_kernel_is_called() -> None:
    fn = _kernel()
    launch = DirectLauncher(fn)
    args = _args()
    first = launch((4,), *args, BLOCK=128, num_warps=4, num_stages=2)
    assert len(fn.log) == 1 and fn.log[0][:2] == ("jit", (4,))
    assert all(a is b for a, b in zip(fn.log[0][2], args, strict=True))
    assert fn.log[0][3] == {"num_warps": 4, "num_stages": 2, "BLOCK": 128}
    # other tensors, other integers in the i32 range (1 and multiples of 16 included): the same compiled kernel
    for n in (1, 16, 17):
        x, out = torch.ones(8), torch.ones(8)[1:]  # a misaligned view too
        assert launch((4, 2), x, out, n, 0.25, BLOCK=128, num_warps=4, num_stages=2) is first
        kind, grid, args = fn.log[-1]
        assert (kind, grid) == ("direct", (4, 2, 1))
        # every parameter in signature order, FLAG's default included
        assert args[0] is x and args[1] is out and args[2:] == (n, 0.25, 128, False)
    launch((3,), *_args(), BLOCK=128, FLAG=True, num_warps=4, num_stages=2)
    launch((3,), *_args(), BLOCK=128, FLAG=True, num_warps=4, num_stages=2)
    assert fn.log[-1][:2] == ("direct", (3, 1, 1)) and fn.log[-1][2][-2:] == (128, True)
    assert (launch.jit_launches, launch.direct_launches) == (2, 4)


@pytest.mark.usefixtures("compiled_mode")
@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"args": _args(dtype=torch.float64)}, id="dtype"),
        pytest.param({"args": _args(n=2**31)}, id="i64"),
        pytest.param({"args": _args(n=-(2**31) - 1)}, id="negative-i64"),
        pytest.param({"args": _args(n=2**63)}, id="u64"),
        pytest.param({"args": _args(scale=1)}, id="int-for-float"),
        pytest.param({"args": _args(scale=True)}, id="bool-for-float"),
        pytest.param({"constexprs": {"BLOCK": 256}}, id="constexpr-value"),
        # an equal value of another type: Triton keys on str(value)
        pytest.param({"constexprs": {"BLOCK": 128.0}}, id="constexpr-type"),
        pytest.param({"constexprs": {"BLOCK": 128, "FLAG": True}}, id="constexpr-default-given"),
        pytest.param({"options": {"num_warps": 8, "num_stages": 2}}, id="num_warps"),
        pytest.param({"options": {"num_warps": 4, "num_stages": 3}}, id="num_stages"),
        pytest.param({"options": {"num_warps": 4}}, id="num_stages-default"),
        pytest.param({"device": 1}, id="device"),
    ],
)
def test_a_different_key_takes_the_jit_launcher(change: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    fn = _kernel()
    launch = DirectLauncher(fn)
    base = {"args": _args(), "constexprs": {"BLOCK": 128}, "options": {"num_warps": 4, "num_stages": 2}}
    launch((4,), *base["args"], **base["constexprs"], **base["options"])
    monkeypatch.setattr(triton_launch, "_current_device", lambda: change.get("device", 0))
    call = {**base, **change}
    launch((4,), *call["args"], **call["constexprs"], **call["options"])
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]
    launch((4,), *call["args"], **call["constexprs"], **call["options"])
    assert fn.log[-1][0] == "direct"


@pytest.mark.usefixtures("compiled_mode")
def test_a_failing_direct_launch_falls_back_for_good(caplog: pytest.LogCaptureFixture) -> None:
    fn = _kernel()
    launch = DirectLauncher(fn)
    compiled = launch((4,), *_args(), BLOCK=128)
    # a failure of the call itself (the JIT launcher fails too) is the caller's: the direct path stays
    compiled.error, fn.error = AttributeError("no such API"), ValueError("bad call")
    with pytest.raises(ValueError, match="bad call"):
        launch((4,), *_args(), BLOCK=128)
    assert launch.direct
    fn.error = None
    with caplog.at_level(logging.WARNING, logger=triton_launch.__name__):
        launch((4,), *_args(), BLOCK=128)
        launch((4,), *_args(), BLOCK=128)
    assert not launch.direct
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "jit"]
    assert len(caplog.records) == 1 and "no such API" in caplog.records[0].getMessage()


@pytest.mark.usefixtures("compiled_mode")
def test_a_runtime_parameter_after_a_constexpr_is_refused_when_built() -> None:
    late = _Jit([_Param("BLOCK", is_constexpr=True), _Param("x_ptr", do_not_specialize_on_alignment=True)])
    with pytest.raises(ValueError, match="'x_ptr' follows a constexpr"):
        DirectLauncher(late)


@pytest.mark.usefixtures("compiled_mode")
@pytest.mark.parametrize(
    ("declaration", "same", "other"),
    [
        # undeclared: Triton specialises an int's value 1 and its divisibility by 16
        pytest.param({}, [(16, 32), (17, 33)], [(1, 16), (16, 17), (1, 17)], id="undeclared"),
        # alignment unspecialised: the value 1 still is, divisibility by 16 is not
        pytest.param(
            {"do_not_specialize_on_alignment": True},
            [(16, 17), (2, 33)],
            [(1, 16), (1, 2)],
            id="no-alignment",
        ),
        # value unspecialised: neither is
        pytest.param({"do_not_specialize": True}, [(1, 16), (16, 17)], [(17, 2**31)], id="no-value"),
    ],
)
def test_an_int_parameter_is_keyed_on_what_triton_specialises(declaration, same, other) -> None:
    fn = _kernel(n=_Param("n", **declaration))
    x, out, _, scale = _args()
    for a, b in same:
        launch = DirectLauncher(fn)
        launch((4,), x, out, a, scale, BLOCK=128)
        launch((4,), x, out, b, scale, BLOCK=128)
        assert (launch.jit_launches, launch.direct_launches) == (1, 1), (declaration, a, b)
    for a, b in other:
        launch = DirectLauncher(fn)
        launch((4,), x, out, a, scale, BLOCK=128)
        launch((4,), x, out, b, scale, BLOCK=128)
        assert (launch.jit_launches, launch.direct_launches) == (2, 0), (declaration, a, b)


@pytest.mark.usefixtures("compiled_mode")
def test_an_undeclared_pointer_is_keyed_on_its_alignment() -> None:
    launch = DirectLauncher(_kernel(out_ptr=_Param("out_ptr")))
    x, out, n, scale = _args()
    buf = torch.zeros(12)
    launch((4,), x, buf[:8], n, scale, BLOCK=128)
    launch((4,), x, buf[4:], n, scale, BLOCK=128)  # 16 bytes on: aligned as well
    assert (launch.jit_launches, launch.direct_launches) == (1, 1)
    launch((4,), x, buf[1:], n, scale, BLOCK=128)  # 4 bytes on: another specialisation
    launch((4,), x, buf[1:9], n, scale, BLOCK=128)
    assert (launch.jit_launches, launch.direct_launches) == (2, 2)
    # a declared pointer is not: misaligned or not, one compiled kernel
    launch = DirectLauncher(_kernel())
    launch((4,), buf[:8], out, n, scale, BLOCK=128)
    launch((4,), buf[1:], out, n, scale, BLOCK=128)
    assert (launch.jit_launches, launch.direct_launches) == (1, 1)


@pytest.mark.usefixtures("compiled_mode")
def test_launch_options_are_passed_and_keyed() -> None:
    fn = _kernel()
    launch = DirectLauncher(fn)
    launch((4,), *_args(), BLOCK=128, launch_pdl=True, maxnreg=128)
    assert fn.log[-1][3] == {"BLOCK": 128, "launch_pdl": True, "maxnreg": 128}
    launch((4,), *_args(), BLOCK=128, launch_pdl=True, maxnreg=128)
    launch((4,), *_args(), BLOCK=128, maxnreg=128)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "jit"]


@pytest.mark.usefixtures("compiled_mode")
def test_calls_it_cannot_key_are_refused_before_launching() -> None:
    launch = DirectLauncher(_kernel())
    x, out, n, scale = _args()
    for bad in ((x, None, n, scale), (x, out, (n, n), scale), (x, out, n, torch.tensor(0.5).numpy())):
        with pytest.raises(TypeError, match="DirectLauncher takes tensors"):
            launch((4,), *bad, BLOCK=128)
    with pytest.raises(TypeError, match="neither constexpr parameters nor launch options"):
        launch((4,), x, out, n, scale, BLOCK=128, STRIDE=4)
    with pytest.raises(TypeError, match=r"missing constexpr arguments \['BLOCK'\]"):
        launch((4,), x, out, n, scale)
    with pytest.raises(TypeError, match="takes 4 runtime arguments, got 3"):
        launch((4,), x, out, n, BLOCK=128)
    assert launch.jit_launches == 0


@pytest.mark.usefixtures("compiled_mode")
def test_the_interpreter_always_takes_the_jit_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = _kernel()
    launch = DirectLauncher(fn)
    for _ in range(3):
        launch((4,), *_args(), BLOCK=128)
    assert not launch.direct and [entry[0] for entry in fn.log] == ["jit"] * 3

    interpreted = _Interpreted(do_not_specialize=["n"], do_not_specialize_on_alignment=[0])
    launch = DirectLauncher(interpreted)
    for _ in range(2):
        launch((2,), torch.zeros(2), 3, BLOCK=16)
    assert not launch.direct and [entry[0] for entry in interpreted.log] == ["jit"] * 2


@pytest.mark.usefixtures("compiled_mode")
def test_hooks_and_callable_grids_take_the_jit_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    fn = _kernel()
    launch = DirectLauncher(fn)
    launch((4,), *_args(), BLOCK=128)
    launch(lambda meta: (4,), *_args(), BLOCK=128)
    fn.pre_run_hooks.append(lambda *args, **kwargs: None)
    launch((4,), *_args(), BLOCK=128)
    fn.pre_run_hooks.clear()
    monkeypatch.setattr(triton_launch, "_needs_jit_launcher", lambda: True)  # a profiler's launch hook
    launch((4,), *_args(), BLOCK=128)
    monkeypatch.setattr(triton_launch, "_needs_jit_launcher", lambda: False)
    launch((4,), *_args(), BLOCK=128)
    assert [entry[0] for entry in fn.log] == ["jit"] * 4 + ["direct"]
    assert launch.direct


@pytest.mark.skipif(triton_scan.triton is None, reason="needs Triton")
def test_tritons_launch_hooks_and_debug_are_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    assert not triton_launch._needs_jit_launcher()

    def hook(*args: object) -> None:
        pass

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain (Triton >= 3.6)
        chain.add(hook)
        try:
            assert triton_launch._needs_jit_launcher()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert triton_launch._needs_jit_launcher()
        monkeypatch.undo()
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert triton_launch._needs_jit_launcher()


@pytest.mark.usefixtures("compiled_mode")
def test_uncompiled_results_are_not_cached() -> None:
    fn = _kernel()
    fn.returns = None  # a jit_cache_hook that skipped the compile, or an asynchronous compile's future
    launch = DirectLauncher(fn)
    launch((4,), *_args(), BLOCK=128)
    launch((4,), *_args(), BLOCK=128)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"] and launch.direct


@pytest.mark.usefixtures("compiled_mode")
def test_a_changed_global_takes_the_jit_launcher_as_triton_checks_it() -> None:
    """A kernel that read a module constant launches directly while the constant holds the value it was compiled
    with; once it changes, every launch goes to Triton's launcher (which raises its error)."""
    scope = {"SCALE": 2}
    fn = _kernel()
    fn.used_global_vals = {("SCALE", 0): (2, scope)}
    launch = DirectLauncher(fn)
    for _ in range(3):
        launch((4,), *_args(), BLOCK=128)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "direct"]
    scope["SCALE"] = 3
    launch((4,), *_args(), BLOCK=128)
    del scope["SCALE"]
    launch((4,), *_args(), BLOCK=128)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "direct", "jit", "jit"] and launch.direct


# ----- against Triton's own specialisation (Triton installed, no GPU needed) -----------------------------------
def _scan_kernels() -> dict:
    return {k: getattr(triton_scan, k) for k in ("_gae_kernel", "_return_kernel", "_whiten_kernel")}


def _as_jit_function(kernel, declared: bool = True):
    """A ``JITFunction`` of the scan kernel's Python function with its declarations (or none), interpreted or not."""
    from triton.runtime import jit

    if hasattr(kernel, "kwargs"):  # InterpretedFunction
        decl = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    else:
        decl = {k: getattr(kernel, k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    # a new JITFunction registers itself under the kernel's name: leave Triton's registry as it was
    registry = getattr(jit, "_triton_jit_function_registry", {})
    saved = dict(registry)
    try:
        return jit.JITFunction(kernel.fn, **(decl if declared else {}))
    finally:
        registry.clear()
        registry.update(saved)


@pytest.mark.skipif(triton_scan.triton is None, reason="needs Triton")
def test_equal_launcher_keys_mean_equal_triton_specialisations() -> None:
    """Triton's binder (``specialize_impl`` for every argument) over aligned and misaligned tensors, row counts and
    lengths of 1, 16 and 17, float32 and float64: whenever the launcher's key parts are equal, so is Triton's
    specialisation, for the scan kernel as declared and with its declarations removed (keyed then on values and
    alignment too, so with more keys)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    kernel = _scan_kernels()["_gae_kernel"]
    constexprs = {"WITH_RETURNS": True, "CHECKED": True, "STATS": False, "ACC": triton_scan.tl.float32}
    constexprs |= {"BLOCK_B": 1, "BLOCK_T": 128}
    jit_functions = {declared: _as_jit_function(kernel, declared) for declared in (True, False)}
    binders = {
        declared: create_function_from_signature(jf.signature, jf.params, BaseBackend)
        for declared, jf in jit_functions.items()
    }
    launchers = {declared: DirectLauncher(jf) for declared, jf in jit_functions.items()}
    seen: dict[bool, dict] = {True: {}, False: {}}
    for dtype in (torch.float32, torch.float64):
        for offset in (0, 1):
            buf = torch.zeros(64 + offset, dtype=dtype)[offset:]
            mask = torch.zeros(64 + offset, dtype=torch.uint8)[offset:]
            flag = torch.zeros(4 + offset, dtype=torch.int32)[offset:]
            for n_rows in (1, 16, 17):
                for length in (1, 16, 17, 2**31):
                    args = (buf, buf, mask, buf, buf, flag, buf, n_rows, length, 0.99, 0.9405)
                    for declared, binder in binders.items():
                        key = (launchers[declared].key_parts(args), tuple(constexprs.items()))
                        _, spec, _ = binder(*args, **constexprs)
                        seen[declared].setdefault(key, set()).add(str(spec))
    assert len(seen[True]) == 4  # two dtypes times i32/i64 lengths
    for declared in (True, False):
        assert all(len(specs) == 1 for specs in seen[declared].values()), seen[declared]
    assert len(seen[False]) > len(seen[True])  # undeclared: the alignments and the values 1 and 16 count
    # the kinds alone (the key of a declared kernel) would merge the undeclared kernel's specialisations
    merged: dict = {}
    for specs_by_key in seen[False].items():
        (parts, _), specs = specs_by_key
        merged.setdefault(tuple(p if not isinstance(p, tuple) else p[0] for p in parts), set()).update(specs)
    assert any(len(specs) > 1 for specs in merged.values())
    for kernel in _scan_kernels().values():
        DirectLauncher(_as_jit_function(kernel))  # a real JITFunction's params pass the check


# ----- the real scans, every parameter positional (as the compiled kernel takes them) --------------------------
def _bits(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        return x
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` one element past an allocation's start (not 16-byte aligned)."""
    buf = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    buf[1:].copy_(x.reshape(-1))
    return buf[1:].view(x.shape)


def _case(
    batch: int, length: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, length, generator=gen)
    v = torch.randn(batch, length, generator=gen)
    m = torch.rand(batch, length, generator=gen) < 0.8
    b = torch.randn(batch, generator=gen)
    if seed % 2:  # a non-finite reward and value at valid positions: flags set
        m[0, 0] = True
        r[0, 0], v[0, 0] = float("nan"), float("inf")
    return r.to(device, dtype), v.to(device, dtype), m.to(device), b.to(device, dtype)


def _outputs(r, v, m, b, flags=None) -> list[torch.Tensor]:
    """Every output of every scan entry point (flag words included), cloned."""
    outs = [
        *triton_scan.gae_returns_checked_triton(r, v, m, 0.99, 0.95, flags=flags),
        *triton_scan.gae_returns_checked_triton(r, v, m, 0.99, 0.95, whiten=True),
        *triton_scan.return_advantages_checked_triton(r, m, 0.99, whiten=True),
        *triton_scan.return_advantages_checked_triton(r, m, 1.0, baselines=b),
        *triton_scan.gae_scan_triton(r, v, m, 0.9, 1.0, with_returns=True),
        triton_scan.discounted_return_scan_triton(r, m, 0.5),
    ]
    return [x.clone() for x in outs]


def _assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), i


def _launchers() -> list[DirectLauncher]:
    return [triton_scan._gae_launcher, triton_scan._return_launcher, triton_scan._whiten_launcher]


def _jit_launches() -> int:
    return sum(launch.jit_launches for launch in _launchers())


def _direct_launches() -> int:
    return sum(launch.direct_launches for launch in _launchers())


def _check_direct_equals_jit(device: str, shapes, dtypes) -> None:
    """For each case: the JIT path's outputs, then the direct path's (a second call, all launches direct), then
    the same inputs (and flag words) misaligned (direct too: the same compiled kernels), all bit for bit equal."""
    assert all(launch.direct for launch in _launchers()), (
        "a launcher gave the direct path up (see its warning)"
    )
    for seed, (shape, dtype) in enumerate((s, d) for s in shapes for d in dtypes):
        r, v, m, b = _case(*shape, dtype, device, seed)
        programs = shape[0]  # the default launch: one row per program
        for launch in _launchers():
            launch.direct = False
        try:
            want = _outputs(r, v, m, b, flags=torch.zeros(programs, dtype=torch.int32, device=device))
        finally:
            for launch in _launchers():
                launch.direct = True
        _outputs(r, v, m, b)  # compiles (or finds) the kernels of this case for the direct path
        jit, direct = _jit_launches(), _direct_launches()
        _assert_same_bits(
            _outputs(r, v, m, b, flags=torch.zeros(programs, dtype=torch.int32, device=device)), want
        )
        assert _jit_launches() == jit and _direct_launches() > direct, (shape, dtype)
        flags = _misaligned(torch.zeros(programs, dtype=torch.int32, device=device))
        odd = [_misaligned(x) for x in (r, v, m, b)]
        assert all(x.data_ptr() % 16 for x in (*odd, flags))
        _assert_same_bits(_outputs(*odd, flags=flags), want)
        assert _jit_launches() == jit, (shape, dtype)


class _PositionalInterpreted:
    """Stands in for a scan's ``JITFunction`` and ``CompiledKernel`` under the interpreter: Triton's launcher binds
    keyword arguments, the compiled kernel takes every parameter positionally; both run the interpreted kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.params = kernel, _as_jit_function(kernel).params
        self.__name__ = kernel.__name__
        self.positional_launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.positional_launches += not kwargs
            self.kernel[grid](*args, **kwargs)
            return self

        return launch


@pytest.mark.usefixtures("compiled_mode")
@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1")
def test_scans_launched_positionally_match_the_jit_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path's argument list (runtime arguments, then the constexprs in signature order) drives the real
    scans as Triton's launcher does; the interpreter stands in for the compiled kernels."""
    shims = {name: _PositionalInterpreted(kernel) for name, kernel in _scan_kernels().items()}
    for name in ("_gae", "_return", "_whiten"):
        monkeypatch.setattr(triton_scan, f"{name}_launcher", DirectLauncher(shims[f"{name}_kernel"]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_direct_equals_jit("cpu", [(1, 37), (5, 37)], [torch.float32, torch.float64])
    assert all(shim.positional_launches > 0 for shim in shims.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_direct_launches_match_the_jit_launcher_on_cuda() -> None:
    shapes = [(1, 37), (17, 37), (17, 300), (1, 1), (4, 1024), (3, 5000)]
    _check_direct_equals_jit("cuda", shapes, [torch.float32, torch.float64, torch.bfloat16])
