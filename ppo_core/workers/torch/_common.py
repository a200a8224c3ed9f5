"""Pieces shared by the actor and the critic workers: model set-up, response slicing, optimiser steps."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from ppo_core.workers._minibatching import global_loss_denominators, local_minibatches
from ppo_core.workers.base import Worker
from ppo_core.workers.torch.config import ActorCriticCommon, OptimConfig
from ppo_core.workers.torch.distributed import (
    all_reduce_sum,
    init_data_parallel,
    resolve_device,
    unwrap,
    wrap_ddp,
)
from ppo_core.workers.torch.sampling import logits_of

__all__: list[str] = []

ModelFactory = Callable[[], nn.Module]


def _check_keys(batch: TensorDictBase, keys: tuple[str, ...], method: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{method} needs batch keys {list(keys)}; missing {missing}")


def response_outputs(model: nn.Module, batch: TensorDictBase) -> torch.Tensor:
    """Model outputs at the positions that predict the response: ``out[:, P-1 : P+R-1]`` (``[B, R, ...]``).

    Position ``t`` of the response is predicted from the output at position ``P + t - 1`` of ``input_ids``.
    """
    R = batch["responses"].shape[1]
    out = logits_of(model(batch["input_ids"], attention_mask=batch["attention_mask"]))
    return out[:, -R - 1 : -1]


def split_rows(batch: TensorDictBase, size: int | None) -> list[TensorDictBase]:
    """``batch`` cut into consecutive chunks of ``size`` rows (the last may be smaller); None keeps it whole."""
    n = int(batch.batch_size[0])
    if size is None or size >= n:
        return [batch]
    return [batch[i : i + size] for i in range(0, n, size)]


class TorchWorkerBase(Worker):
    """Builds the model on the worker's device, wraps it for data parallelism and owns its optimiser and RNG."""

    def __init__(self, model_factory: ModelFactory, config: ActorCriticCommon, optim: OptimConfig) -> None:
        super().__init__()
        if not callable(model_factory):
            raise TypeError(
                f"model_factory must be a zero-argument callable, got {type(model_factory).__name__}"
            )
        self.config = config
        self.device = resolve_device(config.device, self.local_rank)
        self.data_parallel = init_data_parallel(self.rank, self.world_size, self.device)
        module = model_factory()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(module).__name__}")
        self.model = wrap_ddp(module.to(self.device), self.device, self.data_parallel)
        self.optim_config = optim
        self.optimizer = torch.optim.AdamW(
            unwrap(self.model).parameters(),
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        # sampling draws on the model's device; iter_minibatches shuffles with a CPU generator
        self.generator = torch.Generator(device=self.device).manual_seed(int(config.seed) + self.rank)
        self.shuffle_generator = torch.Generator().manual_seed(int(config.seed) + self.rank)
        if config.ppo_mini_batch_size % self.dp_size:
            raise ValueError(
                f"ppo_mini_batch_size ({config.ppo_mini_batch_size}) must be divisible by dp_size ({self.dp_size})"
            )

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return unwrap(self.model)

    def _minibatches(self, batch: TensorDictBase) -> Iterator[TensorDictBase]:
        """This rank's mini-batches for every epoch (each 1/dp_size of ``ppo_mini_batch_size`` rows)."""
        cfg = self.config
        return local_minibatches(
            batch,
            ppo_mini_batch_size=cfg.ppo_mini_batch_size,
            ppo_epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            generator=self.shuffle_generator,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )

    def _global_denominators(self, mask: torch.Tensor) -> dict[str, Any]:
        """agg_loss keywords normalising a mini-batch by its size over all dp ranks (pitfall 13)."""
        return global_loss_denominators(
            mask,
            dp_size=self.dp_size,
            loss_scale_factor=self.config.loss_scale_factor,
            all_reduce_sum=lambda t: all_reduce_sum(t, self.data_parallel),
        )

    def _optimizer_step(self) -> float:
        """Clip the gradient norm, step if it is finite (else skip, as verl does), clear gradients; returns the norm."""
        clip = self.optim_config.grad_clip
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _checkpoint_file(self, path: str) -> str:
        return os.path.join(path, f"rank_{self.rank}.pt")

    def _save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "shuffle_generator": self.shuffle_generator.get_state(),
        }
        torch.save(state, self._checkpoint_file(path))

    def _load(self, path: str) -> None:
        file = self._checkpoint_file(path)
        if not os.path.exists(file):
            raise ValueError(f"no checkpoint for rank {self.rank} at path={path!r} (expected {file})")
        state = torch.load(file, map_location=self.device, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"].cpu())
        self.shuffle_generator.set_state(state["shuffle_generator"].cpu())

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
