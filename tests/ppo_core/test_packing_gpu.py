"""GPU tests of padding-free micro-batches: the packed attention kernels (``varlen``, ``flex``) against the per-document
SDPA reference in bf16, forward and backward; ``MegatronActorWorker`` packed vs padded (bf16: log-probs within bf16
tolerance; fp32: losses and fp32 main gradients within 1e-3 relative; token-budget micro-batches leave the summed
gradient unchanged); the Hugging Face torch engine packed vs padded in bf16.

Run on one GPU: ``pytest -m gpu tests/ppo_core/test_packing_gpu.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from _packing import mixed_batch, predicted  # noqa: E402

from ppo_core.kernels.packed_attention import (  # noqa: E402
    PackedDocuments,
    packed_causal_attention,
    varlen_available,
)
from ppo_core.keys import KEYS  # noqa: E402

CUDA = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----- kernels ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["varlen", "flex", "auto"])
def test_packed_attention_kernels_match_the_reference_in_bf16(backend: str) -> None:
    probe = torch.zeros(1, 1, 8, device=CUDA, dtype=torch.bfloat16)
    if backend in ("varlen", "auto") and not varlen_available(probe):
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    seqlens = [1, 17, 300, 64, 1000, 5, 611, 128]
    docs = PackedDocuments.from_seqlens(seqlens, CUDA)
    t, heads, groups, d = sum(seqlens), 8, 2, 64
    g = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (
        torch.randn(t, n, d, device=CUDA, generator=g, dtype=torch.bfloat16).requires_grad_()
        for n in (heads, groups, groups)
    )
    weight = torch.randn(t, heads, d, device=CUDA, generator=g)
    out = packed_causal_attention(q, k, v, docs, backend=backend)
    assert out.shape == (t, heads, d) and out.dtype == torch.bfloat16
    grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
    ref_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = packed_causal_attention(*ref_inputs, docs, backend="sdpa")
    ref_grads = torch.autograd.grad((ref * weight).sum(), ref_inputs)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert _rel(got, want) < 3e-2, name


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_packed_attention_kernels_keep_documents_apart(backend: str) -> None:
    probe = torch.zeros(1, 1, 8, device=CUDA, dtype=torch.bfloat16)
    if backend == "varlen" and not varlen_available(probe):
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    docs = PackedDocuments.from_seqlens([50, 200, 7], CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    q, k, v = (torch.randn(257, n, 64, device=CUDA, generator=g, dtype=torch.bfloat16) for n in (4, 4, 4))
    k2, v2 = k.clone(), v.clone()
    k2[:50] += 3
    v2[:50] -= 2
    a = packed_causal_attention(q, k, v, docs, backend=backend)
    b = packed_causal_attention(q, k2, v2, docs, backend=backend)
    assert torch.equal(a[50:], b[50:])
    assert not torch.equal(a[:50], b[:50])


# ----- megatron -----------------------------------------------------------------------------------------------
def _model(dtype: str) -> dict:
    return {
        "num_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 512,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "dtype": dtype,
    }


@pytest.fixture(scope="module")
def single_rank():
    pytest.importorskip("megatron.core")
    from ppo_core.workers.megatron import ParallelConfig, destroy_megatron_parallel, init_megatron_parallel

    init_megatron_parallel(ParallelConfig(), rank=0, world_size=1, device=CUDA)
    yield
    destroy_megatron_parallel()


def _actors(dtype: str, **extra) -> dict:
    """A packed and a padded ``MegatronActorWorker`` with the same weights."""
    from ppo_core.workers.base import worker_context
    from ppo_core.workers.megatron import MegatronActorWorker

    actors, weights = {}, None
    for packed in (True, False):
        cfg = {
            "model": _model(dtype),
            "ppo_mini_batch_size": 8,
            "use_reference": False,
            "use_remove_padding": packed,
            "optim": {"lr": 1e-4, "grad_clip": None},
            **extra,
        }
        with worker_context(rank=0, world_size=1):
            actor = MegatronActorWorker(cfg)
        if weights is None:
            weights = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in actor.engine.module.state_dict().items()
            }
        else:  # megatron's RNG tracker has moved on since the first model: give both the same weights
            actor.engine.module.load_state_dict(weights)
        assert actor.engine.packed == packed
        actors[packed] = actor
    return actors


def _main_grads(actor, batch, micros) -> tuple[float, dict[str, torch.Tensor]]:
    from ppo_core.workers._common import global_loss_denominators
    from ppo_core.workers.engine import OutputSpec
    from ppo_core.workers.ppo import actor_loss

    engine = actor.engine
    engine.train()
    agg = global_loss_denominators(
        batch[KEYS.response_mask], dp_size=1, loss_scale_factor=None, all_reduce_sum=engine.all_reduce_sum
    )
    loss_fn = functools.partial(actor_loss, config=actor.config, agg=agg, n_micro=len(micros))
    metrics = engine.forward_backward(micros, loss_fn, OutputSpec())
    loss = sum(float(m["actor/pg_loss"]) for m in metrics)
    grads = {n: p.main_grad.clone() for n, p in engine.module.named_parameters()}
    engine.zero_grad()
    return loss, grads


def _gpu_batch(seed: int = 0):
    return mixed_batch(rows=8, prompt=24, response=40, vocab=128, seed=seed)


def test_megatron_packed_log_probs_match_padded_in_bf16(single_rank) -> None:
    actors = _actors("bfloat16")
    batch = _gpu_batch()
    where = predicted(batch)
    a = actors[True].compute_log_prob(batch)
    b = actors[False].compute_log_prob(batch)
    for key in (KEYS.old_log_probs, KEYS.entropies):
        diff = (a[key] - b[key])[where].abs()
        assert float(diff.max()) < 0.1 and float(diff.mean()) < 1e-2, (
            key,
            float(diff.max()),
            float(diff.mean()),
        )
        assert a[key][~where].eq(0).all()
    cuda_batch = batch.to(CUDA)
    loss_a, grads_a = _main_grads(actors[True], cuda_batch, [cuda_batch[:4], cuda_batch[4:]])
    loss_b, grads_b = _main_grads(actors[False], cuda_batch, [cuda_batch[:4], cuda_batch[4:]])
    assert loss_a == pytest.approx(loss_b, rel=1e-2, abs=1e-3)
    total = _rel(
        torch.cat([g.flatten() for g in grads_a.values()]), torch.cat([g.flatten() for g in grads_b.values()])
    )
    assert total < 3e-2, total


def test_megatron_packed_losses_and_main_grads_match_padded_in_fp32(single_rank) -> None:
    actors = _actors("float32")
    batch = _gpu_batch(seed=1).to(CUDA)
    micros = [batch[:3], batch[3:]]
    loss_a, grads_a = _main_grads(actors[True], batch, micros)
    loss_b, grads_b = _main_grads(actors[False], batch, micros)
    assert loss_a == pytest.approx(loss_b, rel=1e-3)
    for name, g in grads_b.items():
        if float(g.norm()) > 1e-8:
            assert _rel(grads_a[name], g) < 1e-3, name


def test_megatron_token_budget_with_packing_keeps_the_summed_gradient(single_rank) -> None:
    from ppo_core.workers._common import split_micro_batches

    actor = _actors("float32", ppo_max_token_len_per_gpu=160)[True]
    batch = _gpu_batch(seed=2).to(CUDA)
    loss_a, grads_a = _main_grads(actor, batch, [batch])
    micros, _ = split_micro_batches(batch, rows=None, max_tokens=160)
    assert len(micros) > 1
    for m in micros:
        assert int(m[KEYS.attention_mask].sum()) <= 160 or m.batch_size[0] == 1
    loss_b, grads_b = _main_grads(actor, batch, micros)
    assert loss_b == pytest.approx(loss_a, rel=1e-4)
    for name, g in grads_a.items():
        if float(g.norm()) > 1e-8:
            assert _rel(grads_b[name], g) < 1e-3, name
    # and through update_actor with the budget in the config (old log-probs from the packed policy itself)
    update = _gpu_batch(seed=3)
    update[KEYS.old_log_probs] = actor.compute_log_prob(update)[KEYS.old_log_probs]
    metrics = actor.update_actor(update)
    assert metrics["actor/skipped_steps"] == 0.0
    assert abs(metrics["actor/ppo_kl"]) < 1e-4  # the first step starts at ratio 1


# ----- Hugging Face through the torch engine ------------------------------------------------------------------
def test_hf_torch_engine_packed_matches_padded_in_bf16(tmp_path) -> None:
    pytest.importorskip("transformers")
    from _hf import make_checkpoint

    from ppo_core.models.hf import load_causal_lm
    from ppo_core.workers.engine import LOG_PROBS, OutputSpec
    from ppo_core.workers.torch import TorchEngine

    path = make_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=128)
    lm = load_causal_lm(path, dtype=torch.bfloat16, device=CUDA)
    packed = TorchEngine(lm, device=CUDA, remove_padding=True)
    padded = TorchEngine(lm, device=CUDA, remove_padding=False)
    assert packed.packed and not padded.packed
    batch = _gpu_batch(seed=4).to(CUDA)
    (a,), (b,) = packed.forward([batch], OutputSpec()), padded.forward([batch], OutputSpec())
    where = predicted(batch)
    diff = (a[LOG_PROBS] - b[LOG_PROBS])[where].abs()
    assert float(diff.max()) < 0.1 and float(diff.mean()) < 1e-2
