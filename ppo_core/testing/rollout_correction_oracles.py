"""A slow, obviously-correct float64 oracle of :func:`ppo_core.rollout_correction.compute_rollout_correction`:
plain Python loops over rows and tokens, following ``docs/semantics.md`` ("Rollout correction") line by line.

Example:
    >>> import torch
    >>> w, mask, m = rollout_correction_oracle(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-1.5, -1.0]]),
    ...                                        torch.ones(1, 2), {"rollout_is": "token"})
    >>> w
    tensor([[1.6487, 0.1353]], dtype=torch.float64)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["rollout_correction_oracle"]

_BOUND = 20.0


def _clamp(x: float) -> float:
    return min(max(x, -_BOUND), _BOUND)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _bounds(rollout_rs: str, threshold: Any) -> list[tuple[str, float | None, float]]:
    """``[(option, lower, upper)]``: k1 bounds are logs of the ratio bounds."""
    options: list[str] = []
    for part in rollout_rs.split(","):
        if part.strip() and part.strip() not in options:
            options.append(part.strip())
    specs = (
        [s.strip() for s in threshold.split(",") if s.strip()] if isinstance(threshold, str) else [threshold]
    )
    if len(specs) == 1:
        specs = specs * len(options)
    out = []
    for option, spec in zip(options, specs, strict=True):
        if option.endswith("k1"):
            if isinstance(spec, str) and "_" in spec:
                low, high = (float(x) for x in spec.split("_"))
            else:
                high = float(spec)
                low = 1.0 / high
            out.append((option, math.log(low), math.log(high)))
        else:
            out.append((option, None, float(spec)))
    return out


def _token_stat(estimator: str, log_r: float) -> float:
    x = _clamp(log_r)
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[estimator]


def rollout_correction_oracle(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: Mapping[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(weights [B, T] float64 or None, mask [B, T] float64, metrics)`` for a dict of
    :class:`~ppo_core.rollout_correction.RolloutCorrectionConfig` fields (masked positions are never read)."""
    cfg = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
           "rollout_rs": None, "rollout_rs_threshold": None, **dict(config)}  # fmt: skip
    old = old_log_probs.detach().double().tolist()
    roll = rollout_log_probs.detach().double().tolist()
    valid = [[bool(v) for v in row] for row in response_mask.tolist()]
    n_rows, width = response_mask.shape
    idx = [[t for t in range(width) if valid[i][t]] for i in range(n_rows)]
    rows = [i for i in range(n_rows) if idx[i]]
    lr = [[old[i][t] - roll[i][t] for t in range(width)] for i in range(n_rows)]
    tokens = [(i, t) for i in range(n_rows) for t in idx[i]]
    m: dict[str, float] = {}

    keep = [[valid[i][t] for t in range(width)] for i in range(n_rows)]
    if cfg["rollout_rs"] is not None:
        for option, lower, upper in _bounds(cfg["rollout_rs"], cfg["rollout_rs_threshold"]):
            kind, _, est = option.rpartition("_")
            tok = {(i, t): _token_stat(est, lr[i][t]) for i, t in tokens}
            row_stat: dict[int, float] = {}
            for i in range(n_rows):
                values = [tok[(i, t)] for t in idx[i]]
                if kind == "seq_sum":
                    row_stat[i] = sum(values)
                elif kind == "seq_mean":
                    row_stat[i] = _mean(values)
                elif kind == "seq_max":
                    row_stat[i] = max(values) if values else 0.0
            at = {(i, t): tok[(i, t)] if kind == "token" else row_stat[i] for i, t in tokens}
            ok = {(i, t): at[(i, t)] <= upper and (lower is None or at[(i, t)] >= lower) for i, t in tokens}
            for i, t in tokens:
                keep[i][t] = keep[i][t] and ok[(i, t)]
            pool = [at[(i, t)] for i, t in tokens] if kind == "token" else [row_stat[i] for i in rows]
            p = f"rollout_rs_{option}"
            m[f"{p}_mean"] = _mean([at[(i, t)] for i, t in tokens])
            m[f"{p}_max"] = max(pool) if pool else 0.0
            m[f"{p}_min"] = min(pool) if pool else 0.0
            m[f"{p}_fraction_high"] = _mean([float(x > upper) for x in pool])
            m[f"{p}_fraction_low"] = _mean([float(lower is not None and x < lower) for x in pool])
            m[f"{p}_masked_fraction"] = _mean([float(not ok[k]) for k in tokens])
            m[f"{p}_seq_masked_fraction"] = _mean([float(any(not ok[(i, t)] for t in idx[i])) for i in rows])
        m["rollout_rs_masked_fraction"] = _mean([float(not keep[i][t]) for i, t in tokens])
        m["rollout_rs_seq_masked_fraction"] = _mean(
            [float(any(not keep[i][t] for t in idx[i])) for i in rows]
        )

    weights = None
    level, u = cfg["rollout_is"], float(cfg["rollout_is_threshold"])
    if level is not None:
        row_sum = {i: sum(lr[i][t] for t in idx[i]) for i in range(n_rows)}
        raw = [[0.0] * width for _ in range(n_rows)]
        for i, t in tokens:
            raw[i][t] = math.exp(_clamp(lr[i][t]) if level == "token" else _clamp(row_sum[i]))
        flat = [raw[i][t] for i, t in tokens]
        m["rollout_is_mean"] = _mean(flat)
        if level == "token":
            m["rollout_is_max"] = max(flat) if flat else 0.0
            m["rollout_is_min"] = min(flat) if flat else 0.0
            m["rollout_is_ratio_fraction_high"] = _mean([float(w > u) for w in flat])
            m["rollout_is_ratio_fraction_low"] = _mean([float(w < 1 / u) for w in flat])
        else:
            sums = [row_sum[i] for i in rows]
            m["rollout_is_max"] = math.exp(min(max(sums), _BOUND)) if sums else 0.0
            m["rollout_is_min"] = math.exp(min(sums)) if sums else 0.0
            m["rollout_is_ratio_fraction_high"] = _mean([float(s > math.log(u)) for s in sums])
            m["rollout_is_ratio_fraction_low"] = _mean([float(s < -math.log(u)) for s in sums])
        clamped = [min(max(w, 1 / u), u) for w in flat]
        mc = _mean(clamped)
        var = _mean([(c - mc) ** 2 for c in clamped])  # (two-pass: E[c^2] - E[c]^2 cancels)
        m["rollout_is_std"] = math.sqrt(max(var, 0.0)) if len(flat) > 1 else 0.0
        m["rollout_is_eff_sample_size"] = 1 / _mean([(c / mc) ** 2 for c in clamped]) if flat else 0.0
        seq = [_mean([raw[i][t] for t in idx[i]]) for i in rows]
        m["rollout_is_seq_mean"] = _mean(seq)
        m["rollout_is_seq_std"] = statistics.stdev(seq) if len(seq) > 1 else 0.0
        m["rollout_is_seq_max"] = max(seq) if seq else 0.0
        m["rollout_is_seq_min"] = min(seq) if seq else 0.0
        m["rollout_is_seq_max_deviation"] = max(abs(s - 1) for s in seq) if seq else 0.0
        m["rollout_is_seq_fraction_high"] = _mean([float(s > u) for s in seq])
        m["rollout_is_seq_fraction_low"] = _mean([float(s < 1 / u) for s in seq])
        weights = [[min(raw[i][t], u) for t in range(width)] for i in range(n_rows)]
        if cfg["rollout_is_batch_normalize"]:
            if level == "token":
                mean = _mean([weights[i][t] for i, t in tokens if keep[i][t]])
            else:
                mean = _mean([weights[i][idx[i][0]] for i in rows if any(keep[i][t] for t in idx[i])])
            factor = mean if mean > 1e-8 else 1.0
            weights = [[w / factor for w in row] for row in weights]
            m["rollout_is_batch_norm_factor"] = factor
        weights = torch.tensor(weights, dtype=torch.float64).reshape(n_rows, width)

    mean_old = {i: _mean([old[i][t] for t in idx[i]]) for i in rows}
    mean_roll = {i: _mean([roll[i][t] for t in idx[i]]) for i in rows}
    diff = [mean_roll[i] - mean_old[i] for i in rows]
    m["kl"] = _mean([-lr[i][t] for i, t in tokens])
    m["k3_kl"] = _mean([_token_stat("k3", lr[i][t]) for i, t in tokens])
    m["training_ppl"] = _mean([math.exp(-mean_old[i]) for i in rows])
    m["training_log_ppl"] = _mean([-mean_old[i] for i in rows])
    m["rollout_ppl"] = _mean([math.exp(-mean_roll[i]) for i in rows])
    m["rollout_log_ppl"] = _mean([-mean_roll[i] for i in rows])
    m["log_ppl_diff"] = _mean(diff)
    m["log_ppl_abs_diff"] = _mean([abs(d) for d in diff])
    m["log_ppl_diff_max"] = max(diff) if diff else 0.0
    m["log_ppl_diff_min"] = min(diff) if diff else 0.0
    m["ppl_ratio"] = _mean([math.exp(d) for d in diff])
    m["chi2_token"] = _mean([math.exp(2 * _clamp(lr[i][t])) for i, t in tokens]) - 1 if tokens else 0.0
    row_sums = [_clamp(sum(lr[i][t] for t in idx[i])) for i in rows]
    m["chi2_seq"] = _mean([math.exp(2 * s) for s in row_sums]) - 1 if rows else 0.0
    mask = torch.tensor([[float(k) for k in row] for row in keep], dtype=torch.float64).reshape(n_rows, width)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in m.items()}
