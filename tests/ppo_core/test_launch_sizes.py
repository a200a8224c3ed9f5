"""The host's launch-shape arithmetic (:mod:`ppo_core.kernels.launch_sizes`) against its definitions, and against
Triton's own constexpr functions where Triton is installed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2


@given(a=st.integers(0, 10**12), b=st.integers(1, 10**6))
def test_cdiv_is_the_ceiling_of_the_quotient(a: int, b: int) -> None:
    q = cdiv(a, b)
    assert (q - 1) * b < a <= q * b  # exact in integers, where math.ceil(a / b) rounds through a float


@given(n=st.integers(-3, 2**40))
def test_next_power_of_2_is_the_smallest_power_of_two_not_below_n(n: int) -> None:
    p = next_power_of_2(n)
    assert p >= max(n, 1) and p & (p - 1) == 0
    assert p == 1 or p // 2 < n  # the smallest


@given(a=st.integers(0, 10**9), b=st.integers(1, 10**6), n=st.integers(1, 2**40))
def test_they_agree_with_tritons_constexpr_functions(a: int, b: int, n: int) -> None:
    triton = pytest.importorskip("triton")
    assert cdiv(a, b) == triton.cdiv(a, b)
    assert next_power_of_2(n) == triton.next_power_of_2(n)
