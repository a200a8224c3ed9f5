"""The torch workers never skip or waste an optimizer step silently: a non-finite gradient skips the step, counts
in ``*/skipped_steps`` and warns; an exactly zero gradient counts in ``*/zero_grad_steps`` and warns once per
update, naming the role."""

from __future__ import annotations

import logging

import pytest
import torch
from _tiny_lm import EOS, LM, VALUE_MODEL
from tensordict import TensorDict

from ppo_core.keys import KEYS
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker

_WORKER = {"device": "cpu", "ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}}


def _scored_batch(actor: TorchActorWorker, rows: int = 4) -> TensorDict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, EOS, (rows, 3), generator=g)
    batch = actor.generate_sequences(
        TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [rows])
    )
    batch.update(actor.compute_log_prob(batch))
    batch[KEYS.advantages] = torch.randn(batch[KEYS.responses].shape, generator=g)
    return batch


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _unchanged(module: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(module.parameters(), before, strict=True))


def test_nan_gradient_skips_every_step_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    actor = TorchActorWorker(LM, {**_WORKER, "rollout": {"max_new_tokens": 3, "eos_token_id": EOS}})
    batch = _scored_batch(actor)
    first = next(actor.module.parameters())
    first.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = _params(actor.module)
    with caplog.at_level(logging.WARNING, logger="ppo_core.workers.ppo"):
        metrics = actor.update_actor(batch)
    assert (metrics["actor/skipped_steps"], metrics["actor/zero_grad_steps"]) == (2.0, 0.0)
    assert _unchanged(actor.module, before)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("update_actor skipped an optimizer step" in m for m in messages)


def test_zero_gradients_are_counted_and_warned_for_actor_and_critic(caplog: pytest.LogCaptureFixture) -> None:
    actor = TorchActorWorker(LM, {**_WORKER, "rollout": {"max_new_tokens": 3, "eos_token_id": EOS}})
    batch = _scored_batch(actor)
    batch[KEYS.advantages] = torch.zeros_like(batch[KEYS.advantages])
    critic = TorchCriticWorker(VALUE_MODEL, _WORKER)
    batch.update(critic.compute_values(batch))
    batch[KEYS.returns] = batch[KEYS.values].clone()  # the values already are the targets
    before = _params(actor.module), _params(critic.module)
    with caplog.at_level(logging.WARNING, logger="ppo_core.workers.ppo"):
        actor_metrics, critic_metrics = actor.update_actor(batch), critic.update_critic(batch)
    assert actor_metrics["actor/zero_grad_steps"] == 2.0 and critic_metrics["critic/zero_grad_steps"] == 2.0
    assert _unchanged(actor.module, before[0]) and _unchanged(critic.module, before[1])
    actor_msg, critic_msg = (r.getMessage() for r in caplog.records)
    assert "update_actor: 2 of 2 optimizer step(s) of the actor had an exactly zero gradient" in actor_msg
    assert "update_critic: 2 of 2 optimizer step(s) of the critic" in critic_msg
