"""Prompt and response lengths of a batch, shared by the data, timing and throughput metrics.

Lengths come from ``attention_mask`` (``[B, P + T]``, prompt then response, ``T = response_mask.shape[1]``) when the
batch has one, so tool/observation tokens of multi-turn rollouts count as response tokens as in verl (only
these *metrics* use the attention mask, while losses and advantages use ``response_mask``). Without an
``attention_mask`` the response length is ``response_mask.sum(-1)`` and the prompt is unknown (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from ppo_core._checks import check_mask
from ppo_core.batch._td import _check_batch
from ppo_core.keys import KEYS

__all__: list[str] = []


@dataclass(frozen=True)
class _Lengths:
    response: torch.Tensor  # [B] float64
    response_width: int  # T
    prompt: torch.Tensor | None  # [B] float64, None without attention_mask
    prompt_width: int | None  # P

    @property
    def response_tokens(self) -> int:
        return int(self.response.sum().item())

    @property
    def all_tokens(self) -> int:
        prompt = 0 if self.prompt is None else int(self.prompt.sum().item())
        return prompt + self.response_tokens


def _lengths(batch: TensorDictBase) -> _Lengths:
    _check_batch("batch", batch)
    if KEYS.response_mask not in batch:
        raise KeyError(f"batch must have a {KEYS.response_mask!r} [B, T] tensor to measure response lengths")
    response_mask = check_mask(KEYS.response_mask, batch.get(KEYS.response_mask))
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must have shape [B, T], got {tuple(response_mask.shape)}")
    width = int(response_mask.shape[1])
    if KEYS.attention_mask not in batch:
        return _Lengths(response_mask.sum(-1, dtype=torch.float64), width, None, None)
    attention_mask = check_mask(KEYS.attention_mask, batch.get(KEYS.attention_mask))
    if attention_mask.dim() != 2 or attention_mask.shape[1] < width:
        raise ValueError(
            f"attention_mask must have shape [B, P + T] with T={width} (from response_mask), "
            f"got {tuple(attention_mask.shape)}"
        )
    prompt_width = int(attention_mask.shape[1]) - width
    prompt = attention_mask[:, :prompt_width].sum(-1, dtype=torch.float64)
    response = attention_mask[:, prompt_width:].sum(-1, dtype=torch.float64)
    return _Lengths(response, width, prompt, prompt_width)
