"""Trainer edge cases: resuming at an epoch boundary trains the next epoch (with beta, RNG states and the step
restored), the response-mask fallback of ``merge_generation``, and where ``scores_to_token_level`` puts a
sequence score (the last valid response token; an empty response gets nothing).

Expected values are derived in the test (a loop, float64 or a small closed form), never copied from a run;
where verl behaves differently, ``docs/semantics.md`` says how and why.
"""

from __future__ import annotations

import random
from itertools import chain

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.kl_control import AdaptiveKLController
from ppo_core.testing.strategies import response_masks
from ppo_core.trainer import PromptDataLoader, scores_to_token_level
from ppo_core.trainer.checkpoint import capture_rng_state, restore_rng_state, step_of_checkpoint
from ppo_core.trainer.steps import assign_uids, merge_generation

pytestmark = pytest.mark.usefixtures("restore_global_rngs")  # some tests seed the global RNGs on purpose


# --------------------------------------------------------------------------------------------------------------
# Resume at an epoch boundary trains the next epoch; beta, RNG and the step are restored


def _prompts(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [i + 1]} for i in range(n)]


def _ids(batches: list[TensorDict]) -> list[list[int]]:
    return [b["input_ids"].flatten().tolist() for b in batches]


@given(st.integers(1, 9), st.integers(1, 4), st.booleans(), st.integers(0, 12))
def test_resumed_loader_continues_the_uninterrupted_sequence(
    size: int, batch_size: int, drop_last: bool, consumed: int
) -> None:
    def loader() -> PromptDataLoader:
        return PromptDataLoader(_prompts(size), batch_size, seed=3, drop_last=drop_last)

    per_epoch = len(loader())
    reference = loader()
    epochs = consumed // max(per_epoch, 1) + 2
    stream = [b for _ in range(epochs) for b in reference]  # the uninterrupted run
    first = loader()
    taken = 0
    while taken < consumed and per_epoch:
        for _ in first:
            taken += 1
            if taken == consumed:
                break
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    done_in_epoch = taken % per_epoch if per_epoch else 0
    # a state saved at an epoch's end resumes with the whole next epoch, never with zero steps
    assert len(rest) == per_epoch - done_in_epoch
    assert _ids(rest) == _ids(stream[taken : taken + len(rest)])


def test_end_of_epoch_state_reads_as_next_epoch_start() -> None:
    loader = PromptDataLoader(_prompts(6), 2, seed=0)
    epoch0 = list(loader)
    assert loader.state_dict() == {"epoch": 1, "position": 0}
    resumed = PromptDataLoader(_prompts(6), 2, seed=0)
    resumed.load_state_dict({"epoch": 0, "position": 3})  # a raw end-of-epoch position, as verl stores it
    assert resumed.state_dict() == {"epoch": 1, "position": 0}
    epoch1 = list(resumed)
    assert len(epoch1) == 3
    assert sorted(chain(*_ids(epoch1))) == sorted(chain(*_ids(epoch0))) == list(range(1, 7))


def test_kl_beta_rng_and_step_survive_a_resume() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    for kl in (0.3, 0.05):
        ctrl.update(kl, n_steps=8)
    resumed = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value
    expected = ctrl.value * (1 + 0.2 * 8 / 100)  # error = clip(0.12 / 0.1 - 1, ±0.2) = 0.2
    for c in (ctrl, resumed):
        c.update(0.12, n_steps=8)
    assert resumed.value == ctrl.value == pytest.approx(expected)

    state = capture_rng_state()
    draws = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    assert step_of_checkpoint("/ckpt/global_step_17") == 17  # global_steps come from the folder name


# --------------------------------------------------------------------------------------------------------------
# Without an agent loop's response_mask, the response part of attention_mask is used; with one, it is kept


@pytest.mark.parametrize("width", [0, 1, 3])
def test_missing_response_mask_is_the_response_part_of_attention_mask(width: int) -> None:
    prompt = 2
    attention = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])[:, : prompt + width]
    prompts = assign_uids(TensorDict({"input_ids": torch.ones(2, prompt)}, batch_size=[2]), "0")
    generated = TensorDict(
        {"responses": torch.ones(2, width, dtype=torch.long), "attention_mask": attention}, batch_size=[2]
    )
    merged = merge_generation(prompts, generated)
    # verl's compute_response_mask fallback: the last R columns (an empty [B, 0] mask when R = 0)
    assert torch.equal(merged["response_mask"], attention[:, prompt:])
    # an agent loop's own mask (tool tokens excluded) is kept, never recomputed from attention_mask
    agent_mask = torch.zeros(2, width, dtype=torch.long)
    generated.set("response_mask", agent_mask)
    assert torch.equal(merge_generation(prompts, generated)["response_mask"], agent_mask)


# --------------------------------------------------------------------------------------------------------------
# A sequence score lands on the last valid response token; an empty response gets nothing (never column -1)


@given(response_masks(max_batch=8, max_len=10), st.integers(0, 2**31 - 1))
def test_sequence_score_goes_to_last_valid_token(mask: torch.Tensor, seed: int) -> None:
    rows, width = mask.shape
    scores = torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 1.0  # never 0
    out = scores_to_token_level(scores, mask)
    assert out.shape == (rows, width) and out.dtype == torch.float32
    for i in range(rows):
        valid = [t for t in range(width) if mask[i, t]]
        expected = torch.zeros(width)
        if valid:  # an empty response writes nowhere: not to column -1, not anywhere
            expected[valid[-1]] = scores[i]
        assert torch.equal(out[i], expected)


def test_empty_response_never_writes_to_the_last_column() -> None:
    mask = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]])  # empty, first token only, interior gap at the end
    out = scores_to_token_level([5.0, 2.0, 3.0], mask)
    assert out.tolist() == [[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]
    assert out[:, -1].abs().sum().item() == 0.0
    # zero-width responses (R = 0) hold no valid token: nothing is written, and nothing fails
    assert scores_to_token_level([5.0, 2.0], torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
