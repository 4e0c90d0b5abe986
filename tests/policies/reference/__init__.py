"""Naive, loop-based references for the eviction baselines, each written from the authors' released code.

Every module names the repository, file and commit it follows. They work on one layer of random tensors
(batch 1), in float64 Python loops, and return the kept positions per kv-head after every forward, so the
tests can ask the vectorized caches for *identical kept sets*. They are test code: kvtier never imports them.
"""
