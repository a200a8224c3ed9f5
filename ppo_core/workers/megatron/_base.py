"""The machinery shared by the megatron actor and critic: parallel state, model stage, megatron DDP and optimizer,
the forward/backward driver over megatron's pipeline schedules, PPO mini-batches, optimiser steps, checkpoints.

Forward and backward run through ``get_forward_backward_func`` (no pipelining for PP = 1, 1F1B otherwise) over
micro-batches; gradients go through megatron's ``DistributedDataParallel`` (fp32 gradient buffers, averaged over
dp) and its mixed-precision optimizer (fp32 master weights, AdamW, optionally sharded over dp), with the
multi-tensor kernels of :mod:`~ppo_core.workers.megatron.optim` where megatron would fall back to Python loops.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

from ppo_core.workers._minibatching import global_loss_denominators, local_minibatches
from ppo_core.workers.base import Worker
from ppo_core.workers.megatron.hf_loading import load_hf_checkpoint
from ppo_core.workers.megatron.model import build_gpt_model
from ppo_core.workers.megatron.optim import clip_grads, grad_norm, speed_up_megatron_optimizer
from ppo_core.workers.megatron.parallel import destroy_megatron_parallel, init_megatron_parallel
from ppo_core.workers.torch._common import split_rows
from ppo_core.workers.torch.distributed import resolve_device

__all__ = ["MegatronWorkerBase", "megatron_attention_mask", "position_ids"]


def megatron_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Megatron's boolean mask ``[B, 1, S, S]`` (``True`` = masked) for padded rows, or None when nothing is padded.

    A query attends to earlier non-padding keys and always to itself, so that padding rows stay finite.

    Example:
        >>> megatron_attention_mask(torch.ones(2, 3)) is None
        True
        >>> megatron_attention_mask(torch.tensor([[0, 1, 1]]))[0, 0].int()
        tensor([[0, 1, 1],
                [1, 0, 1],
                [1, 0, 0]], dtype=torch.int32)
    """
    valid = attention_mask.bool()
    if bool(valid.all()):
        return None
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    allowed = causal & valid[:, None, None, :]
    allowed |= torch.eye(s, dtype=torch.bool, device=valid.device)
    return ~allowed


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions counting only non-padding tokens (0 on left padding).

    Example:
        >>> position_ids(torch.tensor([[0, 1, 1]]))
        tensor([[0, 0, 1]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


class MegatronWorkerBase(Worker):
    """Parallel state, model stage, megatron DDP + optimizer, and the forward/backward driver."""

    value_head = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.device = resolve_device(config.device, self.local_rank)
        self.layout = init_megatron_parallel(
            config.parallel,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            seed=config.model.seed,
        )
        self.set_dp_layout(self.layout.dp_rank, self.layout.dp_size, self.layout.is_collect_rank)
        if config.ppo_mini_batch_size % self.dp_size:
            raise ValueError(
                f"ppo_mini_batch_size ({config.ppo_mini_batch_size}) must be divisible by dp_size ({self.dp_size})"
            )
        from megatron.core import parallel_state as ps

        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        module = self._build_module()
        self.model, self.optimizer = self._wrap(module)
        # TP/PP peers of one dp rank must draw the same tokens and shuffle the same way: seed by dp rank
        self.generator = torch.Generator(device=self.device).manual_seed(int(config.seed) + self.dp_rank)
        self.shuffle_generator = torch.Generator().manual_seed(int(config.seed) + self.dp_rank)

    # ----- set-up ---------------------------------------------------------------------------------------
    def _build_module(self) -> nn.Module:
        cfg = self.config
        module = build_gpt_model(cfg.model, cfg.parallel, value_head=self.value_head)
        if cfg.hf_checkpoint is not None:
            load_hf_checkpoint(module, cfg.hf_checkpoint, cfg.model, cfg.parallel, value_head=self.value_head)
        return module

    def _wrap(self, module: nn.Module) -> tuple[nn.Module, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg, tc = self.config, module.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer
        )
        model = DistributedDataParallel(config=tc, ddp_config=ddp_config, module=module)
        tc.finalize_model_grads_func = finalize_model_grads
        tc.no_sync_func = model.no_sync
        optim = cfg.optim
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1],
            adam_eps=optim.eps,
            bf16=tc.bf16,
            fp16=tc.fp16,
            params_dtype=tc.params_dtype,
            clip_grad=0.0,  # clipped in _optimizer_step, after the non-finite check
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
        speed_up_megatron_optimizer(optimizer, self.device)
        return model, optimizer

    @property
    def module(self) -> nn.Module:
        """This rank's ``GPTModel`` stage without the DDP wrapper."""
        return self.model.module

    # ----- forward / backward ---------------------------------------------------------------------------
    def _micro_batches(self, batch: TensorDictBase, size: int | None) -> list[TensorDictBase]:
        micros = split_rows(batch, size)
        if self.layout.pp_size > 1 and len({int(m.batch_size[0]) for m in micros}) > 1:
            raise ValueError(
                f"with pipeline parallelism every micro-batch must have the same rows: {int(batch.batch_size[0])} "
                f"rows are not a multiple of the micro-batch size {size}"
            )
        return micros

    def _run(
        self,
        micros: list[TensorDictBase],
        loss_fn: Callable[[TensorDictBase, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """One megatron schedule over ``micros``; returns ``loss_fn``'s outputs (last stage only, else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micros)
        # built before the schedule: megatron_attention_mask syncs with the host, which must not stall a pipeline
        inputs = iter(
            [
                (m, position_ids(m["attention_mask"]), megatron_attention_mask(m["attention_mask"]))
                for m in micros
            ]
        )

        def forward_step(data_iterator: Iterator[Any], model: nn.Module) -> tuple[torch.Tensor, Any]:
            micro, positions, attention_mask = next(data_iterator)
            with self._output_window(self.module, micro):
                out = model(micro["input_ids"], positions, attention_mask)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
                loss, metrics = loss_fn(micro, output)
                # megatron divides the loss by the number of micro-batches; our losses are already shares
                return loss * n, metrics

            return out, loss_func

        first = micros[0]
        rows, seq = int(first.batch_size[0]), int(first["input_ids"].shape[1])
        run = partial(
            get_forward_backward_func(),
            forward_step_func=forward_step,
            data_iterator=inputs,
            model=[self.model],
            num_microbatches=n,
            seq_length=seq,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
        if forward_only:
            with torch.no_grad():
                return list(run())
        return list(run())

    def _output_window(self, module: nn.Module, micro: TensorDictBase) -> contextlib.AbstractContextManager:
        """Where the model must produce outputs for ``micro`` (default: every position)."""
        return contextlib.nullcontext()

    def _forward_outputs(self, batch: TensorDictBase, fn: Callable) -> list[dict[str, torch.Tensor]]:
        self.model.eval()
        micros = self._micro_batches(batch.to(self.device), self.config.forward_micro_batch_size)

        def loss_fn(micro: TensorDictBase, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            return output.new_zeros(()), fn(micro, output)

        return self._run(micros, loss_fn, forward_only=True)

    def _global_denominators(self, mask: torch.Tensor) -> dict[str, Any]:
        """agg_loss keywords normalising a mini-batch by its size over all dp ranks (pitfall 13)."""

        def all_reduce_sum(counts: torch.Tensor) -> torch.Tensor:
            if self.dp_size > 1:
                dist.all_reduce(counts, group=self._dp_group)
            return counts

        return global_loss_denominators(
            mask,
            dp_size=self.dp_size,
            loss_scale_factor=self.config.loss_scale_factor,
            all_reduce_sum=all_reduce_sum,
        )

    def _minibatches(self, batch: TensorDictBase) -> Iterator[TensorDictBase]:
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

    def _optimizer_step(self) -> float:
        """Clip and step (skipped, as in verl, when the gradient norm is not finite); returns the norm."""
        opt = self.optimizer
        found_inf = opt.prepare_grads()
        norm = grad_norm(opt) if not found_inf else math.inf
        clip = self.config.optim.grad_clip
        if math.isfinite(norm):
            if clip is not None:
                clip_grads(opt, clip, norm)
            opt.step_with_ready_grads()
        self.model.zero_grad_buffer()
        opt.zero_grad()
        return norm

    def _train(
        self, batch: TensorDictBase, keys: tuple[str, ...], step_loss: Callable
    ) -> dict[str, list[float]]:
        """``ppo_epochs`` passes of mini-batches; ``step_loss(micro, output, agg, step)`` gives one micro's loss."""
        batch = batch.select(*keys).to(self.device)
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        for mini in self._minibatches(batch):
            agg = self._global_denominators(mini["response_mask"])
            micros = self._micro_batches(mini, self.config.micro_batch_size)
            outs = self._run(micros, partial(step_loss, agg=agg, n_micro=len(micros)), forward_only=False)
            sums["grad_norm"].append(self._optimizer_step())
            step: dict[str, float] = defaultdict(float)
            for metrics in outs:
                for name, value in metrics.items():
                    step[name] += float(value)
            for name, value in step.items():
                sums[name].append(value)
        return sums

    # ----- checkpoints ----------------------------------------------------------------------------------
    def _checkpoint_file(self, path: str) -> str:
        return os.path.join(path, f"rank_{self.rank}.pt")

    def _save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        opt = self.optimizer
        state = {
            "model": self.module.state_dict(),
            "optimizer": opt.state_dict(),
            "generator": self.generator.get_state(),
            "shuffle_generator": self.shuffle_generator.get_state(),
        }
        if self.config.use_distributed_optimizer:
            state["optimizer_shard"] = opt.get_parameter_state_dp_reshardable()
        torch.save(state, self._checkpoint_file(path))

    def _load(self, path: str) -> None:
        file = self._checkpoint_file(path)
        if not os.path.exists(file):
            raise ValueError(f"no checkpoint for rank {self.rank} at path={path!r} (expected {file})")
        state = torch.load(file, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.use_distributed_optimizer:
            self.optimizer.load_parameter_state_from_dp_reshardable(state["optimizer_shard"])
        self.generator.set_state(state["generator"].cpu())
        self.shuffle_generator.set_state(state["shuffle_generator"].cpu())

    def close(self) -> None:
        self.optimizer.zero_grad()
        destroy_megatron_parallel()
