"""iter_minibatches: every row once per epoch, determinism under a seeded generator, no global RNG use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import iter_minibatches
from ppo_core.testing.batch_strategies import assert_batch_rows

FEW = settings(max_examples=min(60, settings.default.max_examples))


def _batch(size: int) -> TensorDict:
    return TensorDict(
        {
            "row": torch.arange(size),
            "x": torch.arange(3.0 * size).reshape(size, 3),
            "uid": NonTensorStack(*[f"u{i}" for i in range(size)]),
        },
        batch_size=[size],
    )


@FEW
@given(st.integers(1, 6), st.integers(0, 4), st.integers(0, 3), st.booleans(), st.integers(0, 2**31 - 1))
def test_every_row_once_per_epoch_and_rows_stay_whole(mb_size, n_mb, epochs, shuffle, seed):
    size = mb_size * n_mb
    batch = _batch(size)
    mbs = list(
        iter_minibatches(
            batch, mb_size, epochs=epochs, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
        )
    )
    assert len(mbs) == epochs * n_mb
    for e in range(epochs):
        epoch = mbs[e * n_mb : (e + 1) * n_mb]
        rows = [r for mb in epoch for r in mb["row"].tolist()]
        assert sorted(rows) == list(range(size))
        if not shuffle:
            assert rows == list(range(size))
        for mb in epoch:
            assert_batch_rows(mb, batch, mb["row"].tolist())


@FEW
@given(st.integers(2, 16), st.integers(0, 2**31 - 1))
def test_deterministic_given_generator_state(size, seed):
    batch = _batch(size)

    def run() -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [mb["row"].tolist() for mb in iter_minibatches(batch, 1, epochs=2, generator=gen)]

    assert run() == run()
    gen = torch.Generator().manual_seed(seed)
    expected = [torch.randperm(size, generator=gen).tolist() for _ in range(2)]
    assert [r for mb in run() for r in mb] == expected[0] + expected[1]


def test_global_rng_is_not_used():
    batch = _batch(8)
    state = torch.get_rng_state()
    list(iter_minibatches(batch, 2, epochs=3, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(state, torch.get_rng_state())


def test_errors_are_raised_at_call_time_and_name_sizes():
    batch = _batch(10)
    with pytest.raises(ValueError, match="minibatch_size=4 does not divide the batch size 10"):
        iter_minibatches(batch, 4, generator=torch.Generator())
    with pytest.raises(ValueError, match="shuffle=True needs generator"):
        iter_minibatches(batch, 5)
    with pytest.raises(ValueError, match="minibatch_size must be an int >= 1"):
        iter_minibatches(batch, 0, shuffle=False)
    with pytest.raises(ValueError, match="epochs must be an int >= 0"):
        iter_minibatches(batch, 5, epochs=-1, shuffle=False)
    assert list(iter_minibatches(_batch(0), 3, shuffle=False)) == []
