"""MATH scorer: last-box extraction with nesting, the fallback normaliser, math-verify equivalence, timeouts."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.rewards import (
    answers_match,
    boxed_contents,
    last_boxed_answer,
    math_equivalent,
    math_score,
    math_verify_available,
    normalize_math_answer,
    rational_value,
)

needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")

# (response, last boxed answer)
BOXES = [
    (r"\boxed{3}", "3"),
    (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} and more text", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),
    (r"\fbox{7}", "7"),
    (r"\boxed{1} then \fbox{2}", "2"),
    (r"\boxed{\boxed{3}}", "3"),
    (r"\boxed{ \boxed{ 3 } }", "3"),
    (r"\boxed{\boxed{3} + 1}", r"\boxed{3} + 1"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{\text{(A)}}", r"\text{(A)}"),
    (r"\boxed 5$ done", "5"),
    (r"\boxed {12}", "12"),
    (r"\boxed{}", None),
    (r"\boxed{1} and a cut \boxed{\frac{1}{", None),
    (r"\boxedx{2}", None),
    ("no box at all: 42", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), BOXES)
def test_last_boxed_answer_table(text, expected):
    assert last_boxed_answer(text) == expected


def test_boxed_contents_reports_an_unclosed_box():
    assert boxed_contents(r"\boxed{1} \boxed{2") == (["1"], True)
    assert boxed_contents(r"\boxed{a}\fbox{b}") == (["a", "b"], False)


@given(st.lists(st.text(alphabet="0123456789x+-", min_size=1, max_size=5), min_size=1, max_size=4))
def test_last_top_level_box_wins_and_nesting_is_kept(parts):
    # each part wrapped in a brace group, boxed, with text between: the last part (with its braces) wins
    text = " then ".join(r"\boxed{{" + p + "}}" for p in parts)
    assert last_boxed_answer(text) == "{" + parts[-1] + "}"


# (prediction, reference, equal by the normaliser alone, equal with math-verify)
EQUIVALENCE = [
    (r"\frac12", "0.5", True, True),
    (r"\dfrac{1}{2}", "1/2", True, True),
    (r"-\frac{3}{4}", "-0.75", True, True),
    ("3.50", "3.5", True, True),
    ("1,000", "1000", True, True),
    ("-3", "-3.0", True, True),
    (r"10\%", "10", True, True),
    (r"90^\circ", "90", True, True),
    (r"5\text{ cm}", "5", True, True),
    (r"\$5", "5", True, True),
    ("x = 3", "3", True, True),
    (r"\text{(B)}", "B", True, True),
    (r"\left( 1, 2 \right)", "(1,2)", True, True),
    (r"\frac{\sqrt2}{2}", r"\frac{\sqrt{2}}{2}", True, True),
    (r"\sqrt{4}", "2", False, True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", False, True),
    ("(x+1)^2", "x^2+2x+1", False, True),
    (r"\{2, 1\}", r"\{1,2\}", False, True),
    ("2", "3", False, False),
    ("-2", "2", False, False),
    (r"\frac{1}{3}", "0.333", False, False),
    ("1,2", "12", False, False),
    ("", "0", False, False),
]


@pytest.mark.parametrize(("pred", "ref", "by_normaliser", "_"), EQUIVALENCE)
def test_normaliser_table(pred, ref, by_normaliser, _):
    assert answers_match(pred, ref) is by_normaliser
    assert math_equivalent(pred, ref, use_math_verify=False) is by_normaliser


@needs_math_verify
@pytest.mark.parametrize(("pred", "ref", "_", "with_math_verify"), EQUIVALENCE)
def test_math_verify_table(pred, ref, _, with_math_verify):
    assert math_equivalent(pred, ref) is with_math_verify
    assert math_equivalent(pred, ref, use_math_verify=True) is with_math_verify


@pytest.mark.parametrize("use_math_verify", [False, pytest.param(None, marks=needs_math_verify)])
def test_score_table(use_math_verify):
    cases = [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"\boxed{2} ... no, \boxed{-2}", "-2", 1.0),
        (r"\boxed{-2} ... no, \boxed{2}", "-2", 0.0),
        ("the answer is 1/2", "0.5", 0.0),
        (r"\boxed{\boxed{\dfrac{1}{2}}}", r"Solution ... \boxed{\frac{1}{2}}", 1.0),
        (r"\boxed{1} then cut \boxed{\frac{1}{", "1", 0.0),
    ]
    for text, truth, expected in cases:
        assert math_score(text, truth, use_math_verify=use_math_verify)["acc"] == expected, text


def test_format_score_and_pred():
    assert math_score(r"\boxed{3}", "4", format_score=0.1, use_math_verify=False) == {
        "score": 0.1,
        "acc": 0.0,
        "pred": "3",
    }
    assert math_score("no box", "4", format_score=0.1) == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert math_score(r"\boxed{x=\dfrac12}", "0.5", use_math_verify=False)["pred"] == r"\frac{1}{2}"


@needs_math_verify
def test_a_pathological_answer_times_out_in_the_main_thread():
    assert threading.current_thread() is threading.main_thread()
    result = math_score(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1)
    assert result["acc"] == 0.0


@needs_math_verify
def test_outside_the_main_thread_math_verify_runs_without_alarm():
    out = {}

    def work():  # signal.alarm would raise here; the scorer must not
        out["ok"] = math_equivalent(r"\sqrt{4}", "2")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert out == {"ok": True}


def test_long_answers_skip_the_symbolic_check_and_bad_options():
    long = "+".join(["1"] * 600)
    assert math_equivalent(long, "600", max_answer_chars=100) is False
    with pytest.raises(ValueError, match="timeout_s must be an int >= 1"):
        math_equivalent("1", "2", timeout_s=0)


@given(
    num=st.integers(-50, 50),
    den=st.integers(1, 20),
    form=st.sampled_from(["frac", "dfrac", "slash", "decimal"]),
    wrap=st.sampled_from(["{}", "${}$", r"\left({}\right)", "{}.", "x = {}"]),
)
def test_rationals_written_any_way_match_their_value(num, den, form, wrap):
    value = Fraction(num, den)
    sign = "-" if value < 0 else ""
    p, q = abs(value).numerator, value.denominator
    if form == "decimal":
        if 10**6 % q:  # not a terminating decimal within 6 places
            return
        text = f"{float(value):.6f}"
    else:
        text = {
            "frac": rf"{sign}\frac{{{p}}}{{{q}}}",
            "dfrac": rf"{sign}\dfrac{{{p}}}{{{q}}}",
            "slash": f"{sign}{p}/{q}",
        }[form]
    written = wrap.format(text)
    if wrap.startswith(r"\left"):  # parentheses survive: only the sizing commands are dropped
        assert normalize_math_answer(written) == "(" + normalize_math_answer(text) + ")"
        return
    assert rational_value(normalize_math_answer(written)) == value
    assert math_equivalent(written, str(value.numerator) + ("" if q == 1 else f"/{q}"), use_math_verify=False)
    assert not math_equivalent(written, str(value + 1), use_math_verify=False)
