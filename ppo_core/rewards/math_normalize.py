"""A string normaliser for LaTeX answers: the fallback equivalence when ``math-verify`` is not installed.

:func:`normalize_math_answer` applies, in order:

1. strip surrounding ``$``, spaces and a final period; drop ``\\left``/``\\right``, thin spaces (``\\!``, ``\\,``, ``\\;``,
   ``\\:``, ``\\quad``, ``~``), ``\\displaystyle``, degrees (``^\\circ``, ``^{\\circ}``), percent and dollar signs;
2. drop a trailing unit ``\\text{...}`` / ``\\mbox{...}`` / ``\\mathrm{...}`` after a value (``5\\text{ cm}`` is
   ``5``), then unwrap the remaining ones (``\\text{(A)}`` is ``(A)``);
3. ``\\dfrac``/``\\tfrac`` become ``\\frac``; one-character shorthand gets braces (``\\frac12`` is
   ``\\frac{1}{2}``, ``\\sqrt2`` is ``\\sqrt{2}``);
4. remove all whitespace, a trailing period and a leading ``+``; drop a leading one-letter assignment
   (``x=3`` is ``3``);
5. numbers lose their thousands separators (``1,000`` is ``1000``); a multiple-choice letter loses its
   parentheses and case (``(b)`` is ``B``).

:func:`answers_match` then says two answers are equal when their normal forms are equal, or when both are exact
rational numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, with a sign) of equal value (``0.5`` and
``\\frac{1}{2}``). This is deliberately conservative: expressions are never evaluated, so ``\\sqrt{4}`` is not
``2``; ``math-verify`` (``pip install math-verify``, used when importable) handles those.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["answers_match", "normalize_math_answer", "rational_value"]

_DROP = (
    r"\left",
    r"\right",
    r"\displaystyle",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\quad",
    r"\qquad",
    "^{\\circ}",
    "^\\circ",
    r"\circ",
    r"\%",
    "%",
    r"\$",
    "$",
    "~",
)
_TEXT_CMD = r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)"
_TRAILING_UNIT_RE = re.compile(r"(?<=[0-9}\)\]a-zA-Z])\s*" + _TEXT_CMD + r"\{[^{}]*\}\s*$")
_TEXT_RE = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])")
_FRAC_HALF_SHORT_1_RE = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*\{")
_FRAC_HALF_SHORT_2_RE = re.compile(r"\\frac\{([^{}]*)\}\s*([0-9a-zA-Z])")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")
_ASSIGN_RE = re.compile(r"^[a-zA-Z]=(?!=)")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CHOICE_RE = re.compile(r"\(?([A-Ea-e])\)?")
_DECIMAL_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH_RE = re.compile(r"([-+]?\d+)/([-+]?\d+)")
_FRAC_RE = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")


def normalize_math_answer(answer: str) -> str:
    """The normal form of a LaTeX answer (the rules are in the module docstring).

    Example:
        >>> normalize_math_answer(r" $x = \\dfrac12$ "), normalize_math_answer(r"5\\text{ cm}.")
        ('\\\\frac{1}{2}', '5')
        >>> normalize_math_answer("1,000"), normalize_math_answer(r"\\text{(b)}")
        ('1000', 'B')
    """
    s = str(answer).strip()
    for token in _DROP:
        s = s.replace(token, "")
    s = s.strip().rstrip(".")
    s = _TRAILING_UNIT_RE.sub("", s)
    s = _TEXT_RE.sub(r"\1", s)
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT_1_RE.sub(r"\\frac{\1}{", s)
    s = _FRAC_HALF_SHORT_2_RE.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    if _ASSIGN_RE.match(s) and len(s) > 2:
        s = s[2:]
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    choice = _CHOICE_RE.fullmatch(s)
    if choice is not None and (s.startswith("(") or s.isupper()):
        s = choice.group(1).upper()
    return s


def rational_value(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a plain rational number, else None.

    Example:
        >>> rational_value("-0.50"), rational_value(r"-\\frac{3}{6}"), rational_value(r"\\sqrt{2}")
        (Fraction(-1, 2), Fraction(-1, 2), None)
    """
    s = normalized
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s)
        if m := _SLASH_RE.fullmatch(s):
            return Fraction(int(m.group(1)), int(m.group(2)))
        if m := _FRAC_RE.fullmatch(s):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(prediction: str, reference: str) -> bool:
    """Whether two answers are equal after :func:`normalize_math_answer`, or equal as exact rationals.

    Example:
        >>> answers_match("0.5", r"\\frac{1}{2}"), answers_match(r"\\sqrt{4}", "2"), answers_match("", "")
        (True, False, False)
    """
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    va, vb = rational_value(a), rational_value(b)
    return va is not None and vb is not None and va == vb
