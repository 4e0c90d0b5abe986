"""Grading: GSM8K and reasoning-gym by number, MATH with math-verify, ARC by choice letter.

``grade(benchmark, completion, gold) -> bool`` is the one entry point. The answer is the last ``\\boxed{}``
(nested braces allowed); GSM8K and numeric tasks fall back to the last number when nothing is boxed.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .specs import base_benchmark

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (balanced braces), or None."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1]
    return best.strip() if best is not None else None


def _to_number(s: str) -> Fraction | None:
    """Parse '1,234', '$5', '12 apples', '3/4', '\\frac{3}{4}', '\\dfrac34', '50%', '-2.5' into an exact number."""
    s = s.strip()
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\!|\\,|\\\$|\$|\\%|%|\\left|\\right", "", s)
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    m = re.fullmatch(r"\s*(-?)\\frac\s*\{?\s*(-?\d+)\s*\}?\s*\{?\s*(\d+)\s*\}?\s*", s)
    if m:
        num = Fraction(int(m.group(2)), int(m.group(3)))
        return -num if m.group(1) else num
    m = re.fullmatch(r"\s*(-?\d+)\s*/\s*(\d+)\s*", s)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2)))
    nums = _NUM.findall(s)
    if len(nums) != 1:
        return None
    try:
        return Fraction(nums[0].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _numeric_answer(completion: str) -> Fraction | None:
    boxed = extract_boxed(completion)
    if boxed is not None:
        return _to_number(boxed)
    nums = _NUM.findall(completion)
    return _to_number(nums[-1]) if nums else None


def grade_numeric(completion: str, gold: str) -> bool:
    g = _to_number(gold)
    p = _numeric_answer(completion)
    return g is not None and p is not None and p == g


def _norm_math(s: str) -> str:
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[,!;: ]", "", s)
    return re.sub(r"\s+", "", s).rstrip(".").strip("$")


def grade_math(completion: str, gold: str) -> bool:
    pred = extract_boxed(completion)
    if pred is None:
        return False
    try:
        from math_verify import parse, verify

        ok = verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}"))
        if ok:
            return True
    except ImportError:
        pass
    except Exception:  # math-verify can choke on odd LaTeX; fall back to normalized text
        pass
    if _norm_math(pred) == _norm_math(gold):
        return True
    g, p = _to_number(gold), _to_number(pred)
    return g is not None and p is not None and g == p


def _choice_letter(completion: str) -> str | None:
    boxed = extract_boxed(completion)
    cand = boxed if boxed is not None else None
    if cand is None:
        m = re.findall(r"answer is\s*\(?([A-H1-8])\)?", completion, flags=re.I)
        cand = m[-1] if m else None
    if cand is None:
        return None
    cand = re.sub(r"\\text\{([^}]*)\}", r"\1", cand).strip().strip("().:")
    m = re.match(r"([A-Ha-h])(?:\b|[.):]|$)", cand)
    if m:
        return m.group(1).upper()
    m = re.match(r"([1-8])\b", cand)
    return "ABCDEFGH"[int(m.group(1)) - 1] if m else None


def grade_choice(completion: str, gold: str) -> bool:
    return _choice_letter(completion) == gold.strip().upper()


def extract_answer(benchmark: str, completion: str) -> str | None:
    """The answer as the grader reads it (for records)."""
    benchmark = base_benchmark(benchmark)
    if benchmark == "arc_challenge":
        return _choice_letter(completion)
    if benchmark in ("gsm8k",) or benchmark.startswith("rg:"):
        boxed = extract_boxed(completion)
        if boxed is not None:
            return boxed
        nums = _NUM.findall(completion)
        return nums[-1] if nums else None
    return extract_boxed(completion)


def grade(benchmark: str, completion: str, gold: str) -> bool:
    """Is ``completion`` a correct answer to a ``benchmark`` problem whose reference answer is ``gold``?"""
    benchmark = base_benchmark(benchmark)
    if benchmark == "arc_challenge":
        return grade_choice(completion, gold)
    if benchmark in ("math500", "math_level5"):
        return grade_math(completion, gold)
    if benchmark == "gsm8k":
        return grade_numeric(completion, gold)
    if benchmark.startswith("rg:"):
        if _to_number(gold) is not None:
            return grade_numeric(completion, gold)
        pred = extract_answer(benchmark, completion)
        return pred is not None and _norm_math(pred) == _norm_math(gold)
    raise ValueError(f"benchmark must be one of gsm8k, math500, math_level5, arc_challenge or rg:<task>, got {benchmark!r}")
