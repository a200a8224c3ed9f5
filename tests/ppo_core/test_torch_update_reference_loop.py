"""The torch workers' updates are bit-identical to a hand-written loop of the PPO update formula.

The loops below are the actor and critic updates written out in one function each (epochs of shuffled
mini-batches, micro-batches with the mini-batch's token and row counts as loss denominators, the actor loss
``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl``, gradient clipping, AdamW, the metrics summed over
micro-batches in float32 and averaged over steps). Parameters and metrics must match exactly (``torch.equal``,
``==``), not approximately: the workers are a refactoring of this formula, not a new numerical method.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from _tiny_lm import EOS, LM, VALUE_MODEL
from tensordict import TensorDict

from ppo_core.batch import iter_minibatches
from ppo_core.kl import kl_penalty
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.losses import agg_loss, compute_policy_loss, compute_value_loss
from ppo_core.masked import masked_mean
from ppo_core.workers.torch import TorchActorConfig, TorchActorWorker, TorchCriticConfig, TorchCriticWorker


def _adamw(module: torch.nn.Module, cfg: TorchActorConfig | TorchCriticConfig) -> torch.optim.AdamW:
    o = cfg.optim
    return torch.optim.AdamW(
        module.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )


def _denominators(mask: torch.Tensor) -> dict:
    return {
        "dp_size": 1,
        "batch_num_tokens": mask.sum().to(torch.float64),
        "global_batch_size": torch.tensor(float(mask.shape[0]), dtype=torch.float64),
        "loss_scale_factor": None,
    }


def _step(module: torch.nn.Module, opt: torch.optim.Optimizer, clip: float | None) -> float:
    params = [p for p in module.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf))
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def reference_update(module, batch: TensorDict, cfg, prefix: str, micro_loss) -> tuple[torch.nn.Module, dict]:
    """Epochs of shuffled mini-batches, micro-batches with the mini-batch's denominators, one clipped AdamW step
    per mini-batch; ``micro_loss(module, mb, agg, n_micro) -> (loss, {metric: share})``."""
    opt = _adamw(module, cfg)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    sums: dict[str, list[float]] = defaultdict(list)
    module.train()
    for mini in iter_minibatches(batch, cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle, shuffle):
        agg = _denominators(mini["response_mask"])
        step: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
        size = cfg.micro_batch_size or int(mini.batch_size[0])
        micros = [mini[i : i + size] for i in range(0, int(mini.batch_size[0]), size)]
        for mb in micros:
            loss, shares = micro_loss(module, mb, agg, len(micros))
            loss.backward()
            for name, value in shares.items():
                step[name] += value
        sums[f"{prefix}/grad_norm"].append(_step(module, opt, cfg.optim.grad_clip))
        for name, value in step.items():
            sums[name].append(float(value))
    metrics = {name: sum(v) / len(v) for name, v in sums.items()}
    zero = {f"{prefix}/skipped_steps": 0.0, f"{prefix}/zero_grad_steps": 0.0}
    return module, metrics | {f"{prefix}/lr": cfg.optim.lr} | zero


def reference_actor_update(batch: TensorDict, cfg: TorchActorConfig) -> tuple[torch.nn.Module, dict]:
    t = cfg.rollout.temperature or 1.0
    mode = cfg.policy_loss.loss_agg_mode

    def micro_loss(module, mb, agg, n_micro):
        mask, r = mb["response_mask"], mb["responses"].shape[1]
        logits = module(mb["input_ids"], attention_mask=mb["attention_mask"])[:, -r - 1 : -1] / t
        log_prob = logprobs_from_logits(logits, mb["responses"])
        pg_loss, pg_metrics = compute_policy_loss(
            mb["old_log_probs"], log_prob, mb["advantages"], mask, config=cfg.policy_loss, **agg
        )
        entropy = agg_loss(entropy_from_logits(logits), mask, mode, **agg)
        kl = agg_loss(kl_penalty(log_prob, mb["ref_log_probs"], cfg.kl_loss_type), mask, mode, **agg)
        loss = pg_loss - cfg.entropy_coeff * entropy + cfg.kl_loss_coef * kl
        shares = {"actor/pg_loss": pg_loss, "actor/update_entropy": entropy, "actor/kl_loss": kl}
        shares |= {f"actor/{name}": value / n_micro for name, value in pg_metrics.items()}
        return loss, {name: value.detach() for name, value in shares.items()}

    module, metrics = reference_update(LM(), batch, cfg, "actor", micro_loss)
    k1 = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], "kl")
    metrics["actor/ref_kl"] = float(masked_mean(k1, batch["response_mask"]))
    return module, metrics


def reference_critic_update(batch: TensorDict, cfg: TorchCriticConfig) -> tuple[torch.nn.Module, dict]:
    def micro_loss(module, mb, agg, n_micro):
        mask, r = mb["response_mask"], mb["responses"].shape[1]
        vpreds = module(mb["input_ids"], attention_mask=mb["attention_mask"])[:, -r - 1 : -1].float()
        vf_loss, clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, **agg
        )
        return vf_loss, {
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": clipfrac / n_micro,
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask) / n_micro,
        }

    return reference_update(VALUE_MODEL(), batch, cfg, "critic", micro_loss)


def _rollout(actor: TorchActorWorker, rows: int) -> TensorDict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, EOS, (rows, 3), generator=g)
    mask = (torch.arange(3)[None] >= torch.randint(0, 3, (rows, 1), generator=g)).long()
    batch = actor.generate_sequences(TensorDict({"input_ids": ids * mask, "attention_mask": mask}, [rows]))
    batch.update(actor.compute_log_prob(batch))
    batch.update(actor.compute_ref_log_prob(batch))
    batch["old_log_probs"] = batch["old_log_probs"] + 0.2 * torch.randn(batch["responses"].shape, generator=g)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g)
    batch["returns"] = torch.randn(batch["responses"].shape, generator=g)
    batch["values"] = 0.1 * torch.randn(batch["responses"].shape, generator=g)
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", [None, 2])
def test_torch_actor_update_is_bit_identical_to_the_reference_loop(mode: str, micro: int | None) -> None:
    config = {
        "device": "cpu",
        "ppo_mini_batch_size": 4,
        "micro_batch_size": micro,
        "ppo_epochs": 2,
        "shuffle": True,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "rollout": {"max_new_tokens": 4, "eos_token_id": EOS, "temperature": 0.8},
        "policy_loss": {"loss_agg_mode": mode},
        "optim": {"lr": 1e-2, "grad_clip": 0.5},
    }
    actor = TorchActorWorker(LM, config)
    batch = _rollout(actor, rows=8)
    want_module, want = reference_actor_update(batch, actor.config)
    got = actor.update_actor(batch)
    assert got == want
    for a, b in zip(actor.module.parameters(), want_module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("micro", [None, 3])
def test_torch_critic_update_is_bit_identical_to_the_reference_loop(micro: int | None) -> None:
    actor = TorchActorWorker(
        LM, {"device": "cpu", "ppo_mini_batch_size": 4, "rollout": {"max_new_tokens": 4}}
    )
    batch = _rollout(actor, rows=6)
    config = {"device": "cpu", "ppo_mini_batch_size": 3, "micro_batch_size": micro, "ppo_epochs": 2,
              "shuffle": True, "optim": {"lr": 1e-2, "grad_clip": 0.5}}  # fmt: skip
    critic = TorchCriticWorker(VALUE_MODEL, config)
    want_module, want = reference_critic_update(batch, critic.config)
    assert critic.update_critic(batch) == want
    for a, b in zip(critic.module.parameters(), want_module.parameters(), strict=True):
        assert torch.equal(a, b)
