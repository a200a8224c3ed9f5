"""validate_batch: missing keys, [B, T] agreement, dtypes; errors name the key and both shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import validate_batch


@given(st.integers(0, 5), st.integers(1, 6), st.integers(1, 6))
def test_shapes_agree_or_error_names_both(size, t1, t2):
    batch = TensorDict(
        {
            "response_mask": torch.ones(size, t1),
            "values": torch.zeros(size, t2),
            "uid": NonTensorStack(*["u"] * size),
        },
        batch_size=[size],
    )
    if t1 == t2:
        assert validate_batch(batch, ["uid"], token_keys=["response_mask", "values"]) == (size, t1)
    else:
        msg = rf"key 'values' has shape \({size}, {t2}\) but 'response_mask' has shape \({size}, {t1}\)"
        with pytest.raises(ValueError, match=msg):
            validate_batch(batch, token_keys=["response_mask", "values"])


def test_missing_keys_and_types():
    batch = TensorDict(
        {"response_mask": torch.ones(2, 3), "uid": NonTensorStack("a", "b"), "n": {"y": torch.zeros(2, 3)}},
        batch_size=[2],
    )
    assert validate_batch(batch, ["uid", ("n", "y")]) == (2, None)
    with pytest.raises(
        KeyError, match=r"missing keys \['advantages', 'n.z'\]; it has \['n.y', 'response_mask', 'uid'\]"
    ):
        validate_batch(batch, ["advantages", ("n", "z")])
    with pytest.raises(TypeError, match="key 'uid' must be a tensor"):
        validate_batch(batch, token_keys=["response_mask", "uid"])
    with pytest.raises(ValueError, match=r"key 'n.y' has shape"):
        validate_batch(
            TensorDict({"a": torch.ones(2, 3), "n": {"y": torch.zeros(2, 4)}}, batch_size=[2]),
            token_keys=["a", ("n", "y")],
        )
    with pytest.raises(ValueError, match=r"key 'uid2' must have shape \[B, T\], got \(2,\)"):
        validate_batch(TensorDict({"uid2": torch.zeros(2)}, batch_size=[2]), token_keys=["uid2"])
    with pytest.raises(TypeError, match=r"key 'response_mask' must have dtype floating, got torch.int64"):
        validate_batch(
            TensorDict({"response_mask": torch.ones(2, 3, dtype=torch.int64)}, [2]),
            dtypes={"response_mask": "floating"},
        )
    with pytest.raises(TypeError, match=r"must have dtype torch\.bool"):
        validate_batch(batch, dtypes={"response_mask": torch.bool})
