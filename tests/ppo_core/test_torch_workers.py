"""Torch workers: log-probs/values alignment, PPO/critic updates, checkpoints, DDP (sampling: test_rollout.py)."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
from _tiny_lm import EOS, LM, VALUE_MODEL
from _tiny_lm import left_padded_prompts as _prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.backends.local import LocalWorkerGroup
from ppo_core.kl import kl_penalty
from ppo_core.losses import agg_loss, compute_policy_loss, compute_value_loss
from ppo_core.workers import WorkerSpec, worker_context
from ppo_core.workers.torch import TorchActorConfig, TorchActorWorker, TorchCriticWorker


def _actor(**overrides: object) -> TorchActorWorker:
    cfg = {
        "rollout": {"max_new_tokens": 4, "eos_token_id": EOS},
        "ppo_mini_batch_size": 4,
        "device": "cpu",
        **overrides,
    }
    return TorchActorWorker(LM, cfg)


def _rollout(actor: TorchActorWorker, seed: int = 0, batch: int = 4) -> TensorDict:
    out = actor.generate_sequences(_prompts(seed, batch))
    out.update(actor.compute_log_prob(out))
    out.update(actor.compute_ref_log_prob(out))
    g = torch.Generator().manual_seed(seed + 100)
    out["advantages"] = torch.randn(out["responses"].shape, generator=g)
    out["returns"] = torch.randn(out["responses"].shape, generator=g)
    return out


# ---------------------------------------------------------------------------------------------------- actor


def _reference_log_probs(lm: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """float64 loop: log p(responses[b, t]) from the logits at position P + t - 1."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = lm(batch["input_ids"], attention_mask=batch["attention_mask"]).double()
    out = torch.zeros(batch.batch_size[0], R, dtype=torch.float64)
    for b in range(out.shape[0]):
        for t in range(R):
            out[b, t] = logits[b, P + t - 1].log_softmax(-1)[batch["responses"][b, t]]
    return out


def test_log_probs_alignment_and_micro_batching() -> None:
    actor = _actor(forward_micro_batch_size=3)
    batch = _rollout(actor, batch=5)
    expected = _reference_log_probs(actor.module, batch)
    assert torch.allclose(batch["old_log_probs"].double(), expected, atol=1e-5)
    # the reference is a frozen copy of the initial policy
    assert torch.allclose(batch["ref_log_probs"], batch["old_log_probs"])
    assert all(not p.requires_grad for p in actor.ref_model.parameters())
    assert batch["entropies"].shape == batch["old_log_probs"].shape and (batch["entropies"] >= 0).all()


def test_temperature_scales_log_prob_logits() -> None:
    actor = _actor(rollout={"max_new_tokens": 3, "temperature": 0.5})
    batch = actor.generate_sequences(_prompts())
    lp = actor.compute_log_prob(batch)["old_log_probs"]
    P = batch["prompts"].shape[1]
    logits = actor.module(batch["input_ids"], attention_mask=batch["attention_mask"])[:, P - 1 : -1] / 0.5
    assert torch.allclose(
        lp, logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0], atol=1e-5
    )


def _capture_grads(worker: TorchActorWorker | TorchCriticWorker) -> list[list[torch.Tensor]]:
    """Replace the optimiser step by a recorder of the gradients it would apply."""
    steps: list[list[torch.Tensor]] = []
    worker.optimizer.step = lambda: steps.append([p.grad.clone() for p in worker.module.parameters()])
    return steps


def _manual_actor_grads(lm: torch.nn.Module, batch: TensorDict, cfg: TorchActorConfig) -> list[torch.Tensor]:
    lm = copy.deepcopy(lm)
    R = batch["responses"].shape[1]
    logits = lm(batch["input_ids"], attention_mask=batch["attention_mask"])[:, -R - 1 : -1]
    lp = logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    mask, mode = batch["response_mask"], cfg.policy_loss.loss_agg_mode
    loss, _ = compute_policy_loss(
        batch["old_log_probs"], lp, batch["advantages"], mask, config=cfg.policy_loss
    )
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, mode)
    if cfg.use_kl_loss:
        loss = loss + cfg.kl_loss_coef * agg_loss(
            kl_penalty(lp, batch["ref_log_probs"], cfg.kl_loss_type), mask, mode
        )
    loss.backward()
    return [p.grad for p in lm.parameters()]


@settings(max_examples=8)
@given(
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    micro=st.sampled_from([None, 1, 2, 3]),
    seed=st.integers(0, 1000),
)
def test_update_actor_gradient_equals_whole_minibatch_loss(mode: str, micro: int | None, seed: int) -> None:
    """Micro-batches with global denominators accumulate exactly the gradient of the mini-batch loss."""
    actor = _actor(
        micro_batch_size=micro,
        ppo_mini_batch_size=6,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        policy_loss={"loss_agg_mode": mode},
        optim={"grad_clip": None},
    )
    batch = _rollout(actor, seed=seed, batch=6)
    # make the update move away from the rollout policy so ratio/KL terms are not trivially 1/0
    batch["old_log_probs"] = batch["old_log_probs"] + 0.1 * batch["returns"]
    expected = _manual_actor_grads(actor.module, batch, actor.config)
    steps = _capture_grads(actor)
    metrics = actor.update_actor(batch)
    assert len(steps) == 1
    for got, want in zip(steps[0], expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert {
        "actor/pg_loss",
        "actor/update_entropy",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/ppo_kl",
    } <= set(metrics)


def test_update_actor_ignores_everything_on_masked_tokens() -> None:
    """NaN/garbage advantages, old log-probs and references on masked tokens (a fully masked row included) change
    neither the gradient nor the metrics."""
    kwargs = {
        "ppo_mini_batch_size": 4,
        "use_kl_loss": True,
        "entropy_coeff": 0.01,
        "optim": {"grad_clip": None},
    }
    clean_actor, dirty_actor = _actor(**kwargs), _actor(**kwargs)
    batch = _rollout(clean_actor, batch=4)
    batch["response_mask"][1] = 0
    dirty = batch.clone()
    masked = ~batch["response_mask"].bool()
    for key in ("advantages", "old_log_probs", "ref_log_probs"):
        dirty[key] = torch.where(masked, torch.tensor(float("nan")), dirty[key])
    clean_steps, dirty_steps = _capture_grads(clean_actor), _capture_grads(dirty_actor)
    clean_metrics, dirty_metrics = clean_actor.update_actor(batch), dirty_actor.update_actor(dirty)
    for got, want in zip(dirty_steps[0], clean_steps[0], strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    assert dirty_metrics == clean_metrics


def test_empty_batch_flows_through_every_method() -> None:
    actor = _actor(ppo_mini_batch_size=1)
    critic = TorchCriticWorker(VALUE_MODEL, {"ppo_mini_batch_size": 1, "device": "cpu"})
    batch = _rollout(actor, batch=0)
    assert batch["responses"].shape == (0, 4) and batch["old_log_probs"].shape == (0, 4)
    batch["values"] = critic.compute_values(batch)["values"]
    assert "actor/grad_norm" not in actor.update_actor(batch)  # no optimiser step on no data
    assert "critic/grad_norm" not in critic.update_critic(batch)


def test_update_actor_epochs_minibatches_and_clipping() -> None:
    actor = _actor(ppo_mini_batch_size=2, ppo_epochs=3, shuffle=True, optim={"grad_clip": 1e-3})
    batch = _rollout(actor, batch=4)
    steps = _capture_grads(actor)
    metrics = actor.update_actor(batch)
    assert len(steps) == 3 * 2
    for grads in steps:
        assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) <= 1e-3 * (1 + 1e-4)
    assert metrics["actor/grad_norm"] > 1e-3  # the metric is the norm before clipping
    with pytest.raises(ValueError, match="mini-batch"):
        _actor(ppo_mini_batch_size=3).update_actor(batch)
    with pytest.raises(ValueError, match="advantages"):
        actor.update_actor(batch.exclude("advantages"))


def test_update_actor_skips_non_finite_gradients() -> None:
    actor = _actor()
    batch = _rollout(actor)
    # the policy loss rejects NaN inputs (ValueError naming them), so make a gradient itself non-finite
    next(actor.module.parameters()).register_hook(lambda grad: torch.full_like(grad, float("nan")))
    before = [p.clone() for p in actor.module.parameters()]
    metrics = actor.update_actor(batch)
    assert metrics["actor/grad_norm"] != metrics["actor/grad_norm"]  # NaN reported
    assert all(torch.equal(a, b) for a, b in zip(before, actor.module.parameters(), strict=True))


def test_update_actor_raises_probability_of_advantaged_tokens() -> None:
    actor = _actor(optim={"lr": 1e-2}, ppo_epochs=4)
    batch = _rollout(actor, batch=4)
    batch["advantages"] = torch.where(batch["responses"] % 2 == 0, 1.0, -1.0)
    actor.update_actor(batch)
    new = actor.compute_log_prob(batch)["old_log_probs"]
    delta = (new - batch["old_log_probs"])[batch["response_mask"].bool()]
    sign = batch["advantages"][batch["response_mask"].bool()]
    assert (delta * sign).mean() > 0


def test_checkpoint_round_trip(tmp_path: pytest.TempPathFactory) -> None:
    actor = _actor(optim={"lr": 1e-2})
    batch = _rollout(actor)
    actor.update_actor(batch)
    actor.save_checkpoint(str(tmp_path / "actor"), 1)
    after_save = actor.generate_sequences(_prompts(5))["responses"]
    actor.update_actor(batch)
    fresh = _actor(optim={"lr": 1e-2})
    fresh.load_checkpoint(str(tmp_path / "actor"))
    assert torch.equal(fresh.generate_sequences(_prompts(5))["responses"], after_save)  # generator restored
    actor.load_checkpoint(str(tmp_path / "actor"))
    for a, b in zip(actor.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh.update_actor(batch) == actor.update_actor(batch)  # optimiser state restored
    with pytest.raises(ValueError, match="path"):
        fresh.load_checkpoint(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------------- critic


def test_critic_values_alignment_and_update() -> None:
    actor = _actor()
    critic = TorchCriticWorker(
        VALUE_MODEL, {"ppo_mini_batch_size": 4, "optim": {"lr": 1e-2}, "ppo_epochs": 4, "device": "cpu"}
    )
    batch = _rollout(actor)
    # perturb the value head so predictions are non-zero
    with torch.no_grad():
        critic.module.head.bias.fill_(0.3)
    values = critic.compute_values(batch)["values"]
    P = batch["prompts"].shape[1]
    full = critic.module(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.allclose(values, full[:, P - 1 : -1] * batch["response_mask"], atol=1e-6)
    batch["values"] = values
    mask = batch["response_mask"]
    loss_before, _ = compute_value_loss(values, batch["returns"], values, mask, None)
    for _ in range(5):
        metrics = critic.update_critic(batch)
    vpreds = critic.compute_values(batch)["values"]
    loss_after, _ = compute_value_loss(vpreds, batch["returns"], values, mask, None)
    assert loss_after < loss_before
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/vpred_mean"} <= set(metrics)


@pytest.mark.parametrize("micro", [1, 3])
def test_update_critic_gradient_equals_whole_minibatch_loss(micro: int) -> None:
    actor = _actor()
    critic = TorchCriticWorker(
        VALUE_MODEL,
        {"ppo_mini_batch_size": 6, "micro_batch_size": micro, "optim": {"grad_clip": None}, "device": "cpu"},
    )
    batch = _rollout(actor, batch=6)
    batch["values"] = critic.compute_values(batch)["values"] + 0.4
    ref = copy.deepcopy(critic.module)
    R = batch["responses"].shape[1]
    vpreds = ref(batch["input_ids"], attention_mask=batch["attention_mask"])[:, -R - 1 : -1]
    loss, _ = compute_value_loss(vpreds, batch["returns"], batch["values"], batch["response_mask"], 0.5)
    loss.backward()
    steps = _capture_grads(critic)
    critic.update_critic(batch)
    for got, want in zip(steps[0], [p.grad for p in ref.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_critic_rejects_multi_output_heads() -> None:
    critic = TorchCriticWorker(
        LM, {"ppo_mini_batch_size": 4, "device": "cpu"}
    )  # an LM head is not a value head
    with pytest.raises(ValueError, match="values"):
        critic.compute_values(_rollout(_actor()))


# ---------------------------------------------------------------------------------------------------- groups, DDP


def test_local_group_binds_worker_methods() -> None:
    spec = WorkerSpec(
        TorchActorWorker, (LM, {"rollout": {"max_new_tokens": 3}, "ppo_mini_batch_size": 4, "device": "cpu"})
    )
    with LocalWorkerGroup(spec) as wg:
        out = wg.generate_sequences(_prompts(), do_sample=False)
        out.update(wg.compute_log_prob(out))
        out["advantages"] = torch.ones_like(out["old_log_probs"])
        assert "actor/pg_loss" in wg.update_actor(out)


def test_simulated_ranks_without_process_group_raise() -> None:
    os.environ.pop("MASTER_ADDR", None)
    with pytest.raises(Exception, match="MASTER_ADDR"):
        LocalWorkerGroup(WorkerSpec(TorchActorWorker, (LM, {"ppo_mini_batch_size": 4})), world_size=2)


def _ddp_rank(rank: int, world_size: int, port: int, batch: TensorDict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with worker_context(rank=rank, world_size=world_size):
        actor = _actor(ppo_mini_batch_size=4, micro_batch_size=1, device="cpu")
    shard = batch[rank * 2 : rank * 2 + 2]
    metrics = actor.update_actor(shard)
    torch.save({"params": list(actor.module.parameters()), "metrics": metrics}, f"{out_dir}/{rank}.pt")
    # Leave without the interpreter's teardown: freeing DDP's reducer there can hang the rank for good (seen once
    # in CI: the gloo group's destructor joins its worker thread while holding the GIL, and the worker waits for the
    # GIL to free the last all-reduce's work). Every collective has completed and the results are on disk.
    os._exit(0)


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_rank(tmp_path: pytest.TempPathFactory) -> None:
    """Two gloo ranks with half the batch each take exactly the step of one rank on the whole batch."""
    single = _actor(ppo_mini_batch_size=4)
    batch = _rollout(single, batch=4)
    single.update_actor(batch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_ddp_rank, args=(2, port, batch, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for want, got0, got1 in zip(
        single.module.parameters(), results[0]["params"], results[1]["params"], strict=True
    ):
        assert torch.equal(got0, got1)
        assert torch.allclose(got0, want, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_workers_on_cuda_match_cpu_and_return_cpu_tensors() -> None:
    gpu = _actor(device="cuda", ppo_mini_batch_size=6)
    batch = _rollout(gpu, batch=6)
    assert all(batch[k].device.type == "cpu" for k in ("responses", "old_log_probs", "ref_log_probs"))
    cpu_lp = _actor(device="cpu").compute_log_prob(batch)["old_log_probs"]
    assert torch.allclose(batch["old_log_probs"], cpu_lp, atol=1e-4)
    assert torch.isfinite(torch.tensor(list(gpu.update_actor(batch).values()))).all()
    critic = TorchCriticWorker(VALUE_MODEL, {"ppo_mini_batch_size": 6, "device": "cuda"})
    batch["values"] = critic.compute_values(batch)["values"]
    assert batch["values"].device.type == "cpu"
    assert torch.isfinite(torch.tensor(list(critic.update_critic(batch).values()))).all()
