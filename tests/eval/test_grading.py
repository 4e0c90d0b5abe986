"""Grading and statistics against hand-written cases and known values."""

from __future__ import annotations

import pytest

from kvtier.eval import extract_boxed, grade
from kvtier.eval.stats import cochran_q, mcnemar_exact, wilson


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}} then \boxed{\dfrac{3}{4}}", r"\dfrac{3}{4}"),
        (r"\boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
        (r"\fbox{7}", "7"),
        ("no box here", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    "completion, gold, ok",
    [
        (r"The answer is \boxed{1,234}", "1234", True),
        (r"\boxed{\$18}", "18", True),
        (r"\boxed{18 dollars}", "18", True),
        (r"\boxed{\text{18 apples}}", "18", True),
        (r"\boxed{18.0}", "18", True),
        (r"\boxed{50\%}", "50", True),
        (r"\boxed{-3}", "-3", True),
        (r"\boxed{3}", "-3", False),
        ("She makes 9 * 2 = $18 every day.", "18", True),  # no box: the last number
        ("I am not sure.", "18", False),  # missing answer
        (r"\boxed{17}", "18", False),
        (r"\boxed{\frac{36}{2}}", "18", True),
    ],
)
def test_gsm8k(completion, gold, ok):
    assert grade("gsm8k", completion, gold) is ok


@pytest.mark.parametrize(
    "completion, gold, ok",
    [
        (r"\boxed{\dfrac{1}{2}}", r"\frac12", True),
        (r"\boxed{0.5}", r"\frac{1}{2}", True),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True),
        (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"\boxed{x^2+2x+1}", r"(x+1)^2", True),
        (r"\boxed{\text{(C)}}", r"\text{(C)}", True),
        (r"\boxed{i}", "i", True),
        (r"\boxed{2}", "3", False),
        ("the answer is 3", "3", False),  # MATH needs a boxed answer
    ],
)
def test_math(completion, gold, ok):
    assert grade("math500", completion, gold) is ok
    assert grade("math_level5", completion, gold) is ok


@pytest.mark.parametrize(
    "completion, gold, ok",
    [
        (r"\boxed{C}", "C", True),
        (r"\boxed{C. Planetary days}", "C", True),
        (r"\boxed{(b)}", "B", True),
        (r"\boxed{\text{D}}", "D", True),
        (r"\boxed{2}", "B", True),  # a numeric label maps by position
        ("The answer is (A).", "A", True),
        (r"\boxed{A}", "C", False),
        ("no idea", "C", False),
    ],
)
def test_arc(completion, gold, ok):
    assert grade("arc_challenge", completion, gold) is ok


def test_reasoning_gym_grading_and_unknown_benchmark():
    assert grade("rg:gsm_symbolic", r"\boxed{70}", "70")
    assert not grade("rg:gsm_symbolic", r"\boxed{71}", "70")
    with pytest.raises(ValueError, match="benchmark must be one of"):
        grade("mmlu", "x", "y")


def test_wilson_known_values():
    lo, hi = wilson(8, 10)  # known: (0.4902, 0.9433)
    assert abs(lo - 0.4902) < 1e-4 and abs(hi - 0.9433) < 1e-4
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and abs(hi - 0.1611) < 1e-4


def test_mcnemar_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert abs(mcnemar_exact(1, 9) - 0.021484375) < 1e-12  # 2 * (1 + 10) / 1024
    assert abs(mcnemar_exact(3, 3) - 1.0) < 1e-12
    assert abs(mcnemar_exact(0, 6) - 0.03125) < 1e-12


def test_cochran_q_known_values():
    # identical outcomes across conditions: Q = 0, p = 1
    assert cochran_q([[1, 1, 1], [0, 0, 0], [1, 1, 1]]) == (0.0, 1.0)
    # textbook example (k=3): columns 5, 4, 1 successes over 6 subjects -> Q = 5.2 (hand computed)
    table = [[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    q, p = cochran_q(table)
    col = [5, 4, 1]
    row = [2, 2, 2, 1, 3, 0]
    want = 2 * (3 * sum(c * c for c in col) - 10**2) / (3 * 10 - sum(r * r for r in row))
    assert abs(q - want) < 1e-12
    assert 0 < p < 0.1
