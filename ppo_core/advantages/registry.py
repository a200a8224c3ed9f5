"""Advantage estimators by name, all called the same way.

Calling convention: every registered estimator is called with keyword arguments only, drawn from the fields of
:class:`AdvantageInputs`, and returns ``(advantages, returns)``, both ``[B, T]``::

    fn = get_advantage_estimator(cfg.adv_estimator)          # "gae", "grpo", "rloo", ...
    advantages, returns = fn(
        token_level_rewards=rewards, response_mask=mask,      # always
        index=uids, values=values, reward_baselines=baselines,  # pass what you have; each takes what it needs
        gamma=cfg.gamma, lam=cfg.lam, norm_by_std=cfg.norm_by_std,
    )

An estimator ignores the inputs and options it does not use, raises ``ValueError`` naming an input it needs but
did not get (``values`` for ``gae``, ``index`` for the group estimators, ``reward_baselines`` for ``remax``), and
raises ``TypeError`` for a keyword that is not a field of :class:`AdvantageInputs` (so a misspelt option such as
``norm_adv_by_std=False`` can never be silently dropped; verl's dispatcher does not even pass
``norm_adv_by_std_in_grpo=False`` to ``grpo_vectorized`` or GDPO, which then still divide by the std). A
custom estimator should accept ``**kwargs`` and parse them with ``AdvantageInputs(**kwargs)`` to get the same
behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import torch

from ppo_core.advantages._common import IndexLike

__all__ = [
    "AdvantageInputs",
    "advantage_estimator_names",
    "get_advantage_estimator",
    "register_advantage_estimator",
]

AdvantageEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
F = TypeVar("F", bound=AdvantageEstimatorFn)

_REGISTRY: dict[str, AdvantageEstimatorFn] = {}


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """Everything a registered advantage estimator may be given (the registry's single calling convention)."""

    token_level_rewards: torch.Tensor
    """``[B, T]`` floating token-level rewards (after any in-reward KL penalty)."""
    response_mask: torch.Tensor
    """``[B, T]`` bool or 0/1 mask of the tokens the policy produced."""
    index: IndexLike | None = None
    """``[B]`` group label per row (1-D int tensor or sequence of hashable ids); needed by group estimators."""
    values: torch.Tensor | None = None
    """``[B, T]`` critic values; needed by ``gae``."""
    reward_baselines: torch.Tensor | None = None
    """``[B]`` greedy-rollout rewards; needed by ``remax``."""
    gamma: float = 1.0
    """Discount, used by ``gae`` and ``reinforce_plus_plus``."""
    lam: float = 1.0
    """GAE lambda, used by ``gae``."""
    whiten: bool = True
    """Whiten the GAE advantages over the batch's valid tokens (``gae`` only)."""
    norm_by_std: bool = True
    """Divide by the group std (``grpo``, ``grpo_passk``); False gives Dr.GRPO."""
    epsilon: float = 1e-6
    """Added to the group std (``grpo``, ``grpo_passk``)."""
    f_norm: float = 1.0
    """GPG divisor (``gpg``)."""
    alpha: float | None = None
    """GPG scale; None for the adaptive ``B / #nonzero`` (``gpg``)."""

    def require(self, field: str, estimator: str) -> Any:
        """The value of ``field``, or ``ValueError`` naming it when it is None."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(
                f"{field} is required by the {estimator!r} advantage estimator but was not given"
            )
        return value


def _key(name: str | Enum) -> str:
    key = name.value if isinstance(name, Enum) else name
    if not isinstance(key, str) or not key:
        raise TypeError(f"name must be a non-empty str (or a str-valued Enum), got {name!r}")
    return key


def register_advantage_estimator(name: str | Enum) -> Callable[[F], F]:
    """Decorator registering an estimator under ``name`` (case-sensitive); returns the function unchanged.

    Registering the same function twice is allowed; a different function under a taken name raises
    ``ValueError``. The function must follow the calling convention of :class:`AdvantageInputs`.

    Example:
        >>> @register_advantage_estimator("my_constant")
        ... def my_constant(**kwargs):
        ...     x = AdvantageInputs(**kwargs)
        ...     adv = x.response_mask.to(x.token_level_rewards.dtype)
        ...     return adv, adv.clone()
    """
    key = _key(name)

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"an advantage estimator must be callable, got {type(fn).__name__}")
        existing = _REGISTRY.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"advantage estimator {key!r} is already registered to {existing.__qualname__}; "
                "pick another name"
            )
        _REGISTRY[key] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str | Enum) -> AdvantageEstimatorFn:
    """The estimator registered under ``name``; ``ValueError`` listing the valid names if there is none.

    Example:
        >>> fn = get_advantage_estimator("grpo")
        >>> adv, ret = fn(token_level_rewards=torch.tensor([[1.0], [0.0]]), response_mask=torch.ones(2, 1),
        ...               index=["u", "u"], norm_by_std=False)
        >>> adv.squeeze(-1)
        tensor([ 0.5000, -0.5000])
    """
    key = _key(name)
    if key not in _REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {key!r}; valid names: {', '.join(advantage_estimator_names())}"
        )
    return _REGISTRY[key]


def advantage_estimator_names() -> tuple[str, ...]:
    """The registered names, sorted.

    Example:
        >>> "gae" in advantage_estimator_names()
        True
    """
    return tuple(sorted(_REGISTRY))
