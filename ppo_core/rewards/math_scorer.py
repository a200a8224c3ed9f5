"""MATH-style answers: the last ``\\boxed{...}`` of the response against the ground truth, up to equivalence.

Equivalence: first the conservative normaliser of :mod:`ppo_core.rewards.math_normalize` (no evaluation, fast);
if that says "different" and the ``math-verify`` package is importable, its symbolic check
(``verify(parse(gold), parse(prediction))``, both given as ``\\boxed{...}``), which knows ``\\sqrt{4} = 2``, sets,
intervals, percentages and equations.

Timeout: ``math-verify`` bounds parsing and comparison with ``signal.alarm``, which only works in the main thread
of a process. In the main thread (the controller calling the reward inline, or a worker of
``RuleBasedReward(num_workers=N)``, whose tasks run in each worker process's main thread) every answer gets
``timeout_s`` seconds and a pathological one (``9^{9^{9^{9}}}``) scores as wrong. Called from another thread,
the symbolic check runs without a timeout and a warning is logged once: score in a process pool there. Answers
longer than ``max_answer_chars`` only get the normaliser.

Differences from verl, on purpose: verl's MATH scorer compares with a string normaliser only; here the symbolic
check is added when ``math-verify`` is installed (the ``hf`` extra installs it), so ``0.5`` against
``\\frac{1}{2}`` is right either way and ``\\sqrt{4}`` against ``2`` is right with ``math-verify``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from ppo_core.rewards._ground_truth import check_ground_truth
from ppo_core.rewards.boxed import last_boxed_answer
from ppo_core.rewards.math_normalize import answers_match, normalize_math_answer

__all__ = ["math_equivalent", "math_score", "math_verify_available"]

logger = logging.getLogger(__name__)

_warned_thread = False


@functools.lru_cache(maxsize=1)
def math_verify_available() -> bool:
    """Whether the ``math-verify`` package can be imported."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _symbolic_equal(prediction: str, reference: str, timeout_s: int) -> bool:
    global _warned_thread
    from math_verify import parse, verify

    timeout: int | None = timeout_s
    if threading.current_thread() is not threading.main_thread():
        timeout = None
        if not _warned_thread:
            _warned_thread = True
            logger.warning(
                "math-verify runs without a timeout outside the main thread; use RuleBasedReward(num_workers=N) "
                "so that a pathological answer cannot hang the caller"
            )
    gold = parse("\\boxed{" + reference + "}", parsing_timeout=timeout)
    pred = parse("\\boxed{" + prediction + "}", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def math_equivalent(
    prediction: str,
    reference: str,
    *,
    use_math_verify: bool | None = None,
    timeout_s: int = 5,
    max_answer_chars: int = 1000,
) -> bool:
    """Whether two LaTeX answers (box contents) are mathematically equal (see the module docstring).

    Args:
        prediction: the model's answer.
        reference: the ground truth.
        use_math_verify: None uses ``math-verify`` when importable; True requires it; False never uses it.
        timeout_s: seconds for each of ``math-verify``'s parse and compare steps (main thread only).
        max_answer_chars: longer answers are compared by the normaliser only.

    Example:
        >>> math_equivalent("0.5", r"\\frac12", use_math_verify=False)
        True
    """
    if int(timeout_s) < 1:
        raise ValueError(
            f"timeout_s must be an int >= 1 (signal.alarm counts whole seconds), got {timeout_s}"
        )
    if answers_match(prediction, reference):
        return True
    if use_math_verify is False:
        return False
    if not math_verify_available():
        if use_math_verify:
            raise ImportError("use_math_verify=True needs the math-verify package: pip install math-verify")
        return False
    if len(prediction) > max_answer_chars or len(reference) > max_answer_chars:
        return False
    return _symbolic_equal(prediction, reference, int(timeout_s))


def math_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
    use_math_verify: bool | None = None,
    timeout_s: int = 5,
    max_answer_chars: int = 1000,
) -> dict[str, Any]:
    """Score a response whose final answer is its last ``\\boxed{...}`` against ``ground_truth``.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer, bare (``"\\frac{1}{2}"``) or a solution with a box (its last box is
            taken).
        extra_info: unused (the registry's calling convention).
        format_score: score of a boxed answer that is wrong.
        score: score of a correct answer.
        use_math_verify, timeout_s, max_answer_chars: see :func:`math_equivalent`.

    Returns:
        ``{"score": float, "acc": 1.0 or 0.0, "pred": the normalised answer ("" when there is no box)}``.

    Raises:
        ValueError: the ground truth is missing (None, empty), NaN or inf (as :func:`gsm8k_score`).

    Example:
        >>> math_score(r"so $x = \\boxed{\\dfrac{1}{2}}$.", "0.5", use_math_verify=False)
        {'score': 1.0, 'acc': 1.0, 'pred': '\\\\frac{1}{2}'}
    """
    check_ground_truth(ground_truth, "math_score")
    answer = last_boxed_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    reference = str(ground_truth)
    if "\\boxed" in reference or "\\fbox" in reference:
        reference = last_boxed_answer(reference) or reference
    correct = math_equivalent(
        answer,
        reference,
        use_math_verify=use_math_verify,
        timeout_s=timeout_s,
        max_answer_chars=max_answer_chars,
    )
    return {
        "score": float(score if correct else format_score),
        "acc": float(correct),
        "pred": normalize_math_answer(answer),
    }
