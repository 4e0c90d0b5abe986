"""The decode step of a Llama-form model without transformers' module machinery (serve, bench), logits bit for bit.

Why: a decode step of a small model on a CPU pays for transformers' forward plumbing on every layer — the decoder
layer, attention and MLP modules' ``__call__``, their keyword arguments, the causal mask built for a ``RowsCache``
that ignores it, the output wrappers. :class:`DirectStep` calls the ops those modules run (the projections, norms,
activation and rotary embedding as the model's own modules and functions, the ``RowsCache`` layer's update and
attend, the residual adds, the lm head) in the same order on the same tensors from one loop; kvtier's own packed
linears, fused norms (each with the residual add before it: :func:`kvtier.step.norm.add_rms_norm`) and fused MLP
activations (:mod:`kvtier.step.mlp`) are called as their one kernel call each (a fused q/k/v or gate/up weight: its
one product, cut into the members' columns, as their modules return it), and a bf16 rotary embedding as one kernel
call per tensor (:mod:`kvtier.step.rotary`, the model function's rounding). Measured on a 2-core Xeon with AMX
(Qwen2.5-0.5B bf16, serve's rows step at 384 tokens, the two paths stepped back to back on twin caches,
``benchmarks/decode/module_overhead.py``): 5.1 ms a step saved at 1 row (of 63), 3.7 at 8 (of 76), 5.0 at 32 (of 115), the
direct step faster in 64-72 of 72 paired steps; the logits equal the model's at every step.

Which models: ``llama``, ``mistral``, ``qwen2`` and ``qwen3`` (its per-head q/k norms) whose causal-LM, model and
decoder-layer classes are transformers' own for that type (a subclass or a remote-code model may change the math)
and whose layers all attend fully. Anything else keeps the model's forward.

Checked before use: :func:`direct_step` prefills two prompts in one packed step and decodes one step both ways, then
two decode steps of a two-row batch cache both ways, on throwaway caches, and keeps the direct step only if every
logit is equal (a transformers release whose forward does something else, a model that differs in a way the class
names do not show); otherwise it logs why and returns None.
The engine's switch: ``EngineConfig.direct_step`` (``kvtier serve --no-direct-step``) keeps the model's forward.

A batch cache (one cache of B rows, as ``generate`` and ``kvtier bench`` hold them) takes the same step for its
decode steps (:func:`batch_logits`; ``kvtier bench --no-direct`` keeps the model's forward): the embedded 0.5B
model in bf16 on a 2-core EPYC (AVX512-BF16), ``benchmarks/decode/module_overhead.py --layout batch``: 4.5 ms a step
saved at 1 row (of 57), 3.1 at 32 (of 123), logits equal at every step. ``generate`` takes it through
:mod:`kvtier.step.decode` (its ``custom_generate`` hook; kvtier patches nothing), as ``kvtier eval`` calls it.
"""

from __future__ import annotations

import logging
import sys
from types import EllipsisType

import torch
from torch import nn

from ..compat import take_over
from .linear import FusedLinear, PackedLinear, _run_packed
from .mlp import act_mul
from .norm import FusedRMSNorm, add_rms_norm, rms_norm
from .rotary import fused_rotary

log = logging.getLogger(__name__)

# model_type -> (the causal LM, its model and decoder-layer class names): transformers' own classes only
FORMS = {
    "llama": ("LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer"),
    "mistral": ("MistralForCausalLM", "MistralModel", "MistralDecoderLayer"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer"),
}


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the direct step, or None when it can (the check of its output still follows)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FORMS:
        return f"model type {kind!r} is not one of {sorted(FORMS)}"
    lm, body, layer = FORMS[kind]
    inner = getattr(model, "model", None)
    if type(model).__name__ != lm or type(inner).__name__ != body or not type(model).__module__.startswith(
            "transformers.models."):
        return f"{type(model).__name__} is not transformers' {lm}"
    layers = list(inner.layers[: cfg.num_hidden_layers])
    if any(type(x).__name__ != layer for x in layers):
        return f"its decoder layers are not all transformers' {layer}"
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types[: cfg.num_hidden_layers]):
        return "some layers attend a sliding window"
    return None


def _linear(m: nn.Module):
    """``m``'s forward as a plain function: a packed kvtier linear's one oneDNN call, else the module itself."""
    if type(m) is PackedLinear:
        return lambda x: _run_packed(x, m.packed, m.bias)
    return m


def _siblings(*mods: nn.Module):
    """``x -> (m(x) for m in mods)``: where they are the members of one fused weight in order, its one product cut
    into their columns (what their FusedLinear calls return), else each module called."""
    f = getattr(mods[0], "fused", None)
    if all(type(m) is FusedLinear and m.fused is f and m.index == i for i, m in enumerate(mods)) \
            and len(f.bounds) == len(mods):
        # the members' columns tile the product in order (_Fused.bounds): one call cuts them all as views (indexing
        # each slice took ~20 us a layer in a 32-row step)
        sizes = [b - a for a, b in f.bounds]
        return lambda x: torch.split_with_sizes(_run_packed(x, f.packed, f.bias), sizes, dim=-1)
    return lambda x: [m(x) for m in mods]


def _norm(m: nn.Module):
    """``m``'s forward as a plain function: kvtier's fused RMSNorm called directly, else the module itself."""
    if type(m) is FusedRMSNorm:
        return lambda x: rms_norm(x, m.weight, m.variance_epsilon)
    return m


def _add_norm(m: nn.Module):
    """``(x, y) -> (x + y, m(x + y))``: a residual add and the norm after it, one kernel pass for kvtier's fused
    RMSNorm (the same tensors as the add and the norm apart; ~1 ms of a 32-row step), else the add and ``m``."""
    if type(m) is FusedRMSNorm:
        return lambda x, y: add_rms_norm(x, y, m.weight, m.variance_epsilon)

    def apart(x, y):
        s = x + y
        return s, m(s)

    return apart


class DirectStep:
    """``step(input_ids, cache, position_ids, last=None) -> logits``, what ``model(..., logits_to_keep=last).logits``
    gives (``last`` None: every position's), in the model's dtype. Two layouts:

    - a packed rows step (``kvtier serve``): ``input_ids`` (1, N) the step's tokens, ``cache`` its
      :class:`~kvtier.cache.rows.RowsCache`, ``position_ids`` (1, N) (``rc.positions()``), ``last`` (R,) each row's
      last token in the sequence (``rc.last_positions()``) -> (1, R, V);
    - a batch decode step (``kvtier bench``, :func:`batch_logits`): ``input_ids`` (B, 1) one token per row,
      ``cache`` a kvtier batch cache that already holds the rows' prompts, ``position_ids`` (1, 1) or (B, 1) ->
      (B, 1, V). Decode only: a prompt goes through the model's forward (its causal mask; a decode step's attention
      reads the rows' validity the cache noted at the prefill, never a mask)."""

    def __init__(self, model: nn.Module) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"no direct step for this model: {why}")
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers[: model.config.num_hidden_layers])
        # the model's own rotary function (every family here defines one in its modeling module), as one kernel call
        # per tensor where it takes the tensors (bf16 on a CPU: kvtier.step.rotary, the function's rounding)
        self.rotary = fused_rotary(sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb)
        # per layer, its modules as plain functions where they are kvtier's own (no nn.Module call around them)
        # (each residual add is fused with the norm that follows it: the layer's post-attention norm, and the next
        # layer's input norm or the final norm)
        after = [x.input_layernorm for x in self.layers[1:]] + [self.body.norm]
        self.plan = [(_siblings(x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj),
                      _linear(x.self_attn.o_proj), _add_norm(x.post_attention_layernorm),
                      _siblings(x.mlp.gate_proj, x.mlp.up_proj), act_mul(x.mlp), _linear(x.mlp.down_proj),
                      _add_norm(nxt), (_norm(x.self_attn.q_norm), _norm(x.self_attn.k_norm))
                      if hasattr(x.self_attn, "q_norm") else None)
                     for x, nxt in zip(self.layers, after)]
        self.first_norm, self.lm_head = _norm(self.layers[0].input_layernorm), _linear(model.lm_head)

    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        body = self.body
        b, n = input_ids.shape
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"this kvtier cache has {len(cache.layers)} layers, the model {len(self.layers)}; make "
                             "the cache for the model that uses it: kvtier.make_cache(policy, model)")
        if not hasattr(cache, "last_positions") and (n != 1 or cache.get_seq_length() == 0):  # not a RowsCache
            raise ValueError(f"a batch cache's direct step takes one decode token per row of a prefilled cache, got "
                             f"input_ids {tuple(input_ids.shape)} on {cache.get_seq_length()} cached tokens; "
                             "prefill through the model's forward")
        x = body.embed_tokens(input_ids)  # (B, N, hidden)
        cos, sin = body.rotary_emb(x, position_ids)
        h = self.first_norm(x)
        for i, (layer, (qkv, o_proj, add_norm2, gate_up, act, down, add_norm_next, qk_norm)) in enumerate(
                zip(self.layers, self.plan)):
            a = layer.self_attn
            shape = (b, n, -1, a.head_dim)
            q, k, v = (y.view(shape) for y in qkv(h))
            if qk_norm is not None:  # qwen3: RMSNorm over each head's dims, before the rotary embedding
                q, k = qk_norm[0](q), qk_norm[1](k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, N, head_dim)
            q, k = self.rotary(q, k, cos, sin)
            layer_cache = cache.layers[i]
            k, v = layer_cache.update(k, v)
            take_over(k)  # update handed its layer to the attention function, which this step does not call
            # (B, N, Hq, head_dim); a RowsCache needs no mask, a batch decode step's attention reads none
            o = layer_cache.attend(q, k, v, None, a.scaling)[0]
            x, h = add_norm2(x, o_proj(o.reshape(b, n, -1).contiguous()))
            g, u = gate_up(h)
            x, h = add_norm_next(x, down(act(g, u)))  # h: the next layer's input, after the last: the final norm's
        return self.lm_head(h if last is None else h[:, last])


def batch_logits(model: nn.Module, step: DirectStep | None, cache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step of a prefilled batch ``cache`` (no left padding: every row at the same position) taking
    ``tokens`` (B, 1), through ``step`` or, None, the model's own forward: logits (B, 1, V)."""
    from ..compat import cache_kw

    with torch.no_grad():
        if step is None:
            return model(input_ids=tokens, **cache_kw(model, cache), use_cache=True).logits
        pos = torch.full((1, 1), cache.get_seq_length(), dtype=torch.long, device=tokens.device)
        return step(tokens, cache, pos)


def rows_logits(model: nn.Module, step: DirectStep | None, caches: list, seqs: list[list[int]]) -> torch.Tensor:
    """One packed step of ``caches`` (one-row caches) taking ``seqs`` (each row's new tokens: a prompt for an empty
    cache, else one token), through ``step`` or, None, the model's own forward: logits (1, B, V)."""
    from ..cache.rows import RowsCache
    from ..compat import cache_kw

    dev = next(model.parameters()).device
    rc = RowsCache(caches, lengths=[len(s) for s in seqs])
    ids = torch.tensor([[t for s in seqs for t in s]], device=dev)
    pos, last = rc.positions(dev), rc.last_positions(dev)
    with torch.no_grad():
        if step is None:
            return model(input_ids=ids, position_ids=pos, **cache_kw(model, rc), use_cache=True,
                         logits_to_keep=last).logits
        return step(ids, rc, pos, last)


def _agree(model: nn.Module, step: DirectStep) -> str | None:
    """Run a packed prefill of two prompts and one decode step through the model's forward and through ``step``, on
    fresh ``full`` caches each, then two decode steps of a two-row batch cache both ways; None when every logit is
    equal, else what differed."""
    from ..compat import cache_kw
    from ..make import make_cache

    vocab = model.config.vocab_size
    prompts = [[(7 * j + 3) % vocab for j in range(9)], [(11 * j + 5) % vocab for j in range(5)]]
    runs = []
    for how in (None, step):
        caches = [make_cache("full", model) for _ in prompts]
        seqs, out = prompts, []
        for _ in range(2):  # the packed prefill, then one decode step
            out.append(rows_logits(model, how, caches, seqs))
            seqs = [[int(t)] for t in out[-1][0].float().argmax(dim=-1)]
        # a batch cache of two 5-token prompts, prefilled by the model, then two decode steps
        dev = next(model.parameters()).device
        cache = make_cache("full", model)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([p[:5] for p in prompts], device=dev), **cache_kw(model, cache),
                       use_cache=True, logits_to_keep=1).logits
        for _ in range(2):
            lg = batch_logits(model, how, cache, lg[:, -1].float().argmax(-1, keepdim=True))
            out.append(lg)
        runs.append(out)
    for name, a, b in zip(("prefill", "decode", "batch decode", "second batch decode"), *runs):
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
            return f"its {name} logits differ from the model's (max |diff| {diff})"
    return None


def direct_step(model: nn.Module, why: str | None | EllipsisType = ...) -> DirectStep | None:
    """The model's :class:`DirectStep` once checked against its own forward (see the module doc), or None (logged).
    ``why``: :func:`unsupported`'s answer when the caller has it already (else it is asked here)."""
    if why is ...:
        why = unsupported(model)
    if why is None:
        try:
            step = DirectStep(model)
            why = _agree(model, step)
        except Exception as e:  # noqa: BLE001 - any failure means: keep the model's forward
            why = f"it failed ({type(e).__name__}: {e})"
    if why is not None:
        log.info("decode steps go through the model's own forward: %s", why)
        return None
    log.info("decode steps go through kvtier.step.direct (checked: the model's logits bit for bit)")
    return step
