"""One value at every valid entry, the case whitening must turn into exact zeros; shared by the whitening tests
(imported as ``from _constant import ...``)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@st.composite
def constant_cases(
    draw: st.DrawFn, *, min_dims: int = 2, max_dims: int = 2, max_size: int = 8, dtypes: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, mask)``: one value of any finite magnitude in a drawn dtype at two or more valid entries of a
    random bool mask (any pattern, rows without a valid entry included), 0 elsewhere."""
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    top = torch.finfo(dtype).max
    value = draw(st.floats(-top, top))
    shape = draw(
        st.lists(st.integers(min_value=1, max_value=max_size), min_size=min_dims, max_size=max_dims).filter(
            lambda s: math.prod(s) >= 2
        )
    )
    size = math.prod(shape)
    flags = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    for i in draw(
        st.lists(st.integers(min_value=0, max_value=size - 1), min_size=2, max_size=2, unique=True)
    ):
        flags[i] = True
    mask = torch.tensor(flags).reshape(shape)
    # rounded to the dtype from float64: a finite value no larger than its largest float stays finite
    values = torch.zeros(shape, dtype=dtype).masked_fill(
        mask, torch.tensor(value, dtype=torch.float64).to(dtype)
    )
    return values, mask
