"""The tiered layer's decode step: which regions it attends where, in which order, and where their scores go.

Three paths, all for one new token per row (``query`` (B, Hq, 1, D)):
    attend_split    each region where it lives (T0 + tail on the device; T1 and deq(T2) streamed to the device
                    or attended on the host), merged by log-sum-exp (:mod:`.merge`, :mod:`.host`); on a CPU device
                    one call of the fused kernel (:mod:`.fused_cpu`) does the same step;
    attend_full     the full cache: one region (the tail buffer) read in place, no scores;
    attend_ordered  the reference: every kept token gathered in position order (:func:`assemble`), one softmax.
The layer (:class:`kvtier.cache.layer.TieredLayer`, read through :class:`.buffers.TieredBuffers`) owns the buffers these read; nothing here allocates K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tiers.planner import T0, T1, T2
from ..tiers.quant import dequantize
from . import fused_cpu
from .buffers import TieredBuffers
from .host import HostRegion, host_tiers_partial
from .merge import Partial, add_weights, merge, ordered, partial, sink_partial



def attend_full(layer: TieredBuffers, query: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Split mode without scores (the full cache): one region, read in place by the fused CPU kernel or SDPA.

    The query heads of one KV head attend as one group: ``query`` (B, Hq, 1, D) is viewed as (B, H_kv, Hq/H_kv,
    D) — Hq/H_kv "query positions" per KV head, nothing causal between them — rather than passing
    ``enable_gqa``, which on CPU falls off SDPA's fused kernel (2-3x slower at 2K-8K tokens, measured). With
    ``sinks`` (Hq,): the kernel with its sink logits, or the eager partial merged with the sinks' (SDPA has none)."""
    st = layer.state
    n = st.n_total
    B, Hq, _, D = query.shape
    H = layer.tail_k.shape[1]
    if st.fused:
        # the whole buffer with its closed columns (-inf, never read) rather than a slice: the mask and
        # positions are rebuilt only when the buffer grows, and one column opens per step
        bias, pos = st.device_view(0, layer.tail_k.shape[2])
        out = fused_cpu.attend(query.reshape(B, H, Hq // H, D), [layer.dev_k], [layer.dev_v], [bias], [pos], None,
                               0.0, scaling, sinks=sinks)
        return out.reshape(B, Hq, 1, D)
    if sinks is not None:  # SDPA has no sink: the eager partial of the buffer, merged with the sinks'
        bias, _ = st.device_view(0, layer.tail_k.shape[2])
        qg = query.reshape(B, H, Hq // H, D).contiguous()
        out, _ = merge([partial(qg, layer.dev_k, layer.dev_v, bias, scaling, False),
                        sink_partial(sinks, B, H, Hq // H, D)])
        return out.to(query.dtype).reshape(B, Hq, 1, D)
    mask = st.valid_dev[:, :n].view(st.batch, 1, 1, n) if st.padded else None
    out = F.scaled_dot_product_attention(query.reshape(B, H, Hq // H, D), layer.tail_k[:, :, :n], layer.tail_v[:, :, :n],
                                         attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, 1, D)


def attend_split(layer: TieredBuffers, query: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Each region attended where it lives, merged by log-sum-exp; scores from the merged weights. ``sinks``
    (Hq,): one more partial in the merge (a logit, no value); the kernel takes them as one more logit."""
    st = layer.state
    lay = st.layout
    B, Hq, _, D = query.shape
    H = layer.dev_k.shape[1]
    qg = query.reshape(B, H, Hq // H, D).contiguous()
    keep = True  # retier-enabled caches always score
    meta = st.meta()
    inv = st.inv_heads_layers
    host_tiers = [x for x in (T1, T2) if lay.tiers[x].count]
    if st.fused:
        return attend_fused(layer, qg, host_tiers, meta, scaling, inv, sinks).to(query.dtype)
    # rows [0, r) stream their host tiers to the device, rows [r, B) attend them on the host ("both" when
    # 0 < r < B): each row's host tiers give one partial either way, and the two row blocks make one
    r = st.stream_rows
    on_host, streamed = slice(r, B), slice(0, r)
    job = None
    if host_tiers and r < B:
        job = st.host.submit(layer.layer_idx, qg[on_host], host_regions(layer, host_tiers, meta, True, on_host),
                             scaling, keep, inv, row0=r)
    # T0 and the tail are one contiguous device buffer, attended whole (empty slots and columns masked)
    bias, dpos = st.device_view(layer.cap0, layer.tail_k.shape[2])
    parts = [partial(qg, layer.dev_k, layer.dev_v, bias, scaling, keep)]
    host_state = stream_state = None
    if host_tiers:
        pieces = []
        if r > 0:
            regions = host_regions(layer, host_tiers, meta, False, streamed)
            sp, sparts, cs = host_tiers_partial(qg[streamed], regions, scaling, keep, query.dtype)
            stream_state = (sparts, cs, [x.pos for x in regions])
            layer.release_staged()
            pieces.append(sp)
        if job is not None:
            hp, host_state = st.host.result(job)
            pieces.append(hp)
        parts.append(pieces[0] if len(pieces) == 1 else
                     Partial(*(torch.cat([getattr(p, a) for p in pieces]) for a in ("o", "m", "l"))))
    out, fs = merge(parts if sinks is None else parts + [sink_partial(sinks, B, H, Hq // H, D)])
    add_weights(st.scores, dpos, parts[0].e, fs[0], inv)
    if host_tiers:
        f_host = fs[len(parts) - 1]
        if stream_state is not None:
            for p, c, ps in zip(*stream_state):
                add_weights(st.scores[streamed], ps, p.e, c * f_host[streamed], inv)
        if job is not None:
            st.host.post(layer.layer_idx, host_state, f_host[on_host])
    return out.to(query.dtype)


def attend_fused(layer: TieredBuffers, qg: torch.Tensor, host_tiers: list[int], meta: dict, scaling: float, inv: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same step as the eager split path in one kernel call (CPU): T0 and the tail, then T1 and deq T2
    (host buffers or their staged copies), one softmax, scores added to the accumulator each region's tokens
    belong to (the host one for host-attended tiers). Returns (B, H, g, D) float32."""
    st = layer.state
    # streaming T1: the kernel stages it itself, block by block (see fused_cpu.attend); int8 T2 is staged
    # whole and dequantised on the device as on the eager path
    kernel_stages = T1 in host_tiers and not st.host_attn and not st.t1_on_device
    ks, vs, biases, poss, scores, staged = kernel_regions(layer, host_tiers, meta, qg.dtype, kernel_stages)
    out = fused_cpu.attend(qg, ks, vs, biases, poss, scores, inv, scaling, staged, sinks)
    if kernel_stages:
        t1 = layer.host_tensors(tiers=(T1,))
        B, H, cap, D = layer.k1.shape
        # staging this stream needs: one chunk of a (row, kv-head) block per worker thread (the kernel's buffers
        # are the process's, shared by every cache, so their total is not this cache's)
        block = min(cap, fused_cpu.staged_rows(D, layer.k1.dtype)) * D * layer.k1.element_size()
        st.engine.count_streamed(sum(t.numel() * t.element_size() for t in t1.values()),
                                 fused_cpu.take_staging_seconds(), min(torch.get_num_threads(), B * H) * block)
    if host_tiers and not st.host_attn and (T2 in host_tiers or not kernel_stages):
        layer.release_staged()
    return out


def kernel_regions(layer: TieredBuffers, host_tiers: list[int], meta: dict, dtype: torch.dtype,
                   kernel_stages: bool = False) -> tuple[list, list, list, list, list, list]:
    """The fused kernel's regions for this layer's step: ``(ks, vs, biases, poss, scores, staged)`` — T0 and the
    tail (one device buffer), then each host tier in ``host_tiers`` (attended in place on the host, or staged),
    each scored into the accumulator its tokens belong to. Counts a host job when the host tiers are attended
    there (what :mod:`.host` counts for the eager path).

    The lists are kept on the layer between steps where every region is read in place (host attention, or no host
    tier) and rebuilt only when one of the tensors they name changes (a reassignment, a grown buffer): building them
    is ~20 us of Python per layer and step, a few percent of a CPU decode step. Int8 T2 is dequantized on every
    call: keeping its bf16 copy would hold 3x T2's bytes on the host (see :func:`_kernel_regions`)."""
    st = layer.state
    bias, dpos = st.device_view(layer.cap0, layer.tail_k.shape[2])  # every step: it opens the new tail column
    on_host = st.host_attn
    if host_tiers and not on_host:  # staged copies are new tensors every step: nothing to keep
        return _kernel_regions(layer, host_tiers, meta, dtype, kernel_stages, bias, dpos)[0]
    if host_tiers:
        st.host.jobs += 1  # one host job per layer and step, whether its lists are built or kept
    # the lists stand while every tensor they name is the same object and nothing else that shapes them changed
    named = (bias, dpos, layer.dev_k, layer.dev_v, meta, st.scores, st.scores_host, layer.k1, layer.v1, layer.k2,
             layer.v2)
    shape = (tuple(host_tiers), dtype)
    memo = layer.kernel_memo
    if memo is None or memo[0] != shape or any(a is not b for a, b in zip(memo[1], named)):
        args, t2 = _kernel_regions(layer, host_tiers, meta, dtype, kernel_stages, bias, dpos)
        kept = args
        if t2 is not None:  # the memo keeps T2's int8 region, not this call's dequantized copy
            kept = ([*args[0]], [*args[1]], *args[2:])
            kept[0][t2[0]] = kept[1][t2[0]] = None
        layer.kernel_memo = (shape, named, kept, t2)
        return args
    _, _, args, t2 = memo
    if t2 is None:
        return args
    i, region = t2
    ks, vs = list(args[0]), list(args[1])
    ks[i], vs[i] = region.kv(dtype)
    return (ks, vs, *args[2:])


def _kernel_regions(layer: TieredBuffers, host_tiers: list[int], meta: dict, dtype: torch.dtype, kernel_stages: bool,
                    bias: torch.Tensor, dpos: torch.Tensor) -> tuple[tuple, tuple[int, HostRegion] | None]:
    """:func:`kernel_regions` built now (the host job is counted by the caller), and ``(index, region)`` of the
    int8 T2 region (None without one): the caller dequantizes it per call."""
    st = layer.state
    ks, vs, biases, poss, scores = [layer.dev_k], [layer.dev_v], [bias], [dpos], [st.scores]
    staged = [False]
    on_host = st.host_attn
    t2 = None
    if host_tiers:
        for x, r in zip(host_tiers, host_regions(layer, host_tiers, meta, on_host, in_place=kernel_stages)):
            k, v = r.kv(dtype)
            if r.k_scale is not None:
                t2 = (len(ks), r)
            ks.append(k), vs.append(v), biases.append(r.bias), poss.append(r.pos)
            scores.append(st.scores_host if on_host else st.scores)
            staged.append(kernel_stages and x == T1)
    return (ks, vs, biases, poss, scores, staged), t2


def rows_call(layer: TieredBuffers, dtype: torch.dtype) -> tuple | None:
    """This layer's decode step as one row of :func:`kvtier.attention.fused_cpu.attend_rows` — ``(ks, vs, biases,
    poss, scores, score_scale)``, the arguments :func:`attend_full` or :func:`attend_fused` would pass the kernel for
    it (``dtype``: the query's, what a quantized tier is dequantized to) — or None where the step is not one kernel
    call without staging (the eager or ordered path, streamed host tiers: then the layer attends it itself)."""
    st = layer.state
    if st.rows_fused:  # full: one region, no scores (the kernel's step, even where alone it would take SDPA)
        bias, pos = st.device_view(0, layer.tail_k.shape[2])
        return [layer.dev_k], [layer.dev_v], [bias], [pos], None, 0.0
    if not (st.retier_enabled and st.fused):  # fused: the split path on the kernel (never set for "ordered")
        return None
    lay = st.layout
    host_tiers = [x for x in (T1, T2) if lay.tiers[x].count]
    if host_tiers and not st.host_attn:
        return None
    ks, vs, biases, poss, scores, _ = kernel_regions(layer, host_tiers, st.meta(), dtype)
    return ks, vs, biases, poss, scores, st.inv_heads_layers


def host_regions(layer: TieredBuffers, tiers: list[int], meta: dict, on_host: bool, rows: slice = slice(None),
                  in_place: bool = False) -> list[HostRegion]:
    """One region per tier in ``tiers``: host buffers (``on_host``) or their device copies, scored into the host
    or the device accumulator accordingly. ``in_place``: streamed, but T1 is read from host memory by a
    consumer that stages it itself (the fused CPU kernel); only T2 is copied here."""
    if on_host:
        src = layer.host_tensors(rows)
    elif in_place:
        src = {**layer.host_tensors(rows, (T1,)), **(layer.staged(rows, (T2,)) if T2 in tiers else {})}
    else:
        src = layer.staged(rows)
    out = []
    for x in tiers:
        pos, bias = meta[("host", x)] if on_host else meta[x]
        pos, bias = pos[rows], bias[rows]
        if x == T1:
            out.append(HostRegion(src["k1"], src["v1"], bias, pos))
        else:
            out.append(HostRegion(src["k2"], src["v2"], bias, pos, src["k2s"], src["v2s"]))
    return out


def attend_ordered(layer: TieredBuffers, query: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The reference: every kept token gathered in position order, one softmax (bit-identical across HBM ratios);
    ``sinks`` (Hq,) join it where the model has them."""
    st = layer.state
    B, Hq, _, D = query.shape
    k, v = assemble(layer)
    H = k.shape[1]
    sv = st.step_view()
    out, p = ordered(query.reshape(B, H, Hq // H, D), k, v, sv["mask"], scaling, sinks)
    if st.retier_enabled:
        # s_i += mean over layers of mean over all query heads of the attention weight on i.
        w = p.sum(dim=(1, 2)) * st.inv_heads_layers
        st.scores.scatter_add_(1, sv["score_pos"], w.to(st.scores.dtype))
    return out


def assemble(layer: TieredBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept K and V of this layer in position order: two (B, H, K, D) views of the engine's work buffers."""
    st = layer.state
    sv = st.step_view()
    K = sv["K"]
    if sv["k_main"] == 0 and layer.tail_k.shape[2] == sv["cap"]:
        return layer.tail_k[:, :, :K], layer.tail_v[:, :, :K]  # nothing to assemble
    B, H, D = st.batch, layer.dev_k.shape[1], layer.dev_k.shape[3]
    wk, wv = st.engine.work_buffers((B, H, sv["cap"], D), layer.dev_k.dtype)
    fk, fv = wk.view(-1, D), wv.view(-1, D)
    gather = sv["gather"]
    if st.layout.tiers[T0].count:
        src, dst = gather[T0]  # rows of the whole device buffer (T0 slots, then the tail)
        fk.index_copy_(0, dst, layer.dev_k.reshape(-1, D).index_select(0, src))
        fv.index_copy_(0, dst, layer.dev_v.reshape(-1, D).index_select(0, src))
    if layer.host_tensors():
        dv = layer.staged()
        if "k1" in dv and st.layout.tiers[T1].count:
            src, dst = gather[T1]
            fk.index_copy_(0, dst, dv["k1"].reshape(-1, D).index_select(0, src))
            fv.index_copy_(0, dst, dv["v1"].reshape(-1, D).index_select(0, src))
        if "k2" in dv and st.layout.tiers[T2].count:
            src, dst = gather[T2]
            fk.index_copy_(0, dst, dequantize(dv["k2"], dv["k2s"], wk.dtype).reshape(-1, D).index_select(0, src))
            fv.index_copy_(0, dst, dequantize(dv["v2"], dv["v2s"], wv.dtype).reshape(-1, D).index_select(0, src))
        layer.release_staged()
    km = sv["k_main"]
    wk[:, :, km:K].copy_(layer.tail_k[:, :, : sv["t"]])
    wv[:, :, km:K].copy_(layer.tail_v[:, :, : sv["t"]])
    return wk[:, :, :K], wv[:, :, :K]
