"""Statistics for paired accuracy comparisons: Wilson intervals, exact McNemar, Cochran's Q."""

from __future__ import annotations

import math


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, center - half), min(1.0, center + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (A right, B wrong) and c (A wrong, B right)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def cochran_q(table: list[list[int]]) -> tuple[float, float]:
    """Cochran's Q for k paired binary outcomes; ``table[i][j]`` = problem i correct under condition j.

    Returns (Q, p) with p from the chi-square distribution with k-1 degrees of freedom. Q = 0 and p = 1 when
    every problem has the same outcome under all conditions (e.g. identical outputs, as Proposition 1 predicts).
    """
    if not table:
        return 0.0, 1.0
    k = len(table[0])
    col = [sum(r[j] for r in table) for j in range(k)]
    row = [sum(r) for r in table]
    n_total = sum(row)
    den = k * n_total - sum(x * x for x in row)
    if k < 2 or den == 0:
        return 0.0, 1.0
    q = (k - 1) * (k * sum(c * c for c in col) - n_total**2) / den
    return q, _chi2_sf(q, k - 1)


def _chi2_sf(x: float, df: int) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.sf(x, df))
    except ImportError:  # regularized upper gamma by series, enough for a report
        a, x2 = df / 2, x / 2
        if x2 <= 0:
            return 1.0
        term = total = 1 / a
        for n in range(1, 500):
            term *= x2 / (a + n)
            total += term
        lower = total * math.exp(-x2 + a * math.log(x2) - math.lgamma(a))
        return max(0.0, 1 - lower)
