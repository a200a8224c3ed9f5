"""The Hugging Face engine's element-wise kernels stay compiled through Qwen3 rollouts: the RMSNorm of the residual
stream, the last position and Qwen3's per-head query/key norms (views of other ranks, strides and sizes of 1) each
compile per shape class, so no compiled function reaches dynamo's recompile limit (past which it runs eagerly,
several kernels a call, inside every captured decode step).

Compiled on the CPU with the ``eager`` backend: dynamo's guards and recompiles are those of inductor on CUDA,
without code generation."""

from __future__ import annotations

import pytest
import torch

import ppo_core_decode.batch_invariant as batch_invariant
import ppo_core_decode.eager_rounding as eager_rounding
import ppo_core_decode.elementwise_launch as elementwise_launch
import ppo_core_decode.hf as hf
from ppo_core.kernels.compiled import cuda_compiled
from ppo_core.rollout import SamplingConfig

transformers = pytest.importorskip("transformers")

FUNCTIONS = (
    "rms_norm_as_model",
    "heads_rms_norm_as_model",
    "add_rms_norm_as_model",
    "rotary_as_model",
    "silu_mul_as_model",
)


def _compile_on_cpu(monkeypatch: pytest.MonkeyPatch, by_shape: bool) -> None:
    """The engine's element-wise functions compiled on the CPU (eager backend), per shape class or not."""
    for name in FUNCTIONS:
        fn = getattr(eager_rounding, name).__wrapped__
        compiled = cuda_compiled(fn, device_types=("cpu",), backend="eager", by_shape=by_shape)
        # the engine calls each from its forward or through elementwise_launch's engine_* functions (the norms by
        # batch_invariant's choice of the two functions of a rounding)
        users = [module for module in (hf, elementwise_launch, batch_invariant) if hasattr(module, name)]
        assert users, name
        for module in users:
            monkeypatch.setattr(module, name, compiled)


def _qwen3(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen3ForCausalLM(config).eval().to(dtype)


def _rollouts() -> int:
    """A worker's rollouts: a policy in fp32 and one in bf16 (weights that require grad, as in training), two
    batch sizes each; returns the graphs dynamo compiled."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for dtype in (torch.float32, torch.bfloat16):
        engine = hf.HFRolloutEngine(_qwen3(dtype))
        assert engine.fast_path
        for batch in (4, 6):
            prompts = torch.randint(3, 64, (batch, 9), generator=torch.Generator().manual_seed(batch))
            out = engine.generate(
                prompts,
                torch.ones_like(prompts),
                SamplingConfig(max_new_tokens=3, temperature=1.0),
                generator=torch.Generator().manual_seed(0),
            )
            assert out["responses"].shape == (batch, 3)
    return counters["stats"]["unique_graphs"] - before


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_qwen3_rollouts_never_reach_the_recompile_limit(
    fresh_dynamo, monkeypatch: pytest.MonkeyPatch
) -> None:
    _compile_on_cpu(monkeypatch, by_shape=True)
    # a margin below dynamo's default limit of 8: every shape class compiles at most 5 graphs
    strict = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=5)
    with strict:
        graphs = _rollouts()
    assert graphs > len(FUNCTIONS)  # it did compile, several classes


@pytest.mark.slow
def test_one_compiled_copy_per_grad_pattern_did_reach_it(
    fresh_dynamo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The regression this guards: compiled per grad mode and ``requires_grad`` pattern only, the norm reaches the
    limit (ranks 2, 3 and 4, sizes of 1, two dtypes and batch sizes in one code object)."""
    _compile_on_cpu(monkeypatch, by_shape=False)
    strict = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    with strict, pytest.raises(Exception, match=r"recompile_limit|recompile limit"):
        _rollouts()
