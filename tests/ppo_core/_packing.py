"""Mixed-length PPO micro-batches shared by the packing tests (imported as ``from _packing import ...``)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppo_core.keys import KEYS


def mixed_batch(
    rows: int = 6, prompt: int = 5, response: int = 7, vocab: int = 96, seed: int = 0
) -> TensorDict:
    """Left-padded prompts and right-padded responses of mixed lengths (one response of a single token, one
    full), with the update keys."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g)
    p_len = torch.randint(1, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(1, response + 1, (rows,), generator=g)
    r_len[0], r_len[-1] = 1, response
    cols = torch.arange(prompt + response)
    mask = ((cols >= prompt - p_len[:, None]) & (cols < prompt + r_len[:, None])).long()
    response_mask = mask[:, prompt:]
    return TensorDict(
        {
            KEYS.input_ids: ids * mask,
            KEYS.attention_mask: mask,
            KEYS.responses: ids[:, prompt:] * response_mask,
            KEYS.response_mask: response_mask,
            KEYS.old_log_probs: -torch.rand(rows, response, generator=g) * 3,
            KEYS.advantages: torch.randn(rows, response, generator=g),
        },
        batch_size=[rows],
    )


def predicted(batch: TensorDict) -> torch.Tensor:
    """``[b, R]``: response positions whose predicting position is a valid token."""
    r = batch[KEYS.responses].shape[1]
    return batch[KEYS.attention_mask][:, -r - 1 : -1].bool()
