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
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ppo_core.batch import iter_minibatches
from ppo_core.kl import kl_penalty
from ppo_core.losses import agg_loss, compute_policy_loss, compute_value_loss
from ppo_core.masked import masked_mean
from ppo_core.workers.base import Worker, register
from ppo_core.workers.dispatch import Dispatch
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.megatron.hf_loading import load_hf_checkpoint
from ppo_core.workers.megatron.model import build_gpt_model, logits_window
from ppo_core.workers.megatron.parallel import destroy_megatron_parallel, init_megatron_parallel
from ppo_core.workers.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from ppo_core.workers.torch._common import _check_keys, split_rows
from ppo_core.workers.torch.distributed import resolve_device
from ppo_core.workers.torch.sampling import generate

__all__ = ["MegatronActorWorker", "MegatronCriticWorker", "megatron_attention_mask"]

_ACTOR_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages")
_CRITIC_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")


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


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


class _MegatronWorker(Worker):
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
        _use_fused_adamw(optimizer, self.device)
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
                (m, _position_ids(m["attention_mask"]), megatron_attention_mask(m["attention_mask"]))
                for m in micros
            ]
        )

        def forward_step(data_iterator: Iterator[Any], model: nn.Module) -> tuple[torch.Tensor, Any]:
            micro, position_ids, attention_mask = next(data_iterator)
            with self._output_window(self.module, micro):
                out = model(micro["input_ids"], position_ids, attention_mask)

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
        counts = torch.stack(
            [
                mask.sum().to(torch.float64),
                torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device),
            ]
        )
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self._dp_group)
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": counts[0],
            "global_batch_size": counts[1],
            "loss_scale_factor": self.config.loss_scale_factor,
        }

    def _minibatches(self, batch: TensorDictBase) -> Iterator[TensorDictBase]:
        cfg = self.config
        local = cfg.ppo_mini_batch_size // self.dp_size
        n = int(batch.batch_size[0])
        if n % local:
            raise ValueError(
                f"the batch of {n} rows on dp rank {self.dp_rank} is not a multiple of the local mini-batch size "
                f"{local} (ppo_mini_batch_size={cfg.ppo_mini_batch_size} / dp_size={self.dp_size})"
            )
        return iter_minibatches(
            batch, local, epochs=cfg.ppo_epochs, shuffle=cfg.shuffle, generator=self.shuffle_generator
        )

    def _optimizer_step(self) -> float:
        """Clip and step (skipped, as in verl, when the gradient norm is not finite); returns the norm."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm()) if not found_inf else math.inf
        clip = self.config.optim.grad_clip
        if math.isfinite(grad_norm):
            if clip is not None:
                clip_grad_by_total_norm_fp32(opt.get_parameters(), clip, grad_norm)
            opt.step_with_ready_grads()
        self.model.zero_grad_buffer()
        opt.zero_grad()
        return grad_norm

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


def _use_fused_adamw(optimizer: Any, device: torch.device) -> None:
    """Without Apex/TE megatron falls back to ``torch.optim.AdamW`` (foreach); its fused CUDA kernel is faster."""
    if device.type != "cuda":
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


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
            out = w.module(input_ids, _position_ids(attention_mask), megatron_attention_mask(attention_mask))
        last = out[:, -1:].float()
        if w.layout.tp_size > 1:
            parts = [torch.empty_like(last) for _ in range(w.layout.tp_size)]
            dist.all_gather(parts, last.contiguous(), group=w._tp_group)
            last = torch.cat(parts, dim=-1)
        return last[..., : w.config.model.vocab_size]


class MegatronActorWorker(_MegatronWorker):
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
                    logits = model(micro["input_ids"], _position_ids(mask), megatron_attention_mask(mask))
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


class MegatronCriticWorker(_MegatronWorker):
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
