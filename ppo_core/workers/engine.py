"""The training-engine protocol: what the PPO algorithm (:mod:`ppo_core.workers.ppo`) asks of a model.

An engine owns one model on this rank (and, if it trains, its optimiser and its data-parallel wrapping). The
algorithm owns everything PPO: batch keys, losses, the epoch -> mini-batch -> micro-batch loop, metrics,
checkpoint files. Between the two pass micro-batches (``TensorDict`` row slices of a batch, on the engine's
device, with ``input_ids [b, P+R]``, ``attention_mask [b, P+R]`` and ``responses [b, R]``) and per-token outputs
at the response positions (position ``t`` is read from the model output at ``P + t - 1``):

- a **policy** engine (``head == "policy"``) gives ``log_probs [b, R]`` (log-prob of ``responses`` under
  ``softmax(logits / spec.temperature)``) and, when ``spec.entropy``, ``entropy [b, R]`` (of the same
  distribution);
- a **value** engine (``head == "value"``) gives ``values [b, R]``.

Implementations: :class:`ppo_core.workers.torch.TorchEngine` (any ``nn.Module``, DDP, AdamW) and
:class:`ppo_core.workers.megatron.MegatronEngine` (megatron-core GPT, TP/PP/DP, pipeline schedules), both on
:class:`EngineBase`. A forward-only engine (a frozen reference policy) implements :class:`ForwardEngine` only.

Example:
    >>> StepResult(grad_norm=float("nan"), nonfinite_grad="layer.weight").skipped
    True
    >>> OutputSpec(temperature=0.7, entropy=True)
    OutputSpec(temperature=0.7, entropy=True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase
from torch import nn

from ppo_core.workers.config import OptimConfig

__all__ = [
    "ENTROPY",
    "HEADS",
    "LOG_PROBS",
    "VALUES",
    "EngineBase",
    "ForwardEngine",
    "LossFn",
    "OutputSpec",
    "StepResult",
    "TrainingEngine",
]

LOG_PROBS = "log_probs"
"""Output key of a policy engine: ``[b, R]`` log-probs of the responses."""
ENTROPY = "entropy"
"""Output key of a policy engine asked for it: ``[b, R]`` per-token entropies."""
VALUES = "values"
"""Output key of a value engine: ``[b, R]`` values."""
HEADS = ("policy", "value")
"""Valid values of ``ForwardEngine.head``."""

LossFn = Callable[[TensorDictBase, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(micro, outputs) -> (loss, metrics)``: ``outputs`` as :meth:`ForwardEngine.forward` gives them (with
autograd), ``loss`` a scalar to differentiate, ``metrics`` detached scalar tensors."""


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """Which per-token outputs a policy engine computes (a value engine ignores it)."""

    temperature: float = 1.0
    """The logits are divided by it (the sampling temperature; 1 for greedy sampling)."""
    entropy: bool = False
    """Also compute the per-token entropy."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an optimiser step did."""

    grad_norm: float
    """Global gradient L2 norm before clipping (NaN or inf when a gradient is not finite)."""
    nonfinite_grad: str | None = None
    """When the step was skipped: the name of the first parameter (on this rank) whose gradient is not finite."""

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped because the norm is not finite."""
        return not math.isfinite(self.grad_norm)


@runtime_checkable
class ForwardEngine(Protocol):
    """A model on this rank that computes per-token outputs of responses (a frozen reference policy, or the
    forward half of a :class:`TrainingEngine`)."""

    @property
    def head(self) -> str:
        """``"policy"`` (log-probs, entropy) or ``"value"`` (values)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where micro-batches must be before they are passed in."""
        ...

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (tensor/pipeline-parallel peers share it)."""
        ...

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        ...

    @property
    def is_collect_rank(self) -> bool:
        """Whether this rank's outputs represent its data-parallel group (e.g. TP rank 0 of the last PP stage)."""
        ...

    def forward(self, micros: Sequence[TensorDictBase], spec: OutputSpec) -> list[dict[str, torch.Tensor]]:
        """Outputs of every micro-batch without autograd (``[]`` on ranks that hold none, e.g. early PP stages)."""
        ...

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of ``value`` over the data-parallel ranks (``value`` itself with one rank)."""
        ...

    def train(self) -> None:
        """Put the model in training mode."""
        ...

    def eval(self) -> None:
        """Put the model in evaluation mode (no dropout)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (gradients, buffers)."""
        ...


@runtime_checkable
class TrainingEngine(ForwardEngine, Protocol):
    """A :class:`ForwardEngine` with an optimiser."""

    @property
    def lr(self) -> float:
        """The current learning rate."""
        ...

    @property
    def checkpoint_weights_only(self) -> bool:
        """Whether :meth:`state_dict` holds only tensors and plain containers (``torch.load(weights_only=True)``)."""
        ...

    def forward_backward(
        self, micros: Sequence[TensorDictBase], loss_fn: LossFn, spec: OutputSpec
    ) -> list[dict[str, torch.Tensor]]:
        """Forward every micro-batch, call ``loss_fn(micro, outputs)``, back-propagate its loss; gradients accumulate
        over the micro-batches (synchronised over dp once, after the last). Returns ``loss_fn``'s metrics per
        micro-batch, in order (``[]`` on ranks that compute no loss, e.g. early PP stages).

        One call for all micro-batches of a mini-batch, so that an engine can run a pipeline schedule over them.
        """
        ...

    def optimizer_step(self) -> StepResult:
        """Clip the gradient norm, step unless it is not finite, and clear the gradients."""
        ...

    def zero_grad(self) -> None:
        """Clear the accumulated gradients without stepping."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and engine state of this rank (its shard)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same layout)."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters under the engine's names (what a rollout engine's ``update_weights`` gets)."""
        ...


class EngineBase:
    """The plumbing every engine shares (no PPO, no framework): layout attributes, model modes, the optimiser's
    presence, learning rate and parameters. Subclasses set ``dp_rank``, ``dp_size`` and ``is_collect_rank``
    (default: one rank) and implement ``all_reduce_sum``, ``forward``, ``forward_backward``, ``optimizer_step``,
    ``zero_grad``, ``state_dict`` and ``load_state_dict``.

    Args:
        module: the model without any data-parallel wrapper (state dicts and parameters are read from it).
        model: what runs forward/backward (``module`` wrapped for data parallelism, or ``module`` itself).
        head: ``"policy"`` or ``"value"``.
        device: where the model and the micro-batches live.
        optim: optimiser settings; None for a forward-only engine.
        optimizer: the optimiser (None for a forward-only engine).
    """

    checkpoint_weights_only = True
    dp_rank = 0
    dp_size = 1
    is_collect_rank = True

    def __init__(
        self,
        module: nn.Module,
        model: nn.Module,
        *,
        head: str,
        device: torch.device,
        optim: OptimConfig | None = None,
        optimizer: Any = None,
    ) -> None:
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        if (optim is None) != (optimizer is None):
            raise ValueError("optim and optimizer must both be given (a trained engine) or both be None")
        self.module, self.model = module, model
        self.head, self.device = head, device
        self.optim_config, self.optimizer = optim, optimizer

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def _trained(self) -> tuple[OptimConfig, Any]:
        """The optimiser settings and the optimiser; ``ValueError`` for a forward-only engine."""
        if self.optim_config is None:
            raise ValueError(
                f"this {type(self).__name__} is forward-only (built without optim): it has no optimizer"
            )
        return self.optim_config, self.optimizer

    @property
    def lr(self) -> float:
        return float(self._trained()[1].param_groups[0]["lr"])

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_parameters()

    def close(self) -> None:
        if self.optimizer is not None:
            self.zero_grad()

    def zero_grad(self) -> None:
        raise NotImplementedError
