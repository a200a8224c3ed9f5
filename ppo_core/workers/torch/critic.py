"""``TorchCriticWorker``: the value model role for any ``nn.Module`` mapping token ids to per-token values.

The model is called as ``model(input_ids, attention_mask=mask)`` and returns values ``[B, S]`` or ``[B, S, 1]``
(or an object whose ``.logits`` is one of those, as a Hugging Face token-classification head). Like log-probs,
the value of response position ``t`` is read at position ``P + t - 1``: the value of the state *before* the
token is emitted (verl's convention).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.losses import compute_value_loss
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
from ppo_core.workers.torch.config import TorchCriticConfig
from ppo_core.workers.torch.distributed import maybe_no_sync

__all__ = ["TorchCriticWorker"]

_UPDATE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")


def _as_values(out: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:
        if out.shape[-1] != 1:
            raise ValueError(
                f"the critic model must output [B, S] or [B, S, 1] values, got {tuple(out.shape)}"
            )
        out = out.squeeze(-1)
    return out.float()


class TorchCriticWorker(TorchWorkerBase):
    """Computes values of the response tokens and fits them to the returns with the clipped value loss.

    Args:
        model_factory: zero-argument callable returning the value model (e.g. a ``TinyGPT`` with
            ``value_head=True``); called once per rank.
        config: a :class:`TorchCriticConfig` or a dict of its fields.

    Example:
        >>> import functools
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> cfg = TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2, value_head=True)
        >>> critic = TorchCriticWorker(functools.partial(TinyGPT, cfg), {"ppo_mini_batch_size": 1})
        >>> batch = TensorDict({"input_ids": torch.tensor([[3, 4, 5]]), "attention_mask": torch.ones(1, 3),
        ...                     "responses": torch.tensor([[4, 5]]), "response_mask": torch.ones(1, 2)}, [1])
        >>> critic.compute_values(batch)["values"]  # a fresh TinyGPT value head predicts 0
        tensor([[0., 0.]])
    """

    def __init__(
        self, model_factory: ModelFactory, config: TorchCriticConfig | Mapping[str, Any] | None = None
    ) -> None:
        if config is None or isinstance(config, Mapping):
            config = TorchCriticConfig.from_dict(config)
        if not isinstance(config, TorchCriticConfig):
            raise TypeError(f"config must be a TorchCriticConfig or a dict, got {type(config).__name__}")
        super().__init__(model_factory, config, config.optim)
        self.config: TorchCriticConfig = config

    def _vpreds(self, model: torch.nn.Module, batch: TensorDictBase) -> torch.Tensor:
        return _as_values(response_outputs(model, batch))

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_values(self, batch: TensorDictBase) -> TensorDict:
        """``values [B, R]`` (on the CPU) of the response tokens (0 where ``response_mask`` is 0, as in verl)."""
        keys = ("input_ids", "attention_mask", "responses", "response_mask")
        _check_keys(batch, keys, "compute_values")
        batch = batch.select(*keys).to(self.device)
        chunks = [
            self._vpreds(self.module, m) for m in split_rows(batch, self.config.forward_micro_batch_size)
        ]
        values = torch.cat(chunks) * batch["response_mask"]
        return TensorDict({"values": values.cpu()}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, batch: TensorDictBase) -> dict[str, float]:
        """Fit the values to ``returns`` with the clipped value loss, ``ppo_epochs`` passes of mini-batches.

        Args:
            batch: ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``, ``values`` (rollout-time),
                ``returns``.

        Returns:
            Means over optimiser steps: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
            ``critic/grad_norm``, ``critic/lr``.
        """
        cfg = self.config
        _check_keys(batch, _UPDATE_KEYS, "update_critic")
        batch = batch.select(*_UPDATE_KEYS).to(self.device)
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        for mini in self._minibatches(batch):
            agg = self._global_denominators(mini["response_mask"])
            step: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
            micros = split_rows(mini, cfg.micro_batch_size)
            for i, micro in enumerate(micros):
                mask = micro["response_mask"]
                with maybe_no_sync(self.model, skip_sync=i < len(micros) - 1):
                    vpreds = self._vpreds(self.model, micro)
                    vf_loss, clipfrac = compute_value_loss(
                        vpreds,
                        micro["returns"],
                        micro["values"],
                        mask,
                        cfg.cliprange_value,
                        cfg.loss_agg_mode,
                        **agg,
                    )
                    vf_loss.backward()
                step["critic/vf_loss"] += vf_loss.detach()
                step["critic/vf_clipfrac"] += clipfrac / len(micros)
                step["critic/vpred_mean"] += masked_mean(vpreds.detach(), mask) / len(micros)
            sums["critic/grad_norm"].append(self._optimizer_step())
            for name, value in step.items():
                sums[name].append(float(value))
        metrics = {name: sum(values) / len(values) for name, values in sums.items()}
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int | None = None) -> None:
        """Write model, optimiser and RNG state of this rank to ``path/rank_<rank>.pt`` (``step`` is unused)."""
        self._save(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        self._load(path)
