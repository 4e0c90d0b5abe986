"""generate's own decoding loop with each decode step of a kvtier cache through kvtier.step.direct: ``custom_generate``.

Why: ``model.generate`` runs the model's forward every step, and on a CPU a decode step of a small model pays for
transformers' module machinery on every layer (:mod:`kvtier.step.direct` says what and how much). transformers
lets a caller hand ``generate`` a decoding loop (``custom_generate=``, a callable: generate prepares the inputs, the
logits processors and the stopping criteria as always, then calls it). :func:`decode` is that callable: it runs
transformers' own sampling loop (``GenerationMixin._sample``: the same processors, stopping criteria, padding of
finished rows and outputs), on a view of the model whose forward takes a kvtier cache's one-token decode
steps through the model's checked :class:`~kvtier.step.direct.DirectStep`; the prompt, and any call the direct step
does not take, go to the model's forward. The logits are the model's bit for bit, so the tokens are generate's.

    out = model.generate(**enc, cache=cache, custom_generate=kvtier.decode)   # kvtier.decode is this module's decode

kvtier's tools pass it (``kvtier eval/sweep/demo/generate``, the static server); ``KVTIER_DIRECT=0`` in the
environment turns it off (generate's loop on the model's forward, for debugging). Nothing in the model or in
``generate`` is patched. (transformers 5.4-5.24 hand a ``custom_generate`` callable no ``streamer``: generate
with a streamer without it.)
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..env import on
from .direct import DirectStep, direct_step, unsupported

# the inputs generate's loop passes a decode step that the direct step honours (others, when set, go to the forward)
_TAKEN = {"input_ids", "cache", "past_key_values", "position_ids", "attention_mask", "cache_position", "use_cache",
          "return_dict", "logits_to_keep"}
# the output's field for the cache: ``cache`` from transformers 5.24, ``past_key_values`` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def enabled() -> bool:
    """Whether kvtier's tools decode through the direct step: ``KVTIER_DIRECT`` (unset: yes; ``0``/``off`` no)."""
    return on("KVTIER_DIRECT")


def decode_kw() -> dict:
    """``{"custom_generate": decode}`` for ``model.generate(...)``, or nothing where ``KVTIER_DIRECT`` turns it off
    (then generate runs exactly as without kvtier's loop)."""
    return {"custom_generate": decode} if enabled() else {}


def _shape_key(model: nn.Module) -> tuple:
    """What a DirectStep captured of ``model``: its layers' modules (a step built before ``prepare_step`` replaced
    them would call the old ones)."""
    layers = model.model.layers
    return tuple(id(m) for x in layers for m in (x.self_attn, *x.self_attn.children(), x.mlp, *x.mlp.children(),
                                                  x.input_layernorm, x.post_attention_layernorm)) + (id(model.lm_head),)


def step_for(model: nn.Module) -> DirectStep | None:
    """``model``'s checked direct step, built once per model (again if its modules were replaced since), or None
    (why, logged once per model). The one owner of the check: generate's loop, ``kvtier bench`` and the server."""
    why = unsupported(model)
    key = _shape_key(model) if why is None else why
    held = model.__dict__.get("_kvtier_direct")
    if held is None or held[0] != key:
        held = (key, direct_step(model, why))
        model.__dict__["_kvtier_direct"] = held
    return held[1]


class _DirectView:
    """``model`` as generate's loop sees it: every attribute the model's, its call the direct step for a decode step
    of ``cache`` (one token a row, the cache already holding the prompts), else the model's forward."""

    def __init__(self, model: nn.Module, step: DirectStep, cache) -> None:
        self._model, self._step, self._cache = model, step, cache

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, *args, **inputs):
        cache = inputs.get("cache", inputs.get("past_key_values"))
        ids = inputs.get("input_ids")
        if (args or cache is not self._cache or ids is None or ids.dim() != 2 or ids.shape[1] != 1
                or cache.get_seq_length() == 0 or inputs.get("use_cache") is False
                or any(v is not None and v is not False for k, v in inputs.items() if k not in _TAKEN)):
            return self._model(*args, **inputs)
        pos = inputs.get("position_ids")
        if pos is None:  # the model's own default: the cache positions, shared by every row
            cp = inputs.get("cache_position")
            pos = (cp if cp is not None else torch.full((1,), cache.get_seq_length(), dtype=torch.long,
                                                          device=ids.device)).unsqueeze(0)
        with torch.no_grad():
            logits = self._step(ids, cache, pos)
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_FIELD: cache})


def decode(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
           synced_gpus: bool = False, streamer=None, **model_kwargs):
    """generate's decoding loop (``custom_generate=``): transformers' sampling loop (greedy or sampled) with each
    decode step of a kvtier cache through the model's direct step. Where there is no kvtier cache, no direct step
    for the model (:func:`kvtier.step.direct.unsupported`, or its check failed), ``KVTIER_DIRECT=0``, beam search's
    other settings or synced GPUs: the loop on the model's forward alone, as generate would run it."""
    from ..cache.tiered import KVTierCache

    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    step = None
    if isinstance(cache, KVTierCache) and enabled() and not synced_gpus and generation_config.num_beams in (None, 1):
        step = step_for(model)
    target = model if step is None else _DirectView(model, step, cache)
    return GenerationMixin._sample(target, input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus, streamer, **model_kwargs)
