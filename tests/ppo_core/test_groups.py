"""Group label factorisation and per-group statistics (ppo_core.advantages._groups) against Python-loop references."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.advantages._groups import factorize_index, group_count, group_stats, group_weighted_mean

labels_st = st.one_of(
    st.text(alphabet="0123456789abcdef-", min_size=0, max_size=4),
    st.integers(min_value=-(2**62), max_value=2**62),
)


def _partition(labels: list) -> list[list[int]]:
    """Rows grouped by Python equality of their labels, in first-appearance order (the reference)."""
    members: dict = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    return sorted(members.values())


def _partition_of_ids(ids: torch.Tensor) -> list[list[int]]:
    return _partition(ids.tolist())


@given(st.lists(labels_st, max_size=40))
def test_factorize_matches_python_equality(labels: list) -> None:
    groups = factorize_index(labels, batch_size=len(labels))
    assert groups.ids.dtype == torch.int64
    assert groups.num_groups == len(set(labels))
    if labels:
        assert int(groups.ids.min()) >= 0 and int(groups.ids.max()) < groups.num_groups
    assert _partition_of_ids(groups.ids) == _partition(labels)


@given(st.lists(st.integers(min_value=-(2**62), max_value=2**62), max_size=40))
def test_factorize_tensor_and_numpy_agree_with_list(labels: list[int]) -> None:
    expected = _partition(labels)
    for index in (torch.tensor(labels, dtype=torch.int64), np.array(labels, dtype=np.int64)):
        groups = factorize_index(index, batch_size=len(labels))
        assert groups.num_groups == len(set(labels))
        assert _partition_of_ids(groups.ids) == expected


def test_factorize_keeps_lookalike_strings_apart_and_cheap_for_huge_ints() -> None:
    assert factorize_index(["01", "1", "01", "1.0"], batch_size=4).num_groups == 3
    assert factorize_index(["1", 1], batch_size=2).num_groups == 2
    huge = factorize_index(torch.tensor([10**9, -(10**12), 10**9]), batch_size=3)
    assert huge.num_groups == 2 and huge.ids.numel() == 3
    assert huge.ids[0] == huge.ids[2] != huge.ids[1]
    objects = factorize_index(np.array(["a", "b", "a"], dtype=object), batch_size=3)
    assert _partition_of_ids(objects.ids) == [[0, 2], [1]]


@pytest.mark.parametrize(
    ("index", "error", "match"),
    [
        (["a", "b"], ValueError, "index has 2 labels but the batch has 3 rows"),
        (torch.tensor([1.0, 2.0, 3.0]), TypeError, "index must be an integer tensor"),
        (torch.tensor([True, False, True]), TypeError, "index must be an integer tensor"),
        (torch.zeros(3, 1, dtype=torch.int64), ValueError, "index must be 1-D"),
        ("abc", TypeError, "not a single string"),
        ([[1], [2], [3]], TypeError, "index labels must be hashable"),
        ([torch.tensor(1), torch.tensor(1), torch.tensor(2)], TypeError, "index labels must not be tensors"),
        (3, TypeError, "index must be a 1-D integer tensor or a sequence"),
    ],
)
def test_factorize_errors_name_index(index: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        factorize_index(index, batch_size=3)  # type: ignore[arg-type]


@st.composite
def scored_groups(draw: st.DrawFn) -> tuple[list, list[float], list[bool]]:
    n = draw(st.integers(min_value=0, max_value=24))
    labels = draw(st.lists(st.integers(min_value=-3, max_value=3), min_size=n, max_size=n))
    base = draw(st.sampled_from([0.0, 1.0, 1e6]))
    scores = draw(
        st.lists(
            st.one_of(st.sampled_from([0.0, 1.0]), st.floats(min_value=-10, max_value=10)).map(
                lambda x: base + x
            ),
            min_size=n,
            max_size=n,
        )
    )
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return labels, scores, valid


@given(scored_groups())
def test_group_stats_match_loop(data: tuple[list, list[float], list[bool]]) -> None:
    labels, scores, valid = data
    groups = factorize_index(labels, batch_size=len(labels))
    stats = group_stats(
        torch.tensor(scores, dtype=torch.float64), groups, torch.tensor(valid, dtype=torch.bool)
    )
    ids = groups.ids.tolist()
    for i in range(len(labels)):
        members = [scores[j] for j in range(len(labels)) if labels[j] == labels[i] and valid[j]]
        g = ids[i]
        assert stats.count[g] == len(members)
        if not members:
            assert stats.centred[i] == 0
            continue
        mean = math.fsum(members) / len(members)
        assert stats.mean[g] == pytest.approx(mean, rel=1e-12, abs=1e-9)
        if len(members) > 1:
            var = math.fsum((x - mean) ** 2 for x in members) / (len(members) - 1)
            assert stats.std[g] == pytest.approx(math.sqrt(var), rel=1e-9, abs=1e-9)
        else:
            assert stats.std[g] == 0
        if not valid[i]:
            assert stats.centred[i] == 0
        elif max(members) == min(members):
            assert stats.centred[i] == 0  # exact, not merely small
        else:
            assert stats.centred[i] == pytest.approx(scores[i] - mean, rel=1e-9, abs=1e-9)


@given(scored_groups(), st.data())
def test_group_weighted_mean_matches_loop(
    data: tuple[list, list[float], list[bool]], draw: st.DataObject
) -> None:
    labels, scores, valid = data
    weights = [float(draw.draw(st.integers(min_value=1, max_value=9))) if v else 0.0 for v in valid]
    groups = factorize_index(labels, batch_size=len(labels))
    mean, centred = group_weighted_mean(torch.tensor(scores), groups, torch.tensor(weights))
    for i, label in enumerate(labels):
        members = [j for j in range(len(labels)) if labels[j] == label and weights[j] > 0]
        if not members:
            assert mean[groups.ids[i]] == 0 and centred[i] == 0
            continue
        expected = math.fsum(weights[j] * scores[j] for j in members) / math.fsum(weights[j] for j in members)
        assert mean[groups.ids[i]] == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_group_stats_low_variance_float32_is_centred() -> None:
    # low variance: naive float32 sum-of-squares collapses this variance; the centred float64 path does not
    scores = torch.tensor([1.0, 1.00001, 2.0, 2.00001], dtype=torch.float32)
    groups = factorize_index([0, 0, 1, 1], batch_size=4)
    stats = group_stats(scores, groups)
    exact = scores.double()
    expected_std = (exact[1] - exact[0]).abs() / math.sqrt(2)
    torch.testing.assert_close(stats.std[0], expected_std, rtol=1e-9, atol=0)
    assert group_count(groups).tolist() == [2.0, 2.0]


def test_group_stats_large_batch_sanity() -> None:
    """B = 65536 rows in 8192 uuid groups of 8: runs in O(B) and matches a reshape-based reference."""
    n_groups, size = 8192, 8
    labels = [str(uuid.UUID(int=g)) for g in range(n_groups) for _ in range(size)]
    scores = torch.randn(n_groups * size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    groups = factorize_index(labels, batch_size=len(labels))
    stats = group_stats(scores, groups)
    assert groups.num_groups == n_groups
    by_group = scores.view(n_groups, size)
    first_rows = torch.arange(0, n_groups * size, size)
    torch.testing.assert_close(stats.mean[groups.ids[first_rows]], by_group.mean(dim=1))
    torch.testing.assert_close(stats.std[groups.ids[first_rows]], by_group.std(dim=1))
    torch.testing.assert_close(stats.centred, (by_group - by_group.mean(dim=1, keepdim=True)).flatten())
