"""``ppo_core.keys``: one frozen, unique spelling per batch key, used by the workers, the trainer and metrics."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_core.keys import KEYS, BatchKeys
from ppo_core.workers.ppo import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, FORWARD_KEYS, GENERATE_KEYS


def test_keys_are_unique_frozen_and_named_after_their_field() -> None:
    values = KEYS.all()
    assert len(values) == len(set(values)) == len(dataclasses.fields(BatchKeys))
    for field in dataclasses.fields(BatchKeys):
        # one exception: the multi-turn count keeps its dunder name, as rollouts write it
        expected = "__num_turns__" if field.name == "num_turns" else field.name
        assert getattr(KEYS, field.name) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        KEYS.old_log_probs = "old_log_prob"  # type: ignore[misc]


def test_log_prob_keys_have_one_plural_spelling() -> None:
    names = set(KEYS.all())
    assert {"old_log_probs", "ref_log_probs", "rollout_log_probs", "entropies"} <= names
    assert not names & {"old_log_prob", "ref_log_prob", "logprob", "ref_logprob", "entropys"}


def test_worker_key_sets_are_made_of_batch_keys() -> None:
    names = set(KEYS.all())
    for keys in (GENERATE_KEYS, FORWARD_KEYS, ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS):
        assert set(keys) <= names and len(set(keys)) == len(keys)
