"""Hypothesis strategies for ``TensorDict`` batches with tensor and non-tensor (``NonTensorStack``) fields.

Every drawn batch carries ``row: [B] int64 = arange(B)``, so a test can tell exactly which original row ended up
where after a split, a shuffle or a selection.

Example:
    >>> from hypothesis import given
    >>> from ppo_core.testing.batch_strategies import td_batches
    >>> @given(td_batches(max_batch=6))
    ... def test_rows_survive_clone(b):
    ...     assert b.clone()["row"].tolist() == list(range(b.batch_size[0]))
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict, is_leaf_nontensor, is_non_tensor

__all__ = ["assert_batch_rows", "td_batches", "uid_texts"]

uid_texts = st.text(alphabet="0123456789abcdef-", min_size=1, max_size=6)
"""Short uuid-like strings, including look-alikes such as ``"01"`` and ``"1"``."""


def _objects() -> st.SearchStrategy[object]:
    scalars = st.one_of(
        st.none(),
        st.integers(-5, 5),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=4),
    )
    return st.one_of(
        scalars, st.dictionaries(st.text(max_size=2), scalars, max_size=2), st.lists(scalars, max_size=2)
    )


@st.composite
def td_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 0,
    max_batch: int = 12,
    min_len: int = 1,
    max_len: int = 8,
    non_tensor: bool = True,
    nested: bool = True,
    nan: bool = True,
    device: str | torch.device = "cpu",
) -> TensorDict:
    """A ``TensorDict`` with ``batch_size=[B]``.

    Fields: ``row`` ``[B]`` int64 (``arange(B)``), ``response_mask`` ``[B, T]`` bool, ``values`` ``[B, T]``
    float32 (NaN/inf at some masked positions when ``nan``), ``scores`` ``[B]`` float64, ``responses`` ``[B, T]``
    int64; with ``non_tensor``: ``uid`` (strings, repeated within drawn groups), ``data_source`` (strings) and
    ``extra`` (None, numbers including NaN, short strings, dicts, lists) as ``NonTensorStack``; with ``nested``:
    ``("info", "weight")`` ``[B, 2]`` float64.
    """
    batch = draw(st.integers(min_value=min_batch, max_value=max_batch))
    seq_len = draw(st.integers(min_value=min_len, max_value=max_len))
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=gen)
    mask = torch.arange(seq_len).expand(batch, seq_len) < lengths[:, None]
    values = torch.randn(batch, seq_len, generator=gen)
    if nan and batch:
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
        picks = junk[torch.randint(0, 4, (batch, seq_len), generator=gen)]
        values = torch.where(mask, values, picks)
    fields: dict[str, object] = {
        "row": torch.arange(batch),
        "response_mask": mask,
        "values": values,
        "scores": torch.randn(batch, generator=gen, dtype=torch.float64),
        "responses": torch.randint(0, 100, (batch, seq_len), generator=gen),
    }
    if nested:
        fields["info"] = {"weight": torch.rand(batch, 2, generator=gen, dtype=torch.float64)}
    if non_tensor:
        group_labels = draw(st.lists(uid_texts, min_size=1, max_size=max(1, batch), unique=True))
        uids = [group_labels[min(i // 2, len(group_labels) - 1)] for i in range(batch)]
        sources = draw(st.lists(st.sampled_from(["gsm8k", "math", "code"]), min_size=batch, max_size=batch))
        extras = draw(st.lists(_objects(), min_size=batch, max_size=batch))
        fields["uid"] = NonTensorStack(*uids)
        fields["data_source"] = NonTensorStack(*sources)
        fields["extra"] = NonTensorStack(*extras)
    return TensorDict(fields, batch_size=[batch], device=device)


def assert_batch_rows(actual: TensorDict, source: TensorDict, rows: list[int]) -> None:
    """Assert that ``actual`` holds exactly rows ``rows`` of ``source``: same keys, dtypes and values.

    Tensors are compared exactly with NaN equal to NaN; non-tensor fields by ``repr`` (deep, NaN-safe).
    """
    assert actual.batch_size == torch.Size([len(rows)]), (actual.batch_size, len(rows))
    keys = sorted(map(str, source.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)))
    got = sorted(map(str, actual.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)))
    assert got == keys, (got, keys)
    index = torch.tensor(rows, dtype=torch.int64)
    for key in source.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        want, have = source.get(key), actual.get(key)
        if is_non_tensor(want):
            assert is_non_tensor(have), key
            values = list(want.tolist())
            assert repr([values[i] for i in rows]) == repr(list(have.tolist())), key
        else:
            assert not is_non_tensor(have), key
            torch.testing.assert_close(have, want[index], rtol=0, atol=0, equal_nan=True)
