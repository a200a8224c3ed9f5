"""When the decode kernels launch with programmatic dependent launch (:mod:`ppo_core_decode.pdl`)."""

from __future__ import annotations

import types

import pytest
import torch

from ppo_core_decode import pdl


def test_pdl_is_off_on_the_cpu_under_the_interpreter_and_when_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("PPO_CORE_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl, "_supported", lambda index: True)  # as on a Hopper GPU
    assert pdl.pdl_enabled(torch.device("cuda", 0))  # on by default
    monkeypatch.setenv("PPO_CORE_PDL", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("PPO_CORE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or pdl.tl is None, reason="needs CUDA and Triton")
def test_pdl_follows_the_compute_capability(monkeypatch) -> None:
    monkeypatch.delenv("PPO_CORE_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_enabled(torch.device("cuda")) == (hopper and hasattr(pdl.tl.extra.cuda, "gdc_wait"))


@pytest.mark.parametrize("on", [True, False])
def test_the_sampling_kernels_launch_with_pdl_where_it_is_on(monkeypatch, on) -> None:
    """Both sampling kernels (the blocks' statistics, then the combining draw) take part in PDL where it is on: each
    is compiled to wait for the kernel before it and launched with the attribute; elsewhere neither is. (The
    launches are recorded, not run: the kernels' results are the CUDA and interpreter tests' business.)"""
    from ppo_core_decode import fused_sampling as fs

    launches = []

    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, kw["PDL"], kw.get("launch_pdl", False)))

    stub = types.SimpleNamespace(
        cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << max(0, (n - 1).bit_length())
    )
    monkeypatch.setattr(fs, "triton", stub)
    monkeypatch.setattr(fs, "_sample_blocks", Kernel("blocks"), raising=False)
    monkeypatch.setattr(fs, "_sample_combine", Kernel("combine"), raising=False)
    monkeypatch.setattr(fs, "pdl_enabled", lambda device: on)
    logits = torch.zeros(2, 10)
    step, seed = torch.tensor(0), torch.tensor(3)
    fs.fused_sample(logits, None, 1.0, seed=seed, step=step)
    fs.fused_sample_record(
        logits,
        1.0,
        step=step,
        responses=torch.zeros(2, 3, dtype=torch.long),
        response_mask=torch.zeros(2, 3, dtype=torch.bool),
        log_probs=torch.zeros(2, 3),
        done=torch.zeros(2, dtype=torch.bool),
        last_tok=torch.zeros(2, dtype=torch.long),
        last_valid=torch.zeros(2, dtype=torch.bool),
        eos_token_id=None,
        pad_token_id=0,
        seed=seed,
    )
    assert launches == [("blocks", on, on), ("combine", on, on)] * 2
