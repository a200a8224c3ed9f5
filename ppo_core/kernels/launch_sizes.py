"""Integer arithmetic of launch shapes on the host: grid sizes (:func:`cdiv`) and power-of-two block sizes
(:func:`next_power_of_2`).

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from Python, each first
unwraps its arguments as the kernel compiler's calls need, several times the arithmetic's cost, and a kernel's
wrapper calls them a few times a launch. The decode engine's wrappers run for every launch of a decode step while
a generation captures that step's graph, host time that the device may wait for; the advantage estimators' run for
every call. These are the plain functions.

Example:
    >>> cdiv(10, 4), next_power_of_2(5), next_power_of_2(8), next_power_of_2(0)
    (3, 8, 8, 1)
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``: a block is never empty)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
