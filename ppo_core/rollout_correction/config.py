"""``RolloutCorrectionConfig``: importance weights and rejection against the sampler/trainer mismatch (verl's
``algorithm.rollout_correction`` section, same option names and meanings).

The rollout engine samples with log-probs ``rollout_log_probs`` that differ from the training forward's
``old_log_probs`` (other kernels, batch shapes, roundings). With ``log r = old_log_probs - rollout_log_probs`` per
token, the section chooses importance weights (``rollout_is``: truncated ``r`` per token, or the truncated product
of a sequence's ``r``) and rejection filters (``rollout_rs``: tokens or sequences whose divergence estimate leaves a
bound are removed from the policy loss). See :func:`ppo_core.rollout_correction.compute_rollout_correction` and
``docs/semantics.md`` ("Rollout correction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ppo_core._checks import FieldValueError, check_positive
from ppo_core._config_base import ConfigBase

__all__ = ["ROLLOUT_RS_OPTIONS", "RejectionBound", "RolloutCorrectionConfig", "parse_rollout_rs"]

ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""The rejection filters: ``{token, seq_sum, seq_mean, seq_max}`` of the per-token statistic ``k1 = -log r``,
``k2 = (log r)^2 / 2`` or ``k3 = r - 1 - log r``."""


@dataclass(frozen=True)
class RejectionBound:
    """The accepted range of one rejection filter's statistic: ``lower <= stat <= upper`` (``lower`` None: none).

    For the ``k1`` filters both bounds are logs of the configured ratio bounds; for ``k2``/``k3`` ``upper`` is the
    configured bound itself.
    """

    option: str
    lower: float | None
    upper: float


def _threshold_error(spec: str, option: str, problem: str) -> FieldValueError:
    return FieldValueError("rollout_rs_threshold", f": entry {spec!r} of option {option!r} {problem}")


def _parse_k1(spec: str, option: str) -> tuple[float, float]:
    lower_text, sep, upper_text = spec.partition("_")
    if not sep:  # one number: the upper ratio bound; the lower one is its reciprocal (verl)
        lower_text, upper_text = "", spec
    try:
        if "_" in upper_text or "_" in lower_text:  # (float() reads "2_0" as 20)
            raise ValueError
        upper = float(upper_text)
        lower = 1.0 / upper if not sep else float(lower_text)
    except (ValueError, ZeroDivisionError):
        raise _threshold_error(
            spec, option, "must be a positive number or 'lower_upper' (e.g. '0.5_2.0')"
        ) from None
    if not (math.isfinite(lower) and math.isfinite(upper) and 0 < lower <= upper):
        raise _threshold_error(spec, option, "needs 0 < lower <= upper, both finite")
    return math.log(lower), math.log(upper)


def parse_rollout_rs(rollout_rs: str, rollout_rs_threshold: str | float | None) -> tuple[RejectionBound, ...]:
    """The rejection filters named by ``rollout_rs`` (comma-separated, duplicates dropped, order kept) with their
    bounds from ``rollout_rs_threshold``: one entry shared by every filter, or one per filter (comma-separated).

    A ``k1`` entry is an upper ratio bound ``u`` (accepted: ``1/u <= exp(k1) <= u``, with ``exp(k1) = pi_rollout /
    pi_old`` for a token) or ``"lower_upper"``; the other filters take one positive upper bound. ``ValueError``
    names the bad entry.

    Example:
        >>> parse_rollout_rs("token_k1,seq_max_k3", "0.5_2.0,0.01")[1]
        RejectionBound(option='seq_max_k3', lower=None, upper=0.01)
    """
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    if not options:
        raise FieldValueError("rollout_rs", f"={rollout_rs!r} names no rejection option")
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if unknown:
        raise FieldValueError(
            "rollout_rs", f" has unknown option(s) {unknown}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}"
        )
    if rollout_rs_threshold is None:
        raise FieldValueError("rollout_rs_threshold", f" is needed by rollout_rs={rollout_rs!r}")
    if isinstance(rollout_rs_threshold, str):
        specs = [part.strip() for part in rollout_rs_threshold.split(",") if part.strip()]
    else:
        specs = [repr(float(rollout_rs_threshold))]
    if len(specs) not in (1, len(options)):
        raise FieldValueError(
            "rollout_rs_threshold",
            f"={rollout_rs_threshold!r} has {len(specs)} entries; rollout_rs={rollout_rs!r} needs 1 (shared) or "
            f"{len(options)}",
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = []
    for option, spec in zip(options, specs, strict=True):
        if option.endswith("k1"):
            lower, upper = _parse_k1(spec, option)
            bounds.append(RejectionBound(option, lower, upper))
            continue
        try:
            if "_" in spec:  # (float() would read "0.1_2" as 0.12)
                raise ValueError
            upper = float(spec)
        except ValueError:
            raise _threshold_error(spec, option, "must be one positive upper bound") from None
        if not (math.isfinite(upper) and upper > 0):
            raise _threshold_error(spec, option, "must be finite and > 0")
        bounds.append(RejectionBound(option, None, upper))
    return tuple(bounds)


@dataclass(kw_only=True)
class RolloutCorrectionConfig(ConfigBase):
    """Rollout correction (verl's ``algorithm.rollout_correction``). Everything off by default: no weights, no
    rejection, the old log-probs recomputed (the trainer then behaves exactly as without this section).

    Example:
        >>> cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2")
        >>> cfg.enabled, cfg.rejection_bounds()[0].option
        (True, 'seq_sum_k1')
    """

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights: None (none), ``"token"`` (``min(r_t, threshold)`` per token) or ``"sequence"`` (``min(prod_t
    r_t, threshold)`` for every token of a response)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation bound of the weights (TIS); ``> 0``."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the batch (tokens, or responses for ``"sequence"``)."""
    rollout_rs: str | None = None
    """Comma-separated rejection filters (:data:`ROLLOUT_RS_OPTIONS`); every filter must accept a token."""
    rollout_rs_threshold: str | float | None = None
    """Bounds of the filters: one shared entry or one per filter; ``k1`` takes ``u`` or ``"lower_upper"``."""
    bypass_mode: bool = False
    """Skip the old log-prob pass: the rollout's log-probs serve as the old policy (PPO's ratio then corrects the
    mismatch; ``rollout_is`` and ``rollout_rs`` must be None, see ``docs/semantics.md``)."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """The loss of the bypass mode; only ``"ppo_clip"`` (the configured policy loss) is implemented."""

    def __post_init__(self) -> None:
        check_positive("rollout_is_threshold", self.rollout_is_threshold)
        self.rejection_bounds()
        if self.loss_type != "ppo_clip":
            raise FieldValueError(
                "loss_type",
                f"={self.loss_type!r}: only 'ppo_clip' is implemented (the bypass mode's REINFORCE loss needs "
                "weights from the policy of each micro-batch)",
            )
        if self.bypass_mode and (self.rollout_is is not None or self.rollout_rs is not None):
            raise FieldValueError(
                "bypass_mode",
                "=True takes rollout_is=None and rollout_rs=None: with the rollout's log-probs as the old policy "
                "the weights and filters would need the current policy of every micro-batch, which is not "
                "implemented (verl's PPO-clip bypass does not apply the weights either)",
            )

    @property
    def enabled(self) -> bool:
        """Whether :func:`compute_rollout_correction` runs in the trainer (weights or rejection asked for)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def rejection_bounds(self) -> tuple[RejectionBound, ...]:
        """The parsed filters of ``rollout_rs`` (empty when it is None)."""
        if self.rollout_rs is None:
            return ()
        return parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)
