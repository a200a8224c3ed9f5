"""``MegatronActorWorker`` and ``MegatronCriticWorker``: the trainer's actor/rollout/reference and critic roles
on a megatron-core ``GPTModel`` with tensor, pipeline and data parallelism.

They keep the method names, batch keys and metrics of :mod:`ppo_core.workers.torch` (``generate_sequences``,
``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``, ``compute_values``, ``update_critic``,
``save_checkpoint``, ``load_checkpoint``), so :class:`ppo_core.trainer.BasePPOTrainer` drives either. Each rank
initialises megatron's parallel state from the backend's ranks (:mod:`ppo_core.workers.megatron.parallel`) and
declares its dp layout, so a ``DP_COMPUTE`` dispatch sends every TP x PP replica the same shard and collects
the last stage's TP rank 0.

Forward and backward run through megatron's pipeline schedules (``get_forward_backward_func``: no pipelining
for PP = 1, 1F1B otherwise) over micro-batches; gradients go through megatron's ``DistributedDataParallel``
(fp32 gradient buffers, averaged over dp) and its mixed-precision optimizer (fp32 master weights, AdamW,
optionally sharded over dp). Log-probs and entropies come from the vocab-parallel logits
(:mod:`ppo_core.workers.megatron.vocab_parallel`), losses from the registry (:mod:`ppo_core.losses`).

Sampling (``generate_sequences``) recomputes the whole sequence at each step (no KV cache) and needs PP = 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ppo_core.kl import kl_penalty
from ppo_core.losses import agg_loss, compute_policy_loss, compute_value_loss
from ppo_core.masked import masked_mean
from ppo_core.workers.base import register
from ppo_core.workers.dispatch import Dispatch
from ppo_core.workers.megatron._base import MegatronWorkerBase, megatron_attention_mask, position_ids
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.megatron.model import build_gpt_model, logits_window
from ppo_core.workers.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from ppo_core.workers.torch._common import _check_keys, split_rows
from ppo_core.workers.torch.sampling import generate

__all__ = ["MegatronActorWorker", "MegatronCriticWorker", "megatron_attention_mask", "position_ids"]

_ACTOR_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages")
_CRITIC_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")


class _GenerationView(nn.Module):
    """Calls the megatron model like a Hugging Face LM for :func:`generate`: full-vocabulary logits ``[B, 1, V]``
    of the last position only (gathered over TP), so sampling never materialises ``[B, S, V]``."""

    def __init__(self, worker: MegatronActorWorker) -> None:
        super().__init__()
        self.worker = worker

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        w = self.worker
        s = input_ids.shape[1]
        with logits_window(w.module, s - 1, s):
            out = w.module(input_ids, position_ids(attention_mask), megatron_attention_mask(attention_mask))
        last = out[:, -1:].float()
        if w.layout.tp_size > 1:
            parts = [torch.empty_like(last) for _ in range(w.layout.tp_size)]
            dist.all_gather(parts, last.contiguous(), group=w._tp_group)
            last = torch.cat(parts, dim=-1)
        return last[..., : w.config.model.vocab_size]


class MegatronActorWorker(MegatronWorkerBase):
    """Actor, rollout and reference roles on a megatron-core GPT (see the module docstring).

    Args:
        config: a :class:`MegatronActorConfig` or a dict of its fields.

    Example:
        >>> # one process per rank, torch.distributed env set (Monarch / torchrun):
        >>> # actor = MegatronActorWorker({"model": {...}, "parallel": {"tensor_model_parallel_size": 2}})
    """

    def __init__(self, config: MegatronActorConfig | Mapping[str, Any] | None = None) -> None:
        if config is None or isinstance(config, Mapping):
            config = MegatronActorConfig.from_dict(config)
        if not isinstance(config, MegatronActorConfig):
            raise TypeError(f"config must be a MegatronActorConfig or a dict, got {type(config).__name__}")
        super().__init__(config)
        self.config: MegatronActorConfig = config
        self.ref_model: nn.Module | None = None
        if config.use_reference:
            self.ref_model = build_gpt_model(config.model, config.parallel).requires_grad_(False)
            self.ref_model.load_state_dict(self.module.state_dict())
            self.ref_model.eval()

    def _temperature(self) -> float:
        t = self.config.rollout.temperature
        return t if t > 0 else 1.0

    def _output_window(self, module: nn.Module, micro: TensorDictBase) -> contextlib.AbstractContextManager:
        # only the positions that predict response tokens: [S - R - 1, S - 1)
        s, r = micro["input_ids"].shape[1], micro["responses"].shape[1]
        return logits_window(module, s - r - 1, s - 1)

    def _log_probs(
        self, micro: TensorDictBase, logits: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = micro["responses"].shape[1]
        if logits.shape[1] != r:  # the model ignored the logits window (sequence parallelism)
            logits = logits[:, -r - 1 : -1]
        t = self._temperature()
        if t != 1.0:
            logits = logits / t
        return vocab_parallel_log_probs_and_entropy(
            logits,
            micro["responses"],
            self._tp_group,
            vocab_size=self.config.model.vocab_size,
            with_entropy=with_entropy,
            validate=False,  # responses are sampled from this vocabulary; saves two host syncs per micro-batch
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(
        self,
        batch: TensorDictBase,
        do_sample: bool = True,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> TensorDict | None:
        """Sample one response per prompt (same contract as ``TorchActorWorker.generate_sequences``; PP = 1)."""
        _check_keys(batch, ("input_ids", "attention_mask"), "generate_sequences")
        if self.layout.pp_size > 1:
            raise ValueError(
                "generate_sequences needs pipeline_model_parallel_size=1 (no pipelined sampling)"
            )
        cfg = self.config.rollout
        if not do_sample:
            temperature = 0.0
        overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        if overrides:
            cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides})
        self.module.eval()
        with torch.no_grad():
            out = generate(
                _GenerationView(self),
                batch["input_ids"].to(self.device),
                batch["attention_mask"].to(self.device),
                cfg,
                generator=self.generator,
            )
        return out if self.is_collect_rank else None

    def _score(
        self, model: nn.Module, batch: TensorDictBase, key: str, with_entropy: bool
    ) -> TensorDict | None:
        _check_keys(batch, ("input_ids", "attention_mask", "responses"), "compute_log_prob")

        def fn(micro: TensorDictBase, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            lp, ent = self._log_probs(micro, logits, with_entropy)
            return {key: lp, "entropys": ent} if with_entropy else {key: lp}

        if model is self.module:
            outs = self._forward_outputs(batch, fn)
        else:
            outs = self._reference_forward(model, batch, fn)
        if not self.is_collect_rank:
            return None
        cols = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        return TensorDict(cols, batch_size=batch.batch_size)

    def _reference_forward(self, model: nn.Module, batch: TensorDictBase, fn: Callable) -> list[dict]:
        if self.layout.pp_size > 1:
            raise ValueError("compute_ref_log_prob with PP > 1 needs a separate reference worker group")
        batch = batch.to(self.device)
        outs = []
        with torch.no_grad():
            for micro in split_rows(batch, self.config.forward_micro_batch_size):
                mask = micro["attention_mask"]
                with self._output_window(model, micro):
                    logits = model(micro["input_ids"], position_ids(mask), megatron_attention_mask(mask))
                outs.append(fn(micro, logits))
        return outs

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDictBase) -> TensorDict | None:
        """``old_log_probs [B, R]`` and ``entropys [B, R]`` under the current policy (None on non-collect ranks)."""
        return self._score(self.module, batch, "old_log_probs", with_entropy=True)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict | None:
        """``ref_log_prob [B, R]`` under the frozen initial policy (PP = 1)."""
        if self.ref_model is None:
            raise ValueError("compute_ref_log_prob needs a reference model; set use_reference=True")
        return self._score(self.ref_model, batch, "ref_log_prob", with_entropy=False)

    def _actor_loss(
        self, micro: TensorDictBase, logits: torch.Tensor, *, agg: dict, n_micro: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        mask = micro["response_mask"]
        mode = cfg.policy_loss.loss_agg_mode
        log_prob, entropy_tok = self._log_probs(micro, logits, with_entropy=True)
        pg_loss, pg_metrics = compute_policy_loss(
            micro["old_log_probs"], log_prob, micro["advantages"], mask, config=cfg.policy_loss, **agg
        )
        loss = pg_loss
        entropy = agg_loss(entropy_tok, mask, mode, **agg)
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * entropy
        metrics = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy.detach()}
        if cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type), mask, mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        for name, value in pg_metrics.items():
            metrics[f"actor/{name}"] = value.detach() / n_micro
        return loss, metrics

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDictBase) -> dict[str, float]:
        """PPO policy update; same contract and metrics as ``TorchActorWorker.update_actor``."""
        cfg = self.config
        keys = (*_ACTOR_KEYS, "ref_log_prob") if cfg.use_kl_loss else _ACTOR_KEYS
        _check_keys(batch, keys, "update_actor")
        has_ref = "ref_log_prob" in batch.keys()  # noqa: SIM118 (TensorDict)
        sums = self._train(batch, keys, self._actor_loss)
        metrics = {("actor/grad_norm" if k == "grad_norm" else k): sum(v) / len(v) for k, v in sums.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if has_ref:
            k1 = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], "kl")
            metrics["actor/ref_kl"] = float(masked_mean(k1, batch["response_mask"]))
        return metrics

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int | None = None) -> None:
        """Write this rank's model shard, optimiser state and generators to ``path/rank_<rank>.pt``."""
        self._save(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same layout and world size)."""
        self._load(path)


class MegatronCriticWorker(MegatronWorkerBase):
    """Value model on a megatron-core GPT whose output layer is a :class:`~ppo_core.workers.megatron.model.ValueHead`.

    Args:
        config: a :class:`MegatronCriticConfig` or a dict of its fields.
    """

    value_head = True

    def __init__(self, config: MegatronCriticConfig | Mapping[str, Any] | None = None) -> None:
        if config is None or isinstance(config, Mapping):
            config = MegatronCriticConfig.from_dict(config)
        if not isinstance(config, MegatronCriticConfig):
            raise TypeError(f"config must be a MegatronCriticConfig or a dict, got {type(config).__name__}")
        super().__init__(config)
        self.config: MegatronCriticConfig = config

    @staticmethod
    def _vpreds(micro: TensorDictBase, output: torch.Tensor) -> torch.Tensor:
        r = micro["responses"].shape[1]
        return output[:, -r - 1 : -1, 0].float()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, batch: TensorDictBase) -> TensorDict | None:
        """``values [B, R]`` of the response tokens (0 where ``response_mask`` is 0)."""
        _check_keys(batch, ("input_ids", "attention_mask", "responses", "response_mask"), "compute_values")
        outs = self._forward_outputs(batch, lambda micro, out: {"values": self._vpreds(micro, out)})
        if not self.is_collect_rank:
            return None
        values = torch.cat([o["values"] for o in outs]) * batch["response_mask"].to(self.device)
        return TensorDict({"values": values}, batch_size=batch.batch_size)

    def _critic_loss(
        self, micro: TensorDictBase, output: torch.Tensor, *, agg: dict, n_micro: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro["response_mask"]
        vpreds = self._vpreds(micro, output)
        vf_loss, clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            mask,
            self.config.cliprange_value,
            self.config.loss_agg_mode,
            **agg,
        )
        return vf_loss, {
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": clipfrac / n_micro,
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask) / n_micro,
        }

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, batch: TensorDictBase) -> dict[str, float]:
        """Clipped value-loss update; same contract and metrics as ``TorchCriticWorker.update_critic``."""
        _check_keys(batch, _CRITIC_KEYS, "update_critic")
        sums = self._train(batch, _CRITIC_KEYS, self._critic_loss)
        metrics = {("critic/grad_norm" if k == "grad_norm" else k): sum(v) / len(v) for k, v in sums.items()}
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int | None = None) -> None:
        """Write this rank's model shard, optimiser state and generators to ``path/rank_<rank>.pt``."""
        self._save(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same layout and world size)."""
        self._load(path)
