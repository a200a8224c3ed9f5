"""Up-front checks of a batch's keys and token shapes, with errors that name the key and both shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDictBase, is_non_tensor

from ppo_core.batch._td import Key, _check_batch, _key_name, _leaves

__all__ = ["validate_batch"]


def validate_batch(
    batch: TensorDictBase,
    required_keys: Sequence[Key] = (),
    *,
    token_keys: Sequence[Key] = (),
    dtypes: Mapping[Key, torch.dtype | str] | None = None,
) -> tuple[int, int | None]:
    """Check that ``batch`` has the keys a step needs and that its ``[B, T]`` tensors agree.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        required_keys: keys (nested ones as tuples) that must be present, tensors or non-tensor fields.
        token_keys: tensor keys that must all be 2-D with one shape ``[B, T]`` (e.g. ``response_mask``,
            ``old_log_probs``, ``advantages``); they are required too. The first one sets ``T``.
        dtypes: optional ``{key: dtype}``; a dtype may be ``"floating"`` to accept any floating dtype. Listed keys
            are required.

    Returns:
        ``(B, T)``, with ``T = None`` when ``token_keys`` is empty.

    Raises:
        KeyError: a missing key (the message lists the missing and the present keys).
        ValueError: a token key that is not 2-D or whose shape differs (names the key and both shapes).
        TypeError: a non-tensor field where a tensor is needed, or a dtype mismatch (names the key).

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"response_mask": torch.ones(2, 5), "values": torch.zeros(2, 5)}, batch_size=[2])
        >>> validate_batch(b, token_keys=["response_mask", "values"])
        (2, 5)
    """
    size = _check_batch("batch", batch)
    dtypes = dict(dtypes or {})
    leaves = _leaves(batch)
    present = set(leaves)
    present |= {k for k in batch.keys(include_nested=True)}
    wanted = list(dict.fromkeys([*required_keys, *token_keys, *dtypes]))
    missing = [_key_name(k) for k in wanted if k not in present]
    if missing:
        raise KeyError(f"batch is missing keys {missing}; it has {sorted(_key_name(k) for k in leaves)}")

    def tensor(key: Key) -> torch.Tensor:
        value = leaves.get(key)
        if value is None or is_non_tensor(value):
            raise TypeError(f"key {_key_name(key)!r} must be a tensor, got {type(batch.get(key)).__name__}")
        return value

    seq_len = None
    if token_keys:
        ref_key = token_keys[0]
        ref = tensor(ref_key)
        if ref.dim() != 2:
            raise ValueError(f"key {_key_name(ref_key)!r} must have shape [B, T], got {tuple(ref.shape)}")
        seq_len = int(ref.shape[1])
        for key in token_keys[1:]:
            value = tensor(key)
            if value.shape != ref.shape:
                raise ValueError(
                    f"key {_key_name(key)!r} has shape {tuple(value.shape)} but {_key_name(ref_key)!r} has shape "
                    f"{tuple(ref.shape)}; token-level tensors must share [B, T]"
                )
    for key, dtype in dtypes.items():
        value = tensor(key)
        ok = value.is_floating_point() if dtype == "floating" else value.dtype == dtype
        if not ok:
            raise TypeError(f"key {_key_name(key)!r} must have dtype {dtype}, got {value.dtype}")
    return size, seq_len
