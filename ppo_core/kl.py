"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3 and the exact KL).

With ``d = logprob - ref_logprob`` (log pi(y) - log pi_ref(y) of the sampled token ``y``):

==========================  =======================================================================================
``"kl"`` / ``"k1"``         ``d`` (unbiased for KL(pi || pi_ref) under y ~ pi; can be negative per token)
``"abs"``                   ``|d|``
``"mse"`` / ``"k2"``        ``d**2 / 2``
``"low_var_kl"`` / ``"k3"`` ``exp(x) - x - 1`` with ``x = clamp(-d, -20, 20)``, then clamped to ``[-10, 10]``
                            (verl's clamps; the value is always in ``[0, 10]``, and the gradient is zero where a
                            clamp is active)
``"full"``                  exact ``sum_v pi(v) (log pi(v) - log pi_ref(v))`` from ``logits`` and ``ref_logits``
``"<name>+"``               straight-through: the value of ``<name>``, the gradient of k2 (``d * grad logprob``)
==========================  =======================================================================================

:func:`importance_weighted_kl` multiplies a per-token estimate by the importance ratio ``pi / pi_old`` for tokens
sampled from ``pi_old`` (TRL's ``use_bias_correction_kl``).

Deviation from verl: ``"full"`` is implemented (verl raises ``NotImplementedError``), and unknown names raise
``ValueError`` listing the valid names (verl: ``NotImplementedError``).
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from ppo_core._checks import check_choice, check_devices_match, check_floating, check_same_shape
from ppo_core.logprobs import (
    DEFAULT_CHUNK_SIZE,
    _check_chunk_size,
    _check_finite_lse,
    _chunks,
    _compute_dtype,
    _empty_grad,
    _log_softmax_chunk,
    _row_blocks,
)

__all__ = ["KL_ESTIMATORS", "KLEstimator", "importance_weighted_kl", "kl_penalty"]

KLEstimator = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+", "full+",
]  # fmt: skip
"""Every name accepted by :func:`kl_penalty` (the annotation of the config fields that hold one)."""

KL_ESTIMATORS: tuple[str, ...] = typing.get_args(KLEstimator)
"""Every name accepted by :func:`kl_penalty`: each base estimator and its straight-through ``+`` variant."""

_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


class _FullKL(torch.autograd.Function):
    """Row-chunked exact KL(softmax(logits) || softmax(ref_logits)) with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        dtype = _compute_dtype(torch.promote_types(logits.dtype, ref_logits.dtype))
        blocks, ref_blocks = _row_blocks(logits), _row_blocks(ref_logits)
        if [b.shape[0] for b in blocks] != [b.shape[0] for b in ref_blocks]:
            logits, ref_logits = logits.contiguous(), ref_logits.contiguous()
            blocks, ref_blocks = _row_blocks(logits), _row_blocks(ref_logits)
        n_rows = sum(b.shape[0] for b in blocks)
        kl = torch.empty(n_rows, dtype=dtype, device=logits.device)
        lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        ref_lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        pairs = zip(_chunks(blocks, chunk_size), _chunks(ref_blocks, chunk_size), strict=True)
        for (rows, chunk), (_, ref_chunk) in pairs:
            logp, lse[rows] = _log_softmax_chunk(chunk, dtype)
            logq, ref_lse[rows] = _log_softmax_chunk(ref_chunk, dtype)
            p = logp.exp()
            # tokens pi never picks contribute 0, even where pi_ref also forbids them (-inf - -inf)
            kl[rows] = torch.where(p > 0, p * (logp - logq), 0.0).sum(dim=-1)
        _check_finite_lse(lse, "logits")
        _check_finite_lse(ref_lse, "ref_logits")
        ctx.save_for_backward(logits, ref_logits, lse, ref_lse, kl)
        ctx.chunk_size = chunk_size
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        logits, ref_logits, lse, ref_lse, kl = ctx.saved_tensors
        need_logits, need_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = kl.dtype
        grad, grad_rows = _empty_grad(logits) if need_logits else (None, None)
        ref_grad, ref_grad_rows = _empty_grad(ref_logits) if need_ref else (None, None)
        pairs = zip(
            _chunks(_row_blocks(logits), ctx.chunk_size),
            _chunks(_row_blocks(ref_logits), ctx.chunk_size),
            strict=True,
        )
        for (rows, chunk), (_, ref_chunk) in pairs:
            g = grad_out[rows].to(dtype).unsqueeze(-1)
            logp = chunk.to(dtype) - lse[rows].unsqueeze(-1)
            logq = ref_chunk.to(dtype) - ref_lse[rows].unsqueeze(-1)
            p = logp.exp()
            if grad_rows is not None:
                # dKL/dz_j = p_j (log p_j - log q_j - KL)
                centred = logp - logq - kl[rows].unsqueeze(-1)
                grad_rows[rows] = torch.where(p > 0, p * centred, 0.0) * g
            if ref_grad_rows is not None:
                # dKL/dr_j = q_j - p_j
                ref_grad_rows[rows] = (logq.exp() - p) * g
        return grad, ref_grad, None


def _full_kl(
    logprob: torch.Tensor, logits: torch.Tensor | None, ref_logits: torch.Tensor | None, chunk_size: int
) -> torch.Tensor:
    if logits is None or ref_logits is None:
        raise ValueError(
            "estimator 'full' needs logits and ref_logits (the full [..., V] distributions); "
            "use 'k3' / 'low_var_kl' when only sampled-token log-probs are available"
        )
    logits = check_floating("logits", logits)
    ref_logits = check_floating("ref_logits", ref_logits)
    check_same_shape(logits=logits, ref_logits=ref_logits)
    if logits.dim() < 1 or logits.shape[:-1] != logprob.shape or logits.shape[-1] == 0:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}; it must be [..., V] with V >= 1 and leading shape "
            f"{tuple(logprob.shape)} (the shape of logprob)"
        )
    out = _FullKL.apply(logits, ref_logits, _check_chunk_size(chunk_size))
    return out.view(logprob.shape)


def _k3(delta: torch.Tensor) -> torch.Tensor:
    x = torch.clamp(-delta, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1, min=-_K3_VALUE_CLAMP, max=_K3_VALUE_CLAMP)


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str = "kl",
    *,
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, element-wise (see the module docstring for the formulas).

    Args:
        logprob: ``[B, T]`` log pi(y_t) of the sampled tokens (any shape works, element-wise).
        ref_logprob: ``[B, T]`` log pi_ref(y_t), same shape.
        estimator: one of :data:`KL_ESTIMATORS`.
        logits: ``[B, T, V]`` policy logits, required by ``"full"`` / ``"full+"`` only.
        ref_logits: ``[B, T, V]`` reference logits, required by ``"full"`` / ``"full+"`` only.
        chunk_size: rows of logits up-cast at once by ``"full"`` (see :mod:`ppo_core.logprobs`).

    Returns:
        ``[B, T]`` per-token penalty, not masked (multiply by the response mask or pass it to an aggregation).
        NaN inputs propagate. ``"full"`` is fp32 for half-precision logits and ``+inf`` where pi puts mass on a
        token pi_ref forbids.

    Raises:
        ValueError: unknown ``estimator`` (the message lists the valid ones), shape mismatch, or ``"full"``
            without ``logits`` and ``ref_logits``.

    Example:
        >>> kl_penalty(torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -1.0]]), "k2")
        tensor([[0.1250, 0.0000]])
    """
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str, got {type(estimator).__name__}")
    check_choice("estimator", estimator, KL_ESTIMATORS)
    logprob = check_floating("logprob", logprob)
    ref_logprob = check_floating("ref_logprob", ref_logprob)
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    check_devices_match(logprob=logprob, ref_logprob=ref_logprob)
    straight_through = estimator.endswith("+")
    base = estimator.removesuffix("+")

    delta = logprob - ref_logprob
    if base in ("kl", "k1"):
        value = delta
    elif base == "abs":
        value = delta.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * delta.square()
    elif base in ("low_var_kl", "k3"):
        value = _k3(delta)
    else:
        value = _full_kl(logprob, logits, ref_logits, chunk_size)
    if not straight_through:
        return value
    k2 = 0.5 * delta.square()
    # k2 - sg(k2) is exactly 0 in the forward pass, so the value is bit-identical to the base estimator
    return value.detach() + (k2 - k2.detach())


_RATIO_LOG_CLAMP = 20.0
"""The policy losses' log-ratio clamp (:data:`ppo_core.losses.LOG_RATIO_CLAMP`)."""


def importance_weighted_kl(
    kl: torch.Tensor, logprob: torch.Tensor, old_logprob: torch.Tensor
) -> torch.Tensor:
    """``r · kl`` with ``r = exp(clamp(logprob − old_logprob, ±20))``: a per-token KL estimate made unbiased for
    tokens sampled from ``pi_old`` rather than from ``pi``.

    A KL estimator ``k(y)`` such as k3 estimates ``KL(pi || pi_ref)`` when ``y ~ pi``; the tokens of a PPO update
    come from ``pi_old``, and importance sampling gives ``E_{y~pi_old}[r(y) k(y)] = E_{y~pi}[k(y)]`` (DeepSeek-V3.2's
    "unbiased KL estimate"; TRL's ``use_bias_correction_kl``). The ratio is *not* detached: the gradient of
    ``E_{pi_old}[r k]`` is then the gradient of ``E_{pi}[k]`` itself. On the first mini-batch of an update
    (``pi = pi_old``) the value equals ``kl`` and the gradient gains ``kl · ∇log pi``.

    Args:
        kl: ``[B, T]`` per-token estimate (:func:`kl_penalty`'s output), differentiable.
        logprob: ``[B, T]`` log pi of the sampled tokens (differentiated).
        old_logprob: ``[B, T]`` log pi_old of the same tokens (the sampling policy; not differentiated).

    Returns:
        ``[B, T]``, not masked.

    Example:
        >>> importance_weighted_kl(torch.tensor([[0.5]]), torch.tensor([[-1.0]]), torch.tensor([[-1.0]]))
        tensor([[0.5000]])
    """
    kl = check_floating("kl", kl)
    logprob = check_floating("logprob", logprob)
    old_logprob = check_floating("old_logprob", old_logprob)
    check_same_shape(kl=kl, logprob=logprob, old_logprob=old_logprob)
    log_ratio = (logprob - old_logprob.detach()).clamp(-_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP)
    return torch.exp(log_ratio) * kl
