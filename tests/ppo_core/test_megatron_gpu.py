"""GPU tests of the megatron-core workers: PPO end to end under Monarch, HF weights vs transformers, checkpoints.

megatron-core's optimizer and RNG tracker need CUDA, so the workers only run on a GPU.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core workers need CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]


def _digits_example():
    spec = importlib.util.spec_from_file_location("ppo_digits", ROOT / "examples" / "ppo_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_model(vocab: int) -> dict:
    return {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 128,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "dtype": "bfloat16",
    }


@pytest.mark.monarch
@pytest.mark.slow
def test_three_ppo_steps_of_the_digits_task_under_monarch(tmp_path):
    import ppo_core_monarch  # noqa: F401  (before monarch: fast failure detection)
    from ppo_core.trainer import BasePPOTrainer
    from ppo_core.workers import WorkerSpec
    from ppo_core.workers.megatron import MegatronActorWorker, MegatronCriticWorker
    from ppo_core_monarch import MonarchConfig
    from ppo_core_monarch.group import MonarchWorkerGroup

    ex = _digits_example()
    common = {
        "seed": 0,
        "ppo_epochs": 2,
        "ppo_mini_batch_size": 16,
        "micro_batch_size": 8,
        "model": _tiny_model(ex.VOCAB),
    }
    config = {
        "data": {"train_batch_size": 32, "seed": 0},
        "rollout": {"n": 1},
        "algorithm": {
            "adv_estimator": "gae",
            "gamma": 1.0,
            "lam": 1.0,
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.001},
        },
        "actor": {
            "worker": {
                **common,
                "optim": {"lr": 1e-4, "weight_decay": 0.0, "grad_clip": 1.0},
                "rollout": {
                    "max_new_tokens": ex.RESPONSE_LEN,
                    "eos_token_id": ex.EOS,
                    "pad_token_id": ex.PAD,
                },
                "policy_loss": {"loss_mode": "vanilla", "clip_ratio": 0.2},
            }
        },
        "critic": {"worker": {**common, "optim": {"lr": 1e-4, "weight_decay": 0.0}}},
        "trainer": {
            "total_training_steps": 3,
            "total_epochs": 100,
            "test_freq": 0,
            "save_freq": 0,
            "resume_mode": "disable",
            "seed": 0,
            "log_dir": str(tmp_path),
            "default_local_dir": str(tmp_path / "ckpt"),
            "loggers": ("jsonl",),
        },
    }
    mc = MonarchConfig(ready_timeout_s=300.0, call_timeout_s=300.0)

    class Trainer(BasePPOTrainer):
        def init_workers(self) -> None:
            cfg = self.config
            self.actor_wg = MonarchWorkerGroup(
                WorkerSpec(MegatronActorWorker, kwargs={"config": cfg.actor.worker}),
                procs_per_host=1,
                config=mc,
            )
            self.critic_wg = MonarchWorkerGroup(
                WorkerSpec(MegatronCriticWorker, kwargs={"config": cfg.critic.worker}),
                procs_per_host=1,
                config=mc,
            )

    data = ex.make_dataset(96, torch.Generator().manual_seed(0))
    trainer = Trainer(config, train_dataset=data, reward_fn=ex.digit_sum_reward, pad_token_id=ex.PAD)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    print({k: v for k, v in metrics.items() if "actor" in k or "critic" in k or "kl" in k})
    assert trainer.global_steps == 3
    for name in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
        assert math.isfinite(metrics[name]), name
    assert abs(metrics["actor/ppo_kl"]) < 0.05
    kls = [v for k, v in metrics.items() if "kl" in k and isinstance(v, float)]
    assert kls and all(math.isfinite(v) and abs(v) < 0.5 for v in kls), kls


@pytest.fixture(scope="module")
def single_rank():
    from ppo_core.workers.megatron import ParallelConfig, destroy_megatron_parallel, init_megatron_parallel

    init_megatron_parallel(ParallelConfig(), rank=0, world_size=1, device=torch.device("cuda", 0))
    yield
    destroy_megatron_parallel()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_checkpoint_gives_the_logits_of_transformers(single_rank, tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from ppo_core.workers.megatron import (
        MegatronModelConfig,
        ParallelConfig,
        build_gpt_model,
        load_hf_checkpoint,
    )

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    if family == "llama":
        hf_cfg = transformers.LlamaConfig(**common)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen2Config(**common)
        hf = transformers.Qwen2ForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = MegatronModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=300,
        max_position_embeddings=64,
        dtype="float32",
        qkv_bias=family == "qwen2",
        norm_epsilon=1e-6,
    )
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, str(tmp_path), cfg)
    hf = hf.cuda().float().eval()
    ids = torch.randint(0, 300, (2, 12), device="cuda")
    pos = torch.arange(12, device="cuda").expand(2, 12)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., :300]
        ref = hf(input_ids=ids).logits
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-3, float(rel)


def test_actor_checkpoint_round_trip_and_log_probs_match_full_vocab(single_rank, tmp_path):
    from tensordict import TensorDict

    from ppo_core.logprobs import logprobs_from_logits
    from ppo_core.workers.base import worker_context
    from ppo_core.workers.megatron import MegatronActorWorker

    cfg = {
        "model": {**_tiny_model(50), "dtype": "float32"},
        "ppo_mini_batch_size": 4,
        "micro_batch_size": 2,
        "rollout": {"max_new_tokens": 5},
        "optim": {"lr": 1e-3},
    }
    with worker_context(rank=0, world_size=1):
        actor = MegatronActorWorker(cfg)
    prompts = TensorDict(
        {
            "input_ids": torch.randint(1, 50, (4, 3)),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]]),
        },
        [4],
    )
    batch = actor.generate_sequences(prompts).cpu()
    scored = actor.compute_log_prob(batch).cpu()
    # reference: full-vocabulary log-probs of the same forward pass
    mask = batch["attention_mask"].cuda()
    from ppo_core.workers.megatron.workers import megatron_attention_mask, position_ids

    with torch.no_grad():
        logits = actor.engine.module(
            batch["input_ids"].cuda(), position_ids(mask), megatron_attention_mask(mask)
        )
    ref = logprobs_from_logits(logits[:, -6:-1, :50], batch["responses"].cuda()).cpu()
    torch.testing.assert_close(scored["old_log_probs"], ref, rtol=1e-4, atol=1e-4)
    batch.update(scored)
    batch["advantages"] = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    actor.update_actor(batch)
    actor.save_checkpoint(str(tmp_path))
    first = actor.update_actor(batch)
    actor.load_checkpoint(str(tmp_path))
    again = actor.update_actor(batch)
    assert first["actor/pg_loss"] == pytest.approx(again["actor/pg_loss"], rel=1e-5, abs=1e-6)
    assert first["actor/grad_norm"] == pytest.approx(again["actor/grad_norm"], rel=1e-4)
    assert all(math.isfinite(v) for v in first.values())
    actor.engine.optimizer.zero_grad()


def test_distributed_optimizer_steps_like_the_plain_one(single_rank):
    from tensordict import TensorDict

    from ppo_core.workers.base import worker_context
    from ppo_core.workers.megatron import MegatronCriticWorker

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (4, 8), generator=g)
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones(4, 8, dtype=torch.long),
            "responses": ids[:, 3:],
            "response_mask": torch.ones(4, 5),
            "values": torch.zeros(4, 5),
            "returns": torch.randn(4, 5, generator=g),
        },
        [4],
    )
    losses = {}
    for dist_opt in (False, True):
        cfg = {
            "model": {**_tiny_model(50), "dtype": "float32"},
            "ppo_mini_batch_size": 4,
            "use_distributed_optimizer": dist_opt,
            "optim": {"lr": 1e-3},
        }
        with worker_context(rank=0, world_size=1):
            critic = MegatronCriticWorker(cfg)
        losses[dist_opt] = [critic.update_critic(batch)["critic/vf_loss"] for _ in range(3)]
    # the first step is identical; later ones agree to 1% (not bitwise: see the report of issue 7)
    assert losses[False][0] == pytest.approx(losses[True][0], rel=1e-6)
    assert losses[False] == pytest.approx(losses[True], rel=1e-2)
    assert losses[False][2] < losses[False][0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_compiled_norm_and_rotary_match_fp64_references_forward_and_backward():
    from ppo_core.workers.megatron.fused import apply_rotary, rms_norm, rotary_tables

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 2, 1024, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(1024, device="cuda", generator=g)).bfloat16().requires_grad_()
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.rms_norm(x64, (1024,), w64, 1e-5)
    assert _rel(y, ref) < 1e-2
    gy = torch.randn_like(y)
    y.backward(gy)
    ref.backward(gy.double())
    assert _rel(x.grad, x64.grad) < 1e-2 and _rel(w.grad, w64.grad) < 1e-2

    q = torch.randn(256, 2, 8, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(256, 2, 2, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    cos, sin = rotary_tables(256, 64, 5e5, "cuda")
    rq, rk = apply_rotary(q, k, cos, sin)
    cos64, sin64 = cos.double(), sin.double()

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos64 + torch.cat((-t2, t1), -1) * sin64

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    assert _rel(rq, rot(q64)) < 1e-2 and _rel(rk, rot(k64)) < 1e-2
    (rq.float().square().sum() + rk.float().sum()).backward()
    (rot(q64).square().sum() + rot(k64).sum()).backward()
    assert _rel(q.grad, q64.grad) < 1e-2 and _rel(k.grad, k64.grad) < 1e-2


def test_weight_gradient_accumulates_into_fp32_main_grad_at_full_size():
    from ppo_core.workers.megatron.linear import _fp32_accumulating_mm, accumulate_weight_grad

    assert _fp32_accumulating_mm(torch.device("cuda", torch.cuda.current_device()))
    g = torch.Generator(device="cuda").manual_seed(1)
    grad_out = torch.randn(8192, 1024, device="cuda", generator=g).bfloat16()
    inputs = torch.randn(8192, 2048, device="cuda", generator=g).bfloat16()
    main = torch.randn(1024, 2048, device="cuda", generator=g)
    expected = main.double() + grad_out.double().t() @ inputs.double()
    accumulate_weight_grad(main, grad_out, inputs)
    assert _rel(main, expected) < 1e-5


def test_fused_and_unfused_models_agree_on_log_probs_main_grads_and_norm(single_rank):
    """fused_kernels=True (main-grad linears, compiled SwiGLU / residual adds) computes megatron's numbers: the same
    log-probs, the same fp32 main gradients over two micro-batches, and our gradient norm is megatron's."""
    from functools import partial

    from tensordict import TensorDict

    from ppo_core.workers._common import global_loss_denominators, split_rows
    from ppo_core.workers.base import worker_context
    from ppo_core.workers.engine import OutputSpec
    from ppo_core.workers.megatron import MegatronActorWorker
    from ppo_core.workers.megatron.optim import grad_norm
    from ppo_core.workers.objectives import actor_loss

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (4, 12), generator=g)
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones(4, 12, dtype=torch.long),
            "responses": ids[:, 4:],
            "response_mask": torch.ones(4, 8, dtype=torch.long),
            "old_log_probs": -torch.rand(4, 8, generator=g) * 3,
            "advantages": torch.randn(4, 8, generator=g),
        },
        [4],
    ).cuda()
    results, weights = {}, None
    for fused in (True, False):
        cfg = {
            "model": {**_tiny_model(50), "dtype": "float32", "fused_kernels": fused},
            "ppo_mini_batch_size": 4,
            "micro_batch_size": 2,
            "use_reference": False,
            "shuffle": False,
            "optim": {"lr": 1e-3, "grad_clip": 1e-3},  # the clip is active
        }
        with worker_context(rank=0, world_size=1):
            actor = MegatronActorWorker(cfg)
        engine = actor.engine
        if weights is None:
            weights = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in engine.module.state_dict().items()
            }
        else:  # megatron's RNG tracker has moved on since the first model: give both the same weights
            engine.module.load_state_dict(weights)
        log_probs = actor.compute_log_prob(batch)["old_log_probs"]
        engine.train()
        agg = global_loss_denominators(
            batch["response_mask"], dp_size=1, loss_scale_factor=None, all_reduce_sum=engine.all_reduce_sum
        )
        loss_fn = partial(actor_loss, config=actor.config, agg=agg, n_micro=2)
        engine.forward_backward(split_rows(batch, 2), loss_fn, OutputSpec())
        grads = {n: p.main_grad.clone() for n, p in engine.module.named_parameters()}
        assert all(p.grad is None for p in engine.module.parameters())  # nothing left for the DDP hook
        engine.optimizer.prepare_grads()
        norm = grad_norm(engine.optimizer)
        assert norm == pytest.approx(float(engine.optimizer.get_grad_norm()), rel=1e-6)
        engine.zero_grad()
        metrics = actor.update_actor(batch)
        assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
        results[fused] = (log_probs, grads, metrics)
    (lp_f, grads_f, m_f), (lp_u, grads_u, m_u) = results[True], results[False]
    torch.testing.assert_close(lp_f, lp_u, rtol=1e-5, atol=1e-5)
    for name, ref in grads_u.items():
        assert _rel(grads_f[name], ref) < 1e-4, name
    assert m_f["actor/pg_loss"] == pytest.approx(m_u["actor/pg_loss"], rel=1e-5, abs=1e-7)
