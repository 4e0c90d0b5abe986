"""Evaluation: the paper's benchmarks, resumable runs, sweeps, statistics and plots (``pip install kvtier[eval]``)."""

from .grading import extract_boxed, grade

__all__ = ["extract_boxed", "grade"]
