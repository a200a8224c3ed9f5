"""balance_by_seqlen / seqlen_balance_metrics name the bad argument instead of failing deep inside."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ppo_core.batch import balance_by_seqlen, seqlen_balance_metrics


def test_strings_are_not_sequence_lengths():
    with pytest.raises(TypeError, match=r"^seqlens must hold numbers, got seqlens\[0\] = 'a' \(str\)"):
        balance_by_seqlen(["a", "b"], 2)
    with pytest.raises(TypeError, match=r"seqlens\[1\] = None"):
        balance_by_seqlen([3, None], 2)


@pytest.mark.parametrize(
    "seqlens",
    [
        TensorDict({"attention_mask": torch.ones(2, 3)}, batch_size=[2]),
        {"a": 1, "b": 2},
        "ab",
        5,
    ],
)
def test_a_batch_or_other_object_is_rejected_with_what_to_pass(seqlens):
    with pytest.raises(TypeError, match=r"^seqlens must be a 1-D tensor or a sequence of numbers") as info:
        balance_by_seqlen(seqlens, 2)
    assert "attention_mask" in str(info.value)  # says how to get the lengths of a batch


def test_tensors_arrays_and_numpy_numbers_are_still_accepted():
    expected, _ = balance_by_seqlen([1, 2, 3, 4], 2)
    assert balance_by_seqlen(torch.tensor([1, 2, 3, 4]), 2)[0] == expected
    assert balance_by_seqlen(np.array([1.0, 2.0, 3.0, 4.0]), 2)[0] == expected
    assert balance_by_seqlen([np.int64(1), np.float32(2), 3, 4.0], 2)[0] == expected
    with pytest.raises(ValueError, match="seqlens must be 1-D"):
        balance_by_seqlen(np.ones((2, 2)), 2)


def test_partition_indices_out_of_range_name_the_partition():
    with pytest.raises(ValueError, match=r"^partitions\[1\] holds row index 9 but seqlens has 4 rows"):
        seqlen_balance_metrics([1, 2, 3, 4], [[0, 1], [2, 9]])
    with pytest.raises(ValueError, match=r"partitions\[0\] holds row index -1"):
        seqlen_balance_metrics([1, 2], [[-1], [1]])


def test_partitions_of_the_wrong_type_name_the_entry():
    with pytest.raises(TypeError, match=r"partitions\[0\] holds 1.5 \(float\)"):
        seqlen_balance_metrics([1, 2], [[1.5], [0]])
    with pytest.raises(TypeError, match=r"partitions\[1\] must be a list of row indices, got int"):
        seqlen_balance_metrics([1, 2], [[0], 1])
    with pytest.raises(TypeError, match="partitions must be a sequence of lists"):
        seqlen_balance_metrics([1, 2], 3)
    with pytest.raises(TypeError, match="seqlens must hold numbers"):
        seqlen_balance_metrics(["x", 2], [[0], [1]])


def test_valid_partitions_still_give_the_metrics():
    parts, _ = balance_by_seqlen([1, 1, 5, 5], 2)
    got = seqlen_balance_metrics([1, 1, 5, 5], parts)
    assert got["global_seqlen/balanced_max"] == 6.0 and got["global_seqlen/minmax_diff"] == 8.0
