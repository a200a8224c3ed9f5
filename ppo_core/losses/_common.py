"""Shared plumbing of the policy losses: validation, masking of padding, the log-ratio clamp, aggregation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_core._checks import (
    check_all_finite,
    check_devices_match,
    check_floating,
    check_mask_deferred,
    check_ndim,
    check_same_shape,
)
from ppo_core.losses.aggregation import _acc_dtype, _aggregate, _check_agg_args, _check_loss_agg_mode
from ppo_core.losses.config import PolicyLossConfig, _as_policy_loss_config
from ppo_core.losses.registry import PolicyLossFn, register_policy_loss
from ppo_core.masked import _mean

__all__ = ["LOG_RATIO_CLAMP"]

LOG_RATIO_CLAMP = 20.0
"""Every loss that exponentiates the log-ratio ``Δ = log_prob − old_log_prob`` clamps it to ``[−20, 20]`` first."""

_FINITE = "the policy loss needs finite inputs where response_mask is 1 (masked positions may hold anything)"


@dataclass
class _LossInputs:
    """Validated inputs of a policy loss: ``[B, T]`` tensors that are exactly 0 at masked positions.

    Half-precision inputs are upcast to fp32 (``exp(Δ)`` overflows fp16 above Δ ≈ 11, and fp16 counts above 65504),
    so the loss and the metrics are fp32 for them; the gradient flows back to ``log_prob`` in its own dtype.
    """

    old: torch.Tensor
    new: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None
    config: PolicyLossConfig
    agg: dict[str, Any]
    generator: torch.Generator | None = None
    _log_ratio: torch.Tensor | None = field(default=None, repr=False)

    def log_ratio(self) -> torch.Tensor:
        """``clamp(log_prob − old_log_prob, ±20)`` (computed once per call)."""
        if self._log_ratio is None:
            self._log_ratio = (self.new - self.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return self._log_ratio

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Detached masked mean over valid tokens (0 when none), for metrics; no host sync."""
        return _mean(values.detach().to(self.new.dtype), self.mask)

    def ppo_kl(self, log_ratio: torch.Tensor | None = None) -> torch.Tensor:
        """The ``ppo_kl`` metric: the mean over valid tokens of ``−Δ``, with ``Δ`` the log-ratio the loss uses.

        That is the ±20-clamped log-ratio (default) for every loss that exponentiates it, so metric and loss agree
        however far the policy moved; a loss that uses ``Δ`` unclamped passes it here.
        """
        return self.mean(-(self.log_ratio() if log_ratio is None else log_ratio))

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        if self.is_weights is not None:
            per_token = per_token * self.is_weights
        zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        return _aggregate(torch.where(self.mask, per_token, zero), self.mask, **self.agg)


def _prepare(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: object,
    loss_agg_mode: str | None,
    rollout_is_weights: torch.Tensor | None,
    dp_size: int,
    batch_num_tokens: Any,
    global_batch_size: Any,
    loss_scale_factor: float | None,
    forced_agg_mode: str | None = None,
) -> _LossInputs:
    """Validate the common arguments and replace every masked entry by a harmless constant.

    Masked entries are replaced with ``torch.where`` (not multiplied), so NaN/inf in padding reach neither the loss
    nor any gradient, and padding values cannot change anything. NaN/inf at a valid position raise ``ValueError``
    naming the argument: one fused check over all inputs (and the mask's 0/1 check), one host sync.
    ``forced_agg_mode`` replaces the (still validated) ``loss_agg_mode`` for losses that ignore it.
    """
    config = _as_policy_loss_config(config)
    mode = _check_loss_agg_mode(config.loss_agg_mode if loss_agg_mode is None else loss_agg_mode)
    agg = _check_agg_args(
        forced_agg_mode or mode,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor,
    )
    old = check_ndim("old_log_prob", check_floating("old_log_prob", old_log_prob), 2)
    new = check_floating("log_prob", log_prob)
    adv = check_floating("advantages", advantages)
    check_same_shape(old_log_prob=old, log_prob=new, advantages=adv)
    mask, mask_flag = check_mask_deferred("response_mask", response_mask, like=old, like_name="old_log_prob")
    weights = None
    if rollout_is_weights is not None:
        weights = check_floating("rollout_is_weights", rollout_is_weights)
        check_same_shape(old_log_prob=old, rollout_is_weights=weights)
    check_devices_match(
        log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask, rollout_is_weights=weights
    )
    dtype = _acc_dtype(new.dtype)
    zero = torch.zeros((), dtype=dtype, device=new.device)
    inputs = _LossInputs(
        old=torch.where(mask, old.detach().to(dtype), zero),
        new=torch.where(mask, new.to(dtype), zero),
        adv=torch.where(mask, adv.detach().to(dtype), zero),
        mask=mask,
        # IS weights are constants of the rollout, never differentiated (as in verl).
        is_weights=None if weights is None else torch.where(mask, weights.detach().to(dtype), zero + 1),
        config=config,
        agg=agg,
    )
    named = {"log_prob": inputs.new, "old_log_prob": inputs.old, "advantages": inputs.adv}
    if inputs.is_weights is not None:
        named["rollout_is_weights"] = inputs.is_weights
    check_all_finite(
        named,
        purpose=_FINITE,
        scope=" valid (response_mask=1)",
        mask_name="response_mask",
        mask_flag=mask_flag,
    )
    return inputs


LossCore = Callable[[_LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _policy_loss(name: str, forced_agg_mode: str | None = None) -> Callable[[LossCore], PolicyLossFn]:
    """Turn ``core(inputs) -> (loss, metrics)`` into a public loss with the common signature and register it.

    The public function keeps the core's name and docstring; validation and masking happen once, in
    :func:`_prepare`, for every loss. ``forced_agg_mode``: the aggregation of a loss that ignores ``loss_agg_mode``.
    """

    def decorator(core: LossCore) -> PolicyLossFn:
        def loss_fn(
            old_log_prob: torch.Tensor,
            log_prob: torch.Tensor,
            advantages: torch.Tensor,
            response_mask: torch.Tensor,
            *,
            config: PolicyLossConfig | Mapping[str, Any] | None = None,
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
                forced_agg_mode=forced_agg_mode,
            )  # fmt: skip
            inputs.generator = generator
            return core(inputs)

        loss_fn.__name__ = loss_fn.__qualname__ = core.__name__
        loss_fn.__doc__ = core.__doc__
        loss_fn.__module__ = core.__module__
        return register_policy_loss(name)(loss_fn)

    return decorator
