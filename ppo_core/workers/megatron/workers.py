"""``MegatronActorWorker`` and ``MegatronCriticWorker``: the PPO workers (:mod:`ppo_core.workers.ppo`) on
:class:`~ppo_core.workers.megatron.engine.MegatronEngine` s, a megatron-core ``GPTModel`` with tensor, pipeline and
data parallelism.

Same method names, batch keys and metrics as every PPO worker, so :class:`ppo_core.trainer.BasePPOTrainer` drives
either engine. Each rank initialises megatron's parallel state from the backend's ranks
(:mod:`ppo_core.workers.megatron.parallel`) and declares its dp layout, so a ``DP_COMPUTE`` dispatch sends every
TP x PP replica the same shard and collects the last stage's TP rank 0.

Sampling (``generate_sequences``) goes through the KV-cached, graph-captured
:class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine` on the policy's own weights (PP = 1), or through
any rollout engine the caller builds on a view of the policy that returns the full-vocabulary logits of the last
position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppo_core.rollout.engine import RolloutEngine
from ppo_core.workers._common import resolve_device
from ppo_core.workers.base import current_worker_context
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.megatron.engine import MegatronEngine, megatron_attention_mask, position_ids
from ppo_core.workers.megatron.hf_loading import load_hf_checkpoint
from ppo_core.workers.megatron.model import build_gpt_model, logits_window
from ppo_core.workers.megatron.parallel import (
    MegatronLayout,
    destroy_megatron_parallel,
    init_megatron_parallel,
)
from ppo_core.workers.ppo import PPOActorWorker, PPOCriticWorker

__all__ = ["MegatronActorWorker", "MegatronCriticWorker", "megatron_attention_mask", "position_ids"]

RolloutFactory = Callable[[nn.Module], RolloutEngine]


def _build_engine(config: MegatronActorConfig | MegatronCriticConfig, head: str) -> MegatronEngine:
    """Megatron's parallel state for this rank, then its trained model stage (from ``hf_checkpoint`` if set)."""
    ctx = current_worker_context()
    device = resolve_device(config.device, ctx.local_rank)
    layout = init_megatron_parallel(
        config.parallel, rank=ctx.rank, world_size=ctx.world_size, device=device, seed=config.model.seed
    )
    value_head = head == "value"
    head_init = {}
    if isinstance(config, MegatronCriticConfig):
        head_init = {
            "value_head_init_std": config.value_head_init_std,
            "value_head_seed": config.value_head_seed,
        }
    module = build_gpt_model(config.model, config.parallel, value_head=value_head, **head_init)
    if config.hf_checkpoint is not None:
        load_hf_checkpoint(module, config.hf_checkpoint, config.model, config.parallel, value_head=value_head)
    return MegatronEngine(
        module,
        layout=layout,
        device=device,
        head=head,
        vocab_size=config.model.vocab_size,
        optim=config.optim,
        use_distributed_optimizer=config.use_distributed_optimizer,
        remove_padding=config.use_remove_padding,
    )


class _LastLogitsView(nn.Module):
    """The policy called like a Hugging Face LM, ``view(input_ids, attention_mask=mask)``, returning the
    full-vocabulary logits ``[B, 1, V]`` of the last position only (gathered over TP), so sampling never
    materialises ``[B, S, V]``."""

    def __init__(
        self, module: nn.Module, layout: MegatronLayout, vocab_size: int, model_config: Any = None
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        self.module = module
        self.layout = layout
        self.vocab_size = vocab_size
        self.model_config = (
            model_config  # the MegatronModelConfig: what the ``megatron`` rollout engine needs
        )
        self._tp_group = ps.get_tensor_model_parallel_group()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.layout.pp_size > 1:
            raise ValueError(
                "generate_sequences needs pipeline_model_parallel_size=1 (no pipelined sampling)"
            )
        s = input_ids.shape[1]
        with logits_window(self.module, s - 1, s):
            out = self.module(
                input_ids, position_ids(attention_mask), megatron_attention_mask(attention_mask)
            )
        last = out[:, -1:].float()
        if self.layout.tp_size > 1:
            parts = [torch.empty_like(last) for _ in range(self.layout.tp_size)]
            dist.all_gather(parts, last.contiguous(), group=self._tp_group)
            last = torch.cat(parts, dim=-1)
        return last[..., : self.vocab_size]


def _auto_engine(engine: MegatronEngine, config: MegatronActorConfig) -> str:
    """What ``rollout.engine: auto`` means for the megatron actor: the KV-cached, graph-captured ``megatron``
    engine where the model supports it (SDPA attention, no pipeline or sequence parallelism), else the
    ``reference`` loop (full recomputation through the policy view)."""
    sequence_parallel = getattr(engine.module.config, "sequence_parallel", False)
    if config.model.attention == "sdpa" and engine.layout.pp_size == 1 and not sequence_parallel:
        return "megatron"
    return "reference"


def _default_rollout(
    engine: MegatronEngine, config: MegatronActorConfig, view: _LastLogitsView
) -> RolloutEngine:
    """The engine ``config.rollout.engine`` names (``auto``: :func:`_auto_engine`), built once for this worker."""
    return config.rollout.build_engine(view, auto=_auto_engine(engine, config))


class MegatronActorWorker(PPOActorWorker):
    """Actor, rollout and reference roles on a megatron-core GPT (see the module docstring).

    Args:
        config: a :class:`MegatronActorConfig` or a dict of its fields.
        rollout_engine: ``factory(policy) -> RolloutEngine``, called with the policy as a causal LM
            (``policy(input_ids, attention_mask=mask)`` -> last-position logits ``[B, 1, V]``; pass
            :class:`~ppo_core.rollout.ModelRolloutEngine` to recompute every step); None: the engine
            ``config.rollout.engine`` names (:mod:`~ppo_core.rollout.registry`), built once and reused; ``auto``:
            the KV-cached :class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine` (CUDA graphs on a GPU)
            where the model supports it (``attention="sdpa"``, PP = 1, no sequence parallelism), else
            recomputation (``reference``).

    Example:
        >>> # one process per rank, torch.distributed env set (Monarch / torchrun):
        >>> # actor = MegatronActorWorker({"model": {...}, "parallel": {"tensor_model_parallel_size": 2}})
    """

    def __init__(
        self,
        config: MegatronActorConfig | Mapping[str, Any] | None = None,
        *,
        rollout_engine: RolloutFactory | None = None,
    ) -> None:
        config = MegatronActorConfig.coerce(config, none_is_default=True)
        engine = _build_engine(config, "policy")
        reference = None
        if config.use_reference:
            frozen = build_gpt_model(config.model, config.parallel).requires_grad_(False)
            frozen.load_state_dict(engine.module.state_dict())
            reference = MegatronEngine(
                frozen,
                layout=engine.layout,
                device=engine.device,
                vocab_size=config.model.vocab_size,
                remove_padding=config.use_remove_padding,
            )
        view = _LastLogitsView(engine.module, engine.layout, config.model.vocab_size, config.model)
        rollout = (
            rollout_engine(view) if rollout_engine is not None else _default_rollout(engine, config, view)
        )
        super().__init__(config, engine, rollout=rollout, reference=reference)
        self.config: MegatronActorConfig = config

    def close(self) -> None:
        super().close()
        destroy_megatron_parallel()


class MegatronCriticWorker(PPOCriticWorker):
    """Value model on a megatron-core GPT whose output layer is a :class:`~ppo_core.workers.megatron.model.ValueHead`.

    Args:
        config: a :class:`MegatronCriticConfig` or a dict of its fields.
    """

    def __init__(self, config: MegatronCriticConfig | Mapping[str, Any] | None = None) -> None:
        config = MegatronCriticConfig.coerce(config, none_is_default=True)
        super().__init__(config, _build_engine(config, "value"))
        self.config: MegatronCriticConfig = config

    def close(self) -> None:
        super().close()
        destroy_megatron_parallel()
