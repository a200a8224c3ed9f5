"""``TorchActorWorker``: the actor, rollout and reference roles for any causal LM ``nn.Module``.

The model maps ``input_ids [B, S]`` (with ``attention_mask=``) to logits ``[B, S, V]`` (see
:mod:`ppo_core.workers.torch.sampling`). Batches are ``TensorDict``s with verl's keys: ``prompts [B, P]`` (left
padded), ``responses [B, R]``, ``input_ids``/``attention_mask [B, P+R]``, ``response_mask [B, R]`` and the
``[B, R]`` tensors ``old_log_probs``, ``ref_log_prob``, ``advantages``. Log-probabilities are aligned with the
response: position ``t`` is scored with the logits at ``P + t - 1``, divided by the rollout temperature.

Results of the ``DP_COMPUTE`` methods are returned on the CPU, whatever the worker's device. Group-callable
methods (``@register``): ``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob``
(``DP_COMPUTE``), ``update_actor`` (``DP_COMPUTE_METRIC``), ``save_checkpoint``/``load_checkpoint``
(``ONE_TO_ALL``). With ``world_size > 1`` every rank is a DDP replica (see
:mod:`ppo_core.workers.torch.distributed`).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.kl import kl_penalty
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.losses import agg_loss, compute_policy_loss
from ppo_core.masked import masked_mean
from ppo_core.workers.base import register
from ppo_core.workers.dispatch import Dispatch
from ppo_core.workers.torch._common import (
    ModelFactory,
    TorchWorkerBase,
    _check_keys,
    response_outputs,
    split_rows,
)
from ppo_core.workers.torch.config import TorchActorConfig
from ppo_core.workers.torch.distributed import maybe_no_sync
from ppo_core.workers.torch.sampling import generate

__all__ = ["TorchActorWorker"]

_UPDATE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages")


class TorchActorWorker(TorchWorkerBase):
    """Samples responses, scores them (policy and frozen reference) and runs the PPO policy update.

    Args:
        model_factory: zero-argument callable returning the policy ``nn.Module`` (called once per rank; it must be
            picklable for process backends, e.g. a module-level function or ``functools.partial``).
        config: a :class:`TorchActorConfig` or a dict of its fields.

    Example:
        >>> import functools
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> lm = functools.partial(TinyGPT, TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
        >>> actor = TorchActorWorker(lm, {"rollout": {"max_new_tokens": 3}, "ppo_mini_batch_size": 2})
        >>> prompts = TensorDict({"input_ids": torch.tensor([[0, 4], [3, 5]]),
        ...                       "attention_mask": torch.tensor([[0, 1], [1, 1]])}, batch_size=[2])
        >>> actor.generate_sequences(prompts)["responses"].shape
        torch.Size([2, 3])
    """

    def __init__(
        self, model_factory: ModelFactory, config: TorchActorConfig | Mapping[str, Any] | None = None
    ) -> None:
        if config is None or isinstance(config, Mapping):
            config = TorchActorConfig.from_dict(config)
        if not isinstance(config, TorchActorConfig):
            raise TypeError(f"config must be a TorchActorConfig or a dict, got {type(config).__name__}")
        super().__init__(model_factory, config, config.optim)
        self.config: TorchActorConfig = config
        self.ref_model = copy.deepcopy(self.module).requires_grad_(False) if config.use_reference else None

    def _temperature(self) -> float:
        t = self.config.rollout.temperature
        return t if t > 0 else 1.0

    def _response_logits(self, model: torch.nn.Module, batch: TensorDictBase) -> torch.Tensor:
        return response_outputs(model, batch) / self._temperature()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(
        self,
        batch: TensorDictBase,
        do_sample: bool = True,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> TensorDict:
        """Sample one response per prompt.

        Args:
            batch: ``input_ids [B, P]`` left-padded prompts and their ``attention_mask [B, P]``.
            do_sample: False decodes greedily (validation), whatever the configured temperature.
            temperature / top_p: override the configured values for this call.

        Returns:
            ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``response_mask`` (batch size ``[B]``).
        """
        _check_keys(batch, ("input_ids", "attention_mask"), "generate_sequences")
        cfg = self.config.rollout
        if not do_sample:
            temperature = 0.0
        overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        if overrides:
            cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides})
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        was_training = self.module.training
        self.module.eval()
        try:
            return generate(self.module, ids, mask, cfg, generator=self.generator).cpu()
        finally:
            self.module.train(was_training)

    @torch.no_grad()
    def _score(
        self, model: torch.nn.Module, batch: TensorDictBase, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        keys = ("input_ids", "attention_mask", "responses")
        _check_keys(batch, keys, "compute_log_prob")
        batch = batch.select(*keys).to(self.device)
        log_probs, entropys = [], []
        for micro in split_rows(batch, self.config.forward_micro_batch_size):
            logits = self._response_logits(model, micro)
            log_probs.append(logprobs_from_logits(logits, micro["responses"]))
            if with_entropy:
                entropys.append(entropy_from_logits(logits))
        out = {"log_probs": torch.cat(log_probs).cpu()}
        if with_entropy:
            out["entropys"] = torch.cat(entropys).cpu()
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``old_log_probs [B, R]`` and per-token ``entropys [B, R]`` of the responses under the current policy."""
        scored = self._score(self.module, batch, with_entropy=True)
        return TensorDict(
            {"old_log_probs": scored["log_probs"], "entropys": scored["entropys"]},
            batch_size=batch.batch_size,
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``ref_log_prob [B, R]``: log-probabilities of the responses under the frozen initial policy."""
        if self.ref_model is None:
            raise ValueError("compute_ref_log_prob needs a reference model; set use_reference=True")
        scored = self._score(self.ref_model, batch, with_entropy=False)
        return TensorDict({"ref_log_prob": scored["log_probs"]}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDictBase) -> dict[str, float]:
        """PPO policy update: ``ppo_epochs`` passes of mini-batches, each one optimiser step.

        The loss of a micro-batch is normalised by the token/row counts of the whole mini-batch over all dp ranks,
        so accumulating micro-batches and averaging over ranks gives the gradient of the mini-batch loss:
        ``loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl`` (entropy and KL aggregated with the
        policy loss's ``loss_agg_mode``).

        Args:
            batch: ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``, ``old_log_probs``,
                ``advantages`` (and ``ref_log_prob`` when ``use_kl_loss``).

        Returns:
            Means over optimiser steps: ``actor/pg_loss``, ``actor/ppo_kl``, ``actor/pg_clipfrac`` (and the
            other metrics of the policy loss), ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``,
            ``actor/lr``, and ``actor/ref_kl`` (mean ``old_log_probs - ref_log_prob`` over valid tokens) when the
            batch has ``ref_log_prob``.
        """
        cfg = self.config
        _check_keys(
            batch, (*_UPDATE_KEYS, "ref_log_prob") if cfg.use_kl_loss else _UPDATE_KEYS, "update_actor"
        )
        has_ref = "ref_log_prob" in batch
        batch = batch.select(*_UPDATE_KEYS, *(["ref_log_prob"] if has_ref else [])).to(self.device)
        mode = cfg.policy_loss.loss_agg_mode
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        for mini in self._minibatches(batch):
            agg = self._global_denominators(mini["response_mask"])
            step: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
            micros = split_rows(mini, cfg.micro_batch_size)
            for i, micro in enumerate(micros):
                mask = micro["response_mask"]
                with maybe_no_sync(self.model, skip_sync=i < len(micros) - 1):
                    logits = self._response_logits(self.model, micro)
                    log_prob = logprobs_from_logits(logits, micro["responses"])
                    pg_loss, pg_metrics = compute_policy_loss(
                        micro["old_log_probs"],
                        log_prob,
                        micro["advantages"],
                        mask,
                        config=cfg.policy_loss,
                        **agg,
                    )
                    loss = pg_loss
                    entropy = agg_loss(entropy_from_logits(logits), mask, mode, **agg)
                    if cfg.entropy_coeff:
                        loss = loss - cfg.entropy_coeff * entropy
                    if cfg.use_kl_loss:
                        kl = agg_loss(
                            kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type), mask, mode, **agg
                        )
                        loss = loss + cfg.kl_loss_coef * kl
                        step["actor/kl_loss"] += kl.detach()
                    loss.backward()
                # the micro-batch losses are shares of the mini-batch loss: they add up
                step["actor/pg_loss"] += pg_loss.detach()
                step["actor/entropy"] += entropy.detach()
                for name, value in pg_metrics.items():
                    step[f"actor/{name}"] += value.detach() / len(micros)
            sums["actor/grad_norm"].append(self._optimizer_step())
            for name, value in step.items():
                sums[name].append(float(value))
        metrics = {name: sum(values) / len(values) for name, values in sums.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if has_ref:
            # k1 estimate of KL(pi_old || pi_ref) over this rank's valid tokens: how far training has drifted
            k1 = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], "kl")
            metrics["actor/ref_kl"] = float(masked_mean(k1, batch["response_mask"]))
        return metrics

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int | None = None) -> None:
        """Write model, optimiser and RNG state of this rank to ``path/rank_<rank>.pt`` (``step`` is unused).

        The reference model is not saved: it is rebuilt by ``model_factory``, which must therefore be
        deterministic (e.g. a fixed seed or pretrained weights).
        """
        self._save(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        self._load(path)
