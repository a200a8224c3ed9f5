"""GSM8K-style answers: a number after ``####`` (strict) or the last number of the text (flexible).

Numbers are read as exact decimals: thousands separators (``1,234``), a ``$`` sign, a leading minus, decimals
(``3.50`` equals ``3.5``) and a sentence's trailing period (``18.``) are understood; text after the number (units,
``dollars``) is ignored. Differences from verl's GSM8K scorer, on purpose: answers are compared as numbers, not
strings (verl scores ``3.50`` against ``3.5`` as wrong, and ``18.`` as unparsable); the whole response is searched
(verl looks at its last 300 characters only); a comma is a thousands separator only in groups of three digits
(``1,2,3`` is three numbers, not ``123``).

Scores: ``score`` for a correct answer, ``format_score`` (default 0, as verl) for a well-formed answer with a wrong
value, 0 when no answer can be extracted.

The format check, :func:`has_gsm8k_answer` (a number after ``####``, the strict extraction), is also returned by
:func:`gsm8k_score` as ``format`` (1.0 or 0.0, whatever the extraction ``method``): averaged over responses it is
the *format rate*, logged per data source by training (``reward/{source}/format/mean``) and validation
(``val-aux/{source}/format/mean@N``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from ppo_core.rewards._ground_truth import check_ground_truth

__all__ = ["extract_gsm8k_answer", "gsm8k_score", "has_gsm8k_answer", "parse_number"]

# a number: a sign and/or dollar sign right before it, digits (thousands groups of three, or plain), decimals
_NUMBER = r"(?:-\$|\$-|-|\$)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")

Method = Literal["strict", "flexible"]


def parse_number(text: str) -> Decimal | None:
    """The exact value of one number as written in an answer (``"$1,234.50"``, ``"-3"``); None if it is not one.

    Example:
        >>> parse_number("$1,234.50"), parse_number("-$5"), parse_number("12 apples")
        (Decimal('1234.50'), Decimal('-5'), None)
    """
    cleaned = re.sub(r"[\s$]", "", str(text)).rstrip(".")
    if not re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?", cleaned) or not re.search(r"\d", cleaned):
        return None
    try:
        return Decimal(cleaned.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern above only lets valid decimals through
        return None


def extract_gsm8k_answer(solution_str: str, method: Method = "strict") -> Decimal | None:
    """The answer of a response: the number after the last ``####`` (strict) or the last number (flexible).

    Args:
        solution_str: the decoded response.
        method: ``"strict"`` (GSM8K's ``#### 42`` format) or ``"flexible"`` (any last number).

    Returns:
        The answer as an exact ``Decimal``, or None when there is none.

    Example:
        >>> extract_gsm8k_answer("3 + 4 = 7 apples.\\n#### 7"), extract_gsm8k_answer("so 7 apples")
        (Decimal('7'), None)
        >>> extract_gsm8k_answer("we get 1,234.", method="flexible")
        Decimal('1234')
    """
    if method == "strict":
        matches = _STRICT_RE.findall(solution_str)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(solution_str)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    for candidate in reversed(matches):
        value = parse_number(candidate)
        if value is not None:
            return value
    return None


def has_gsm8k_answer(solution_str: str) -> bool:
    """Whether a response is in GSM8K's answer format: a number after ``####`` (the strict extraction finds one).

    Example:
        >>> has_gsm8k_answer("3 + 4 = 7\\n#### 7"), has_gsm8k_answer("#### seven"), has_gsm8k_answer("so 7")
        (True, False, False)
    """
    return extract_gsm8k_answer(solution_str, "strict") is not None


def _ground_truth_value(ground_truth: Any) -> Decimal | None:
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return Decimal(str(ground_truth))
    text = str(ground_truth)
    if "####" in text:  # a whole GSM8K solution
        return extract_gsm8k_answer(text, "strict")
    return parse_number(text.strip())


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    *,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    """Score a GSM8K-style response against its ground truth.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer: a number, a string such as ``"1,234"``, or a whole solution ending
            in ``#### 1234``.
        extra_info: unused (the registry's calling convention).
        method: answer extraction (see :func:`extract_gsm8k_answer`).
        format_score: score of a well-formed answer with a wrong value.
        score: score of a correct answer.

    Returns:
        ``{"score": float, "acc": 1.0 or 0.0, "format": 1.0 or 0.0 (:func:`has_gsm8k_answer`), "pred": the
        extracted answer as a string ("" when none)}``.

    Raises:
        ValueError: the ground truth is missing (None, empty), NaN or inf, or not a number.

    Example:
        >>> gsm8k_score("#### $1,000.00", "1000")
        {'score': 1.0, 'acc': 1.0, 'format': 1.0, 'pred': '1000'}
    """
    check_ground_truth(ground_truth, "gsm8k_score")
    truth = _ground_truth_value(ground_truth)
    if truth is None:
        raise ValueError(
            f"gsm8k ground_truth must be a number (or a solution ending in '#### N'), got {ground_truth!r}"
        )
    answer = extract_gsm8k_answer(solution_str, method)
    well_formed = float(answer is not None if method == "strict" else has_gsm8k_answer(solution_str))
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format": well_formed, "pred": ""}
    correct = answer == truth
    # normalize() drops trailing zeros so equal values vote for the same answer in maj@N
    pred = format(answer.normalize(), "f")
    return {
        "score": float(score if correct else format_score),
        "acc": float(correct),
        "format": well_formed,
        "pred": pred,
    }
