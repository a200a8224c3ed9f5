"""``PolicyLossConfig``: the knobs of every registered policy loss, with verl's defaults.

Clip bounds (a deliberate deviation from verl): ``clip_ratio_low`` and ``clip_ratio_high`` default to
None and then take the value of ``clip_ratio``, so setting ``clip_ratio=0.3`` alone gives the range [0.7, 1.3]. An
explicit ``clip_ratio_low``/``clip_ratio_high`` wins over ``clip_ratio``. In verl both default to 0.2, so overriding
only ``clip_ratio`` silently keeps [0.8, 1.2]. Use :attr:`PolicyLossConfig.eps_low` / :attr:`eps_high` to read the
bounds actually used.

The losses take a ``PolicyLossConfig`` or a mapping of its fields (a dict, an OmegaConf ``DictConfig``), read with
:meth:`PolicyLossConfig.from_dict`; anything else raises ``TypeError`` saying what to pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ppo_core._checks import FieldValueError, check_finite_at_least
from ppo_core._config_base import ConfigBase
from ppo_core.losses.aggregation import LossAggMode

__all__ = ["PolicyLossConfig"]

RATIO_CLIP_MODES = ("vanilla", "cispo", "gspo", "clip_cov")
"""The built-in losses that clip the importance ratio to ``[1 − ε_lo, 1 + ε_hi]``: for them ``ε_lo`` must be < 1,
since a bound ``1 − ε_lo <= 0`` is below every ratio (``r = exp(Δ) > 0``) and the lower clip would silently never
act. (dppo's ``ε_lo`` is a divergence threshold and geo_mean's a log-ratio bound: any value >= 0 means something.)"""


@dataclass(kw_only=True)
class PolicyLossConfig(ConfigBase):
    """Configuration shared by the policy losses of :mod:`ppo_core.losses` (verl's ``actor`` loss knobs).

    Example:
        >>> cfg = PolicyLossConfig(clip_ratio=0.3, clip_ratio_high=0.28)
        >>> (cfg.eps_low, cfg.eps_high)
        (0.3, 0.28)
        >>> PolicyLossConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    loss_mode: str = "vanilla"
    """Name of the policy loss in the registry (:func:`ppo_core.losses.get_policy_loss`)."""
    clip_ratio: float = 0.2
    """Symmetric PPO clip range ε; the default for ``clip_ratio_low``/``clip_ratio_high`` when they are None."""
    clip_ratio_low: float | None = None
    """Lower clip ε_lo (ratio clipped below at 1 − ε_lo, so < 1; a divergence threshold for dppo); None: ``clip_ratio``."""
    clip_ratio_high: float | None = None
    """Upper clip ε_hi (ratio clipped above at 1 + ε_hi, DAPO's clip-higher); None: ``clip_ratio``."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (also dppo's ratio truncation);
    None turns the dual clip off (the plain clipped surrogate; dppo's ratio is then not truncated)."""
    tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO gate temperature for non-positive advantages."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: fraction of valid tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window of candidate tokens."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window of candidate tokens."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: fraction of valid tokens (largest covariance) that receive the |Δ| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log-ratio| penalty (verl's config default; its code fallback is 1.0)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Default aggregation (:data:`ppo_core.losses.LOSS_AGG_MODES`) when a loss is called without one."""
    dro_beta: float | None = None
    """dro: coefficient β > 0 of the quadratic log-ratio penalty; required when ``loss_mode="dro"``."""

    def __post_init__(self) -> None:
        from ppo_core.losses.registry import _check_loss_mode

        _check_loss_mode(self.loss_mode)
        check_finite_at_least("clip_ratio", self.clip_ratio, 0.0)
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if getattr(self, name) is not None:
                check_finite_at_least(name, getattr(self, name), 0.0)
        # cispo's weight clip may stop at 0 (clip_ratio_low = 1: no lower bound, TRL's cispo)
        limit_reached = self.eps_low > 1 if self.loss_mode == "cispo" else self.eps_low >= 1
        if self.loss_mode in RATIO_CLIP_MODES and limit_reached:
            name = "clip_ratio" if self.clip_ratio_low is None else "clip_ratio_low"
            bound = "<= 1" if self.loss_mode == "cispo" else "< 1"
            raise FieldValueError(
                name,
                f" must be {bound} with loss_mode={self.loss_mode!r}, got {self.eps_low}: the ratio is clipped below at "
                f"1 - {name} = {1 - self.eps_low:g}, which no ratio (> 0) reaches, so the lower clip would never "
                "act"
                + (
                    ""
                    if self.clip_ratio_low is not None
                    else " (clip_ratio_low is unset and takes clip_ratio)"
                ),
            )
        if self.clip_ratio_c is not None:
            check_finite_at_least("clip_ratio_c", self.clip_ratio_c, 1.0, strict=True)
        check_finite_at_least("tau_pos", self.tau_pos, 0.0, strict=True)
        check_finite_at_least("tau_neg", self.tau_neg, 0.0, strict=True)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            check_finite_at_least(name, getattr(self, name), 0.0)
            if getattr(self, name) > 1:
                raise FieldValueError(name, f" must be in [0, 1], got {getattr(self, name)}")
        check_finite_at_least("clip_cov_lb", self.clip_cov_lb, -math.inf)
        check_finite_at_least("clip_cov_ub", self.clip_cov_ub, -math.inf)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb must be < clip_cov_ub, got clip_cov_lb={self.clip_cov_lb}, "
                f"clip_cov_ub={self.clip_cov_ub}"
            )
        check_finite_at_least("ppo_kl_coef", self.ppo_kl_coef, 0.0)
        if self.dro_beta is not None:
            check_finite_at_least("dro_beta", self.dro_beta, 0.0, strict=True)
        elif self.loss_mode == "dro":
            raise ValueError("dro_beta is required (a number > 0) when loss_mode='dro'")

    @property
    def eps_low(self) -> float:
        """The lower clip ε actually used: ``clip_ratio_low`` if set, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        """The upper clip ε actually used: ``clip_ratio_high`` if set, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def _as_policy_loss_config(config: object) -> PolicyLossConfig:
    """``config`` as a :class:`PolicyLossConfig`: None gives the defaults, a mapping of its fields is converted.

    Any other object, including a mapping with other keys (a whole actor config, such as verl's ``ActorConfig``,
    which keeps the clip ratios beside many unrelated fields and the loss name under ``policy_loss.loss_mode``),
    raises ``TypeError`` that lists the offending keys and says what to pass.
    """
    if config is None:
        return PolicyLossConfig()
    if isinstance(config, PolicyLossConfig):
        return config
    valid = sorted(f.name for f in fields(PolicyLossConfig))
    expected = (
        "config must be a ppo_core PolicyLossConfig, or a dict of its fields read by PolicyLossConfig.from_dict "
        f"({', '.join(valid)})"
    )
    if not isinstance(config, Mapping):
        raise TypeError(f"{expected}; got {type(config).__name__}")
    unknown = sorted(str(key) for key in config if key not in valid)
    if unknown:
        shown = ", ".join(unknown[:6]) + (", ..." if len(unknown) > 6 else "")
        raise TypeError(
            f"{expected}; got a {type(config).__name__} with other keys ({shown}). From a trainer's actor config "
            "pass only the loss fields, e.g. PolicyLossConfig(loss_mode=actor.policy_loss.loss_mode, "
            "clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low, "
            "clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c)"
        )
    return PolicyLossConfig.from_dict(dict(config))
