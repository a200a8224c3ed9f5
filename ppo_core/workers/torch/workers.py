"""``TorchActorWorker`` and ``TorchCriticWorker``: the PPO workers (:mod:`ppo_core.workers.ppo`) on
:class:`~ppo_core.workers.torch.engine.TorchEngine` s, for any causal LM / value ``nn.Module``.

Each rank builds its model with ``model_factory()`` on its device; with ``world_size > 1`` every rank is a DDP
replica (see :mod:`ppo_core.workers.torch.distributed`). The actor adds a frozen copy of the initial policy
(``use_reference``) and samples through a rollout engine built from the policy module
(the engine named by ``rollout.engine`` in its config, :mod:`~ppo_core.rollout.registry`, unless
``rollout_engine`` says otherwise).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ppo_core.rollout.engine import RolloutEngine
from ppo_core.workers.base import current_worker_context
from ppo_core.workers.config import OptimConfig
from ppo_core.workers.ppo import PPOActorWorker, PPOCriticWorker
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig
from ppo_core.workers.torch.distributed import init_data_parallel, resolve_device
from ppo_core.workers.torch.engine import TorchEngine
from ppo_core.workers.torch.exact import ExactLogProbs

__all__ = ["TorchActorWorker", "TorchCriticWorker"]

ModelFactory = Callable[[], nn.Module]
RolloutFactory = Callable[[nn.Module], RolloutEngine]


def _build_engine(
    model_factory: ModelFactory, device: str | None, optim: OptimConfig, head: str, remove_padding: bool
) -> TorchEngine:
    """This rank's model from ``model_factory`` on its device, joined to the data-parallel group."""
    if not callable(model_factory):
        raise TypeError(f"model_factory must be a zero-argument callable, got {type(model_factory).__name__}")
    ctx = current_worker_context()
    dev = resolve_device(device, ctx.local_rank)
    data_parallel = init_data_parallel(ctx.rank, ctx.world_size, dev)
    module = model_factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"model_factory must return an nn.Module, got {type(module).__name__}")
    return TorchEngine(
        module.to(dev),
        device=dev,
        head=head,
        optim=optim,
        dp_rank=ctx.rank,
        dp_size=ctx.world_size,
        data_parallel=data_parallel,
        remove_padding=remove_padding,
    )


class _ModelAccess:
    """``module`` and ``optimizer`` of a torch worker's engine, for users who inspect or patch them."""

    engine: TorchEngine

    @property
    def module(self) -> nn.Module:
        """The trained model without its DDP wrapper."""
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The trained model's AdamW."""
        return self.engine.optimizer


class TorchActorWorker(_ModelAccess, PPOActorWorker):
    """Samples responses, scores them (policy and frozen reference) and runs the PPO policy update.

    Args:
        model_factory: zero-argument callable returning the policy ``nn.Module`` (called once per rank; it must be
            picklable for process backends, e.g. a module-level function or ``functools.partial``).
        config: a :class:`TorchActorConfig` or a dict of its fields.
        rollout_engine: ``factory(policy_module) -> RolloutEngine``; None: the engine named by
            ``config.rollout.engine`` (:mod:`~ppo_core.rollout.registry`; ``auto``: ``hf`` for a Hugging Face causal
            LM, else the reference loop), built once here and reused for every step.

    Example:
        >>> import functools
        >>> from tensordict import TensorDict
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> lm = functools.partial(TinyGPT, TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
        >>> actor = TorchActorWorker(lm, {"rollout": {"max_new_tokens": 3}, "ppo_mini_batch_size": 2})
        >>> prompts = TensorDict({"input_ids": torch.tensor([[0, 4], [3, 5]]),
        ...                       "attention_mask": torch.tensor([[0, 1], [1, 1]])}, batch_size=[2])
        >>> actor.generate_sequences(prompts)["responses"].shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        config: TorchActorConfig | Mapping[str, Any] | None = None,
        *,
        rollout_engine: RolloutFactory | None = None,
    ) -> None:
        config = TorchActorConfig.coerce(config, none_is_default=True)
        engine = _build_engine(
            model_factory, config.device, config.optim, "policy", config.use_remove_padding
        )
        reference = None
        if config.use_reference:
            frozen = copy.deepcopy(engine.module).requires_grad_(False)
            reference = TorchEngine(
                frozen,
                device=engine.device,
                dp_rank=engine.dp_rank,
                dp_size=engine.dp_size,
                remove_padding=config.use_remove_padding,
            )
        rollout = (
            rollout_engine(engine.module)
            if rollout_engine is not None
            else config.rollout.build_engine(engine.module)
        )
        if config.exact_log_probs:
            engine.exact_log_probs = ExactLogProbs(rollout, config.rollout)
            if reference is not None:
                reference.exact_log_probs = engine.exact_log_probs.for_module(reference.module)
        super().__init__(config, engine, rollout=rollout, reference=reference)
        self.config: TorchActorConfig = config

    @property
    def ref_model(self) -> nn.Module | None:
        """The frozen reference policy (None without ``use_reference``)."""
        return None if self.reference is None else self.reference.module


class TorchCriticWorker(_ModelAccess, PPOCriticWorker):
    """Computes values of the response tokens and fits them to the returns with the clipped value loss.

    Like log-probs, the value of response position ``t`` is read at position ``P + t - 1``: the value of the state
    *before* the token is emitted (verl's convention).

    Args:
        model_factory: zero-argument callable returning the value model (e.g. a ``TinyGPT`` with
            ``value_head=True``); called once per rank.
        config: a :class:`TorchCriticConfig` or a dict of its fields.

    Example:
        >>> import functools
        >>> from tensordict import TensorDict
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
        config = TorchCriticConfig.coerce(config, none_is_default=True)
        engine = _build_engine(model_factory, config.device, config.optim, "value", config.use_remove_padding)
        super().__init__(config, engine)
        self.config: TorchCriticConfig = config
