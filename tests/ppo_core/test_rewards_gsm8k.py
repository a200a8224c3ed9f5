"""GSM8K scorer: strict and flexible extraction against a table of tricky answers, exact decimal comparison."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.rewards import extract_gsm8k_answer, get_scorer, gsm8k_score, has_gsm8k_answer, parse_number

# (response, strict answer, flexible answer)
EXTRACTION = [
    ("3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1234"),
    ("#### 1,234,567.25", "1234567.25", "1234567.25"),
    ("#### -5", "-5", "-5"),
    ("#### $18.00 dollars", "18", "18"),
    ("#### $-3", "-3", "-3"),
    ("#### -$3", "-3", "-3"),
    ("####42", "42", "42"),
    ("#### .5", "0.5", "0.5"),
    ("#### 7 apples\n", "7", "7"),
    ("#### 12kg", "12", "12"),
    ("The answer is 18.", None, "18"),
    ("So she has 3 apples, then 4, then 5", None, "5"),
    ("1,2,3", None, "3"),
    ("#### 5 first, then #### 6", "6", "6"),
    ("#### 5\nWait, 10 is wrong.", "5", "10"),
    ("#### answer", None, None),
    ("no digits at all", None, None),
    ("", None, None),
    ("#### - 5", None, "5"),
    ("10 - 5 = 5", None, "5"),
    ("the change is -3.", None, "-3"),
    ("#### 1,2345", "1", "2345"),
    ("#### 007", "7", "7"),
]


@pytest.mark.parametrize(("text", "strict", "flexible"), EXTRACTION)
def test_extraction_table(text, strict, flexible):
    for method, expected in (("strict", strict), ("flexible", flexible)):
        got = extract_gsm8k_answer(text, method)
        assert got == (None if expected is None else Decimal(expected)), (method, text, got)


# (response, ground truth, score with the default strict method)
SCORES = [
    ("#### 3.50", "3.5", 1.0),
    ("#### 3.5", "3.50", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### -0", "0", 1.0),
    ("#### 18.", "18", 1.0),
    ("#### 72", 72, 1.0),
    ("#### 72", 72.0, 1.0),
    ("#### 2", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("#### 73", "72", 0.0),
    ("72", "72", 0.0),
    ("#### -72", "72", 0.0),
]


@pytest.mark.parametrize(("text", "truth", "expected"), SCORES)
def test_score_table(text, truth, expected):
    result = gsm8k_score(text, truth)
    assert result["score"] == expected and result["acc"] == expected


def test_format_score_for_a_well_formed_wrong_answer_only():
    assert gsm8k_score("#### 8", "7", format_score=0.1) == {
        "score": 0.1,
        "acc": 0.0,
        "format": 1.0,
        "pred": "8",
    }
    assert gsm8k_score("seven", "7", format_score=0.1) == {
        "score": 0.0,
        "acc": 0.0,
        "format": 0.0,
        "pred": "",
    }
    assert gsm8k_score("#### 7", "7", format_score=0.1, score=2.0)["score"] == 2.0
    assert gsm8k_score("it is 7", "7", method="flexible")["acc"] == 1.0


def test_equal_values_vote_alike():
    preds = {gsm8k_score(t, "3.5")["pred"] for t in ("#### 3.50", "#### 3.5", "#### $3.500")}
    assert preds == {"3.5"}
    assert gsm8k_score("#### 1,200", "1200")["pred"] == "1200"


def test_bad_arguments():
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible'"):
        extract_gsm8k_answer("#### 1", "loose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gsm8k ground_truth must be a number"):
        gsm8k_score("#### 1", "one")


def test_registered_for_gsm8k_sources():
    assert get_scorer("openai/gsm8k") is gsm8k_score
    assert get_scorer("synthetic/arith_GSM8K") is gsm8k_score


def _written(value: Decimal, commas: bool, dollar: bool) -> str:
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    whole, _, frac = f"{magnitude:f}".partition(".")
    if commas:
        whole = f"{int(whole):,}"
    return sign + ("$" if dollar else "") + whole + ("." + frac if frac else "")


@given(
    value=st.decimals(min_value=-(10**9), max_value=10**9, places=2, allow_nan=False, allow_infinity=False),
    commas=st.booleans(),
    dollar=st.booleans(),
    suffix=st.sampled_from(["", ".", " dollars", " apples.", "\n"]),
    prefix=st.sampled_from(["", "First 12 then 3.\n", "#### 99 (draft)\n"]),
)
def test_strict_and_flexible_recover_any_written_number(value, commas, dollar, suffix, prefix):
    text = _written(value, commas, dollar)
    assert parse_number(text) == value
    response = f"{prefix}{text} is it.\n#### {text}{suffix}"
    assert extract_gsm8k_answer(response, "strict") == value
    assert extract_gsm8k_answer(response, "flexible") == value
    assert gsm8k_score(response, str(value))["acc"] == 1.0
    assert gsm8k_score(response, str(value + 1))["acc"] == 0.0


def test_the_whole_response_is_searched():
    # an answer followed by a long explanation is still found (a scorer that reads only the tail would miss it)
    response = "#### 42\n" + "Let me double-check this carefully. " * 20
    assert len(response) > 600
    assert gsm8k_score(response, "42")["acc"] == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\n#### 7", True),
        ("####7", True),
        ("#### $1,234.50 dollars", True),
        ("#### -3", True),
        ("#### seven", False),
        ("####", False),
        ("the answer is 7", False),
        ("", False),
        ("# 7", False),
        ("#### 7 then #### eight", True),  # the last #### with a number counts
    ],
)
def test_has_gsm8k_answer_edge_cases(text, expected):
    assert has_gsm8k_answer(text) is expected
    assert gsm8k_score(text, "7")["format"] == float(expected)
    assert gsm8k_score(text, "7", method="flexible")["format"] == float(expected)  # format is always strict


@given(st.text(alphabet="#0123456789 ,.$-abc\n", max_size=30))
def test_format_is_the_strict_extraction_and_bounds_the_accuracy(text):
    result = gsm8k_score(text, "7")
    assert has_gsm8k_answer(text) == (extract_gsm8k_answer(text, "strict") is not None)
    assert result["format"] == float(has_gsm8k_answer(text))
    assert result["acc"] <= result["format"]  # a strict answer is right only when it is well formed
    assert (result["pred"] != "") == has_gsm8k_answer(text)
