"""Dispatch of the masked scans to the fastest implementation that fits the inputs.

Backends (all with the semantics of :mod:`ppo_core.kernels.reference`, checked against it in the tests):

- ``"triton"``: one Triton kernel launch on CUDA (:mod:`ppo_core.kernels.triton_scan`);
- ``"chunked"``: vectorised PyTorch on any device (the CPU path: nothing is compiled at run time), and the only
  fast path that is differentiable (:mod:`ppo_core.kernels.chunked`);
- ``"reference"``: the per-timestep loop, the oracle.

``"auto"`` picks ``chunked`` when autograd must flow through the inputs or for float64 inputs on CUDA (Triton
takes gamma and lam as fp32 scalars), else ``triton`` on CUDA when available, and ``chunked`` otherwise.

Two forms of each scan: the raw one (``masked_gae_returns_scan``...: at a masked position the state carried from
the right) and the estimators' one (``*_checked``: exactly 0 at masked positions, plus a flag the scan itself
sets when a NaN/inf input at a valid position entered it, so that an estimator needs no pass of its own over
the inputs and one host sync to read the flag).
"""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_mask, check_ndim, check_same_shape
from ppo_core.kernels import chunked, reference, triton_scan
from ppo_core.kernels.whiten import whiten_valid

__all__ = [
    "BACKENDS",
    "available_backends",
    "masked_discounted_return_checked",
    "masked_discounted_return_scan",
    "masked_gae_returns_checked",
    "masked_gae_returns_scan",
    "masked_gae_scan",
    "masked_return_advantages_checked",
]

BACKENDS = ("auto", "triton", "chunked", "reference")
"""Names accepted by the ``backend`` argument of the scans."""


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``, fastest first (``"auto"`` excluded).

    Example:
        >>> "reference" in available_backends("cpu")
        True
    """
    device = torch.device(device)
    names = ["triton"] if device.type == "cuda" and triton_scan.is_available(device) else []
    return [*names, "chunked", "reference"]


def _resolve(backend: str, device: torch.device, tensors: tuple[torch.Tensor, ...]) -> str:
    if backend == "auto":  # the common case first, without building the list of available backends
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return "chunked"
        if device.type != "cuda" or triton_scan.triton is None:  # a CUDA tensor: CUDA is available
            return "chunked"
        if any(t.dtype == torch.float64 for t in tensors):
            # Triton passes gamma and lam as fp32 scalars: float64 inputs would lose ~1e-8 of precision
            return "chunked"
        return "triton"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    available = available_backends(device)
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
    impl = (
        chunked.discounted_return_scan_chunked
        if name == "chunked"
        else reference.masked_discounted_return_scan
    )
    return impl(rewards, mask, gamma)


def _reference_flag(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    bad = torch.zeros_like(mask)
    for tensor in tensors:
        bad |= ~torch.isfinite(tensor)
    return (bad & mask).any()


def masked_gae_returns_checked(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and returns as the estimators give them, and a non-finite flag set by the scan itself.

    Semantics of :func:`masked_gae_returns_scan` at valid positions; both outputs are exactly 0 at masked ones
    (where rewards and values may hold anything, NaN and inf included). With ``whiten`` the advantages are
    whitened over all valid tokens (:func:`~ppo_core.kernels.whiten.whiten_valid`; fused into the scan on Triton).

    Args:
        rewards, values: ``[B, T]`` floating tensors.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma, lam: discount and GAE lambda.
        whiten: whiten the advantages.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(advantages, returns, flag)``: two ``[B, T]`` tensors in the promoted dtype of rewards and values, and a
        0-d tensor on their device. A zero (False) flag guarantees that every reward and value at a valid position
        is finite; a nonzero one says that one may not be: Triton and the reference test the inputs they read,
        the vectorised scan tests the sum of the TD errors it forms (which an overflow of finite inputs can also
        make non-finite), so the caller checks the inputs to name the culprit. Reading the flag is the one host
        sync an estimator needs.

    Example:
        >>> r, v = torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, float("nan"), 0.5]])
        >>> adv, ret, flag = masked_gae_returns_checked(r, v, torch.tensor([[1, 0, 1]]), 1.0, 1.0)
        >>> ret, bool(flag)
        (tensor([[1., 0., 1.]]), False)
    """
    mask = _check_inputs(rewards, mask, values=values)
    gamma, lam = _scalar("gamma", gamma), _scalar("lam", lam)
    adv, ret, flags = _gae_checked(rewards, values, mask, gamma, lam, whiten, backend, flags_on_host=False)
    return adv, ret, _as_flag(flags)


def _as_flag(flags: torch.Tensor) -> torch.Tensor:
    """The 0-d flag of the public ``*_checked`` functions from a backend's flags (Triton: one word per program)."""
    return flags if flags.dim() == 0 else flags.any()


def flags_set(*flags: torch.Tensor | None) -> bool:
    """Whether any of the flags of a ``*_checked`` scan (any shape, as :func:`_gae_checked` gives them) or of a
    deferred check is set: one host sync for all of them (None entries skipped).

    Flags in pinned host memory were written by the device directly (:func:`~triton_scan.host_flag_words`): a
    stream sync makes them readable, with no copy back.
    """
    views: list = []  # NumPy views of words the device wrote to pinned host memory
    others: list[torch.Tensor] = []
    for flag in flags:
        if flag is None:
            continue
        view = triton_scan.host_words_array(flag)  # this thread's words: known without asking the driver
        if view is not None:
            views.append(view)
        elif flag.device.type == "cpu" and flag.is_pinned():
            views.append(flag.numpy())  # made before the sync, so that little is left to do after it
        else:
            others.append(flag)
    if others:
        combined = others[0] if len(others) == 1 else torch.stack([flag.any() for flag in others])
        if bool(
            combined.any()
        ):  # on CUDA the one sync: the device's writes to host words are complete after it
            return True
    if not views:
        return False
    if not any(flag.is_cuda for flag in others):  # the one sync: the stream the scans were launched on
        triton_scan.sync_current_stream()
    return any(view.any() for view in views)  # no copy back


def _host_words(rewards: torch.Tensor, flags_on_host: bool) -> torch.Tensor | None:
    """Where a checked Triton scan of ``rewards`` writes its flag words: this thread's pinned host words (at least
    one per program: one per row) with ``flags_on_host``, else new device memory (None)."""
    return triton_scan.host_flag_words(rewards.device, rewards.shape[0]) if flags_on_host else None


def _gae_checked(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = False,
    backend: str = "auto",
    flags_on_host: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_gae_returns_checked` on inputs already validated (floating, same shape and device, bool mask,
    float scalars), for the estimators, which check them once; the flags in the backend's form, to read at once
    with :func:`flags_set` (Triton's words in this thread's pinned host memory with ``flags_on_host``)."""
    name = _resolve(backend, rewards.device, (rewards, values))
    if name == "triton":
        return triton_scan.gae_returns_checked_triton(
            rewards, values, mask, gamma, lam, whiten=whiten, flags=_host_words(rewards, flags_on_host)
        )
    if name == "chunked":
        adv, ret, flag = chunked.gae_returns_checked_chunked(rewards, values, mask, gamma, lam)
    else:
        dtype = torch.promote_types(rewards.dtype, values.dtype)
        r, v = rewards.to(dtype), values.to(dtype)
        zero = torch.zeros((), dtype=dtype, device=r.device)
        adv = torch.where(mask, reference.masked_gae_scan(r, v, mask, gamma, lam), zero)
        ret, flag = torch.where(mask, adv + v, zero), _reference_flag(mask, rewards, values)
    return (whiten_valid(adv, mask) if whiten else adv), ret, flag


def masked_discounted_return_checked(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`masked_discounted_return_scan` and a non-finite flag set by the scan (see
    :func:`masked_gae_returns_checked`).

    Args:
        rewards: ``[B, T]`` floating tensor.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma: discount.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(returns, flag)``: ``[B, T]`` returns in the dtype of ``rewards``, 0 at masked positions, and a 0-d
        tensor that is zero (False) only if every reward at a valid position is finite.

    Example:
        >>> r = torch.tensor([[1.0, float("inf"), 1.0]])
        >>> out, flag = masked_discounted_return_checked(r, torch.tensor([[1, 0, 1]]), 0.5)
        >>> out, bool(flag)
        (tensor([[1.5000, 0.0000, 1.0000]]), False)
    """
    mask = _check_inputs(rewards, mask)
    gamma = _scalar("gamma", gamma)
    # the advantages without whitening or baselines are the returns: the same scan, the same launch
    _, returns, flags = _return_advantages_checked(rewards, mask, gamma, backend=backend, flags_on_host=False)
    return returns, _as_flag(flags)


def masked_return_advantages_checked(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    *,
    whiten: bool = False,
    baselines: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages from the masked discounted return as the critic-free estimators give them, the return, and a
    non-finite flag set by the scan (see :func:`masked_gae_returns_checked`).

    ``advantages`` is the return whitened over all valid tokens (``whiten``: REINFORCE++), the return minus the
    row's baseline (``baselines``: ReMax) or the return; both outputs are 0 at masked positions. On Triton the
    baseline and the whitening statistics come from the scan itself (plus one normalising kernel to whiten).

    Args:
        rewards: ``[B, T]`` floating tensor.
        mask: ``[B, T]`` bool (or 0/1) tensor.
        gamma: discount.
        whiten: whiten the return.
        baselines: ``[B]`` floating per-row baselines in the dtype of ``rewards`` (not with ``whiten``).
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(advantages, returns, flag)``: two ``[B, T]`` tensors in the dtype of ``rewards`` and a 0-d tensor that
        is zero (False) only if every reward at a valid position, and the baseline of every row with one, is
        finite.

    Example:
        >>> r = torch.tensor([[1.0, 5.0, 1.0]])
        >>> adv, ret, flag = masked_return_advantages_checked(r, torch.tensor([[1, 0, 1]]), 1.0,
        ...                                                   baselines=torch.tensor([0.5]))
        >>> adv, bool(flag)
        (tensor([[1.5000, 0.0000, 0.5000]]), False)
    """
    mask = _check_inputs(rewards, mask)
    gamma = _scalar("gamma", gamma)
    if whiten and baselines is not None:
        raise ValueError("masked_return_advantages_checked: give whiten or baselines, not both")
    if baselines is not None:
        baselines = check_ndim("baselines", check_floating("baselines", baselines), 1)
        if baselines.shape[0] != rewards.shape[0] or baselines.device != rewards.device:
            raise ValueError(
                f"baselines must be [B] = [{rewards.shape[0]}] on {rewards.device}, got shape "
                f"{tuple(baselines.shape)} on {baselines.device}"
            )
    adv, returns, flags = _return_advantages_checked(
        rewards, mask, gamma, whiten, baselines, backend, flags_on_host=False
    )
    return adv, returns, _as_flag(flags)


def _return_advantages_checked(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    whiten: bool = False,
    baselines: torch.Tensor | None = None,
    backend: str = "auto",
    flags_on_host: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_return_advantages_checked` on inputs already validated (see :func:`_gae_checked`)."""
    name = _resolve(backend, rewards.device, (rewards,))
    if name == "triton":
        return triton_scan.return_advantages_checked_triton(
            rewards,
            mask,
            gamma,
            whiten=whiten,
            baselines=baselines,
            flags=_host_words(rewards, flags_on_host),
        )
    if name == "chunked":
        returns, flag = chunked.discounted_return_scan_checked_chunked(rewards, mask, gamma)
    else:
        returns = reference.masked_discounted_return_scan(rewards, mask, gamma)
        flag = _reference_flag(mask, rewards)
    if whiten:
        return whiten_valid(returns, mask), returns, flag
    if baselines is None:
        return returns, returns, flag
    # a baseline only matters for a row with a valid token
    used = mask.any(dim=-1)
    flag = flag | (used & ~torch.isfinite(baselines)).any()
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    return torch.where(mask, returns - baselines.unsqueeze(-1), zero), returns, flag
