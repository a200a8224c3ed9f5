"""union compares object values that contain themselves (cyclic object arrays, lists, dicts) without recursing
forever, and still tells cyclic values apart."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import union
from ppo_core.batch._td import _values_equal


def _ring(labels: list[object]) -> np.ndarray:
    """A cycle of object arrays: node i holds (label i, node i+1); the last points back at the first."""
    nodes = [np.empty(2, dtype=object) for _ in labels]
    for i, (node, label) in enumerate(zip(nodes, labels, strict=True)):
        node[0] = label
        node[1] = nodes[(i + 1) % len(nodes)]
    return nodes[0]


def _unroll(labels: list[object], steps: int) -> list[object]:
    """Oracle: the labels met walking ``steps`` nodes around the ring."""
    return [labels[i % len(labels)] for i in range(steps)]


def _batch(value: object) -> TensorDict:
    return TensorDict({"obj": NonTensorStack.from_list([value, "plain"])}, batch_size=[2])


def test_union_of_self_containing_object_arrays():
    a, b = np.empty(2, dtype=object), np.empty(2, dtype=object)
    a[0], a[1] = a, float("nan")
    b[0], b[1] = b, float("nan")
    out = union(_batch(a), _batch(b))
    assert out.get("obj").tolist()[0] is a
    c = np.empty(2, dtype=object)
    c[0], c[1] = c, 1.0
    with pytest.raises(ValueError, match="key 'obj' is in both a and b with different values"):
        union(_batch(a), _batch(c))


labels = st.lists(st.sampled_from([0, 1, "x", None]), min_size=1, max_size=4)


@given(labels, labels)
def test_cyclic_equality_matches_the_unrolled_oracle(left, right):
    # Two rings are equal exactly when their infinite walks agree, i.e. on the first len(l) * len(r) steps.
    steps = len(left) * len(right)
    want = _unroll(left, steps) == _unroll(right, steps)
    assert _values_equal(_ring(left), _ring(right)) is want
    assert _values_equal(_ring(left), _ring(left))


def test_self_containing_lists_and_dicts():
    x, y = [1], [1]
    x.append(x)
    y.append(y)
    assert _values_equal(x, y)
    assert not _values_equal(x, [1, [1, [2]]])
    d, e = {"k": 1.0}, {"k": 1.0}
    d["self"], e["self"] = d, e
    assert _values_equal(d, e)
    assert not _values_equal(d, {"k": 1.0, "self": {"k": 1.0, "self": {}}})
    # mutual recursion: p -> q -> p against r -> r
    p, q, r = [0], [0], [0]
    p.append(q)
    q.append(p)
    r.append(r)
    assert _values_equal(p, r)
