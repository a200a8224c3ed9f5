"""Policy-loss registry: every loss is ``fn(old_log_prob, log_prob, advantages, response_mask, *, ...)``.

Calling convention (all registered losses, see :class:`PolicyLossFn`):

``fn(old_log_prob, log_prob, advantages, response_mask, *, config=None, loss_agg_mode=None,
rollout_is_weights=None, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None,
generator=None) -> (loss, metrics)``

- tensors are ``[B, T]`` on one device; ``config`` is a :class:`~ppo_core.losses.PolicyLossConfig` or a dict of its
  fields (None: defaults);
  ``loss_agg_mode`` None means ``config.loss_agg_mode``; the aggregation keywords are those of
  :func:`~ppo_core.losses.agg_loss`; ``generator`` drives randomised losses (``clip_cov``) and is ignored by the others;
- ``loss`` is a 0-d tensor; ``metrics`` maps names (``ppo_kl`` always, ``pg_clipfrac`` and ``pg_clipfrac_lower``
  where they apply) to **0-d detached tensors** (no device sync per micro-batch; call ``float()`` to log);
- NaN/inf at a valid position of any input tensor raises ``ValueError`` naming it (one fused check, one host
  sync); half-precision inputs are computed in fp32, and the loss and metrics are then fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ppo_core.losses.config import PolicyLossConfig

__all__ = [
    "PolicyLossFn",
    "compute_policy_loss",
    "get_policy_loss",
    "policy_loss_names",
    "register_policy_loss",
]


class PolicyLossFn(Protocol):
    """The signature every registered policy loss implements."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        config: PolicyLossConfig | Mapping[str, Any] | None = None,
        loss_agg_mode: str | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: Any = None,
        global_batch_size: Any = None,
        loss_scale_factor: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``; returns the function unchanged.

    Registering a *different* function under a taken name raises ``ValueError`` (verl silently overwrites);
    registering the same function twice is allowed.

    Example:
        >>> @register_policy_loss("my_loss")
        ... def my_loss(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        ...     ...
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if not callable(fn):
            raise TypeError(f"policy loss {name!r} must be callable, got {type(fn).__name__}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss name {name!r} is already registered to {existing!r}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def policy_loss_names() -> list[str]:
    """The registered policy-loss names, sorted."""
    return sorted(_REGISTRY)


def _check_loss_mode(name: object) -> str:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"unknown policy loss (loss_mode) {name!r}; valid names: {', '.join(policy_loss_names())}"
        )
    return name


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; unknown names raise ``ValueError`` listing the valid ones.

    Example:
        >>> fn = get_policy_loss("vanilla")
        >>> lp = torch.zeros(1, 2)
        >>> loss, metrics = fn(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> loss
        tensor(-1.)
    """
    return _REGISTRY[_check_loss_mode(name)]


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: PolicyLossConfig | Mapping[str, Any],
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call the loss named by ``config.loss_mode`` (same arguments and result as the registered losses).

    ``config`` is a :class:`~ppo_core.losses.PolicyLossConfig` or a dict of its fields (read with
    ``PolicyLossConfig.from_dict``); any other object raises ``TypeError`` saying what to pass.

    Example:
        >>> from ppo_core.losses import PolicyLossConfig
        >>> lp = torch.zeros(1, 2)
        >>> loss, _ = compute_policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2), config=PolicyLossConfig())
        >>> loss
        tensor(-1.)
    """
    from ppo_core.losses.config import _as_policy_loss_config

    config = _as_policy_loss_config(config)
    fn = get_policy_loss(config.loss_mode)
    return fn(old_log_prob, log_prob, advantages, response_mask, config=config, **kwargs)
