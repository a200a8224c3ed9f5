"""``benchmarks/kernel_resources.py`` compiles the decode kernels for Hopper without a GPU: where Triton is missing it
says so; where it is there, every kernel of a decode step compiles under its register cap without spilling."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from benchmarks import kernel_resources


def _nvidia_triton() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(_nvidia_triton(), reason="Triton with its NVIDIA backend is installed")
def test_without_triton_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kernel_resources.main([])
    assert "needs Triton" in capsys.readouterr().err


def test_under_the_interpreter_it_refuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit):
        kernel_resources.main([])
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.skipif(not _nvidia_triton(), reason="the family check comes after the Triton check")
def test_an_unknown_family_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kernel_resources.main(["--families", "gpt2"])
    assert "gpt2" in capsys.readouterr().err


@pytest.mark.skipif(not _nvidia_triton(), reason="needs Triton with its NVIDIA backend")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU")
def test_qwen3s_decode_kernels_compile_for_hopper_under_their_caps() -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ppo_core_decode.decode_rotary_attention import MAX_REGISTERS

    getitem, active = JITFunction.__getitem__, driver._active
    result = kernel_resources.main(["--families", "qwen3"])["results"]["qwen3"]
    assert JITFunction.__getitem__ is getitem and driver._active is active  # launches run again afterwards
    assert set(result) == set(kernel_resources.cases("qwen3", kernel_resources.torch.bfloat16))
    for name, kernel in result.items():
        assert kernel["local_bytes"] == 0 and kernel["stack_bytes"] == 0, name  # nothing spilled
        assert kernel["sass_instructions"] > 0, name
    for name in ("attention_one_launch", "attention_one_launch_split4"):
        assert result[name]["kernel"] == "_rotate_write_attend_kernel"
        assert result[name]["registers"] <= MAX_REGISTERS
    # the products of one shape class share their machine code; the SwiGLU epilogue is another program
    assert result["out_product"]["sass_sha"] == result["down_product"]["sass_sha"]
    assert result["gate_up_product"]["sass_sha"] != result["out_product"]["sass_sha"]


@pytest.mark.skipif(not _nvidia_triton(), reason="needs Triton with its NVIDIA backend")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU")
def test_every_decode_linear_launch_shape_compiles_for_hopper_with_its_prefetch() -> None:
    """The launch shapes a ``DecodeLinearConfig`` allows, at a weight small enough to be prefetched into the L2 before
    the wait (PDL on, as on an H100): ``K`` blocks narrower than a 128-byte line (16 and 32 entries) included, which
    the engines' defaults never pick. Each compiles without spilling."""
    import itertools

    import torch

    from ppo_core_decode.decode_linear import DecodeLinearConfig, decode_linear, prefetches_weight

    m, k, width = 5, 300, 40
    with kernel_resources.offline_compiler(90) as compiled, kernel_resources.hopper_choices():
        tools = kernel_resources.triton_tools()
        for block_k, split, swiglu in itertools.product((16, 32, 64, 128), (1, 2), (False, True)):
            weight = torch.empty(2 * width if swiglu else width, k, dtype=torch.bfloat16)
            assert prefetches_weight(weight)
            compiled.clear()
            decode_linear(
                torch.empty(m, k, dtype=torch.bfloat16),
                weight,
                sumsq=torch.empty(1, m),
                residual=None if swiglu else torch.empty(m, width, dtype=torch.bfloat16),
                swiglu=swiglu,
                config=DecodeLinearConfig(block_n=16, block_k=block_k, split_k=split),
            )
            code = kernel_resources.machine_code(compiled[-1], tools)
            assert code["local_bytes"] == 0 and code["sass_instructions"] > 0, (block_k, split, swiglu)


@pytest.mark.skipif(not _nvidia_triton(), reason="needs Triton with its NVIDIA backend")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU")
@pytest.mark.parametrize("width", [1024, 2048, 8192])
def test_the_prefills_norm_and_swiglu_move_16_byte_vectors(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill's RMSNorm and SwiGLU kernels (``ppo_core_decode.elementwise_launch``), compiled for Hopper at the
    model widths they see, load and store their rows as 16-byte vectors: a row width declared unspecialised (as the
    norm's was) leaves Triton unable to prove a masked vector aligned, and every element moves alone."""
    import re

    import torch

    import ppo_core_decode.batch_invariant as bi
    import ppo_core_decode.elementwise_launch as el

    rows = 4
    from ppo_core.kernels.triton_launch import DirectLauncher

    # CPU tensors take the Triton path as on a GPU (the offline compiler compiles it and launches nothing), through
    # launchers of their own (the modules' would launch a kernel they compiled for another width directly)
    monkeypatch.setattr(bi, "_interpreting", lambda: True)
    monkeypatch.setattr(el, "_interpreting", lambda: True)
    monkeypatch.setattr(bi, "_rms_norm_launch", DirectLauncher(bi._rms_norm_kernel))
    monkeypatch.setattr(el, "_silu_mul_launch", DirectLauncher(el._silu_mul_kernel))
    with kernel_resources.offline_compiler(90) as compiled:
        x = torch.zeros(rows, width, dtype=torch.bfloat16)
        el.rms_norm_launch(x, torch.ones(width, dtype=torch.bfloat16), 1e-6)
        el.rms_norm_launch(x, torch.ones(width, dtype=torch.bfloat16), 1e-6, delta=x, model_rounding=False)
        gate, up = torch.zeros(rows, 2 * width, dtype=torch.bfloat16).chunk(2, dim=-1)
        el.silu_mul_launch(gate, up)
    assert [k.name for k in compiled] == ["_rms_norm_kernel", "_rms_norm_kernel", "_silu_mul_kernel"]
    for kernel in compiled:
        ptx = kernel.asm["ptx"]
        loads, stores = re.findall(r"ld\.global[.\w]*", ptx), re.findall(r"st\.global[.\w]*", ptx)
        assert loads and stores, kernel.name
        assert all(".v4" in op for op in loads + stores), (kernel.name, sorted(set(loads + stores)))


@pytest.mark.skipif(not _nvidia_triton(), reason="needs Triton with its NVIDIA backend")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU")
@pytest.mark.parametrize("width", [1024, 2048])
def test_the_norm_weight_folds_move_16_byte_vectors(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation's norm-weight folds in one launch (``fold_norm_weights_all``), compiled for Hopper, move 16-byte
    vectors where every address is aligned and every width a multiple of 16: the addresses the kernel reads from
    its table carry no alignment Triton could see, and without the host's word every element moved alone."""
    import re

    import torch

    import ppo_core_decode.decode_linear as dl
    from ppo_core.kernels.triton_launch import DirectLauncher

    monkeypatch.setattr(dl, "_fold_pieces_launch", DirectLauncher(dl._fold_pieces_kernel))
    with kernel_resources.offline_compiler(90) as compiled:
        weights = [torch.zeros(n, width, dtype=torch.bfloat16) for n in (width, 256, 256)]
        out = torch.empty(width + 512, width, dtype=torch.bfloat16)
        dl._fold_pieces_triton([(out, torch.ones(width, dtype=torch.bfloat16), weights)])
    assert [k.name for k in compiled] == ["_fold_pieces_kernel"]
    ptx = compiled[0].asm["ptx"]
    # the table's addresses and sizes are 8-byte loads; the weight's loads and the output's stores are vectors
    loads = [op for op in re.findall(r"ld\.global[.\w]*", ptx) if op != "ld.global.b64"]
    stores = re.findall(r"st\.global[.\w]*", ptx)
    assert stores and all(".v4" in op for op in stores), sorted(set(stores))
    assert sum(".v4" in op for op in loads) >= 2, sorted(set(loads))
    assert len([op for op in loads if ".v4" not in op]) <= 1, sorted(
        set(loads)
    )  # the scale's may be narrower
