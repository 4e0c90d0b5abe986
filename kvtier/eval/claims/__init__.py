"""The seed paper's claims, side by side with what a run folder measured (``kvtier report DIR --claims``).

Each claim is located in the records by its configuration (policy + parameters, as the sweep files under
``benchmarks/sweeps/`` write them), tested on the problems both sides share, and given a verdict by a rule stated in
the row, from one fixed vocabulary (:data:`VERDICTS`): *reproduced*; *not reproduced*; *not testable here*, the
rule saying why (the configuration is missing, ``full`` itself is too weak on that benchmark for a retention to mean
anything, or the test cannot tell the two apart at this n); *holds by construction* (kvtier's own math makes the
claim true, as the ordered path makes outputs independent of the T0/T1 split: the records confirm it, they do not
test the paper).

Modules: :mod:`.rules` (the vocabulary, :class:`ClaimRow`, pairing and the number formats), one module per
campaign's subject (:mod:`.paper`, :mod:`.eviction`, :mod:`.cliff`), :mod:`.campaigns` (:func:`evaluate`: which
campaign gives which row and which supersedes which), :mod:`.write` (claims.md / claims.json) and :mod:`.table`
(the README's table).
"""

from .campaigns import evaluate
from .rules import MIN_FULL_ACCURACY, VERDICTS, ClaimRow, by_config, paired
from .write import chain_lengths, write_claims

__all__ = ["MIN_FULL_ACCURACY", "VERDICTS", "ClaimRow", "by_config", "chain_lengths", "evaluate", "paired",
           "write_claims"]
