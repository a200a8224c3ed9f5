"""The one check every built-in scorer makes first: a ground truth to compare with."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_ground_truth"]


def check_ground_truth(ground_truth: Any, scorer: str) -> None:
    """Raise ``ValueError`` when ``ground_truth`` is missing (None, an empty string) or a NaN / inf number.

    A response cannot be right or wrong against no reference: scoring it 0 would hide a data bug as a hard prompt.
    """
    if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
        raise ValueError(
            f"{scorer} needs a ground truth, got {ground_truth!r} (reward_model.ground_truth of the prompt row)"
        )
    if isinstance(ground_truth, numbers.Real) and not math.isfinite(float(ground_truth)):
        raise ValueError(f"{scorer} needs a finite ground truth, got {ground_truth!r}")
