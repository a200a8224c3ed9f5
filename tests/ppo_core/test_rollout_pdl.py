"""When the decode kernels launch with programmatic dependent launch (:mod:`ppo_core.rollout.pdl`)."""

from __future__ import annotations

import pytest
import torch

from ppo_core.rollout import pdl


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
