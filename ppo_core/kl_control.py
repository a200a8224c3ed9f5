"""KL coefficient controllers (fixed, adaptive from Ziegler et al. 2019) and the in-reward KL penalty.

The adaptive rule (arXiv 1909.08593, as in verl): ``e = clip(KL / target_kl - 1, -0.2, 0.2)`` and
``beta <- beta * (1 + e * n_steps / horizon)``, where ``n_steps`` is the number of sequences in the batch.

Deviations from verl (``docs/semantics.md``):

- the multiplier is clamped at 0, so beta never turns negative (verl: with ``n_steps / horizon > 5``
  and a KL far below target, beta becomes negative and the penalty rewards divergence). A beta of 0 stays 0 under
  the multiplicative rule, so a warning is logged; keep ``horizon`` well above the batch size. Arguments are
  validated (verl: ``target_kl = 0`` is a ``ZeroDivisionError``), and a non-finite ``current_kl`` raises instead
  of turning beta into NaN.
- kept from verl: the metric ``actor/reward_kl_penalty`` is the mean over rows of per-row masked means, an
  all-masked row counting as 0; :func:`apply_kl_penalty` returns a new TensorDict instead of writing into its input
  and raises on a non-finite penalty at a valid token.
- both controllers have ``state_dict`` / ``load_state_dict`` so beta survives a resume.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from ppo_core._checks import check_floating, check_mask, check_positive
from ppo_core._config_base import ConfigBase
from ppo_core.batch._td import _shallow_copy
from ppo_core.keys import KEYS
from ppo_core.kl import kl_penalty
from ppo_core.masked import masked_mean

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLConfig",
    "KLController",
    "apply_kl_penalty",
    "build_kl_controller",
    "kl_penalty_rewards",
]

logger = logging.getLogger(__name__)

_PROPORTIONAL_ERROR_CLIP = 0.2


@runtime_checkable
class KLController(Protocol):
    """What :func:`apply_kl_penalty` and trainers need from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _BetaState:
    """beta is the only state of a controller (``target_kl`` and ``horizon`` come from the configuration)."""

    value: float

    def state_dict(self) -> dict[str, Any]:
        """``{"value": beta}``."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore beta from :meth:`state_dict` (``KeyError`` if ``"value"`` is missing)."""
        if "value" not in state:
            raise KeyError(f"KL controller state is missing key 'value' (got keys {sorted(state)})")
        self.value = check_positive("state['value']", state["value"], allow_zero=True)


class FixedKLController(_BetaState):
    """A constant coefficient beta; ``update`` does nothing.

    Example:
        >>> ctrl = FixedKLController(0.001)
        >>> ctrl.update(current_kl=5.0, n_steps=64)
        >>> ctrl.value
        0.001
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = check_positive("kl_coef", kl_coef, allow_zero=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed); accepts the same arguments as the adaptive controller."""

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value})"


class AdaptiveKLController(_BetaState):
    """Proportional controller steering the observed KL towards ``target_kl`` (Ziegler et al. 2019).

    Args:
        init_kl_coef: initial beta, ``>= 0``.
        target_kl: KL the controller aims at, ``> 0``.
        horizon: number of sequences over which the error is corrected, ``> 0``.

    Example:
        >>> ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
        >>> ctrl.update(current_kl=0.2, n_steps=10)  # KL above target: beta grows by 0.2 * 10 / 100
        >>> round(ctrl.value, 6)
        0.102
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value = check_positive("init_kl_coef", init_kl_coef, allow_zero=True)
        self.target_kl = check_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta according to the KL measured on a batch of ``n_steps`` sequences.

        Args:
            current_kl: the batch KL (a float or 0-d tensor), finite.
            n_steps: number of sequences it was measured on, ``>= 0`` (verl passes the batch size).
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 0:
            raise ValueError(f"n_steps must be an int >= 0, got {n_steps!r}")
        n_steps = int(n_steps)
        error = current_kl / self.target_kl - 1.0
        error = min(max(error, -_PROPORTIONAL_ERROR_CLIP), _PROPORTIONAL_ERROR_CLIP)
        multiplier = 1.0 + error * n_steps / self.horizon
        if multiplier < 0.0:
            logger.warning(
                "adaptive KL multiplier %.3g < 0 (n_steps / horizon = %.3g > 5); clamping beta at 0, where it "
                "stays. Use a horizon much larger than the batch size.",
                multiplier,
                n_steps / self.horizon,
            )
            multiplier = 0.0
        self.value *= multiplier

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, horizon={self.horizon})"


@dataclass(kw_only=True)
class KLConfig(ConfigBase):
    """How the in-reward KL coefficient beta is controlled (verl's ``algorithm.kl_ctrl``)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """``"fixed"`` (constant ``kl_coef``) or ``"adaptive"`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """beta, or its initial value for the adaptive controller; ``>= 0``."""
    target_kl: float = 0.1
    """KL the adaptive controller aims at; ``> 0``."""
    horizon: int = 10000
    """Sequences over which the adaptive controller corrects the error; ``> 0``."""

    def __post_init__(self) -> None:
        check_positive("kl_coef", self.kl_coef, allow_zero=True)
        check_positive("target_kl", self.target_kl)
        check_positive("horizon", self.horizon)


def build_kl_controller(config: KLConfig | dict[str, Any]) -> FixedKLController | AdaptiveKLController:
    """The controller described by ``config`` (a :class:`KLConfig` or a dict of its fields).

    Example:
        >>> build_kl_controller({"type": "adaptive", "kl_coef": 0.05})
        AdaptiveKLController(value=0.05, target_kl=0.1, horizon=10000.0)
    """
    if not isinstance(config, KLConfig):
        config = KLConfig.from_dict(config)
    if config.type == "fixed":
        return FixedKLController(config.kl_coef)
    return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)


_APPLY_KL_KEYS = (KEYS.token_level_scores, KEYS.old_log_probs, KEYS.ref_log_probs, KEYS.response_mask)


def kl_penalty_rewards(
    scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row core of :func:`apply_kl_penalty`: ``(scores - beta * kl, row_kl)``.

    Every output row depends on its own input row only, so a data-parallel rank computing it on its rows gets
    the same bits as the whole batch would (what a resident step relies on: ``docs/resident-batches.md``).

    Args:
        scores: ``[B, T]`` floating token-level scores.
        old_log_probs, ref_log_probs: ``[B, T]`` floating log-probs (checked by the caller: same shape).
        mask: ``[B, T]`` bool response mask.
        beta: the KL coefficient.
        estimator: :func:`ppo_core.kl.kl_penalty`'s estimator.

    Returns:
        ``rewards`` ``[B, T]`` in ``scores``' dtype and ``row_kl`` ``[B]``: each row's masked mean of the penalty
        (0 for an all-masked row); the batch's ``current_kl`` is ``row_kl.mean()``.

    Raises:
        ValueError: a non-finite penalty at a valid token.

    Example:
        >>> r, k = kl_penalty_rewards(torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]),
        ...                           torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.1)
        >>> r, k
        (tensor([[-0.0500,  0.0000]]), tensor([0.2500]))
    """
    with torch.no_grad():
        kld = kl_penalty(old_log_probs, ref_log_probs, estimator)
        if bool((mask & ~torch.isfinite(kld)).any()):
            raise ValueError(
                f"KL penalty ({estimator!r}) is not finite at a valid token; check old_log_probs and ref_log_probs"
            )
        kld = torch.where(mask, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
        rewards = scores - beta * kld.to(scores.dtype)
        row_kl = masked_mean(kld, mask, dim=-1)
    return rewards, row_kl


def apply_kl_penalty(
    batch: TensorDict, kl_ctrl: KLController, estimator: str = "kl"
) -> tuple[TensorDict, dict[str, float]]:
    """Shape the rewards with a KL penalty: ``token_level_rewards = token_level_scores - beta * kl``.

    Reads ``token_level_scores``, ``old_log_probs``, ``ref_log_probs`` (all ``[B, T]`` floating) and
    ``response_mask`` (``[B, T]`` bool or 0/1). The per-token penalty is :func:`ppo_core.kl.kl_penalty` of the old
    and reference log-probs, zeroed outside the mask (``where``, so garbage at padding never leaks). ``beta`` is
    ``kl_ctrl.value`` before this call; afterwards ``kl_ctrl.update(current_kl, n_steps=B)`` runs, where
    ``current_kl`` is the mean over rows of each row's masked mean (an all-masked row counts as 0, as in verl).
    Computed without autograd.

    Returns:
        ``(new_batch, metrics)``: ``new_batch`` is a shallow copy of ``batch`` (same tensors) with
        ``token_level_rewards`` set; ``batch`` itself is not modified. ``metrics`` holds floats
        ``actor/reward_kl_penalty`` (``current_kl``; 0 for an empty batch) and ``actor/reward_kl_penalty_coeff``
        (the beta used).

    Raises:
        KeyError: a required key is missing (the message names it).
        ValueError: shape mismatch, unknown ``estimator``, or a non-finite penalty at a valid token.

    Example:
        >>> batch = TensorDict(
        ...     {
        ...         "token_level_scores": torch.tensor([[0.0, 1.0]]),
        ...         "old_log_probs": torch.tensor([[-1.0, -1.0]]),
        ...         "ref_log_probs": torch.tensor([[-1.5, -1.0]]),
        ...         "response_mask": torch.tensor([[1, 1]]),
        ...     },
        ...     batch_size=[1],
        ... )
        >>> out, metrics = apply_kl_penalty(batch, FixedKLController(0.1))
        >>> out["token_level_rewards"]
        tensor([[-0.0500,  1.0000]])
        >>> metrics
        {'actor/reward_kl_penalty': 0.25, 'actor/reward_kl_penalty_coeff': 0.1}
    """
    if not isinstance(batch, TensorDict):
        raise TypeError(f"batch must be a tensordict.TensorDict, got {type(batch).__name__}")
    present = set(batch.keys())
    for key in _APPLY_KL_KEYS:
        if key not in present:
            raise KeyError(
                f"batch is missing key {key!r} (apply_kl_penalty needs {', '.join(_APPLY_KL_KEYS)})"
            )
    scores = check_floating(KEYS.token_level_scores, batch[KEYS.token_level_scores])
    old = check_floating(KEYS.old_log_probs, batch[KEYS.old_log_probs])
    ref = check_floating(KEYS.ref_log_probs, batch[KEYS.ref_log_probs])
    if scores.dim() != 2:
        raise ValueError(f"token_level_scores must have shape [B, T], got {tuple(scores.shape)}")
    mask = check_mask(
        KEYS.response_mask, batch[KEYS.response_mask], like=scores, like_name=KEYS.token_level_scores
    )
    for name, tensor in ((KEYS.old_log_probs, old), (KEYS.ref_log_probs, ref)):
        if tensor.shape != scores.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but token_level_scores has shape "
                f"{tuple(scores.shape)}; they must match"
            )
    beta = float(kl_ctrl.value)
    rewards, row_kl = kl_penalty_rewards(scores, old, ref, mask, beta, estimator)
    n_rows = scores.shape[0]
    current_kl = float(row_kl.mean()) if n_rows else 0.0
    out = _shallow_copy(batch)
    out[KEYS.token_level_rewards] = rewards
    kl_ctrl.update(current_kl, n_steps=n_rows)
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return out, metrics
