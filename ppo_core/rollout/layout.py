"""The batch a rollout engine returns (verl's layout), assembled from the prompts and the sampled responses."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppo_core._checks import check_ndim, check_tensor
from ppo_core.keys import KEYS

__all__ = ["rollout_batch"]


def rollout_batch(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None = None,
) -> TensorDict:
    """``prompts``, ``responses``, ``input_ids`` (prompt then response), ``attention_mask``, ``response_mask`` and,
    when given, ``rollout_log_probs``, as one ``TensorDict`` of batch size ``[B]`` (keys from :data:`KEYS`).

    Args:
        prompts: ``[B, P]`` left-padded prompt ids; prompt_mask: ``[B, P]`` 1 on prompt tokens.
        responses: ``[B, R]`` right-padded response ids; response_mask: ``[B, R]`` 1 on response tokens.
        rollout_log_probs: ``[B, R]`` log-probs of the sampled tokens under the sampling distribution.

    Example:
        >>> out = rollout_batch(torch.tensor([[0, 5]]), torch.tensor([[0, 1]]), torch.tensor([[6, 2]]),
        ...                     torch.tensor([[1, 0]]))
        >>> out["input_ids"].tolist(), out["attention_mask"].tolist()
        ([[0, 5, 6, 2]], [[0, 1, 1, 0]])
    """
    for name, value in (("prompts", prompts), ("responses", responses)):
        check_ndim(name, check_tensor(name, value), 2)
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"prompts has {prompts.shape[0]} rows but responses has {responses.shape[0]}")
    out = {
        KEYS.prompts: prompts,
        KEYS.responses: responses,
        KEYS.input_ids: torch.cat([prompts, responses], dim=1),
        KEYS.attention_mask: torch.cat([prompt_mask, response_mask], dim=1),
        KEYS.response_mask: response_mask,
    }
    if rollout_log_probs is not None:
        out[KEYS.rollout_log_probs] = rollout_log_probs
    return TensorDict(out, batch_size=[prompts.shape[0]])
