"""Shared plumbing of the policy losses: validation, masking of padding, the log-ratio clamp, aggregation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppo_core._checks import check_floating, check_mask, check_ndim, check_same_shape
from ppo_core.losses.aggregation import _check_loss_agg_mode, agg_loss
from ppo_core.losses.config import PolicyLossConfig
from ppo_core.losses.registry import PolicyLossFn, register_policy_loss
from ppo_core.masked import masked_mean

__all__ = ["LOG_RATIO_CLAMP"]

LOG_RATIO_CLAMP = 20.0
"""Every loss clamps the log-ratio ``Δ = log_prob − old_log_prob`` to ``[−20, 20]`` before exponentiating.

So a huge ``Δ`` gives a finite loss and gradient."""


@dataclass
class _LossInputs:
    old: torch.Tensor
    new: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None
    config: PolicyLossConfig
    agg: dict[str, Any]
    generator: torch.Generator | None = None

    def log_ratio(self) -> torch.Tensor:
        return (self.new - self.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Detached masked mean over valid tokens (0 when none), for metrics; at least fp32 for half inputs."""
        dtype = torch.promote_types(self.new.dtype, torch.float32)
        return masked_mean(values.detach().to(dtype), self.mask)

    def ppo_kl(self) -> torch.Tensor:
        return self.mean(self.old - self.new)

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        if self.is_weights is not None:
            per_token = per_token * self.is_weights
        return agg_loss(per_token, self.mask, **self.agg)


def _prepare(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: PolicyLossConfig | None,
    loss_agg_mode: str | None,
    rollout_is_weights: torch.Tensor | None,
    dp_size: int,
    batch_num_tokens: Any,
    global_batch_size: Any,
    loss_scale_factor: float | None,
) -> _LossInputs:
    """Validate the common arguments and replace every masked entry by a harmless constant.

    Masked entries are replaced with ``torch.where`` (not multiplied), so NaN/inf in padding reach neither the loss
    nor any gradient, and padding values cannot change anything.
    """
    if config is None:
        config = PolicyLossConfig()
    elif not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    mode = _check_loss_agg_mode(config.loss_agg_mode if loss_agg_mode is None else loss_agg_mode)
    old = check_ndim("old_log_prob", check_floating("old_log_prob", old_log_prob), 2)
    new = check_floating("log_prob", log_prob)
    adv = check_floating("advantages", advantages)
    check_same_shape(old_log_prob=old, log_prob=new, advantages=adv)
    mask = check_mask("response_mask", response_mask, like=old, like_name="old_log_prob")
    zero = torch.zeros((), dtype=new.dtype, device=new.device)
    weights = None
    if rollout_is_weights is not None:
        weights = check_floating("rollout_is_weights", rollout_is_weights)
        check_same_shape(old_log_prob=old, rollout_is_weights=weights)
        # IS weights are constants of the rollout, never differentiated (as in verl).
        weights = torch.where(mask, weights.detach(), torch.ones_like(zero))
    agg = {
        "loss_agg_mode": mode,
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    return _LossInputs(
        old=torch.where(mask, old.detach(), zero),
        new=torch.where(mask, new, zero),
        adv=torch.where(mask, adv.detach(), zero),
        mask=mask,
        is_weights=weights,
        config=config,
        agg=agg,
    )


LossCore = Callable[[_LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _policy_loss(name: str) -> Callable[[LossCore], PolicyLossFn]:
    """Turn ``core(inputs) -> (loss, metrics)`` into a public loss with the common signature and register it.

    The public function keeps the core's name and docstring; validation and masking happen once, in
    :func:`_prepare`, for every loss.
    """

    def decorator(core: LossCore) -> PolicyLossFn:
        def loss_fn(
            old_log_prob: torch.Tensor,
            log_prob: torch.Tensor,
            advantages: torch.Tensor,
            response_mask: torch.Tensor,
            *,
            config: PolicyLossConfig | None = None,
            loss_agg_mode: str | None = None,
            rollout_is_weights: torch.Tensor | None = None,
            dp_size: int = 1,
            batch_num_tokens: int | float | torch.Tensor | None = None,
            global_batch_size: int | float | torch.Tensor | None = None,
            loss_scale_factor: float | None = None,
            generator: torch.Generator | None = None,
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            inputs = _prepare(
                old_log_prob, log_prob, advantages, response_mask, config=config, loss_agg_mode=loss_agg_mode,
                rollout_is_weights=rollout_is_weights, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
            )  # fmt: skip
            inputs.generator = generator
            return core(inputs)

        loss_fn.__name__ = loss_fn.__qualname__ = core.__name__
        loss_fn.__doc__ = core.__doc__
        loss_fn.__module__ = core.__module__
        return register_policy_loss(name)(loss_fn)

    return decorator
