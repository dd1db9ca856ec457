"""fla-core (flash-linear-attention) backed KDA implementations, imported lazily.

fla keeps one state per sequence of the call ([N, H, K, V], K-first like our pool), so the
wrappers gather the initial states from the slot pool and scatter the final states back.
Sequences with slot < 0 (or no tokens) are dropped before the call; their outputs are zeros.
"""
from __future__ import annotations

import torch

from .. import alloc


def _kept(slots, cu_seqlens=None):
    """Indices of the sequences that run (host list; prefill/decode metadata is small)."""
    sl = slots.tolist()
    if cu_seqlens is None:
        return [n for n, s in enumerate(sl) if s >= 0], None
    cu = cu_seqlens.tolist()
    return [n for n, s in enumerate(sl) if s >= 0 and cu[n + 1] > cu[n]], cu


def chunk_prefill(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True):
    """kda_prefill through fla `chunk_kda` (varlen, initial/final states via the slot pool)."""
    from fla.ops.kda import chunk_kda

    kept, cu = _kept(slots, cu_seqlens)
    N = len(cu) - 1
    if len(kept) < N:  # compact the tokens of the sequences that run
        o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        if not kept:
            return o
        tok = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in kept]).to(q.device)
        lens = [cu[n + 1] - cu[n] for n in kept]
        run_cu = [0]
        for n_len in lens:
            run_cu.append(run_cu[-1] + n_len)
        out = chunk_prefill(q[tok], k[tok], v[tok], g[tok], beta[tok], state,
                            torch.tensor(run_cu, dtype=cu_seqlens.dtype, device=q.device),
                            slots[kept] if len(kept) else slots[:0], scale, qk_l2norm)
        o[tok] = out
        return o
    idx = slots.long()
    h0 = state.index_select(0, idx)                                          # [N, H, K, V]
    o, ht = chunk_kda(q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
                      initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm,
                      cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long))
    state.index_copy_(0, idx, ht.float())
    return o[0]


def fused_recurrent_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    """kda_decode through fla `fused_recurrent_kda` (one token per sequence)."""
    from fla.ops.kda import fused_recurrent_kda

    N = q.shape[0]
    kept, _ = _kept(slots)
    o = alloc.empty(v.shape, v.dtype, v.device)
    if len(kept) < N:
        o.zero_()
        if not kept:
            return o
    sel = torch.tensor(kept, dtype=torch.long, device=q.device)
    idx = slots.long().index_select(0, sel)
    pick = (lambda t: t.index_select(0, sel)) if len(kept) < N else (lambda t: t)
    cu = torch.arange(len(kept) + 1, dtype=torch.long, device=q.device)
    out, ht = fused_recurrent_kda(pick(q)[None], pick(k)[None], pick(v)[None], pick(g)[None].float(),
                                  pick(beta)[None], scale=scale, initial_state=state.index_select(0, idx),
                                  output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu)
    state.index_copy_(0, idx, ht.float())
    o.index_copy_(0, sel, out[0])
    return o
