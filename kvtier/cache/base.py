"""What every kvtier cache layer shares: one generation per cache, logical lengths, and how attention finds it."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compat import hand_over


def check_update(batch: int | None, n_total: int, keys: torch.Tensor, prompt_end: int | None = None) -> None:
    """Refuse a different batch or a second prompt: a kvtier cache holds one generation (``cache.reset()``).
    ``prompt_end``: the length of a prompt announced by ``open_prompt`` (its chunks may follow one another)."""
    if batch is not None and keys.shape[0] != batch:
        raise ValueError(
            f"this kvtier cache holds a batch of {batch}, got {keys.shape[0]} rows; "
            "call cache.reset() or make a new cache with kvtier.make_cache() for a new batch"
        )
    if prompt_end is not None and n_total < prompt_end:
        if n_total + keys.shape[2] > prompt_end:
            raise ValueError(f"a prompt chunk of {keys.shape[2]} tokens after {n_total} overruns the {prompt_end}-token "
                             "prompt announced by open_prompt()")
        return
    if n_total > 0 and keys.shape[2] > 1:
        raise ValueError(
            "a kvtier cache holds one generation: it got a new prompt after "
            f"{n_total} positions; call cache.reset() or make a new cache for an unrelated prompt"
        )


def prompt_validity(attention_mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """(B, q) bool: which prompt positions are real, read from the mask's diagonal (a padding query's own
    column is masked). None when there is no 4-D mask (no padding)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    i = torch.arange(q, device=attention_mask.device)
    diag = attention_mask[:, 0, i, i]
    diag = diag if diag.dtype == torch.bool else diag == 0  # additive float masks are 0 where attended
    if q > 1 and bool((diag[:, 1:].int() < diag[:, :-1].int()).any()):  # a real token followed by padding
        raise ValueError("right padding is not supported by kvtier caches (decoder-only generation pads on the "
                         "left): set tokenizer.padding_side = 'left'")
    return diag


def model_shape(config) -> tuple[int, int, int]:
    """(layers, kv-heads, head_dim) of a transformers config."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    return (int(c.num_hidden_layers), int(getattr(c, "num_key_value_heads", None) or heads),
            int(getattr(c, "head_dim", None) or c.hidden_size // heads))


class ShapeGuardedCache(Cache):
    """Base of kvtier's caches: a cache serves the model it was made for, and says so when it is not."""

    @property
    def model_shape(self) -> tuple[int, int, int] | None:
        """(layers, kv-heads, head_dim) of the model the cache was made for (set by ``make_cache``)."""
        return getattr(self.layers[0], "made_for", None) if self.layers else None

    @model_shape.setter
    def model_shape(self, shape: tuple[int, int, int]) -> None:
        for layer in self.layers:
            layer.made_for = tuple(shape)

    def sliding_layers(self) -> list:
        """The sliding-window layers of a hybrid model (:mod:`kvtier.cache.sliding`); empty otherwise."""
        return [layer for layer in self.layers if layer.is_sliding]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"this kvtier cache was made for a model with {len(self.layers)} layers and got layer {layer_idx}; "
                "make the cache for the model that uses it: kvtier.make_cache(policy, model)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KVTierLayer(CacheLayerMixin):
    """Base of kvtier's cache layers. Subclasses keep ``self.state`` (shared bookkeeping with ``n_total``)."""

    is_sliding = False

    def expose(self, update_kwargs: dict, key: torch.Tensor) -> None:
        """Hand this layer to the registered attention, which runs next with the ``key`` returned by ``update``.

        From transformers 5.24 the attention kwargs are passed to ``cache.update(..., kwargs=kwargs)`` and then
        unpacked into the attention function, which finds its layer there; older releases pass nothing, and
        :func:`kvtier.compat.hand_over` carries the layer with the key tensor instead.
        """
        attn_kwargs = update_kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["kvtier_layer"] = self
        hand_over(self, key)

    def check_model(self, module, key: torch.Tensor) -> None:
        """At prefill (layer 0): the attention's model must have this cache's layer count and K/V shape."""
        config = getattr(module, "config", None)
        if config is None:
            return
        used = model_shape(config)
        layers = getattr(self.state, "model_layers", None) or self.state.num_layers  # hybrid: sliding ones too
        made = getattr(self, "made_for", None) or (layers, key.shape[1], key.shape[3])
        if used != made or used[0] != layers:
            fmt = lambda s: f"{s[0]} layers x {s[1]} kv-heads x head_dim {s[2]}"  # noqa: E731
            raise ValueError(
                f"this kvtier cache was made for a model with {fmt(made)}, used with a model of {fmt(used)}; "
                "make the cache for the model that uses it: kvtier.make_cache(policy, model)"
            )

    def fused_slot(self, key_states):
        """A RowsCache step's update without the copy (``(k_buf, v_buf, column)`` to write the token into), or
        None: then ``update`` it (:meth:`kvtier.cache.layer.TieredLayer.fused_slot`)."""
        return None

    def fused_region(self, n_heads_q: int, dtype):
        """This decode step as one row of a fused-kernel call across rows (the kernel's arguments for it), or None:
        then ``attend`` it (:meth:`kvtier.cache.layer.TieredLayer.fused_region`)."""
        return None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.n_total + query_length, 0  # logical length: masks and RoPE stay true

    def get_seq_length(self) -> int:
        return self.state.n_total

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the same, under its name before transformers 5.13 (kvtier.compat)
        return self.get_max_length()

    def reset(self) -> None:
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvtier caches do not support beam search (reorder_cache); use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvtier caches do not support num_return_sequences > 1 with a shared prompt cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvtier caches do not support batch selection")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvtier caches do not support crop (assisted decoding)")
