"""Slow, obviously-correct float64 reference implementations of the losses of :mod:`ppo_core.losses`.

Each oracle loops over tokens with Python floats (``math``), following the formula in the docstring of the loss it
mirrors, and returns ``(loss, metrics)`` as plain floats, with the same metric names as the loss, always (an
all-masked batch gives 0 for each). They are meant for small batches in tests, including tests of your own
implementations (draw inputs with :func:`policy_loss_inputs`):

    >>> from ppo_core.testing import vanilla_policy_loss_oracle
    >>> old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    >>> new = torch.log(torch.tensor([[0.6, 0.9, 0.1]]))
    >>> adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.tensor([[1, 1, 0]])
    >>> loss, metrics = vanilla_policy_loss_oracle(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    >>> round(loss, 6), sorted(metrics)  # (−1.2 − 1.28) / 2: the second token is clipped at 1.28
    (-1.24, ['pg_clipfrac', 'pg_clipfrac_lower', 'ppo_kl'])

Conventions shared with the library: every denominator is clamped to at least 1 (an empty mask gives 0), the
log-ratio is clamped to ±20 wherever it is exponentiated (``ppo_kl`` is the mean of the clamped ``old − new``),
masked entries are never read, and ``rollout_is_weights`` multiply the per-token loss. Aggregation keywords
(``loss_agg_mode``, ``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) are passed through
``**agg`` to :func:`agg_loss_oracle`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ppo_core.testing.strategies import _mask_summary, _tensor_kind, response_masks

__all__ = [
    "PolicyLossInputs",
    "agg_loss_oracle",
    "cispo_policy_loss_oracle",
    "clip_cov_policy_loss_oracle",
    "dppo_kl_policy_loss_oracle",
    "dppo_tv_policy_loss_oracle",
    "dro_policy_loss_oracle",
    "entropy_loss_oracle",
    "geo_mean_policy_loss_oracle",
    "gpg_policy_loss_oracle",
    "gspo_policy_loss_oracle",
    "kl_cov_policy_loss_oracle",
    "policy_loss_inputs",
    "sapo_policy_loss_oracle",
    "value_loss_oracle",
    "vanilla_policy_loss_oracle",
]

Grid = list[list[float]]
Metrics = dict[str, float]


def _grid(t: torch.Tensor) -> Grid:
    return t.detach().to(torch.float64).cpu().tolist()


def _valid(mask: torch.Tensor) -> list[list[bool]]:
    return (mask.detach().cpu() != 0).tolist()


def _cells(mask: list[list[bool]]) -> list[tuple[int, int]]:
    """Valid ``(i, t)`` positions in row-major order."""
    return [(i, t) for i, row in enumerate(mask) for t, ok in enumerate(row) if ok]


def _frac(flags: list[bool], n_valid: int) -> float:
    return sum(flags) / max(n_valid, 1)


def _log_ratio(new: float, old: float) -> float:
    return min(max(new - old, -20.0), 20.0)


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def agg_loss_oracle(
    loss_mat: torch.Tensor | Grid,
    loss_mask: torch.Tensor | list[list[bool]],
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> float:
    """Reference :func:`ppo_core.losses.agg_loss` with explicit loops (``[B, T]`` tensors or nested lists)."""
    loss = _grid(loss_mat) if isinstance(loss_mat, torch.Tensor) else loss_mat
    mask = _valid(loss_mask) if isinstance(loss_mask, torch.Tensor) else loss_mask
    row_sums, counts = [], []
    for loss_row, mask_row in zip(loss, mask, strict=True):
        row_sums.append(sum(x for x, ok in zip(loss_row, mask_row, strict=True) if ok))
        counts.append(sum(1 for ok in mask_row if ok))
    if loss_agg_mode == "token-sum":
        return sum(row_sums) * dp_size
    if loss_agg_mode == "token-mean":
        n_tokens = sum(counts) if batch_num_tokens is None else float(batch_num_tokens)
        return sum(row_sums) / max(n_tokens, 1) * dp_size
    n_seqs = sum(1 for n in counts if n > 0) if global_batch_size is None else float(global_batch_size)
    n_seqs = max(n_seqs, 1)
    if loss_agg_mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(row_sums, counts, strict=True) if n > 0) / n_seqs * dp_size
    if loss_agg_mode == "seq-mean-token-sum":
        return sum(row_sums) / n_seqs * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        assert loss_scale_factor is not None, "the oracle needs loss_scale_factor, like agg_loss"
        return sum(row_sums) / n_seqs * dp_size / loss_scale_factor
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")


TokenFn = Callable[[float, float, float], tuple[float, dict[str, bool]]]
_CLIP_FLAGS = ("pg_clipfrac", "pg_clipfrac_lower")


def _per_token(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    token_fn: TokenFn,
    rollout_is_weights: torch.Tensor | None,
    agg: dict[str, Any],
    flag_names: tuple[str, ...] = (),
    clamp_kl: bool = True,
) -> tuple[float, Metrics]:
    """Apply ``token_fn(old, new, adv) -> (loss, flags)`` to every valid token, weight, aggregate, average flags.

    ``flag_names`` are the flags ``token_fn`` returns: each becomes a metric, 0 when no token is valid.
    ``ppo_kl`` is the mean of ``old − new``, clamped to ±20 like the log-ratio unless ``clamp_kl`` is False.
    """
    o, n, a, valid = _grid(old), _grid(new), _grid(adv), _valid(mask)
    w = _grid(rollout_is_weights) if rollout_is_weights is not None else None
    loss = [[0.0] * len(row) for row in valid]
    flags: dict[str, list[bool]] = {name: [] for name in flag_names}
    cells = _cells(valid)
    for i, t in cells:
        value, token_flags = token_fn(o[i][t], n[i][t], a[i][t])
        loss[i][t] = value * (w[i][t] if w is not None else 1.0)
        assert set(token_flags) == set(flag_names), (sorted(token_flags), flag_names)
        for name, flag in token_flags.items():
            flags[name].append(flag)
    metrics = {name: _frac(f, len(cells)) for name, f in flags.items()}
    metrics["ppo_kl"] = _ppo_kl(o, n, cells, clamp_kl)
    return agg_loss_oracle(loss, valid, **agg), metrics


def _ppo_kl(o: Grid, n: Grid, cells: list[tuple[int, int]], clamp: bool = True) -> float:
    """Mean over valid tokens of ``old − new`` (``−Δ``), clamped to ±20 like the losses' log-ratio."""
    kl = (-_log_ratio(n[i][t], o[i][t]) if clamp else o[i][t] - n[i][t] for i, t in cells)
    return sum(kl) / max(len(cells), 1)


def vanilla_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``vanilla`` (PPO clip + dual clip; ``clip_ratio_c=None``: no dual clip) loss."""

    def token(o: float, n: float, a: float) -> tuple[float, dict[str, bool]]:
        r = math.exp(_log_ratio(n, o))
        l1, l2 = -a * r, -a * _clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        lc = max(l1, l2)
        if clip_ratio_c is None:
            return lc, {"pg_clipfrac": l2 > l1, "pg_clipfrac_lower": False}
        l3 = -a * clip_ratio_c
        value = min(lc, l3) if a < 0 else lc
        return value, {"pg_clipfrac": l2 > l1, "pg_clipfrac_lower": a < 0 and lc > l3}

    return _per_token(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, _CLIP_FLAGS
    )


def gpg_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``gpg`` loss ``−A·log_prob``."""
    return _per_token(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        lambda o, n, a: (-a * n, {}),
        rollout_is_weights,
        agg,
    )


def dro_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    dro_beta: float,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``dro`` loss ``−A·log_prob + ½·β·(log_prob − old_log_prob)²`` (unclamped, as is its ``ppo_kl``)."""
    return _per_token(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        lambda o, n, a: (-a * n + 0.5 * dro_beta * (n - o) ** 2, {}),
        rollout_is_weights,
        agg,
        clamp_kl=False,
    )


def sapo_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``sapo`` loss ``−A·σ(τ(r − 1))·4/τ``."""

    def token(o: float, n: float, a: float) -> tuple[float, dict[str, bool]]:
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(_log_ratio(n, o))
        return -a * 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0))), {}

    return _per_token(old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg)


def cispo_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``cispo`` loss ``−clip(r)·A·log_prob``."""

    def token(o: float, n: float, a: float) -> tuple[float, dict[str, bool]]:
        r = math.exp(_log_ratio(n, o))
        rc = _clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        return -rc * a * n, {"pg_clipfrac": rc != r}

    return _per_token(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, ("pg_clipfrac",)
    )


def _dppo_token(valid: bool, o: float, n: float, a: float, c: float | None) -> tuple[float, dict[str, bool]]:
    r = math.exp(_log_ratio(n, o))
    c = math.inf if c is None else c
    value = -a * min(r, c) * n if valid else 0.0
    return value, {"pg_clipfrac": not valid, "pg_clipfrac_lower": valid and r > c}


def dppo_tv_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``dppo_tv`` loss (total-variation trust region on the token probability)."""

    def token(o: float, n: float, a: float) -> tuple[float, dict[str, bool]]:
        diff = math.exp(n) - math.exp(o)
        valid = diff <= clip_ratio_high if a > 0 else diff >= -clip_ratio_low
        return _dppo_token(valid, o, n, a, clip_ratio_c)

    return _per_token(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, _CLIP_FLAGS
    )


def dppo_kl_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``dppo_kl`` loss (binary-KL trust region on the token probability)."""

    def token(o: float, n: float, a: float) -> tuple[float, dict[str, bool]]:
        p, p_old = math.exp(n), math.exp(o)
        div = p_old * (o - n) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = div <= clip_ratio_high or p <= p_old if a > 0 else div <= clip_ratio_low or p >= p_old
        return _dppo_token(valid, o, n, a, clip_ratio_c)

    return _per_token(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, _CLIP_FLAGS
    )


def gspo_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``gspo`` loss: PPO clipping of ``exp(mean_t Δ)`` shared by all tokens of a row."""
    o, n, valid = _grid(old_log_prob), _grid(log_prob), _valid(response_mask)
    seq_ratio = []
    for i, row in enumerate(valid):
        logs = [_log_ratio(n[i][t], o[i][t]) for t, ok in enumerate(row) if ok]
        seq_ratio.append(math.exp(sum(logs) / max(len(logs), 1)))

    def token(_o: float, i_t: float, a: float) -> tuple[float, dict[str, bool]]:
        s = seq_ratio[int(i_t) // len(valid[0])]
        l1, l2 = -a * s, -a * _clip(s, 1 - clip_ratio_low, 1 + clip_ratio_high)
        return max(l1, l2), {"pg_clipfrac": l2 > l1}

    return _with_positions(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, ("pg_clipfrac",)
    )


def geo_mean_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    global_batch_size: float | None = None,
    **_ignored: Any,
) -> tuple[float, Metrics]:
    """Reference ``geo_mean`` (GMPO) loss: ``Σ_i −mean(A)·exp(mean(Δ*))·geomean(w) / G · dp``."""
    o, n, a, valid = _grid(old_log_prob), _grid(log_prob), _grid(advantages), _valid(response_mask)
    w = _grid(rollout_is_weights) if rollout_is_weights is not None else None
    total, rows_with_tokens, upper, lower = 0.0, 0, [], []
    for i, row in enumerate(valid):
        ts = [t for t, ok in enumerate(row) if ok]
        if not ts:
            continue
        rows_with_tokens += 1
        clipped_sum = log_w = adv_sum = 0.0
        for t in ts:
            d = _log_ratio(n[i][t], o[i][t])
            dc = _clip(d, -clip_ratio_low, clip_ratio_high)
            sgn = (a[i][t] > 0) - (a[i][t] < 0)
            clipped_sum += sgn * min(sgn * d, sgn * dc)
            adv_sum += a[i][t]
            log_w += math.log(w[i][t] + 1e-10) if w is not None else 0.0
            upper.append(d != dc and a[i][t] > 0)
            lower.append(d != dc and a[i][t] < 0)
        total += -adv_sum / len(ts) * math.exp((clipped_sum + log_w) / len(ts))
    n_seqs = max(rows_with_tokens if global_batch_size is None else float(global_batch_size), 1)
    cells = _cells(valid)
    metrics = {
        "pg_clipfrac": _frac(upper, len(cells)),
        "pg_clipfrac_lower": _frac(lower, len(cells)),
        "ppo_kl": _ppo_kl(o, n, cells),
    }
    return total / n_seqs * dp_size, metrics


def _covariance(a: Grid, n: Grid, cells: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-cell ``(a − mean a)(n − mean n)``, each centred about the first cell's value before its mean is taken
    (so that constant values give exactly 0)."""

    def centred(g: Grid) -> dict[tuple[int, int], float]:
        if not cells:
            return {}
        ref = g[cells[0][0]][cells[0][1]]
        shifted = {c: g[c[0]][c[1]] - ref for c in cells}
        mean = sum(shifted.values()) / len(cells)
        return {c: x - mean for c, x in shifted.items()}

    ca, cn = centred(a), centred(n)
    return {c: ca[c] * cn[c] for c in cells}


def _n_selected(ratio: float, n_valid: int) -> int:
    return 0 if ratio == 0 or n_valid == 0 else max(int(ratio * n_valid), 1)


def clip_cov_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    generator: torch.Generator,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``clip_cov``; the random pick is ``torch.randperm(n_candidates, generator=generator)[:k]``."""
    o, n, a, valid = _grid(old_log_prob), _grid(log_prob), _grid(advantages), _valid(response_mask)
    cells = _cells(valid)
    cov = _covariance(a, n, cells)
    candidates = []
    for i, t in cells:
        r = math.exp(_log_ratio(n[i][t], o[i][t]))
        clipped = -a[i][t] * _clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high) > -a[i][t] * r
        if not clipped and clip_cov_lb < cov[i, t] < clip_cov_ub:
            candidates.append((i, t))
    k = _n_selected(clip_cov_ratio, len(cells))
    detached = set()
    if k and candidates:
        perm = torch.randperm(len(candidates), generator=generator, device=generator.device).tolist()
        detached = {candidates[j] for j in perm[:k]}

    def token(_s: float, i_t: float, _a: float) -> tuple[float, dict[str, bool]]:
        i, t = divmod(int(i_t), len(valid[0]))
        r = math.exp(_log_ratio(n[i][t], o[i][t]))
        l1, l2 = -a[i][t] * r, -a[i][t] * _clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        return (0.0 if (i, t) in detached else max(l1, l2)), {"pg_clipfrac": (i, t) in detached}

    return _with_positions(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg, ("pg_clipfrac",)
    )


def kl_cov_policy_loss_oracle(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[float, Metrics]:
    """Reference ``kl_cov``: ``−A·r`` plus ``ppo_kl_coef·|Δ|`` on the top-k covariance tokens (ties: earlier)."""
    o, n, a, valid = _grid(old_log_prob), _grid(log_prob), _grid(advantages), _valid(response_mask)
    cells = _cells(valid)
    cov = _covariance(a, n, cells)
    ranked = sorted(cells, key=lambda c: -cov[c])  # sorted() is stable: ties keep row-major order
    penalised = set(ranked[: _n_selected(kl_cov_ratio, len(cells))])

    def token(_s: float, i_t: float, _a: float) -> tuple[float, dict[str, bool]]:
        i, t = divmod(int(i_t), len(valid[0]))
        d = _log_ratio(n[i][t], o[i][t])
        value = -a[i][t] * math.exp(d) + (ppo_kl_coef * abs(d) if (i, t) in penalised else 0.0)
        return value, {}

    loss, metrics = _with_positions(
        old_log_prob, log_prob, advantages, response_mask, token, rollout_is_weights, agg
    )
    metrics["ppo_kl_abs"] = sum(abs(_log_ratio(n[i][t], o[i][t])) for i, t in cells) / max(len(cells), 1)
    return loss, metrics


def _with_positions(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    token_fn: TokenFn,
    rollout_is_weights: torch.Tensor | None,
    agg: dict[str, Any],
    flag_names: tuple[str, ...] = (),
) -> tuple[float, Metrics]:
    """:func:`_per_token` where ``token_fn`` receives the flat position instead of ``new`` (for global selections)."""
    positions = torch.arange(mask.numel(), dtype=torch.float64).reshape(mask.shape)
    loss, metrics = _per_token(old, positions, adv, mask, token_fn, rollout_is_weights, agg, flag_names)
    metrics["ppo_kl"] = _ppo_kl(_grid(old), _grid(new), _cells(_valid(mask)))
    return loss, metrics


def value_loss_oracle(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    **agg: Any,
) -> tuple[float, float]:
    """Reference clipped value loss ``½·agg(max((v − R)², (clip(v, V ± c) − R)²))`` and its clip fraction."""

    def token(v_old: float, v: float, ret: float) -> tuple[float, dict[str, bool]]:
        l1 = (v - ret) ** 2
        if cliprange_value is None:
            return l1, {"clipfrac": False}
        l2 = (_clip(v, v_old - cliprange_value, v_old + cliprange_value) - ret) ** 2
        return max(l1, l2), {"clipfrac": l2 > l1}

    loss, metrics = _per_token(values, vpreds, returns, response_mask, token, None, agg, ("clipfrac",))
    return 0.5 * loss, metrics["clipfrac"]


def entropy_loss_oracle(logits: torch.Tensor, response_mask: torch.Tensor, **agg: Any) -> float:
    """Reference entropy loss: per-token ``−Σ_v p_v log p_v`` (``0·log 0 = 0``) aggregated by :func:`agg_loss_oracle`."""
    z = logits.detach().to(torch.float64).cpu().tolist()
    valid = _valid(response_mask)
    ent = [[0.0] * len(row) for row in valid]
    for i, t in _cells(valid):
        top = max(z[i][t])
        lse = top + math.log(sum(math.exp(x - top) for x in z[i][t]))
        ent[i][t] = -sum(math.exp(x - lse) * (x - lse) for x in z[i][t] if x != -math.inf)
    return agg_loss_oracle(ent, valid, **agg)


@dataclass(repr=False)
class PolicyLossInputs:
    """Arguments of a policy loss: ``[B, T]`` tensors, ``rollout_is_weights`` optional."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None = None

    def __repr__(self) -> str:
        """One line: sizes, dtype, whether IS weights are present, the mask's structure (not every tensor)."""
        batch, seq_len = self.response_mask.shape
        weights = "with" if self.rollout_is_weights is not None else "without"
        return (
            f"PolicyLossInputs(B={batch}, T={seq_len}, {_tensor_kind(self.log_prob)}, {weights} rollout_is_weights, "
            f"{_mask_summary(self.response_mask)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """The same line for hypothesis' failure reports and IPython, which pretty-print dataclasses field by field."""
        printer.text(repr(self))


@st.composite
def policy_loss_inputs(
    draw: st.DrawFn,
    *,
    max_batch: int = 8,
    max_len: int = 12,
    vocab_size: int = 6,
    with_is_weights: bool | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> PolicyLossInputs:
    """Inputs for a policy loss: masks from :func:`ppo_core.testing.response_masks` (right padding, interior gaps,
    all-masked rows) and log-probs of sampled tokens under two real softmax policies.

    The new policy's logits are the old ones plus ``scale`` times Gaussian noise (``scale`` 0 gives the on-policy
    ratio 1; large scales trigger clipping). Advantages are per token, per sequence (GRPO-like) or per sequence
    with some exact zeros. IS weights, when drawn, lie in [0.5, 2]. The floating contents come from a
    ``torch.Generator`` seeded by hypothesis (fast, reproducible).
    """
    mask = draw(response_masks(max_batch=max_batch, max_len=max_len))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    shape = mask.shape
    scale = draw(st.sampled_from([0.0, 0.3, 1.0, 3.0]))
    logits = 2.0 * torch.randn(*shape, vocab_size, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab_size, (*shape, 1), generator=gen)
    new_logits = logits + scale * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(logits, dim=-1).gather(-1, tokens).squeeze(-1)
    new = torch.log_softmax(new_logits, dim=-1).gather(-1, tokens).squeeze(-1)
    kind = draw(st.sampled_from(["token", "sequence", "sequence_with_zeros"]))
    if kind == "token":
        adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    else:
        adv = torch.randn(shape[0], 1, generator=gen, dtype=torch.float64).expand(shape).clone()
        if kind == "sequence_with_zeros":
            adv = adv * (torch.rand(shape[0], 1, generator=gen, dtype=torch.float64) < 0.6)
    weights = None
    if with_is_weights if with_is_weights is not None else draw(st.booleans()):
        weights = 0.5 + 1.5 * torch.rand(shape, generator=gen, dtype=torch.float64)

    def _to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype, device=device)

    return PolicyLossInputs(
        old_log_prob=_to(old),
        log_prob=_to(new),
        advantages=_to(adv),
        response_mask=mask.to(device),
        rollout_is_weights=None if weights is None else _to(weights),
    )
