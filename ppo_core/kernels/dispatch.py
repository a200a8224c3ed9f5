"""Dispatch of the masked scans to the fastest implementation that fits the inputs.

Backends (all with the semantics of :mod:`ppo_core.kernels.reference`, checked against it in the tests):

- ``"triton"``: one Triton kernel launch on CUDA (:mod:`ppo_core.kernels.triton_scan`);
- ``"cpu"``: a one-pass C kernel over rows on CPU threads (:mod:`ppo_core.kernels.cpu`);
- ``"chunked"``: vectorised PyTorch on any device, and the only fast path that is differentiable
  (:mod:`ppo_core.kernels.chunked`);
- ``"reference"``: the per-timestep loop, the oracle.

``"auto"`` picks ``chunked`` when autograd must flow through the inputs or for float64 inputs on CUDA (Triton
takes gamma and lam as fp32 scalars), else ``triton`` on CUDA, ``cpu`` on CPU, each when available, and ``chunked``
otherwise.
"""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_mask, check_ndim, check_same_shape
from ppo_core.kernels import chunked, cpu, reference, triton_scan

__all__ = [
    "BACKENDS",
    "available_backends",
    "masked_discounted_return_scan",
    "masked_gae_returns_scan",
    "masked_gae_scan",
]

BACKENDS = ("auto", "triton", "cpu", "chunked", "reference")
"""Names accepted by the ``backend`` argument of the scans."""


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``, fastest first (``"auto"`` excluded).

    Example:
        >>> "reference" in available_backends("cpu")
        True
    """
    device = torch.device(device)
    names = []
    if device.type == "cuda" and triton_scan.is_available(device):
        names.append("triton")
    if device.type == "cpu" and cpu.is_available():
        names.append("cpu")
    return [*names, "chunked", "reference"]


def _resolve(backend: str, device: torch.device, tensors: tuple[torch.Tensor, ...]) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    available = available_backends(device)
    if backend == "auto":
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return "chunked"
        if available[0] == "triton" and any(t.dtype == torch.float64 for t in tensors):
            # Triton passes gamma and lam as fp32 scalars: float64 inputs would lose ~1e-8 of precision
            return "chunked"
        return available[0]
    if backend not in available:
        raise ValueError(f"backend {backend!r} is not available on {device}; available: {available}")
    return backend


def _scalar(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    return float(value)


def _check_inputs(rewards: torch.Tensor, mask: torch.Tensor, **others: torch.Tensor) -> torch.Tensor:
    check_ndim("rewards", check_floating("rewards", rewards), 2)
    for name, tensor in others.items():
        check_floating(name, tensor)
        check_same_shape(rewards=rewards, **{name: tensor})
        if tensor.device != rewards.device:
            raise ValueError(f"{name} is on {tensor.device} but rewards is on {rewards.device}")
    mask = check_mask("mask", mask, like=rewards, like_name="rewards")
    if mask.device != rewards.device:
        raise ValueError(f"mask is on {mask.device} but rewards is on {rewards.device}")
    return mask


def _gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    backend: str,
    with_returns: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mask = _check_inputs(rewards, mask, values=values)
    gamma, lam = _scalar("gamma", gamma), _scalar("lam", lam)
    name = _resolve(backend, rewards.device, (rewards, values))
    if name == "triton":
        return triton_scan.gae_scan_triton(rewards, values, mask, gamma, lam, with_returns=with_returns)
    if name == "cpu":
        return cpu.gae_scan_cpu(rewards, values, mask, gamma, lam, with_returns=with_returns)
    impl = chunked.gae_scan_chunked if name == "chunked" else reference.masked_gae_scan
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    adv = impl(rewards.to(dtype), values.to(dtype), mask, gamma, lam)
    return adv, (adv + values.to(dtype) if with_returns else None)


def masked_gae_returns_scan(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw masked GAE advantages and ``returns = advantages + values``, fused where the backend allows.

    Semantics of :func:`ppo_core.kernels.reference.masked_gae_scan`: masked tokens skip their reward and carry
    both the bootstrap value and the running advantage across a gap; the last valid token bootstraps with 0.

    Args:
        rewards, values: ``[B, T]`` floating tensors.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma, lam: discount and GAE lambda.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` in the promoted dtype of rewards and values. At a masked
        position the advantage is the one carried from the right (0 on trailing padding) and the return is
        that plus the value stored there.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> adv, ret = masked_gae_returns_scan(r, torch.zeros_like(r), torch.ones(1, 3, dtype=torch.bool), 0.5, 1.0)
        >>> adv
        tensor([[0.2500, 0.5000, 1.0000]])
    """
    adv, ret = _gae(rewards, values, mask, gamma, lam, backend, with_returns=True)
    assert ret is not None
    return adv, ret


def masked_gae_scan(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Raw (unwhitened) masked GAE advantages; see :func:`masked_gae_returns_scan` for the semantics.

    Args:
        rewards, values: ``[B, T]`` floating tensors.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma, lam: discount and GAE lambda.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``[B, T]`` advantages in the promoted dtype of rewards and values.

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> masked_gae_scan(torch.tensor([[0.0, 5.0, 1.0]]), torch.zeros(1, 3), m, 1.0, 1.0)
        tensor([[1., 1., 1.]])
    """
    return _gae(rewards, values, mask, gamma, lam, backend, with_returns=False)[0]


def masked_discounted_return_scan(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *, backend: str = "auto"
) -> torch.Tensor:
    """Discounted reward-to-go with masked tokens skipped, 0 at masked positions (REINFORCE++ returns).

    Semantics of :func:`ppo_core.kernels.reference.masked_discounted_return_scan`.

    Args:
        rewards: ``[B, T]`` floating tensor.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma: discount.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> masked_discounted_return_scan(torch.tensor([[1.0, 5.0, 1.0]]), m, 0.5)
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    mask = _check_inputs(rewards, mask)
    gamma = _scalar("gamma", gamma)
    name = _resolve(backend, rewards.device, (rewards,))
    if name == "triton":
        return triton_scan.discounted_return_scan_triton(rewards, mask, gamma)
    if name == "cpu":
        return cpu.discounted_return_scan_cpu(rewards, mask, gamma)
    impl = (
        chunked.discounted_return_scan_chunked
        if name == "chunked"
        else reference.masked_discounted_return_scan
    )
    return impl(rewards, mask, gamma)
