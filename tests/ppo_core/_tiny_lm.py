"""A tiny TinyGPT policy and value model and left-padded prompts, shared by the torch worker and rollout tests
(imported as ``from _tiny_lm import ...``)."""

from __future__ import annotations

import functools

import torch
from tensordict import TensorDict

from ppo_core.models import TinyGPT, TinyGPTConfig

V, EOS, PAD = 9, 8, 0
CFG = TinyGPTConfig(vocab_size=V, max_seq_len=12, d_model=16, n_layers=1, n_heads=2)
CRITIC_CFG = TinyGPTConfig(**{**CFG.to_dict(), "value_head": True})
LM = functools.partial(TinyGPT, CFG, seed=1)
VALUE_MODEL = functools.partial(TinyGPT, CRITIC_CFG, seed=2)


def left_padded_prompts(seed: int = 0, batch: int = 4, width: int = 3) -> TensorDict:
    """``input_ids`` / ``attention_mask`` ``[batch, width]``: prompts of 1..width tokens (no EOS), left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, EOS, (batch, width), generator=g)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return TensorDict({"input_ids": ids * mask, "attention_mask": mask}, batch_size=[batch])


class NoCache(torch.nn.Module):
    """The same LM without ``new_cache``: generation must recompute and give the same tokens."""

    def __init__(self, lm: TinyGPT) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids, attention_mask=attention_mask)
