"""kvtier's attention function, registered through transformers' own extension points.

``prepare_model`` registers ``"kvtier"`` with ``AttentionInterface`` (the attention) and
``AttentionMaskInterface`` (a boolean SDPA-style mask, so left padding reaches us), then switches the
model to it. Nothing in the model class or in ``generate`` is patched. Without a kvtier cache (e.g. a
plain ``DynamicCache``) the function is transformers' SDPA, so a prepared model still works normally.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compat import take_over
from .merge import dense

ATTN_NAME = "kvtier"

_MLA = ("docs/MLA.md says how a latent cache would be tiered; the DeepSeek-R1 distills "
        "(deepseek-ai/DeepSeek-R1-Distill-Qwen-7B, ...) are standard attention and supported")
# model_type -> (why it is not supported, what to do instead)
_UNSUPPORTED = {
    "deepseek_v2": ("multi-head latent attention (MLA)", _MLA),
    "deepseek_v3": ("multi-head latent attention (MLA)", _MLA),
    "gemma2": ("attention soft-capping (a tanh on the logits, which kvtier's attention paths do not apply)",
               "Gemma 3 has no soft-capping and is supported"),
}


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """Attention over the kept tokens of the layer's kvtier cache; SDPA when there is none.

    Args:
        query: (B, H_q, q, D); key/value: (B, H_kv, q, D), the new states (the cache holds the rest).
    Returns:
        (B, q, H_q, D) output and None (weights are consumed internally for the scores).
    """
    layer = kwargs.pop("kvtier_layer", None)
    handed = take_over(key)  # transformers < 5.24 pass no kwargs to cache.update (see kvtier.compat)
    layer = layer if layer is not None else handed
    sinks = kwargs.pop("s_aux", None)  # gpt-oss: a learned sink logit per query head (Hq,)
    if layer is None or layer.is_sliding:
        # no kvtier cache, or a hybrid model's sliding layer (its window): transformers' SDPA, or its eager math
        # where the model has sinks (SDPA has none)
        if sinks is not None:
            out = dense(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling,
                        sinks)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("kvtier got a sliding-window attention call for a full-attention cache layer")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer.layer_idx == 0 and query.shape[2] > 1:
        layer.check_model(module, key)
    return layer.attend(query, key, value, attention_mask, scaling, sinks=sinks)


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, kvtier_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def check_supported(model) -> None:
    """Raise ``NotImplementedError`` naming the model type when kvtier cannot serve it."""
    config = model.config
    mtype = getattr(config, "model_type", type(model).__name__)
    if mtype in _UNSUPPORTED:
        why, instead = _UNSUPPORTED[mtype]
        raise NotImplementedError(f"kvtier does not support model type {mtype!r}: {why}. Instead: {instead}")
    if getattr(config, "kv_lora_rank", None):
        raise NotImplementedError(f"kvtier does not support model type {mtype!r}: multi-head latent attention (MLA). "
                                  f"Instead: {_MLA}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise NotImplementedError(f"kvtier does not support model type {mtype!r} with layer types {unknown}: it "
                                  "takes full_attention and sliding_attention layers. Instead: `kvtier plan` "
                                  "answers for its shapes from its config.json")
    if layer_types and "full_attention" not in layer_types:
        raise NotImplementedError(f"kvtier does not support model type {mtype!r} with sliding-window attention on "
                                  "every layer (each keeps only its window: nothing to tier)")
    if getattr(text, "attn_logit_softcapping", None):  # kvtier's attention paths do not apply it
        raise NotImplementedError(f"kvtier does not support model type {mtype!r}: attention soft-capping")
    if not layer_types and (getattr(config, "use_sliding_window", False)
                            or (mtype == "mistral" and getattr(config, "sliding_window", None))):
        raise NotImplementedError(f"kvtier does not support model type {mtype!r} with sliding-window attention on "
                                  "every layer (it keeps only its window: nothing to tier). Instead: the same model "
                                  "with use_sliding_window=False (or sliding_window=None), if it was trained so")
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    if not attn:
        raise NotImplementedError(f"kvtier does not support model type {mtype!r}: no attention modules with a layer_idx")


def prepare_model(model) -> None:
    """Register kvtier's attention and switch ``model`` to it (idempotent)."""
    check_supported(model)
    _register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


def has_sinks(model) -> bool:
    """Whether the model's attention modules carry a learned sink logit per head (gpt-oss's ``sinks``)."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()
               if hasattr(m, "layer_idx"))


def num_cache_layers(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)
