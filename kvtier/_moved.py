"""Old module paths (before the package was split into folders) keep importing, as the new module, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old path -> new path; kvtier.cache and kvtier.attention are packages now and re-export their old names themselves
MOVED = {
    "kvtier.planner": "kvtier.tiers.planner",
    "kvtier.layout": "kvtier.tiers.layout",
    "kvtier.quant": "kvtier.tiers.quant",
    "kvtier.tiermap": "kvtier.tiers.tiermap",
    "kvtier.decode_attention": "kvtier.attention.merge",
    "kvtier.host_attention": "kvtier.attention.host",
    "kvtier.fused_cpu": "kvtier.attention.fused_cpu",
    "kvtier.layer_base": "kvtier.cache.base",
    "kvtier.headwise": "kvtier.cache.headwise",
    "kvtier.bench": "kvtier.tools.bench",
    "kvtier.plan": "kvtier.tools.memplan",
    "kvtier.viz": "kvtier.tools.viz",
    "kvtier.step.cpu": "kvtier.kernels.cpu",  # the kernels' home (kvtier/kernels/)
    "kvtier.step.kernel": "kvtier.kernels.build",
    "kvtier.eval.claim_rules": "kvtier.eval.claims.rules",  # one claims package (kvtier/eval/claims/)
    "kvtier.eval.claims_v2": "kvtier.eval.claims.eviction",
    "kvtier.eval.claims_cliff": "kvtier.eval.claims.cliff",
    "kvtier.eval.claims_table": "kvtier.eval.claims.table",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):  # the new module is already executed; its old name just points at it
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
