"""The decode step's Triton kernels compiled for a GPU on any machine, no GPU needed: registers, spills, shared
memory and the machine code's size and hash, per kernel at the shapes the rollout benchmarks decode.

What it answers without a GPU: whether a kernel change keeps a kernel under its register cap
(:data:`ppo_core_decode.decode_rotary_attention.MAX_REGISTERS`) without spilling (``local_bytes`` 0), and whether a
refactor of a kernel's source leaves its machine code unchanged (the same ``sass_sha``: the same instructions, so the
same speed). It does not time anything: a changed hash says the code moved, and the GPU benchmarks say by how much.

How: Triton's compiler runs for the target (``--arch``, default 90: Hopper) behind a stand-in driver, and each
kernel launch of the public functions (:func:`~ppo_core_decode.decode_linear.decode_linear`,
:func:`~ppo_core_decode.decode_rotary_attention.rotate_write_attend_triton`, ...) becomes a compile-only warm-up, with
CPU tensors of the decode shapes standing in for the device's. The arguments the functions choose from the device
are set as they are on a Hopper GPU: programmatic dependent launch on, 132 SMs
(:func:`~ppo_core_decode.split_launch.sm_count` off CUDA). Each case reports the last kernel its call compiled;
``cuobjdump`` and ``nvdisasm`` (shipped with Triton's NVIDIA backend) read the binary.

Needs Triton with its NVIDIA backend (``pip install triton``; the CPU torch wheel does not bring it).
Usage: ``python benchmarks/kernel_resources.py [--families qwen3,llama] [--arch 90] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks.rollout_families import FAMILIES

ROWS = 64
"""Rows a decode step (``B``), as the rollout benchmarks decode."""
CACHE_SLOTS, SLOT = 384, 320
"""The cache's slots and the step's slot (a 256-token prompt 64 tokens into its response)."""


@contextlib.contextmanager
def offline_compiler(arch: int) -> Iterator[list[Any]]:
    """Within the block, every Triton launch compiles for ``sm_<arch>`` instead of running; yields the list the
    compiled kernels are appended to (``CompiledKernel``: ``asm["cubin"]``, ``metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _Offline(DriverBase):
        """The few calls Triton's launcher makes of a driver before it compiles; nothing here can launch."""

        @staticmethod
        def is_active() -> bool:
            return False

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, index: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_device_interface(self) -> Any:
            return torch.cuda

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_benchmarker(self) -> Any:
            raise RuntimeError("offline: nothing can run")

        def get_empty_cache_for_benchmark(self) -> Any:
            raise RuntimeError("offline: nothing can run")

        def clear_cache(self, cache: Any) -> None:
            pass

    compiled: list[Any] = []
    saved, saved_driver = JITFunction.__getitem__, driver._active  # None where no driver was made yet

    def compile_only(self: Any, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append(kernel)
            return kernel

        return launch

    driver.set_active(_Offline())
    JITFunction.__getitem__ = compile_only
    try:
        yield compiled
    finally:
        JITFunction.__getitem__ = saved
        driver._active = saved_driver


@contextlib.contextmanager
def hopper_choices() -> Iterator[None]:
    """The decode modules choose as on a Hopper GPU though their tensors are on the CPU: PDL on, the products'
    kernels available (they check for CUDA)."""
    import ppo_core_decode.decode_linear as linear
    import ppo_core_decode.decode_rotary_attention as fused

    saved = (linear.pdl_enabled, fused.pdl_enabled, linear.decode_linear_available)
    linear.pdl_enabled = fused.pdl_enabled = lambda device: True
    linear.decode_linear_available = lambda x, weight: True
    try:
        yield
    finally:
        linear.pdl_enabled, fused.pdl_enabled, linear.decode_linear_available = saved


def triton_tools() -> Path:
    """The folder of ``cuobjdump`` and ``nvdisasm`` in Triton's NVIDIA backend (Triton must be importable)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def machine_code(kernel: Any, tools: Path) -> dict[str, Any]:
    """Resources of one compiled kernel, read from its binary."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [str(tools / "cuobjdump"), "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [str(tools / "nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True
        )
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {kernel.metadata.name}:\n{usage}")
    # the instructions without their addresses: the hash is the same wherever the code is placed
    body = [
        line.split("*/", 1)[1].strip()
        for line in sass.stdout.splitlines()
        if re.match(r"\s*/\*[0-9a-f]+\*/", line)
    ]
    return {
        "kernel": kernel.metadata.name,
        "num_warps": kernel.metadata.num_warps,
        "num_stages": kernel.metadata.num_stages,
        "registers": int(found[1]),
        "stack_bytes": int(found[2]),
        "local_bytes": int(found[4]),
        "shared_bytes": int(found[3]) + kernel.metadata.shared,
        "sass_instructions": len(body),
        "sass_sha": hashlib.sha1("\n".join(body).encode()).hexdigest()[:12],
    }


def cases(family: str, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The kernels of one decode step of ``family`` (a name of ``rollout_families.FAMILIES``), each a call of the
    public function as the engine's decode step makes it (:class:`ppo_core_decode.decoder_loop.DecoderLayerLoop`)."""
    from ppo_core_decode.decode_attention import decode_attention_triton
    from ppo_core_decode.decode_linear import decode_linear
    from ppo_core_decode.decode_rotary import rotate_and_write_triton
    from ppo_core_decode.decode_rotary_attention import rotate_write_attend_triton

    _, cfg = FAMILIES[family]
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", hidden // heads)
    b = ROWS

    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt)

    h, x = empty(b, hidden), empty(b, hidden)
    sumsq = empty(1, b, dt=torch.float32)
    q, k, v = empty(b, heads, 1, d), empty(b, groups, 1, d), empty(b, groups, 1, d)
    cos, sin = empty(b, d), empty(b, d)
    keys, values = empty(b, groups, CACHE_SLOTS, d), empty(b, groups, CACHE_SLOTS, d)
    slot = torch.tensor(SLOT)
    bias = empty(b, 1, 1, CACHE_SLOTS, dt=torch.float32)
    norms = (empty(d), empty(d), 1e-6) if family == "qwen3" else None
    attend = dict(model_rounding=True, qk_norm=norms)
    return {
        "qkv_product": lambda: decode_linear(x, empty((heads + 2 * groups) * d, hidden), sumsq=sumsq),
        "attention_one_launch": lambda: rotate_write_attend_triton(
            q, k, v, cos, sin, keys, values, slot, bias, **attend
        ),
        "attention_one_launch_split4": lambda: rotate_write_attend_triton(
            q, k, v, cos, sin, keys, values, slot, bias, split=4, **attend
        ),
        "rotate_and_write": lambda: rotate_and_write_triton(q, k, v, cos, sin, keys, values, slot, **attend),
        "attention_two_launch": lambda: decode_attention_triton(q, keys, values, bias, filled=slot + 1),
        "out_product": lambda: decode_linear(empty(b, heads * d), empty(hidden, heads * d), residual=h),
        "gate_up_product": lambda: decode_linear(x, empty(2 * inner, hidden), sumsq=sumsq, swiglu=True),
        "down_product": lambda: decode_linear(empty(b, inner), empty(hidden, inner), residual=h),
        "vocabulary_product": lambda: decode_linear(x, empty(cfg["vocab_size"], hidden), sumsq=sumsq),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="qwen3,llama", help="names of rollout_families.FAMILIES")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("compiles for a GPU: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    try:
        import triton
    except ImportError:
        parser.error("needs Triton with its NVIDIA backend: pip install triton")
    tools = triton_tools()
    if not (tools / "cuobjdump").exists():
        parser.error(f"needs Triton's NVIDIA backend (no {tools / 'cuobjdump'})")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    dtype = getattr(torch, args.dtype)
    result: dict[str, Any] = {}
    with offline_compiler(args.arch) as compiled, hopper_choices():
        for family in families:
            result[family] = {}
            for name, call in cases(family, dtype).items():
                compiled.clear()
                call()
                result[family][name] = machine_code(compiled[-1], tools)
    return emit(
        {
            "benchmark": "kernel_resources",
            "arch": f"sm_{args.arch}",
            "triton": triton.__version__,
            "dtype": args.dtype,
            "rows": ROWS,
            "cache_slots": CACHE_SLOTS,
            "slot": SLOT,
            "results": result,
        },
        args.out,
        device_name=f"offline compile for sm_{args.arch} (no GPU)",
    )


if __name__ == "__main__":
    main()
